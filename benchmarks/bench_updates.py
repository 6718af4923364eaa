"""Cost of update attribution: a probed AdamW step with ``Probe.attach(optimizer)`` against the Gram alone.

Same models and GRPO-like batch as ``bench_probe.py`` (the testbed, 2 layers hidden 128 with LoRA r8,
and a larger config, 8 layers hidden 512 with LoRA r16; B rows of T tokens, rows shuffled over K
agents in 2 roles). Each timed step is what a training loop runs: forward, probed backward
(``backward_tokens``, hooks method), ``clip_grad_norm_``, ``AdamW.step()``. Variants, each on its own
copy of the model and optimizer, interleaved (order rotated every repetition) after warm-up:

* ``gram``     the probe alone (hooks method, no optimizer attached);
* ``updates``  the same probe with the optimizer attached, split by role (the per-agent gradients go
               to a K×P store, the role moments advance in the optimizer's step hooks);
* ``sampled``  sketch mode, ``Sketch(k=1024)``: CountSketch Gram plus the coordinate sample that the
               update attribution follows (≈ 1024 coordinates per group).

Memory: the extra tensors update attribution keeps between steps, counted exactly from the objects:
the K×P store (when the Gram alone would keep none: the hooks method's dense per-layer state is freed
at the end of a step), the (U + 1)×P role moments, and the P-value float64 copy of θ taken before
each step (freed after it). Ratios of interleaved medians are the robust figures; absolute times move
with the machine's load. Run: ``.venv/bin/python benchmarks/bench_updates.py [--threads N]``.
"""
from __future__ import annotations

import copy
import os
import statistics
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_probe import CONFIGS, interleaved, lora_model, lora_named, make_batch, token_loss

from gradscope.probe import Probe, Sketch
from gradscope.probe.updates import TeeStore

VARIANTS = ["gram", "updates", "sampled"]


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class Runner:
    def __init__(self, model, batch, K: int) -> None:
        self.batch = batch
        agents = [f"a{k}" for k in range(K)]
        roles = {a: "voter" if k < K - 1 else "aggregator" for k, a in enumerate(agents)}
        self.models = {v: copy.deepcopy(model) for v in VARIANTS}
        self.opts, self.probes = {}, {}
        for v in VARIANTS:
            named = lora_named(self.models[v])
            self.opts[v] = torch.optim.AdamW([p for _, p in named], lr=1e-4, weight_decay=0.01)
            self.probes[v] = Probe(self.models[v], agents, roles, params=named, method="hooks",
                                   sketch=Sketch(1024) if v == "sampled" else None,
                                   optimizer=None if v == "gram" else self.opts[v])

    def step(self, v: str) -> float:
        model, opt, probe = self.models[v], self.opts[v], self.probes[v]
        ids, agent_ids, adv = self.batch
        opt.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        loss = token_loss(model, ids, agent_ids, adv)
        with probe.step(0) as s:
            s.backward_tokens(loss, agent_ids)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return time.perf_counter() - t0

    def extra_bytes(self, v: str) -> int:
        """Tensors kept between steps for update attribution (the store's buffers, the role moments) plus
        the θ copy held during a step."""
        updates = self.probes[v]._updates
        if updates is None:
            return 0
        store = updates.store  # sampled: the sketch (the Gram's own state) tees into the coordinate sample
        kept = store.second._buffers() if isinstance(store, TeeStore) else store._buffers()
        moments = [m for t in updates.trackers for m in t.moments.values()]
        coords = [updates.coordinates.coords(i) for i in range(len(updates.params))]
        theta = sum(p.numel() if c is None else len(c) for c, p in zip(coords, updates.params)) * 8
        return _bytes(kept) + _bytes(moments) + theta

    def close(self) -> None:
        for probe in self.probes.values():
            probe.close()


def bench(name: str, K: int, verbose: bool = True) -> dict[str, Any]:
    sizes, rank, B, T, warmup, reps = CONFIGS[name]
    torch.manual_seed(0)
    model = lora_model(sizes, rank)
    runner = Runner(model, make_batch(model.config.vocab_size, B, T, K), K)
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for rep, v in interleaved(VARIANTS, warmup, reps):
        t = runner.step(v)
        if rep >= warmup:
            times[v].append(t)
    med = {v: statistics.median(ts) for v, ts in times.items()}
    P = sum(p.numel() for _, p in lora_named(model))
    extra = {v: runner.extra_bytes(v) for v in VARIANTS}
    residual = {v: runner.probes[v].last_update.residual for v in VARIANTS[1:]}
    runner.close()
    out = {"config": name, "K": K, "B": B, "T": T, "lora_params": P, "median_s": med,
           "ratio": {v: med[v] / med["gram"] for v in med}, "extra_bytes": extra, "residual": residual}
    if verbose:
        print(f"{name}: LoRA r{rank} {P / 1e6:.3f}M params (fp32 {4 * P / 2**20:.1f} MiB), B={B} x T={T}, K={K}, "
              f"{reps} interleaved reps after {warmup} warm-up")
        print(f"  {'variant':<10}{'step ms':>9}{'x gram':>8}{'extra MiB':>11}{'x params':>10}")
        for v in VARIANTS:
            print(f"  {v:<10}{med[v] * 1e3:9.1f}{out['ratio'][v]:8.2f}{extra[v] / 2**20:11.2f}"
                  f"{extra[v] / (4 * P):10.2f}")
        print("  split residual |Δθ - Σ components| / |Δθ|: "
              + ", ".join(f"{v} {r:.1e}" for v, r in residual.items()))
    return out


def main(verbose: bool = True, threads: int = 1) -> list[dict[str, Any]]:
    """Every config at K = 4 and 8; returns the figures."""
    if threads:
        torch.set_num_threads(threads)
    if verbose:
        print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.2f}")
    return [bench(name, K, verbose) for name in CONFIGS for K in (4, 8)]


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default); default 1")
    main(threads=parser.parse_args().threads)
