"""Seconds per training step at each testbed scale, measured side by side.

One trainer per scale (Voting/math, IP, the default 8 tasks × 8 rollouts, every step probed, one torch
thread), all in one process; the steps are interleaved — one step of each scale in turn, ``--steps``
rounds — so every scale sees the same machine load. Prints the median wall-clock and CPU seconds per
step of each scale (rollout + update + probe; no evaluation) and their ratios to the smallest scale.
A scale whose warm start is not cached is timed on the freshly initialised model instead (marked
"untrained" in the output), whose completions all run to the generation limit (24 tokens): its seconds
are an upper bound on the warm-started model's. ``--build`` builds the missing warm starts first
(12–18 and 54–60 min for 1.5M and 6M on 2 shared cores, measured: training.md, "Scales").

Run: ``.venv/bin/python benchmarks/bench_scales.py [--steps N] [--scales 0.3M,1.5M,6M] [--build]``.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import tempfile
import time
from collections.abc import Iterator

import gradscope.trainers.testbed.cache as cache
from gradscope.trainers.config import TrainConfig
from gradscope.trainers.distributed import NullWriter
from gradscope.trainers.testbed.model import build_testbed_model
from gradscope.trainers.testbed.scales import SCALES
from gradscope.trainers.train import Trainer


@contextlib.contextmanager
def untrained_base() -> Iterator[None]:
    """Trainers built inside the block start from the freshly initialised testbed model (no warm start)."""
    warm = cache.warm_started_model
    cache.warm_started_model = lambda cfg, verbose=False: build_testbed_model(cfg.seed, **cfg.model_sizes()).eval()
    try:
        yield
    finally:
        cache.warm_started_model = warm


def main(steps: int = 6, scales: list[str] | None = None, build: bool = False) -> dict[str, dict[str, float]]:
    scales = scales or list(SCALES)
    untrained = set() if build else {s for s in scales if not cache.cached_path(SCALES[s]).exists()}
    with tempfile.TemporaryDirectory() as tmp:
        trainers = {}
        for s in scales:
            with untrained_base() if s in untrained else contextlib.nullcontext():
                trainers[s] = Trainer(TrainConfig(scale=s, steps=steps, eval_every=0, checkpoint_every=0, threads=1,
                                                  out=os.path.join(tmp, f"{s}.h5")))
        wall: dict[str, list[float]] = {s: [] for s in scales}
        cpu: dict[str, list[float]] = {s: [] for s in scales}
        for step in range(1, steps + 2):  # the first round warms up and is not counted
            for s, trainer in trainers.items():
                t, c = time.perf_counter(), time.process_time()
                trainer.train_step(step, NullWriter())
                if step > 1:
                    wall[s].append(time.perf_counter() - t)
                    cpu[s].append(time.process_time() - c)
    out = {s: {"wall": statistics.median(wall[s]), "cpu": statistics.median(cpu[s]),
               "params": sum(p.numel() for n, p in trainers[s].model.named_parameters() if "lora_" not in n)}
           for s in scales}
    base = out[scales[0]]
    print(f"seconds per training step (Voting/math IP, 8 tasks x 8 rollouts, 1 thread; median of {steps}, "
          f"interleaved)")
    print(f"{'scale':>6s} {'parameters':>11s} {'wall s':>8s} {'cpu s':>7s} {'wall ratio':>10s} {'cpu ratio':>9s}")
    for s, r in out.items():
        print(f"{s:>6s} {r['params']:>11,d} {r['wall']:>8.3f} {r['cpu']:>7.3f} {r['wall'] / base['wall']:>10.2f} "
              f"{r['cpu'] / base['cpu']:>9.2f}" + ("  (untrained: an upper bound)" if s in untrained else ""))
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--scales", default=",".join(SCALES))
    parser.add_argument("--build", action="store_true", help="build missing warm starts (hours) instead of timing "
                        "those scales untrained")
    args = parser.parse_args()
    main(args.steps, [s.strip() for s in args.scales.split(",") if s.strip()], args.build)
