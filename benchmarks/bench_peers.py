"""The probe against its peers, side by side: per-agent Grams by hooks, split and sketch against a naive
``autograd.grad`` loop, a per-agent micro-batch loop, torch.func, Opacus and BackPACK (per-row gradients
summed by agent), with time and peak memory per method.

Two workloads, K = 4 and 8 agents, every row one agent's:

* ``lora-lm``: a LoRA LM of the testbed family (4 layers, hidden 256, intermediate 512, LoRA r16 on
  every linear layer, frozen base), B = 32 rows × T = 64 tokens, GRPO-like token loss;
* ``mlp``: a full-width MLP (4 × Linear(512, 512) + tanh, every weight trained), B = 64 rows × T = 16
  positions (a row is a sample; positions share the weights);
* ``mlp-0.6b``: the same at a 0.6B model's MLP widths (1024 → 3072 → 1024, twice), for the sketch:
  plain, hooks + sketch, split and split + sketch only (K per-row or per-agent copies of 3M-value
  weights are what sketch mode is for).

Methods (each a full step: forward, loss, backward, and the K×K Gram; ``.grad`` left as a plain step
leaves it, to rounding):

``plain``       ``loss.sum().backward()``, no probe; ``plain-copy`` (LM) the same on a second copy of the
                model: two identical computations, so its ratio is the noise floor of the others;
``hooks``       ``Probe(method="hooks")``; ``hooks+sketch`` with ``sketch=256`` (TensorSketch on the
                MLP's full-width weights);
``split``       ``Probe(method="split")``; ``split+sketch`` likewise;
``naive``       one ``torch.autograd.grad`` per agent on the shared forward, gradients stacked, Gram;
``microbatch``  one forward + backward per agent on its own rows;
``func``        ``torch.func.vmap(grad(row_loss))`` per-row gradients, summed by agent;
``opacus``      Opacus ``GradSampleModule`` per-row gradients (``grad_sample``), summed by agent;
``backpack``    BackPACK ``BatchGrad`` on the trained Linear layers (``grad_batch``), summed by agent.

Time: every method on its own copy of the model, interleaved (order rotated every repetition) after
warm-up; medians of the process's CPU time per step (``time.process_time``: with one torch thread
it is the compute time, and other jobs on a shared machine do not add their waits to it), and
ratios to ``plain``. A ratio also varies between processes (by ±0.03 on the LM, measured: where the
allocator places each copy's tensors), more than between the repetitions of one process, so the LM's
timings run in ``processes`` fresh processes (default 3) and the table gives the median of their
ratios, with their range. Peak memory: each method in a fresh process (K = 8): the rise
of the process's peak resident set (VmHWM, reset through /proc/self/clear_refs) over two steps,
with every block of 64 KiB or more returned to the system when freed (:data:`MALLOC_ENV`), and its
ratio to plain's. One torch thread by default (the development
machine is shared; see bench_probe.py). The Grams of all methods are compared with split's.

Goals (issue 12): hooks strictly below func, Opacus and BackPACK, and <= 1.05x plain, on the LoRA LM at
K = 4 and 8; split no slower than naive; hooks+sketch <= 1.3x plain on the MLP.

Optional dependencies (``pip install -e '.[bench]'``, ``make bench`` does it): opacus, and
backpack-for-pytorch installed with ``--no-deps`` (it requires torchvision, whose CUDA wheel breaks
transformers' imports on CPU torch; BackPACK's BatchGrad runs without it). A missing one is skipped.
"""
from __future__ import annotations

import copy
import json
import os
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_probe import interleaved, lora_model, make_batch, token_loss
from torch.func import functional_call, grad, vmap

from gradscope.probe import Probe

