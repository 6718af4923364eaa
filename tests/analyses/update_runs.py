"""Synthetic run files with update attribution (no training), for the analyses, figures and alerts.

Voting layout (three voters, an aggregator). Per training step the roles' gradients and their parts
of the update are orthogonal vectors (16 dimensions) with chosen squared norms, so the gradient share
of the voters is ``grad_share`` and their update share ``update_share(step)`` exactly (weight decay:
a small third component, unattributed: 0); each voter agent carries a third of the voters' gradient.
SP: one record per step under ``shared``; IP: one record per role and step, each holding one role.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from gradscope.runfile import RunMeta, RunWriter

AGENTS = ["voter0", "voter1", "voter2", "aggregator"]
ROLES = ["voter", "voter", "voter", "aggregator"]
DIM = 16


def components(share: float, wd: float = 1e-3) -> np.ndarray:
    """(4, DIM) update components: voter, aggregator, unattributed (0), weight decay, with
    <Δθ_voter, Δθ>/‖Δθ‖² = share (the weight decay is orthogonal and small)."""
    e = np.eye(DIM)
    total = 1.0 - wd ** 2
    return np.stack([np.sqrt(share * total) * e[0], np.sqrt((1 - share) * total) * e[1], 0 * e[0], wd * e[2]])


def write_update_run(path: Path, *, update_share: Callable[[int], float],
                     grad_share: float | Callable[[int], float] = 0.55, no_gradient: Callable[[int], bool] = lambda t: False,
                     steps: int = 30, policy: str = "sp", scale: float = 1e-3) -> Path:
    e = np.eye(DIM)
    meta = RunMeta(agents=AGENTS, agent_roles=ROLES, policies=["voter", "aggregator"] if policy == "ip" else ["shared"],
                   config={"workflow": "voting", "task": "math", "model": "testbed", "policy": policy},
                   update_unit="role")
    with RunWriter(path, meta) as w:
        for step in range(1, steps + 1):
            gs = grad_share(step) if callable(grad_share) else grad_share
            g_voter, g_agg = np.sqrt(gs) * e[0], np.sqrt(1 - gs) * e[1]
            G = np.stack([g_voter / 3] * 3 + [g_agg]) * (not no_gradient(step))   # (K, DIM)
            D = scale * components(update_share(step))               # (C, DIM)
            records = [("shared", G, D)] if policy == "sp" else [
                ("voter", G * [[1], [1], [1], [0]], D * [[1], [0], [0], [1]]),
                ("aggregator", G * [[0], [0], [0], [1]], D * [[0], [1], [0], [1]])]
            for name, g, d in records:
                update = type("U", (), dict(gram=d @ d.T, interference=-(d @ g.T), grad_scale=1.0, residual=0.0))
                w.log_step(step, g @ g.T, [30, 30, 30, 10], policy=name, update=update)
            w.log_eval(step, {"accuracy": 0.5})
    return path
