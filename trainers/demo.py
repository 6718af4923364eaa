"""``gradscope demo``: Voting on math with Isolated- and Shared-Policy on the testbed, probed, and a
short run where a phenomenon occurs.

Writes ``ip.h5`` and ``sp.h5`` (the healthy pair at the testbed defaults) and ``hot.h5`` (IP at 10×
the learning rate, where accuracy falls off a terminal cliff within about 15 steps, announced by the
default ``cliff-early`` alert) into the output folder, and prints, per run, the held-out accuracy of
the base model, the peak and the final one, and what the probe saw (voter–aggregator Gram entries
are exactly 0 under IP, where the roles own disjoint adapters, and not under SP).
"""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from gradscope.runfile import open_run
from gradscope.trainers.cli import run_with_progress
from gradscope.trainers.config import TrainConfig
from gradscope.trainers.grpo_config import GRPOConfig
from gradscope.trainers.testbed import cache
from gradscope.trainers.train import Trainer


#: CPU seconds per demo training step (rollout, update, probe, amortised evaluation and analysis):
#: 247 CPU-s for the demo's 230 steps, measured with a warm cache.
SECONDS_PER_STEP = 1.07
#: The run in a regime where a phenomenon occurs: IP at 10x the testbed's learning rate.
HOT = dict(policy="ip", lr=1e-2, steps=30, eval_every=5)


def run_demo(out_dir: str | Path, steps: int = 100, threads: int = 0) -> list[Path]:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    total = 2 * steps + HOT["steps"]
    print(f"demo: Voting/math, IP then SP, {steps} steps each, then IP at 10x the learning rate for "
          f"{HOT['steps']} steps; torch threads: {threads or '1 (testbed default; --threads N for more)'}; "
          f"expected about {total * SECONDS_PER_STEP / 60:.0f} min on an idle machine, plus about "
          f"{cache.EXPECTED_SECONDS / 60:.0f} min once to build the testbed warm start", flush=True)
    runs = [("ip", dict(policy="ip", steps=steps, eval_every=10)), ("sp", dict(policy="sp", steps=steps, eval_every=10)),
            ("hot", HOT)]
    paths = []
    for name, settings in runs:
        if name == "hot":
            print(f"\ndemo: a regime where a phenomenon occurs: IP at lr {HOT['lr']:g} (10x), evaluations every "
                  f"{HOT['eval_every']} steps; watch the default alerts", flush=True)
        t0 = time.perf_counter()
        cfg = TrainConfig(workflow="voting", task="math", out=str(out_dir / f"{name}.h5"), overwrite=True,
                          checkpoint_every=0, threads=threads, probe_updates="role",
                          grpo=GRPOConfig(lr=settings.get("lr", 0.0)),
                          **{k: v for k, v in settings.items() if k != "lr"})
        paths.append(run_with_progress(Trainer(cfg, verbose=True)))
        print(summary(paths[-1]) + f"\n  time      {time.perf_counter() - t0:.0f} s", flush=True)
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
