"""The hooks method's fixed cost per layer call, side by side with plain: 56 tiny Linear layers (16 × 16,
the count of the LoRA LM of bench_peers.py), 32 rows × 4 tokens, K = 8 agents, so that the arithmetic is
negligible and what is left is the per-call bookkeeping (hooks, the autograd Function, sums by agent)
and the per-step work (the Grams, the add-up check).

Prints the median wall time per step of each, interleaved, and the difference per layer call. On the
LoRA LM of bench_peers.py (56 hooked calls, ~0.3-0.4 s a step on one CPU thread) every 100 µs per call
is 1.5-2 % of a step.

Run: ``.venv/bin/python benchmarks/bench_hook_overhead.py [--steps N]``.
"""
from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch
import torch.nn as nn

from gradscope.probe import Probe

LAYERS, B, T, D, K = 56, 32, 4, 16, 8


def main(steps: int = 300, verbose: bool = True) -> dict[str, float]:
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")

    def model() -> nn.Module:
        torch.manual_seed(0)
        layers = [nn.Linear(D, D, bias=False) for _ in range(LAYERS)]
        for layer in layers:  # norm-preserving, so that 56 layers deep the gradients do not vanish
            nn.init.orthogonal_(layer.weight)
        return nn.Sequential(*layers)

    plain, probed = model(), model()
    x = torch.randn(B, T, D)
    agent_ids = (torch.arange(B) % K)[:, None].expand(B, T)
    agents = [f"a{k}" for k in range(K)]
    probe = Probe(probed, agents, {a: "r" for a in agents}, method="hooks")

    def plain_step() -> None:
        plain.zero_grad(set_to_none=True)
        plain(x).square().mean(-1).sum().backward()

    def hooks_step() -> None:
        probed.zero_grad(set_to_none=True)
        with probe.step(0) as s:
            s.backward_tokens(probed(x).square().mean(-1), agent_ids)

    times: dict[str, list[float]] = {"plain": [], "hooks": []}
    for rep in range(steps + 5):  # the first 5 warm up
        for name, f in (("plain", plain_step), ("hooks", hooks_step))[:: 1 if rep % 2 else -1]:
            t = time.perf_counter()
            f()
            if rep >= 5:
                times[name].append(time.perf_counter() - t)
    out = {name: statistics.median(ts) for name, ts in times.items()}
    out["per_call_us"] = (out["hooks"] - out["plain"]) / LAYERS * 1e6
    if verbose:
        print(f"{LAYERS} Linear({D}, {D}) layers, {B} rows x {T} tokens, K = {K}, 1 thread, median of {steps}: "
              f"plain {out['plain'] * 1e3:.2f} ms, hooks {out['hooks'] * 1e3:.2f} ms per step; "
              f"hooks' fixed cost {out['per_call_us']:.0f} us per layer call")
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    main(parser.parse_args().steps)
