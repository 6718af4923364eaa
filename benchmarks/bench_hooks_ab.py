"""A change to the hooks method against a git revision's, on one model copy: for judging a change worth ~1 %.

Two model copies differ by up to ±0.03 of a plain step on the LoRA LM of bench_peers.py (where the allocator
places each copy's tensors), more than most single changes to hooks are worth. Here both versions of
``gradscope/probe/hooks.py``, ``fused.py`` and ``accumulate.py`` (where ``REV`` has it) — the working tree's and
``REV``'s; the other modules are the working tree's — run on the same model copy and the same probe: the probe's
method switches class between steps, its layer hooks and installed forwards with it (its state is the same for
both, but for what it keeps across steps: each class's own buffers, or :class:`Accumulator`). Plain
runs on a second copy, interleaved with both (order rotated every repetition), CPU time per step, medians
after warm-up. One process's difference still varies by about ±0.01: judge by several.

Prints the ratios to plain and their difference (negative: the working tree is faster).

Run: ``.venv/bin/python benchmarks/bench_hooks_ab.py [--rev HEAD] [--agents 8] [--reps 20]``.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
import types
from functools import partial

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_peers import Runner, Workload
from bench_probe import interleaved


def module_at(rev: str, name: str) -> types.ModuleType:
    """``gradscope/probe/<name>.py`` as it is at git revision ``rev``, as a module of its own."""
    source = subprocess.run(["git", "show", f"{rev}:gradscope/probe/{name}.py"], capture_output=True, text=True,
                            check=True).stdout
    module = types.ModuleType(f"{name}_at_{rev}")
    sys.modules[module.__name__] = module  # (dataclasses look their module up)
    exec(compile(source, f"{name}.py@{rev}", "exec"), module.__dict__)
    return module


def hooks_at(rev: str) -> types.ModuleType:
    """``hooks.py`` at ``rev``, using ``fused.py`` (the layers' forward and backward) and, where ``rev`` has it,
    ``accumulate.py`` at ``rev``."""
    fused = module_at(rev, "fused")
    hooks = module_at(rev, "hooks")
    hooks.fused, hooks.as_dtype = fused, fused.as_dtype  # (its imports found the working tree's fused.py)
    if hasattr(hooks, "Accumulator"):
        hooks.Accumulator = module_at(rev, "accumulate").Accumulator
    return hooks


#: What the method keeps across steps: each class its own (the layout may differ between revisions). Before
#: accumulate.py the buffers were the method's own attributes; since, its ``acc`` holds them.
CACHES = ("_buffers", "_scratches", "acc")


def fresh(method: object, cls: type) -> dict[str, object]:
    """What ``cls`` keeps across steps, empty, for ``method``."""
    module = sys.modules[cls.__module__]
    if not hasattr(module, "Accumulator"):
        return {"_buffers": {}, "_scratches": {}}
    return {"acc": module.Accumulator(method.params, method.layers, method.group_index, method.n_groups,
                                      method.n_agents, method.dtype)}


def switch(method: object, cls: type, caches: dict[type, dict[str, object]]) -> None:
    """Make ``method`` an instance of ``cls``, its hooks too: those registered at construction hold bound
    methods of the class it had then; and its :data:`CACHES` those ``cls`` left (``caches``, by class)."""
    caches[type(method)] = {name: getattr(method, name) for name in CACHES if hasattr(method, name)}
    if cls not in caches:
        caches[cls] = fresh(method, cls)
    for name, value in caches[cls].items():
        setattr(method, name, value)
    method.__class__ = cls
    installed_cls = sys.modules[cls.__module__].fused.Installed
    for installed in method._installed:  # fused.Installed: on_call = partial(method._on_forward, layer)
        installed.__class__ = installed_cls  # (its HookedLinear is the one cls's module recognises)
        installed.on_call = partial(method._on_forward, *installed.on_call.args)
    for handle in method._handles:  # the model's pre-hook, and forward hooks partial(_on_forward_hook, layer)
        hooks = handle.hooks_dict_ref()
        hook = hooks[handle.id]
        hooks[handle.id] = (partial(method._on_forward_hook, *hook.args) if isinstance(hook, partial)
                            else method._on_model_call)


def main(rev: str = "HEAD", K: int = 8, reps: int = 20, warmup: int = 3) -> dict[str, float]:
    torch.set_num_threads(1)
    work = Workload("lora-lm", K)
    runner = Runner(work, ["plain", "hooks"])
    method = runner.probes["hooks"]._method
    classes = {"tree": type(method), rev: hooks_at(rev).HooksMethod}
    names = ["plain", "tree", rev]
    times: dict[str, list[float]] = {name: [] for name in names}
    caches: dict[type, dict[str, object]] = {}
    for rep, name in interleaved(names, warmup, reps):
        if name != "plain":
            switch(method, classes[name], caches)
        start = time.process_time()
        runner.step("plain" if name == "plain" else "hooks")
        if rep >= warmup:
            times[name].append(time.process_time() - start)
    plain = statistics.median(times["plain"])
    ratios = {name: statistics.median(t) / plain for name, t in times.items()}
    print(f"lora-lm K={K}, plain {plain * 1e3:.0f} ms: working tree {ratios['tree']:.4f}x, {rev} {ratios[rev]:.4f}x "
          f"plain; difference {ratios['tree'] - ratios[rev]:+.4f}")
    return ratios


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rev", default="HEAD", help="the git revision to compare with (default HEAD)")
    parser.add_argument("--agents", type=int, default=8, help="K (default 8)")
    parser.add_argument("--reps", type=int, default=20, help="timed repetitions (default 20)")
    args = parser.parse_args()
    main(args.rev, args.agents, args.reps)
