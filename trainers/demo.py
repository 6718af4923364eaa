"""``gradscope demo``: Voting on math with Isolated- and Shared-Policy on the testbed, probed, and a
short run where a phenomenon occurs.

Trains ``ip`` and ``sp`` (the healthy pair at the testbed defaults) and ``hot`` (IP at 10× the learning
rate, where accuracy falls off a terminal cliff within about 15 steps, announced by the default
``cliff-early`` alert), each as its own ``gradscope train`` process, ``jobs`` at a time: the output
folder is a three-cell sweep folder (``runs/<name>.h5``, ``logs/<name>.log``, ``cells.json``). Prints,
per run, the held-out accuracy of the base model, the peak and the final one, the alerts it raised,
and what the probe saw (voter–aggregator Gram entries are exactly 0 under IP, where the roles own
disjoint adapters, and not under SP).
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np

from gradscope.errors import GradscopeError
from gradscope.runfile import open_run
from gradscope.trainers.sweep.grid import Cell, cell_config
from gradscope.trainers.sweep.runs import FRESH
from gradscope.trainers.sweep.scheduler import MANIFEST, check_folder, make_folder, run_cells, write_manifest
from gradscope.trainers.testbed import cache
from gradscope.trainers.testbed.scales import DEFAULT_SCALE, SCALES

#: CPU seconds per demo training step (rollout, update, probe, amortised evaluation and analysis):
#: 169 CPU-s for the demo's 130 steps on a 2-core AMD EPYC, measured beside a cold warm-start build.
SECONDS_PER_STEP = 1.3
#: The run in a regime where a phenomenon occurs: IP at 10x the testbed's learning rate.
HOT = dict(policy="ip", lr=1e-2, steps=30, eval_every=5)


def demo_cells(steps: int, threads: int) -> list[Cell]:
    """The demo's runs as sweep cells: ``gradscope train`` flags, without ``--out``."""
    common = ["--workflow", "voting", "--task", "math", "--checkpoint-every", "0", "--probe-updates", "role",
              "--threads", str(threads or 1)]
    runs = {"ip": dict(policy="ip", steps=steps, eval_every=10), "sp": dict(policy="sp", steps=steps, eval_every=10),
            "hot": HOT}
    return [Cell(name, {}, [*common, *(a for k, v in settings.items() for a in (f"--{k.replace('_', '-')}", str(v)))],
                 ()) for name, settings in runs.items()]


def run_demo(out_dir: str | Path, steps: int = 50, threads: int = 0, jobs: int = 3) -> list[Path]:
    """Build the warm start (once per machine), then train the demo's runs ``jobs`` at a time; returns
    their run files (ip, sp, hot). Raises GradscopeError, naming its log, if a run fails."""
    out_dir = Path(out_dir)
    cells = demo_cells(steps, threads)
    # before the banner: a file, FIFO or folder where the demo writes is one line, exit 2
    check_folder(out_dir, cells, files=(MANIFEST,), folders=("runs", "logs"))
    make_folder(out_dir)
    # wall time: the runs' CPU seconds spread over the cores they can use, no less than the longest run
    cores = min(jobs, len(cells), os.cpu_count() or 1)
    expected = max(steps, (2 * steps + HOT["steps"]) / cores) * SECONDS_PER_STEP
    print(f"demo: Voting/math, IP and SP, {steps} steps each, and IP at 10x the learning rate for "
          f"{HOT['steps']} steps; {jobs} at a time, torch threads: {threads or 1} each; expected about "
          f"{expected / 60:.0f} min on an idle machine with {cores} cores, plus about "
          f"{cache.EXPECTED_SECONDS / 60:.0f} min once to build the testbed warm start", flush=True)
    t0 = time.perf_counter()
    cache.warm_started_model(SCALES[DEFAULT_SCALE], verbose=True)  # once here, not in every run's process
    write_manifest(out_dir, cells, Path("gradscope demo"))
    for cell in cells:  # every demo starts its runs afresh: their logs too
        (out_dir / "logs" / f"{cell.name}.log").unlink(missing_ok=True)
    outcome = run_cells([(c, cell_config(c).steps, FRESH, 0) for c in cells], out_dir, jobs, poll=1.0)
    if outcome.failed:
        name, log = next(iter(outcome.failed.items()))
        raise GradscopeError(f"demo run {name!r} failed; its output is in {log}")
    paths = [c.run_path(out_dir) for c in cells]
    for cell, path in zip(cells, paths):
        if cell.name == "hot":
            print(f"\ndemo: a regime where a phenomenon occurs: IP at lr {HOT['lr']:g} (10x), evaluations every "
                  f"{HOT['eval_every']} steps, the default alerts on", flush=True)
        alerts = [line for line in (out_dir / "logs" / f"{cell.name}.log").read_text().splitlines()
                  if line.startswith("gradscope alert")]
        print("\n".join([summary(path), *(f"  {line}" for line in alerts)]), flush=True)
    print(f"\ndemo: trained in {time.perf_counter() - t0:.0f} s", flush=True)
    return paths


def summary(path: Path) -> str:
    """Accuracy base/peak/final and the probe's cross-role Gram entries of a run."""
    with open_run(path) as run:
        acc = run.evals_wide()["accuracy"]
        roles = np.array(run.meta.agent_roles)
        gram = run.gram
        cross = np.abs(gram[:, roles == "voter"][:, :, roles == "aggregator"]).max() if len(gram) else float("nan")
        lines = [f"{path}",
                 f"  accuracy  base {acc.iloc[0]:.3f}  peak {acc.max():.3f} (step {acc.idxmax()})  "
                 f"final {acc.iloc[-1]:.3f}",
                 f"  probe     {run.n_steps} optimizer-step records over {len(set(run.step))} steps, "
                 f"K={len(run.meta.agents)}; max |voter-aggregator Gram entry| = {cross:.3g}"]
    return "\n".join(lines)