CONFIGS = {
    "lora-lm": dict(B=32, T=64, warmup=1, reps=9, processes=3),
    "mlp": dict(B=64, T=16, warmup=1, reps=7, processes=1),
    "mlp-0.6b": dict(B=64, T=16, warmup=1, reps=5, processes=1),
}
METHODS = {
    "lora-lm": ["plain", "plain-copy", "hooks", "split", "naive", "microbatch", "func", "opacus", "backpack"],
    "mlp": ["plain", "hooks", "hooks+sketch", "split", "split+sketch", "naive", "microbatch", "func", "opacus",
            "backpack"],
    "mlp-0.6b": ["plain", "hooks+sketch", "split", "split+sketch"],
}
#: (d_in, d_out) of each Linear (each followed by tanh)
MLP_LAYERS = {"mlp": [(512, 512)] * 4, "mlp-0.6b": [(1024, 3072), (3072, 1024)] * 2}
SKETCH = 256
GOALS = ("hooks < func, opacus, backpack and <= 1.05x plain (lora-lm); split <= naive; "
         "hooks+sketch <= 1.3x (mlp, mlp-0.6b)")


def available(method: str) -> bool:
    try:
        if method == "opacus":
            import opacus  # noqa: F401
        elif method == "backpack":
            import backpack  # noqa: F401
    except ImportError:
        return False
    return True


# ---------------------------------------------------------------- workloads
class Workload:
    """A model, a batch, ``loss(model)`` → (B, T) token losses and the (B,) agent of each row."""

    def __init__(self, name: str, K: int) -> None:
        cfg = CONFIGS[name]
        B, T = cfg["B"], cfg["T"]
        self.name, self.K = name, K
        torch.manual_seed(0)
        if name == "lora-lm":
            self.model = lora_model(dict(hidden=256, layers=4, heads=4, kv_heads=2, intermediate=512), 16)
            self.ids, self.agent_ids, self.adv = make_batch(self.model.config.vocab_size, B, T, K)
            self.row_agent = self.agent_ids.max(1).values
        else:
            layers = MLP_LAYERS[name]
            self.model = nn.Sequential(*[m for d_in, d_out in layers for m in (nn.Linear(d_in, d_out), nn.Tanh())])
            g = torch.Generator().manual_seed(0)
            d = layers[0][0]
            self.x, self.y = torch.randn(B, T, d, generator=g), torch.randn(B, T, d, generator=g)
            self.row_agent = torch.randperm(B, generator=g) % K
            self.agent_ids = self.row_agent[:, None].expand(B, T)

    def named(self, model: nn.Module) -> list[tuple[str, nn.Parameter]]:
        return [(n, p) for n, p in model.named_parameters() if p.requires_grad]

    def loss(self, model: nn.Module, rows: torch.Tensor | None = None) -> torch.Tensor:
        """(B', T') per-token loss of ``rows`` (default: all), normalised by the whole batch."""
        if self.name == "lora-lm":
            if rows is None:
                return token_loss(model, self.ids, self.agent_ids, self.adv)
            mask = self.agent_ids >= 0
            logits = model(input_ids=self.ids[rows]).logits[:, :-1].float()
            lp = torch.log_softmax(logits, -1).gather(-1, self.ids[rows, 1:, None])[..., 0]
            return -self.adv[rows] * lp * mask[rows] / mask.sum()
        x, y = (self.x, self.y) if rows is None else (self.x[rows], self.y[rows])
        return (model(x) - y).square().mean(-1) / len(self.x)

    def row_loss_fn(self, model: nn.Module) -> Callable:
        """(params, row inputs...) → scalar loss of one row, for torch.func."""
        if self.name == "lora-lm":
            mask = self.agent_ids >= 0
            weight = (-self.adv * mask / mask.sum()).float()

            def row_loss(params, ids1, w1):
                logits = functional_call(model, params, (), dict(input_ids=ids1[None])).logits[0, :-1].float()
                return (w1 * torch.log_softmax(logits, -1).gather(-1, ids1[1:, None])[:, 0]).sum()
            return row_loss, (self.ids, weight)

        def row_loss(params, x1, y1):
            return (functional_call(model, params, (x1,)) - y1).square().mean(-1).sum() / len(self.x)
        return row_loss, (self.x, self.y)


