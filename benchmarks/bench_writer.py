"""Writer cost per logged record: K=8 agents, 50 scalar metrics, flush every 10 records.

Times every ``RunWriter.log_step`` call with ``perf_counter_ns`` (after a warm-up) on a
temporary file. The median is the common, buffer-only call; the mean is the amortised cost,
flushes included (one call in ``flush_every`` writes every dataset, flushes the file twice and
advances ``/committed``); p99 is dominated by those flushing calls. Goal: median <= 100 µs.

Run: ``.venv/bin/python benchmarks/bench_writer.py``; or import and call :func:`main`.
"""
from __future__ import annotations

import os
import tempfile
import time
from typing import Any

import numpy as np

from gradscope.runfile import RunMeta, RunWriter

GOAL_MEDIAN_US = 100.0


def _meta(n_agents: int, n_scalars: int, n_groups: int) -> RunMeta:
    agents = [f"voter{i}" for i in range(n_agents - 1)] + ["aggregator"]
    roles = ["voter"] * (n_agents - 1) + ["aggregator"]
    return RunMeta(agents=agents, agent_roles=roles, policies=["voter_lora", "aggregator_lora"],
                   groups=[f"layer{g}" for g in range(n_groups)], group_sizes=[1000] * n_groups,
                   scalar_names=[f"metric/{j}" for j in range(n_scalars)], seed=0,
                   probe_method="split")


def main(n_records: int = 20_000, warmup: int = 1_000, n_agents: int = 8, n_scalars: int = 50,
         flush_every: int = 10, n_groups: int = 0, verbose: bool = True) -> dict[str, Any]:
    """Run the benchmark; return the figures (µs per ``log_step`` call) as a dict."""
    rng = np.random.default_rng(0)
    meta = _meta(n_agents, n_scalars, n_groups)
    # A pool of distinct inputs, built beforehand so that only the writer is timed.
    pool = []
    for i in range(64):
        A = rng.normal(size=(n_agents, 16))
        pool.append((
            A @ A.T,
            rng.integers(0, 2000, size=n_agents),
            {name: float(x) for name, x in zip(meta.scalar_names, rng.normal(size=n_scalars))},
            rng.normal(size=(n_groups, n_agents, n_agents)) if n_groups else None,
        ))
    policies = meta.policies
    times = np.empty(n_records, dtype=np.int64)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "bench.h5")
        clock = time.perf_counter_ns
        with RunWriter(path, meta, flush_every=flush_every) as w:
            for i in range(warmup + n_records):
                gram, tokens, scalars, group = pool[i % len(pool)]
                t0 = clock()
                w.log_step(i, gram, tokens, policy=policies[i % 2], scalars=scalars, group_gram=group)
                t1 = clock()
                if i >= warmup:
                    times[i - warmup] = t1 - t0
            t0 = clock()
        close_us = (clock() - t0) / 1e3
        size = os.path.getsize(path)

    us = times / 1e3
    # Calls that flushed: the last of every flush_every (warm-up is a multiple, so the phase holds).
    flushing = us[(np.arange(n_records) + warmup + 1) % flush_every == 0]
    figures = {
        "n_records": n_records,
        "n_agents": n_agents,
        "n_scalars": n_scalars,
        "n_groups": n_groups,
        "flush_every": flush_every,
        "median_us": float(np.median(us)),
        "mean_us": float(us.mean()),
        "p99_us": float(np.percentile(us, 99)),
        "max_us": float(us.max()),
        "flush_call_median_us": float(np.median(flushing)) if len(flushing) else float("nan"),
        "close_us": close_us,
        "bytes_per_record": size / (warmup + n_records),
        "goal_median_us": GOAL_MEDIAN_US,
    }
    figures["meets_goal"] = figures["median_us"] <= GOAL_MEDIAN_US
    if verbose:
        print(f"RunWriter.log_step, K={n_agents} agents, {n_scalars} scalars, {n_groups} groups, "
              f"flush every {flush_every}, {n_records:,} records after {warmup:,} warm-up")
        print(f"  median           {figures['median_us']:8.1f} µs   (buffer only)")
        print(f"  mean (amortised) {figures['mean_us']:8.1f} µs   (flushes included)")
        print(f"  p99              {figures['p99_us']:8.1f} µs")
        print(f"  max              {figures['max_us']:8.1f} µs")
        print(f"  flushing call    {figures['flush_call_median_us']:8.1f} µs median")
        print(f"  file size        {figures['bytes_per_record']:8.0f} bytes/record")
        verdict = "meets" if figures["meets_goal"] else "MISSES"
        print(f"  goal: median <= {GOAL_MEDIAN_US:.0f} µs -> {verdict}")
    return figures


if __name__ == "__main__":
    main()
