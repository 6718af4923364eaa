"""Small synthetic run files for the figure tests, written with ``RunWriter`` (no training).

Every Gram matrix is ``G Gᵀ`` of random per-agent gradient vectors (16 dimensions), so norms and
cosines are consistent. Voting layout: three voters and an aggregator; IP logs one record per
policy per step (a voter record holds only the voters' gradients), SP one record of all agents
under the policy ``shared``; ``sp_noconfig`` is an SP run whose file holds no config (as another
framework's loop may write it). A cliff run's held-out accuracy rises to 0.6 by step 20 and falls to
0.05 from step 26 on (evaluations every 2 steps); its voters turn coherent and the aggregator's
gradient grows 10× from step 18.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from gradscope.runfile import RunMeta, RunWriter

DIM = 16
VOTING = (["voter0", "voter1", "voter2", "aggregator"], ["voter", "voter", "voter", "aggregator"])
EVALOPT = (["generator", "evaluator"], ["generator", "evaluator"])


def accuracy(step: int, cliff: bool, rng: np.random.Generator) -> float:
    if cliff:
        return 0.05 if step >= 26 else 0.4 + 0.2 * min(step, 20) / 20
    return float(np.clip(0.4 + 0.2 * step / 40 + rng.normal(0, 0.01), 0, 1))


def agent_vectors(step: int, roles: list[str], cliff: bool, rng: np.random.Generator) -> np.ndarray:
    """(K, DIM) per-agent gradients: a shared direction per role plus noise."""
    dirs = {r: np.eye(DIM)[i] for i, r in enumerate(dict.fromkeys(roles))}
    late = cliff and step >= 18
    out = []
    for r in roles:
        rho = 0.9 if (late and r == "voter") else 0.1
        scale = (10.0 if (late and r == "aggregator") else 1.0) * (0.3 if r == "voter" else 0.2)
        noise = rng.normal(size=DIM) / np.sqrt(DIM)
        out.append(scale * (np.sqrt(rho) * dirs[r] + np.sqrt(1 - rho) * noise))
    return np.array(out)


def write_run(path: Path, *, policy: str = "sp", cliff: bool = False, steps: int = 40, evals: bool = True,
              grads: bool = True, workflow: str = "voting", task: str = "math", model: str = "testbed",
              seed: int = 0, eval_every: int = 2, config: bool = True) -> Path:
    agents, roles = VOTING if workflow == "voting" else EVALOPT
    role_names = list(dict.fromkeys(roles))
    policies = role_names if policy == "ip" else ["shared"]
    meta = RunMeta(agents=agents, agent_roles=roles, roles=role_names, policies=policies, scalar_names=[],
                   config={"workflow": workflow, "task": task, "model": model, "policy": policy, "seed": seed}
                   if config else {})
    rng = np.random.default_rng(seed + 1000 * cliff)
    tokens = np.array([60 if r == "voter" else 20 for r in roles])
    with RunWriter(path, meta, flush_every=8) as w:
        if evals:
            w.log_eval(0, {"accuracy": accuracy(0, cliff, rng)})
        for step in range(1, steps + 1):
            if grads:
                G = agent_vectors(step, roles, cliff, rng)
                if policy == "ip":
                    for p in role_names:
                        keep = np.array([r == p for r in roles])
                        Gp = np.where(keep[:, None], G, 0.0)
                        w.log_step(step, Gp @ Gp.T, np.where(keep, tokens, 0), policy=p)
                else:
                    w.log_step(step, G @ G.T, tokens, policy="shared")
                w.log_metrics(step, {f"update_norm/{p}": 0.01 for p in policies})
            if evals and step % eval_every == 0:
                w.log_eval(step, {"accuracy": accuracy(step, cliff, rng)})
    return path


@pytest.fixture(scope="session")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("figruns")
    specs = {
        "ip_cliff": dict(policy="ip", cliff=True),
        "sp_cliff": dict(policy="sp", cliff=True),
        "ip_ok": dict(policy="ip"),
        "ip_ok2": dict(policy="ip", seed=1),
        "sp_ok": dict(policy="sp"),
        "sp_ok2": dict(policy="sp", seed=1),
        "sp_ok3": dict(policy="sp", seed=2),
        "sp_noevals": dict(policy="sp", evals=False),
        "sp_noconfig": dict(policy="sp", config=False),
        "single": dict(policy="sp", steps=1, eval_every=1),
        "evals_only": dict(policy="sp", grads=False),
        "empty": dict(policy="sp", grads=False, evals=False),
        "evalopt_ip": dict(policy="ip", workflow="evalopt"),
        "big_sp": dict(policy="sp", model="/models/Qwen3-1.7B", task="code"),
        "big_ip_noevals": dict(policy="ip", model="Qwen3-4B", evals=False),
    }
    return {name: write_run(d / f"{name}.h5", **kw) for name, kw in specs.items()}
