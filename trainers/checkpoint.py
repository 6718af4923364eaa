"""Checkpoints: the adapters (loadable with peft) plus everything needed to resume exactly.

Layout of ``<run>.h5.ckpt/``: ``latest/`` is the resume point, ``step<N>/`` an alert's
``checkpoint`` action; each holds ``adapters/`` (``PeftModel.save_pretrained`` output, one folder
per adapter), ``state.pt`` (adapter tensors, optimizer states, every random generator's state,
the probe's state) and ``checkpoint.json`` (the step, and what the run file held when it was taken).

Durability. A checkpoint is taken only after the run file's buffered rows are flushed and committed:
``checkpoint.json`` records the run file's committed counters, which then equal its rows up to the
checkpoint's step, and a resume checks that they still do. The folder is written as ``tmp/`` (every
file fsynced, ``state.pt`` renamed into place last, so a folder with ``state.pt`` is complete), then
swapped in: ``latest/`` → ``old/``, ``tmp/`` → ``latest/``, ``old/`` removed. ``old/`` is removed only
while ``latest/`` is complete, so at every moment one of them holds a complete checkpoint, and
:func:`find_checkpoint` takes the newer. Only folders that are gradscope checkpoints (a real folder
holding nothing but the entries above) are ever removed or replaced.
"""
from __future__ import annotations

import json
import os
import random
import re
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from gradscope.errors import ConfigError
from gradscope.paths import fsync, kind_of
from gradscope.peft_support import adapter_parameters

LATEST, OLD, TMP = "latest", "old", "tmp"
STATE, INFO, ADAPTERS = "state.pt", "checkpoint.json", "adapters"
_PARTIAL = STATE + ".partial"
_ENTRIES = {ADAPTERS: stat.S_ISDIR, STATE: stat.S_ISREG, INFO: stat.S_ISREG, _PARTIAL: stat.S_ISREG}
_NAMES = re.compile(rf"({LATEST}|{OLD}|{TMP}|step\d+)")


@dataclass(frozen=True)
class Checkpoint:
    """A complete checkpoint folder and what ``checkpoint.json`` says about it.

    ``committed``: the run file's committed counters (``n_steps``, ``n_evals``, ``n_events``,
    ``n_metrics``) when it was taken; ``run_created``: that run file's ``created`` attribute;
    ``world_size``: the processes that made it (all three None in checkpoints written before
    they were recorded)."""

    path: Path
    step: int
    committed: dict[str, int] | None
    run_created: str | None
    world_size: int | None

    def check_world(self, world: int) -> None:
        """ConfigError unless it was made by ``world`` processes (where that is recorded)."""
        if self.world_size is not None and self.world_size != world:
            raise world_mismatch(self.path, self.world_size, world)


def world_mismatch(path: Path, made: object, world: int) -> ConfigError:
    return ConfigError(f"--resume: checkpoint {path} was made by {made} processes, this run has {world}; "
                       f"resume with the same world size")


def checkpoint_folder(run_file: str | os.PathLike[str]) -> Path:
    """``<run>.ckpt`` beside the run file."""
    run_file = Path(run_file)
    return run_file.with_name(run_file.name + ".ckpt")


def save_checkpoint(folder: Path, step: int, model, updater, trainer, writer, name: str = LATEST) -> Path:
    """Flush ``writer``, then save the state after training step ``step`` as ``folder/name``;
    returns that folder.

    Under torchrun every rank must call it (its random generators are gathered); rank 0, whose
    ``writer`` is the run file's, writes. ConfigError if ``folder`` or ``folder/name`` exists and is
    not a gradscope checkpoint folder (nothing is touched then).
    """
    dist = trainer.dist
    writer.flush()  # the checkpoint covers exactly the committed rows: none of its steps may be lost
    rng = dist.gather({
        "updater_rng": updater.rng.getstate(),
        "task_rng": trainer.task_rng.getstate(),
        "torch_rng": torch.get_rng_state(),
        "cuda_rng": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,  # this rank's device
        "numpy_rng": np.random.get_state(),
        "python_rng": random.getstate(),
        "probe": trainer.probe.state_dict(),  # its self-check schedule decides /steps/method
    })
    final = folder / name
    if dist.is_main:
        info = {"step": step, "world_size": len(rng), "committed": writer.committed,
                "run_created": writer.meta.created}
        _write(folder, final, info, model, updater, rng)
    dist.barrier()
    return final


def _write(folder: Path, final: Path, info: dict, model, updater, rng: list[dict]) -> None:
    check_folder(folder, final.name)
    if not folder.exists():
        folder.mkdir(parents=True)
        fsync(folder.parent)
    tmp = folder / TMP
    _remove(tmp)  # a crashed save's leftover
    tmp.mkdir()
    model.save_pretrained(tmp / ADAPTERS, selected_adapters=list(model.peft_config))
    (tmp / INFO).write_text(json.dumps(info))
    torch.save({
        "step": info["step"],
        "adapters": {n: p.detach().cpu() for ps in adapter_parameters(model).values() for n, p in ps},
        "optimizers": {a: opt.state_dict() for a, opt in updater.optimizers.items()},
        "coherence_ema": updater.coherence_ema,
        "update_moments": updater.probe.update_state(),  # per-role first moments (--probe-updates)
        "world_size": info["world_size"],
        "rng": rng,  # one entry per rank: its random generators and probe state
    }, tmp / _PARTIAL)
    _fsync_tree(tmp)
    os.replace(tmp / _PARTIAL, tmp / STATE)  # from here on tmp/ is a complete checkpoint
    fsync(tmp)
    old = folder / OLD
    if final.name == LATEST and _complete(final):  # old/ is removed only while latest/ is complete: it may be the only checkpoint left
        _remove(old)
        os.rename(final, old)
    else:  # an incomplete latest/, or an alert's step<N>/ (never a resume point) written again
        _remove(final)
    os.rename(tmp, final)
    fsync(folder)
    if final.name == LATEST:
        _remove(old)