def _gram(per_agent: list[torch.Tensor]) -> np.ndarray:
    G = torch.stack(per_agent).double()
    return (G @ G.T).numpy()


def _from_rows(per_row: list[torch.Tensor], row_agent: torch.Tensor, K: int, params: list[nn.Parameter]) -> np.ndarray:
    """Per-row gradients (B, *shape) per parameter → per-agent sums → Gram; ``.grad`` set to their sum."""
    flat = []
    for p, g in zip(params, per_row):
        agent = g.new_zeros(K, *p.shape).index_add_(0, row_agent, g)
        p.grad = agent.sum(0)
        flat.append(agent.reshape(K, -1))
    return _gram(list(torch.cat(flat, 1)))


# ---------------------------------------------------------------- methods
class Runner:
    """One model copy per method; ``step(method)`` runs one step and returns the Gram."""

    def __init__(self, work: Workload, methods: list[str]) -> None:
        self.w, self.K = work, work.K
        self.models = {m: copy.deepcopy(work.model) for m in methods}
        agents = [f"a{k}" for k in range(self.K)]
        roles = {a: "r" for a in agents}
        self.probes = {}
        for m in methods:
            if m.startswith(("hooks", "split")):
                base, _, sketch = m.partition("+")
                self.probes[m] = Probe(self.models[m], agents, roles, params=work.named(self.models[m]),
                                       method=base, sketch=SKETCH if sketch else None)
        if "opacus" in methods:
            from opacus.grad_sample import GradSampleModule

            self.models["opacus"].train()  # Opacus records activations in training mode only (no dropout here)
            self.models["opacus"] = GradSampleModule(self.models["opacus"], batch_first=True, loss_reduction="sum",
                                                     strict=False)
        if "backpack" in methods:
            from backpack import extend

            for module in self.models["backpack"].modules():
                if isinstance(module, nn.Linear) and any(p.requires_grad for p in module.parameters(recurse=False)):
                    extend(module)

    def step(self, method: str) -> np.ndarray | None:
        model, w = self.models[method], self.w
        params = [p for _, p in w.named(model)]
        for p in params:
            p.grad = None
        if method in ("plain", "plain-copy"):
            w.loss(model).sum().backward()
            return None
        if method in self.probes:
            with self.probes[method].step(0) as s:
                s.backward_tokens(w.loss(model), w.agent_ids)
            return s.result.gram
        if method == "naive":
            loss = w.loss(model)
            per_agent = []
            for k in range(self.K):
                grads = torch.autograd.grad(loss[w.row_agent == k].sum(), params, retain_graph=k < self.K - 1)
                per_agent.append(torch.cat([g.reshape(-1) for g in grads]))
            for p, g in zip(params, torch.stack(per_agent).sum(0).split([p.numel() for p in params])):
                p.grad = g.view_as(p)
            return _gram(per_agent)
        if method == "microbatch":
            per_agent = []
            for k in range(self.K):
                before = [p.grad for p in params]
                for p in params:
                    p.grad = None
                w.loss(model, (w.row_agent == k).nonzero().squeeze(1)).sum().backward()
                per_agent.append(torch.cat([(torch.zeros_like(p) if p.grad is None else p.grad).reshape(-1)
                                            for p in params]))
                for p, b in zip(params, before):
                    if b is not None:
                        p.grad = p.grad + b if p.grad is not None else b
            return _gram(per_agent)
        if method == "func":
            row_loss, inputs = w.row_loss_fn(model)
            detached = {n: p.detach() for n, p in w.named(model)}
            per_row = vmap(grad(row_loss), in_dims=(None, 0, 0))(detached, *inputs)
            return _from_rows(list(per_row.values()), w.row_agent, self.K, params)
        if method == "opacus":
            w.loss(model).sum().backward()
            gram = _from_rows([p.grad_sample for p in params], w.row_agent, self.K, params)
            for p in params:
                p.grad_sample = None
            return gram
        if method == "backpack":
            from backpack import backpack
            from backpack.extensions import BatchGrad

            with backpack(BatchGrad()):
                w.loss(model).sum().backward()
            return _from_rows([p.grad_batch for p in params], w.row_agent, self.K, params)
        raise ValueError(method)

    def close(self) -> None:
        for probe in self.probes.values():
            probe.close()


