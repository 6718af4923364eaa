"""Alert evaluation against the training step it watches, measured side by side.

A real testbed training run (Voting/math, IP, the default 8 tasks × 8 rollouts per step, every
step probed) with the default rules plus four more (a wildcard aggregate, a per-agent rule, a
metric rule and every agent pair's cosine). Each step's alert work — ``Monitor.step`` on its Gram records and ``Monitor.metrics``
— is timed inside the same ``train_step`` call it belongs to, so both figures come from the same
process at the same moment: ``ratio = median(alert time) / median(step time without alerts)``.

Goal: ≤ 1 %. Run: ``.venv/bin/python benchmarks/bench_alerts.py [--steps N]``.
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

from gradscope.alerts import DEFAULT_RULES, Monitor, parse_rule
from gradscope.runfile import RunWriter
from gradscope.trainers.config import TrainConfig
from gradscope.trainers.train import Trainer

EXTRA = ("grad_norm[*] > 3x median(50)", "agent_norm[voter0] > 10 for 3", "train/accuracy < 0.05 for 5",
         "cosine[*] > 0.99 for 5")


class TimedMonitor(Monitor):
    """A Monitor that adds up the time spent in its feeding calls."""

    spent = 0.0

    def _timed(self, call, *args, **kw):
        t = time.perf_counter()
        try:
            return call(*args, **kw)
        finally:
            self.spent += time.perf_counter() - t

    def step(self, *args, **kw):
        return self._timed(super().step, *args, **kw)

    def metrics(self, *args, **kw):
        return self._timed(super().metrics, *args, **kw)


def main(steps: int = 12) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        cfg = TrainConfig(steps=steps, eval_every=0, checkpoint_every=0, out=os.path.join(tmp, "run.h5"))
        trainer = Trainer(cfg)
        rules = [*DEFAULT_RULES, *(parse_rule(t) for t in EXTRA)]
        wf = trainer.workflow
        step_times, alert_times = [], []
        with RunWriter(cfg.out, trainer.meta()) as writer:
            monitor = TimedMonitor(rules, list(wf.agents), [wf.agent_roles[a] for a in wf.agents],
                                   policies=trainer.policy.adapters, writer=writer, echo=lambda line: None)
            for step in range(1, steps + 1):
                monitor.spent = 0.0
                t = time.perf_counter()
                trainer.train_step(step, writer, monitor)
                total = time.perf_counter() - t
                step_times.append(total - monitor.spent)
                alert_times.append(monitor.spent)
    step_t, alert_t = statistics.median(step_times[1:]), statistics.median(alert_times[1:])  # step 1 warms up
    result = {"step_s": step_t, "alerts_ms": alert_t * 1e3, "ratio": alert_t / step_t}
    print(f"alerts: {len(rules)} rules, {steps - 1} steps (first dropped): training step {step_t:.3f} s, "
          f"alert evaluation {alert_t * 1e3:.2f} ms (max {max(alert_times[1:]) * 1e3:.2f} ms) "
          f"= {100 * result['ratio']:.3f} % of a step (goal <= 1 %)")
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    main(parser.parse_args().steps)