def find_checkpoint(folder: Path) -> Checkpoint | None:
    """The newest complete checkpoint in ``latest/`` or ``old/`` (``latest/`` on a tie), or None."""
    found = [_read(folder / name) for name in (LATEST, OLD) if _complete(folder / name)]
    return max(found, key=lambda c: c.step, default=None)  # max keeps the first of equals: latest/


def load_checkpoint(ckpt: Checkpoint, model, updater, trainer) -> None:
    """Restore the adapters, optimizer states, random generators and probe state of ``ckpt``."""
    path = ckpt.path / STATE
    state = torch.load(path, weights_only=False, map_location="cpu")  # not every rank onto cuda:0
    params = {n: p for ps in adapter_parameters(model).values() for n, p in ps}
    if set(params) != set(state["adapters"]):
        raise ConfigError(f"--resume: checkpoint {path} was made with other adapters or another model")
    with torch.no_grad():
        for name, value in state["adapters"].items():
            params[name].copy_(value)
    if "rng" not in state:  # written before checkpoints held one entry per rank
        state = {**state, "world_size": 1, "rng": [state]}
    if state["world_size"] != trainer.dist.world:
        raise world_mismatch(ckpt.path, state["world_size"], trainer.dist.world)
    for adapter, opt in updater.optimizers.items():
        opt.load_state_dict(state["optimizers"][adapter])
    updater.coherence_ema = state.get("coherence_ema", {})
    if state.get("update_moments") is not None and updater.probe.update_unit:
        updater.probe.load_update_state(state["update_moments"])
    rng = state["rng"][trainer.dist.rank]
    updater.rng.setstate(rng["updater_rng"])
    trainer.task_rng.setstate(rng["task_rng"])
    torch.set_rng_state(rng["torch_rng"])
    cuda_rng = rng.get("cuda_rng")
    if isinstance(cuda_rng, list):  # older checkpoints kept every device's state
        cuda_rng = cuda_rng[torch.cuda.current_device()] if torch.cuda.is_available() and cuda_rng else None
    if cuda_rng is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(cuda_rng)
    np.random.set_state(rng["numpy_rng"])
    random.setstate(rng["python_rng"])
    if "probe" in rng:  # written before checkpoints held the probe's state
        trainer.probe.load_state_dict(rng["probe"])


def check_folder(folder: Path, *names: str) -> None:
    """ConfigError unless ``folder`` is absent or a real folder (not a link) whose entries
    ``names`` (default: every ``latest``, ``old``, ``tmp`` and ``step<N>`` in it) are absent or
    gradscope checkpoint folders: what a save may replace or remove."""
    try:
        mode = os.lstat(folder).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(mode):
        raise ConfigError(f"checkpoint folder {folder} is {kind_of(mode) or 'a file'}, not a folder; move it away")
    for name in names or [p.name for p in folder.iterdir() if _NAMES.fullmatch(p.name)]:
        path = folder / name
        if os.path.lexists(path) and not _ours(path):
            raise ConfigError(f"{path} is not a gradscope checkpoint folder; refusing to replace it (move it away)")


def clear_resume_points(folder: Path) -> None:
    """Remove ``latest/``, ``old/`` and ``tmp/`` (a new run in place of an old one); ``step<N>/``
    folders stay. ConfigError, nothing removed, if one of them is not a checkpoint folder."""
    check_folder(folder, LATEST, OLD, TMP)
    for name in (LATEST, OLD, TMP):
        _remove(folder / name)


def has_resume_point(folder: Path) -> bool:
    """Whether ``latest/`` or ``old/`` exists (complete or not)."""
    return any(os.path.lexists(folder / name) for name in (LATEST, OLD))


def _read(path: Path) -> Checkpoint:
    info_file = path / INFO
    try:
        if info_file.is_file():
            info = json.loads(info_file.read_text())
        else:  # written before checkpoint.json existed
            info = {"step": torch.load(path / STATE, weights_only=False, map_location="cpu")["step"]}
        return Checkpoint(path, int(info["step"]), info.get("committed"), info.get("run_created"),
                          info.get("world_size"))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ConfigError(f"--resume: cannot read checkpoint {path} ({' '.join(str(exc).split())})") from None


def _complete(path: Path) -> bool:
    return _ours(path) and (path / STATE).is_file()


def _ours(path: Path) -> bool:
    """A real folder holding only a checkpoint's entries, each of its kind (an empty one too: a
    save killed right after creating it)."""
    try:
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            return False
        return all(name in _ENTRIES and _ENTRIES[name](os.lstat(path / name).st_mode) for name in os.listdir(path))
    except OSError:
        return False


def _remove(path: Path) -> None:
    """Remove a checkpoint folder (rmtree never follows links inside it); ConfigError if it is not one."""
    if not os.path.lexists(path):
        return
    if not _ours(path):
        raise ConfigError(f"{path} is not a gradscope checkpoint folder; refusing to remove it (move it away)")
    shutil.rmtree(path)


def _fsync_tree(root: Path) -> None:
    """fsync every file and folder under ``root`` (files first, so a synced folder lists synced files)."""
    for here, _, files in os.walk(root, topdown=False):
        for name in files:
            fsync(Path(here) / name)
        fsync(Path(here))
