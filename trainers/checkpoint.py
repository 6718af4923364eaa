"""Checkpoints: the adapters (loadable with peft) plus everything needed to resume exactly.

``<run>.h5.ckpt/latest/adapters/`` is ``PeftModel.save_pretrained`` output (one folder per adapter);
an alert's ``checkpoint`` action writes ``<run>.h5.ckpt/step<N>/`` the same way;
``state.pt`` holds the adapter tensors, optimizer states and every random generator's state.
The folder is written beside and swapped in atomically, so a crash mid-save keeps the previous one.
"""
from __future__ import annotations

import random
import shutil
from pathlib import Path

import numpy as np
import torch

from gradscope.errors import ConfigError
from gradscope.peft_support import adapter_parameters


def save_checkpoint(folder: Path, step: int, model, updater, trainer, name: str = "latest") -> Path:
    """Save after training step ``step`` as ``folder/name``; returns that folder.

    Under torchrun every rank must call it (its random generators are gathered); rank 0 writes.
    """
    dist = trainer.dist
    rng = dist.gather({
        "updater_rng": updater.rng.getstate(),
        "task_rng": trainer.task_rng.getstate(),
        "torch_rng": torch.get_rng_state(),
        "cuda_rng": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,  # this rank's device
        "numpy_rng": np.random.get_state(),
        "python_rng": random.getstate(),
    })
    final = folder / name
    if dist.is_main:
        _write(folder, final, step, model, updater, rng)
    dist.barrier()
    return final


def _write(folder: Path, final: Path, step: int, model, updater, rng: list[dict]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / "tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp / "adapters", selected_adapters=list(model.peft_config))
    torch.save({
        "step": step,
        "adapters": {n: p.detach().cpu() for ps in adapter_parameters(model).values() for n, p in ps},
        "optimizers": {a: opt.state_dict() for a, opt in updater.optimizers.items()},
        "update_moments": updater.probe.update_state(),  # per-role first moments (--probe-updates)
        "world_size": len(rng),
        "rng": rng,  # one entry per rank
    }, tmp / "state.pt")
    old = folder / "old"
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        final.rename(old)
    tmp.rename(final)
    shutil.rmtree(old, ignore_errors=True)


def load_checkpoint(folder: Path, model, updater, trainer) -> int:
    """Restore the latest checkpoint; returns the training step it was taken after."""
    path = folder / "latest" / "state.pt"
    if not path.is_file():
        raise ConfigError(f"--resume: no checkpoint at {path}")
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
        raise ConfigError(f"--resume: checkpoint {path} was made by {state.get('world_size')} processes, "
                          f"this run has {trainer.dist.world}; resume with the same world size")
    for adapter, opt in updater.optimizers.items():
        opt.load_state_dict(state["optimizers"][adapter])
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
    return int(state["step"])