def time_methods(name: str, K: int, methods: list[str]) -> dict[str, Any]:
    cfg = CONFIGS[name]
    runner = Runner(Workload(name, K), methods)
    times: dict[str, list[float]] = {m: [] for m in methods}
    grams: dict[str, np.ndarray] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # functorch / opacus / backpack performance and deprecation notes
        for rep, method in interleaved(methods, cfg["warmup"], cfg["reps"]):
            t0 = time.process_time()
            gram = runner.step(method)
            if rep >= cfg["warmup"]:
                times[method].append(time.process_time() - t0)
            if gram is not None:
                grams[method] = gram
    runner.close()
    med = {m: statistics.median(t) for m, t in times.items()}
    exact = grams["split"]
    return {"median_s": med, "ratio": {m: med[m] / med["plain"] for m in med},
            "gram_rel_err_vs_split": {m: float(np.abs(g - exact).max() / np.abs(exact).max())
                                      for m, g in grams.items() if m != "split"}}


def time_in_processes(name: str, K: int, methods: list[str], processes: int) -> dict[str, Any]:
    """:func:`time_methods` in ``processes`` fresh processes (here when 1): per method the median of their
    medians and ratios, ``ratio_range`` (min, max) of the ratios, and the largest Gram error."""
    if processes == 1:
        return time_methods(name, K, methods)
    runs = [_in_fresh_process(f"b.time_methods({name!r}, {K}, {methods!r})") for _ in range(processes)]
    return {"median_s": {m: statistics.median(r["median_s"][m] for r in runs) for m in methods},
            "ratio": {m: statistics.median(r["ratio"][m] for r in runs) for m in methods},
            "ratio_range": {m: (min(r["ratio"][m] for r in runs), max(r["ratio"][m] for r in runs)) for m in methods},
            "gram_rel_err_vs_split": {m: max(r["gram_rel_err_vs_split"][m] for r in runs)
                                      for m in runs[0]["gram_rel_err_vs_split"]},
            "processes": processes}


def _in_fresh_process(call: str, env: dict[str, str] | None = None) -> Any:
    """The JSON-able value of ``call`` (an expression over this module as ``b``) in a fresh Python process
    with this one's torch threads."""
    code = f"import sys, json; sys.argv = ['x']; import bench_peers as b; print(json.dumps({call}))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=os.path.dirname(os.path.abspath(__file__)), timeout=1800,
                         env={**os.environ, **(env or {}), "OMP_NUM_THREADS": str(torch.get_num_threads())})
    if out.returncode:
        raise RuntimeError(out.stderr[-2000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


#: glibc keeps freed blocks and hands them back when it likes, which made the rise of the peak resident set
#: vary from 0.1 to 134 MiB for the same hooks step; allocations of 64 KiB and more mapped on their own and
#: unmapped when freed make it the step's peak of live memory (measured: 145.0-145.1 MiB over five processes).
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}


def peak_memory(name: str, K: int, method: str) -> float:
    """MiB the peak resident set rises over two steps of ``method``, in a fresh process."""
    return _in_fresh_process(f"b._peak_here({name!r}, {K}, {method!r})", MALLOC_ENV)


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key))


def _peak_here(name: str, K: int, method: str) -> float:
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    runner = Runner(Workload(name, K), [method])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        runner.step(method)  # the first step allocates what later steps reuse (and runs the self-check)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the peak RSS to the current RSS
        base = _status_kib("VmRSS")
        for _ in range(2):
            runner.step(method)
    return (_status_kib("VmHWM") - base) / 1024


