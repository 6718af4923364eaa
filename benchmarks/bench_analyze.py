"""``gradscope analyze`` on a long run: 100,000 training steps, K = 8 agents in 4 roles.

The run is synthetic (``tests/analyses/synthetic.py``): Shared-Policy, one record per step, real
Gram matrices of per-agent gradient vectors, evaluations every 100 steps with a planted terminal
cliff, preceded by the aggregator's gradient norm jumping 10× (so the lead-indicator search runs
too) and the aggregator capturing the shared parameters; from 60 % of the run on the 3 voters
amplify (coherent, 4× the other roles' norm) and hold the shared parameters until the aggregator
takes over. Expected findings: amplification (voter), capture (voter, then aggregator), cliff.
It is written to a temporary run file with ``RunWriter`` (not timed), then timed, median of 3:

* ``file``:   ``analyses.cli.load`` (open the file, read every record, build the ``RunSeries``)
  + ``analyze_series`` — what ``gradscope analyze run.h5`` does, minus interpreter start-up and
  rendering (rendering is timed separately);
* ``memory``: ``analyze_series`` on a fresh in-memory ``RunSeries`` (no cached statistics);
* ``cli``:    the whole command, ``python -m gradscope.cli analyze run.h5 --json``, in a subprocess.

Goal: file ≤ 2 s. Run: ``.venv/bin/python benchmarks/bench_analyze.py [--profile]``; or import
and call :func:`main`.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np

from gradscope.analyses.cli import load
from gradscope.analyses.report import analyze_series, to_json, to_text
from gradscope.analyses.series import RunSeries

# appended, not prepended: the checkout's gradscope/ must not shadow the installed package
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests.analyses import synthetic as syn  # noqa: E402

GOAL_S = 2.0
LAYOUT = syn.Layout("bench", (("voter", 3), ("worker", 3), ("planner", 1), ("aggregator", 1)))


def build(n_steps: int = 100_000, eval_every: int = 100, seed: int = 0, chunk: int = 20_000) -> RunSeries:
    """The synthetic run (built in chunks of ``chunk`` steps to bound memory)."""
    rng = np.random.default_rng(seed)
    onset = int(0.8 * n_steps) // eval_every * eval_every
    jump = onset - 5 * eval_every // 10          # the aggregator's norm jumps half an interval early
    parts = []
    for lo in range(0, n_steps, chunk):
        T = min(chunk, n_steps - lo)
        t = np.arange(lo + 1, lo + T + 1)
        coherent = t >= int(0.6 * n_steps)   # the voters amplify from 60 % of the run on
        norm = {"aggregator": np.where(t >= jump, 10.0, 1.0), "voter": np.where(coherent, 4.0, 1.0)}
        rho = {"voter": np.where(coherent, 0.85, 0.0)}
        parts.append(syn.make_series(LAYOUT, T, norm=norm, rho=rho, seed=seed + lo, first_step=lo + 1))
    steps = np.arange(0, n_steps + 1, eval_every)
    acc = 0.3 + 0.3 * np.minimum(steps / (0.5 * n_steps), 1) + 0.01 * rng.standard_normal(len(steps))
    acc = np.where(steps >= onset, 0.2 + 0.01 * rng.standard_normal(len(steps)), acc)
    evals = syn.eval_frame(steps, acc, length__voter=100 + rng.normal(size=len(steps)),
                           length__aggregator=np.where(steps >= onset, 90.0, 20.0))
    return RunSeries(agents=LAYOUT.agents, agent_roles=LAYOUT.agent_roles,
                     gram=np.concatenate([p.gram for p in parts]),
                     record_step=np.concatenate([p.record_step for p in parts]),
                     record_policy=np.concatenate([p.record_policy for p in parts]),
                     tokens=np.concatenate([p.tokens for p in parts]), evals=evals,
                     config={"workflow": "bench", "policy": "sp", "task": "math", "model": "synthetic"},
                     name="bench")


def _fresh(s: RunSeries) -> RunSeries:
    """The same data without any cached statistics."""
    return RunSeries(agents=s.agents, agent_roles=s.agent_roles, gram=s.gram, record_step=s.record_step,
                     record_policy=s.record_policy, tokens=s.tokens, evals=s.evals, metrics=s.metrics,
                     config=s.config, name=s.name)


def _time(fn, repeat: int) -> tuple[float, list[float], Any]:
    times, out = [], None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), times, out


def main(n_steps: int = 100_000, repeat: int = 3, profile: bool = False, verbose: bool = True) -> dict[str, Any]:
    """Run the benchmark; return the figures (seconds) as a dict."""
    t0 = time.perf_counter()
    series = build(n_steps)
    build_s = time.perf_counter() - t0
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "bench.h5")
        t0 = time.perf_counter()
        syn.write_run(series, path, flush_every=1000)
        write_s = time.perf_counter() - t0
        size = os.path.getsize(path)

        def from_file():
            s, closed = load(path)
            return analyze_series(s, closed=closed)

        load_s, _, _ = _time(lambda: load(path), repeat)
        file_s, file_times, report = _time(from_file, repeat)
        mem_s, mem_times, report_mem = _time(lambda: analyze_series(_fresh(series)), repeat)
        render_s, _, _ = _time(lambda: (to_text(report), to_json(report)), repeat)
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
        cli_s, cli_times, _ = _time(lambda: subprocess.run(
            [sys.executable, "-m", "gradscope.cli", "analyze", path, "--json"], check=True, cwd=root, env=env,
            stdout=subprocess.DEVNULL), repeat)
        prof_text = ""
        if profile:
            pr = cProfile.Profile()
            pr.enable()
            from_file()
            pr.disable()
            buf = io.StringIO()
            pstats.Stats(pr, stream=buf).sort_stats("cumulative").print_stats(25)
            prof_text = buf.getvalue()

    kinds = sorted(report.kinds())
    figures = {
        "n_steps": n_steps, "n_records": len(series.gram), "n_agents": len(series.agents),
        "n_roles": len(series.roles), "n_evals": len(series.accuracy), "file_bytes": size,
        "build_s": build_s, "write_s": write_s,
        "load_s": load_s, "file_s": file_s, "file_times_s": file_times,
        "memory_s": mem_s, "memory_times_s": mem_times, "render_s": render_s,
        "cli_s": cli_s, "cli_times_s": cli_times,
        "findings": kinds, "n_findings": len(report.findings), "same_findings": kinds == sorted(report_mem.kinds()),
        "goal_s": GOAL_S, "meets_goal": file_s <= GOAL_S,
    }
    if verbose:
        print(f"analyze: {n_steps:,} steps, {figures['n_records']:,} records, K={figures['n_agents']} agents in "
              f"{figures['n_roles']} roles, {figures['n_evals']} evaluations ({size / 2**20:.1f} MiB file; "
              f"built in {build_s:.1f} s, written in {write_s:.1f} s)")
        print(f"  load (read file → RunSeries)   {load_s:6.3f} s")
        print(f"  load + analyze_series (file)   {file_s:6.3f} s   median of {repeat}: "
              + ", ".join(f"{t:.3f}" for t in file_times))
        print(f"  analyze_series (in memory)     {mem_s:6.3f} s   median of {repeat}: "
              + ", ".join(f"{t:.3f}" for t in mem_times))
        print(f"  render text + JSON             {render_s:6.3f} s")
        print(f"  `gradscope analyze --json` CLI {cli_s:6.3f} s   (subprocess: interpreter and imports included)")
        print(f"  findings: {len(report.findings)} ({', '.join(kinds) or 'none'})")
        print(f"  goal: load + analyze <= {GOAL_S:.0f} s -> {'meets' if figures['meets_goal'] else 'MISSES'}")
        if prof_text:
            print(prof_text)
    return figures


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=100_000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--profile", action="store_true", help="cProfile one load + analyze and print the top entries")
    a = ap.parse_args()
    main(a.steps, a.repeat, a.profile)
