"""Where a cell's run stands: finished (skip), resumable (``--resume``), or to start afresh.

* **done** — the run file was closed by its writer and holds every training step, or ended with an
  alert's ``stop`` event (a run that stops itself is finished);
* **resume** — a run file and its checkpoint ``<run>.h5.ckpt/latest/`` exist (a killed or failed run,
  or one whose ``steps`` grew): ``gradscope train --resume`` continues from the checkpoint;
* **fresh** — nothing usable: start (over) with ``--overwrite``.

A run file written with other settings than the cell's (anything but ``steps`` and ``threads``),
or on other tasks than the cell's settings give now (its ``versions["tasks"]`` fingerprint), is never
reused: :func:`check_same_config` and :func:`check_same_tasks` raise.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from gradscope.errors import ConfigError
from gradscope.runfile.progress import run_progress
from gradscope.trainers.tasks.base import same_tasks

DONE, RESUME, FRESH = "done", "resume", "fresh"
#: Config keys a cell may change without invalidating its run file.
MUTABLE = ("out", "overwrite", "resume", "steps", "threads", "world_size")


@dataclass(frozen=True)
class RunState:
    state: str          # DONE | RESUME | FRESH
    steps_done: int     # last training step in the run file (0 if none)
    config: dict | None  # the run file's stored config (None without a readable file)
    tasks: str | None = None  # its tasks' fingerprint (None: not readable, or not recorded)


def run_state(path: Path, steps: int) -> RunState:
    if not path.exists():
        return RunState(FRESH, 0, None)
    progress = run_progress(path)
    done, config, tasks = progress.last_step, progress.config, (progress.versions or {}).get("tasks")
    if progress.finished(steps):
        return RunState(DONE, done, config, tasks)
    ckpt = path.with_name(path.name + ".ckpt")  # old/ alone: a save killed between its two renames
    if config is not None and any((ckpt / name / "state.pt").is_file() for name in ("latest", "old")):
        return RunState(RESUME, done, config, tasks)
    return RunState(FRESH, 0, config, tasks)


def check_same_tasks(path: Path, stored: str | None, wanted: str) -> bool:
    """ConfigError when the run file at ``path`` was trained on other tasks (fingerprint ``stored``)
    than the cell's settings give now (``wanted``); False when that cannot be told (not recorded, or
    another scheme: :func:`same_tasks`), True when they are the same."""
    same = same_tasks(stored, wanted)
    if same is False:
        raise ConfigError(f"{path} was trained on other tasks ({stored}) than its cell's settings give now "
                          f"({wanted}: the task generator, split or file changed); sweep into another --out folder "
                          "or delete the run")
    return bool(same)


def check_same_config(path: Path, stored: dict | None, wanted: dict, defaults: dict | None = None) -> None:
    """ConfigError when the run file at ``path`` was trained with settings the cell does not have.

    A setting the stored config lacks (the run was written by a gradscope that did not have it yet) is
    the same when the cell wants its default (``defaults``: the config's defaults, same layout)."""
    if stored is None:
        return
    defaults = defaults or {}
    diff = sorted(k for k in set(stored) | set(wanted) if k not in MUTABLE
                  and not _same(stored.get(k, _MISSING), wanted.get(k), defaults.get(k, _MISSING)))
    if diff:
        shown = ", ".join(f"{k}: {stored.get(k)!r} in the file, {wanted.get(k)!r} now" for k in diff[:3])
        raise ConfigError(f"{path} was trained with other settings ({shown}); sweep into another --out folder "
                          "or delete the run")


_MISSING = object()


def _same(stored, wanted, default) -> bool:
    """``stored`` (or, missing, ``default``) equals ``wanted``; dicts compared key by key, so a setting
    added inside one (``grpo``) counts at its default too."""
    if stored is _MISSING:
        stored = default
    if isinstance(stored, dict) and isinstance(wanted, dict):
        default = default if isinstance(default, dict) else {}
        return all(_same(stored.get(k, _MISSING), wanted.get(k), default.get(k, _MISSING))
                   for k in set(stored) | set(wanted))
    return stored is not _MISSING and json.dumps(stored, sort_keys=True) == json.dumps(wanted, sort_keys=True)
