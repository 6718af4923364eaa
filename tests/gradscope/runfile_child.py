"""A run-file writer in a subprocess, for the crash and live-reading tests.

Usage: ``python runfile_child.py PATH N_RECORDS FLUSH_EVERY SLEEP_S [RESUME_BELOW_STEP]``

Writes records 0..N-1 whose contents are a pure function of the record index (:func:`record`),
with evaluations, metrics and events after some of them (also pure functions of the index), so a
test can check every row it reads. With ``RESUME_BELOW_STEP`` k it continues an existing file like
a trainer restarted from the checkpoint of step k: ``RunWriter.resume(PATH, keep_below_step=k)``,
then records 2k..N-1 (record i belongs to step i // 2). Protocol on stdout (flushed per line):
``ready`` once the file exists in SWMR mode, ``committed <n>`` whenever the writer's committed
count advances, ``done`` after a clean close.
"""
from __future__ import annotations

import sys
import time
from typing import Any

import numpy as np

AGENTS = ["voter0", "voter1", "voter2", "aggregator"]
AGENT_ROLES = ["voter", "voter", "voter", "aggregator"]
POLICIES = ["voter_lora", "aggregator_lora"]
GROUPS = ["layer0", "layer1", "head"]
SCALARS = ["loss", "lr", "reward/mean", "clip_frac"]


def meta() -> Any:
    from gradscope.runfile import RunMeta

    return RunMeta(agents=AGENTS, agent_roles=AGENT_ROLES, policies=POLICIES, groups=GROUPS,
                   group_sizes=[100, 200, 50], config={"lr": 1e-3, "workflow": "voting"}, seed=3,
                   probe_method="split", scalar_names=SCALARS)


def record(i: int) -> dict[str, Any]:
    """The deterministic content of record ``i`` (keyword arguments of ``log_step`` + extras)."""
    rng = np.random.default_rng(i)
    K = len(AGENTS)
    A = rng.normal(size=(K, 6))
    gram = A @ A.T
    if i % 13 == 5:
        gram[0, 1] = gram[1, 0] = np.nan  # NaN is data, must round-trip
    scalars = {"loss": 0.5 * i, "lr": 1.0 / (i + 1), "reward/mean": float(rng.uniform())}
    if i % 3 == 0:
        scalars["clip_frac"] = -float(i)  # otherwise NaN
    return {
        "step": i // 2,
        "opt_step": i,
        "policy": POLICIES[i % 2],
        "gram": gram,
        "tokens": rng.integers(0, 1000, size=K),
        "group_gram": rng.normal(size=(len(GROUPS), K, K)),
        "scalars": scalars,
    }


def eval_of(i: int) -> dict[str, float] | None:
    """Evaluation logged after record ``i`` (every 5th record)."""
    return {"accuracy": i / 1000.0, f"length/{AGENT_ROLES[i % 4]}": float(i)} if i % 5 == 0 else None


def metrics_of(i: int) -> dict[str, float] | None:
    """Per-training-step metrics logged after record ``i`` (the last record of each step)."""
    if i % 2 == 0:
        return None
    rng = np.random.default_rng(10_000 + i)
    return {"reward/mean": float(rng.uniform()), "update_norm/voter_lora": float(rng.exponential()),
            "update_norm/aggregator_lora": float(rng.exponential()), "opt_steps/voter_lora": 1.0,
            "opt_steps/aggregator_lora": 1.0, "time/step_s": i * 0.01}


def event_of(i: int) -> tuple[str, str, str] | None:
    """(kind, message, severity) logged after record ``i`` (every 7th record)."""
    return ("alert", f"record {i} é", "warning") if i % 7 == 3 else None


def main(argv: list[str]) -> None:
    from gradscope.runfile import RunWriter

    path, n, flush_every, sleep_s = argv[0], int(argv[1]), int(argv[2]), float(argv[3])
    if len(argv) > 4:
        keep_below = int(argv[4])
        w, start = RunWriter.resume(path, keep_below_step=keep_below, flush_every=flush_every), 2 * keep_below
    else:
        w, start = RunWriter(path, meta(), flush_every=flush_every), 0
    with w:
        print("ready", flush=True)
        reported = w.n_committed
        for i in range(start, n):
            rec = record(i)
            w.log_step(rec["step"], rec["gram"], rec["tokens"], policy=rec["policy"],
                       group_gram=rec["group_gram"], scalars=rec["scalars"])
            ev = eval_of(i)
            if ev:
                w.log_eval(rec["step"], ev)
            metrics = metrics_of(i)
            if metrics:
                w.log_metrics(rec["step"], metrics)
            event = event_of(i)
            if event:
                w.log_event(rec["step"], event[0], event[1], severity=event[2])
            if w.n_committed != reported:
                reported = w.n_committed
                print(f"committed {reported}", flush=True)
            if sleep_s:
                time.sleep(sleep_s)
    print("done", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
