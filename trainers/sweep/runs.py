"""Where a cell's run stands: finished (skip), resumable (``--resume``), or to start afresh.

* **done** — the run file was closed by its writer and holds every training step, or ended with an
  alert's ``stop`` event (a run that stops itself is finished);
* **resume** — a run file and its checkpoint ``<run>.h5.ckpt/latest/`` exist (a killed or failed run,
  or one whose ``steps`` grew): ``gradscope train --resume`` continues from the checkpoint;
* **fresh** — nothing usable: start (over) with ``--overwrite``.

A run file written with other settings than the cell's (anything but ``steps`` and ``threads``)
is never reused: :func:`check_same_config` raises.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from gradscope.errors import ConfigError, GradscopeError

DONE, RESUME, FRESH = "done", "resume", "fresh"
#: Config keys a cell may change without invalidating its run file.
MUTABLE = ("out", "overwrite", "resume", "steps", "threads", "world_size")


@dataclass(frozen=True)
class RunState:
    state: str          # DONE | RESUME | FRESH
    steps_done: int     # last training step in the run file (0 if none)
    config: dict | None  # the run file's stored config (None without a readable file)


def last_step(path: Path) -> tuple[int, bool, bool, dict | None]:
    """(last training step with metrics, closed, stopped by an alert, stored config) of a run file,
    live or not; (0, False, False, None) if it cannot be read."""
    from gradscope.runfile import open_run

    try:
        with open_run(path) as run:
            n = run.n_metrics
            rows = run.read_table("metrics", start=n - 1) if n else []
            kinds = run.read_table("events")["kind"] if run.n_events else []
            stopped = any((k.decode() if isinstance(k, bytes) else str(k)) == "stop" for k in kinds)
            return (int(rows[-1]["step"]) if len(rows) else 0), run.closed, stopped, dict(run.meta.config)
    except (GradscopeError, OSError, KeyError, ValueError):
        return 0, False, False, None


def run_state(path: Path, steps: int) -> RunState:
    if not path.exists():
        return RunState(FRESH, 0, None)
    done, closed, stopped, config = last_step(path)
    if closed and (done >= steps or stopped):
        return RunState(DONE, done, config)
    if config is not None and (path.with_name(path.name + ".ckpt") / "latest" / "state.pt").is_file():
        return RunState(RESUME, done, config)
    return RunState(FRESH, 0, config)


def check_same_config(path: Path, stored: dict | None, wanted: dict) -> None:
    """ConfigError when the run file at ``path`` was trained with settings the cell does not have."""
    if stored is None:
        return
    diff = sorted(k for k in set(stored) | set(wanted) if k not in MUTABLE
                  and json.dumps(stored.get(k), sort_keys=True) != json.dumps(wanted.get(k), sort_keys=True))
    if diff:
        shown = ", ".join(f"{k}: {stored.get(k)!r} in the file, {wanted.get(k)!r} now" for k in diff[:3])
        raise ConfigError(f"{path} was trained with other settings ({shown}); sweep into another --out folder "
                          "or delete the run")