def main(verbose: bool = True, threads: int = 1, memory: bool = True,
         processes: int | None = None, only: list[str] | None = None) -> list[dict[str, Any]]:
    """Time every config at K = 4 and 8 (in ``processes`` fresh processes each, default the config's), print
    the tables and the goals' verdicts (on the median ratios, with their range)."""
    if threads:
        torch.set_num_threads(threads)
    results = []
    if verbose:
        print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.2f}")
    for name in only or CONFIGS:
        methods = [m for m in METHODS[name] if available(m)]
        skipped = sorted(set(METHODS[name]) - set(methods))
        for K in (4, 8):
            r = time_in_processes(name, K, methods, processes or CONFIGS[name]["processes"])
            r.update(config=name, K=K, skipped=skipped)
            if memory and K == 8 and sys.platform.startswith("linux"):
                r["peak_mib"] = {m: peak_memory(name, K, m) for m in methods}
            results.append(r)
            if verbose:
                print(f"{name}, K={K}" + (f" (not installed: {', '.join(skipped)})" if skipped else "")
                      + (f" (medians over {r['processes']} processes)" if "processes" in r else ""))
                print(f"  {'method':<14}{'ms':>9}{'x plain':>9}{'range':>12}{'peak MiB':>10}{'x plain':>9}"
                      f"{'Gram err':>10}")
                for m in methods:
                    mem = r.get("peak_mib", {})
                    mcol = (f"{mem[m]:10.1f}{mem[m] / max(mem['plain'], 1e-9):9.2f}" if mem else f"{'-':>10}{'-':>9}")
                    err = r["gram_rel_err_vs_split"].get(m)
                    lo, hi = r.get("ratio_range", {}).get(m, (None, None))
                    span = f"{lo:.3f}-{hi:.3f}" if lo is not None else "-"
                    print(f"  {m:<14}{r['median_s'][m] * 1e3:9.1f}{r['ratio'][m]:9.3f}{span:>12}{mcol}"
                          f"{'-' if err is None else f'{err:.1e}':>10}")
    if verbose:
        print(f"goals: {GOALS}")
        for r in results:
            ratio = r["ratio"]
            checks = []
            if r["config"] == "lora-lm":
                peers = [m for m in ("func", "opacus", "backpack") if m in ratio]
                checks.append(f"hooks {ratio['hooks']:.3f} < {'/'.join(peers)} "
                              f"{'/'.join(f'{ratio[m]:.3f}' for m in peers)}: "
                              f"{'yes' if all(ratio['hooks'] < ratio[m] for m in peers) else 'NO'}")
                lo, hi = r.get("ratio_range", {}).get("hooks", (ratio["hooks"], ratio["hooks"]))
                checks.append(f"hooks <= 1.05: {'yes' if ratio['hooks'] <= 1.05 else 'NO'}"
                              + (f" (every process: {'yes' if hi <= 1.05 else 'NO'}, {lo:.3f}-{hi:.3f})"
                                 if "processes" in r else ""))
                lo, hi = r.get("ratio_range", {}).get("plain-copy", (ratio["plain-copy"],) * 2)
                checks.append(f"noise floor (plain on a second copy): {ratio['plain-copy']:.3f} ({lo:.3f}-{hi:.3f})")
            else:
                checks.append(f"hooks+sketch {ratio['hooks+sketch']:.3f} <= 1.3: "
                              f"{'yes' if ratio['hooks+sketch'] <= 1.3 else 'NO'}")
            if "naive" in ratio:
                checks.append(f"split {ratio['split']:.3f} <= naive {ratio['naive']:.3f}: "
                              f"{'yes' if ratio['split'] <= ratio['naive'] else 'NO'}")
            print(f"  {r['config']} K={r['K']}: " + "; ".join(checks))
    return results


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default); default 1")
    parser.add_argument("--no-memory", action="store_true", help="skip the per-method peak-memory processes")
    parser.add_argument("--processes", type=int, default=None,
                        help="time each config in this many fresh processes (default: 3 for lora-lm, 1 otherwise)")
    parser.add_argument("--only", choices=list(CONFIGS), action="append", help="only this config (repeatable)")
    args = parser.parse_args()
    main(threads=args.threads, memory=not args.no_memory, processes=args.processes, only=args.only)
