"""A toy probed training loop: the placeholder main job until the GRPO trainer lands.

Four agents in a Voting-shaped workflow — three voters answer the same prompts, one aggregator
answers its own — learn small regression tasks. Under Isolated-Policy (``ip``) each role has its
own network; under Shared-Policy (``sp``) all roles share one. Every step is probed and written to
a run file, so the demo exercises the whole instrument: probe → run file → ``gradscope info``.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn as nn

from gradscope.probe import Probe
from gradscope.runfile import RunMeta, RunWriter
from gradscope.runfile.info import render_info

AGENTS = ["voter0", "voter1", "voter2", "aggregator"]
ROLES = {"voter0": "voter", "voter1": "voter", "voter2": "voter", "aggregator": "aggregator"}
SCALARS = ["loss", "loss/voter", "loss/aggregator"]


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 32), nn.Tanh(), nn.Linear(32, 1))


def train_toy(out: Path, policy: str, steps: int = 60, batch: int = 16, seed: int = 0) -> Path:
    """Train the toy workflow under ``policy`` ("ip" or "sp") and write ``out``; returns ``out``."""
    torch.manual_seed(seed)
    nets = nn.ModuleDict({"voter": _net(), "aggregator": _net()} if policy == "ip" else {"shared": _net()})
    net_of = (lambda role: nets[role]) if policy == "ip" else (lambda role: nets["shared"])
    probe = Probe(nets, AGENTS, ROLES)
    optimizer = torch.optim.Adam(nets.parameters(), lr=3e-2)
    w_voter, w_agg = torch.randn(4, 1), torch.randn(4, 1)
    held_out = torch.randn(256, 4)
    meta = RunMeta(agents=AGENTS, agent_roles=[ROLES[a] for a in AGENTS], roles=probe.roles,
                   policies=[policy], groups=probe.groups, group_sizes=probe.group_sizes,
                   config={"workflow": "toy-voting", "policy": policy, "steps": steps, "batch": batch},
                   seed=seed, probe_method=probe.method_name, scalar_names=SCALARS)
    n = batch * len(AGENTS)
    with RunWriter(out, meta, overwrite=True) as writer:
        for step in range(steps):
            x = torch.randn(batch, 4)  # the voters' shared prompt
            x_agg = torch.randn(batch, 4)
            terms = {a: ((net_of("voter")(x + 0.3 * torch.randn_like(x)) - x @ w_voter) ** 2).sum() / n
                     for a in AGENTS[:3]}
            terms["aggregator"] = ((net_of("aggregator")(x_agg) - x_agg @ w_agg) ** 2).sum() / n
            optimizer.zero_grad(set_to_none=True)
            with probe.step(step, policy=policy) as s:
                s.backward(terms, tokens={a: batch for a in AGENTS})
            optimizer.step()
            voter_loss = sum(terms[a].item() for a in AGENTS[:3])
            writer.log_step(step, s.result.gram, s.result.tokens, policy=policy, group_gram=s.result.group_gram,
                            scalars={"loss": voter_loss + terms["aggregator"].item(), "loss/voter": voter_loss,
                                     "loss/aggregator": terms["aggregator"].item()})
            if step % 10 == 9 or step == steps - 1:
                with torch.no_grad():
                    err = (net_of("voter")(held_out) - held_out @ w_voter).abs()
                writer.log_eval(step, {"accuracy": float((err < 0.5).float().mean())})
    return out


def run_demo(out_dir: str | Path) -> list[Path]:
    """Train the toy workflow under IP and SP, print what each run file holds; returns the paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [train_toy(out_dir / f"toy_{policy}.h5", policy) for policy in ("ip", "sp")]
    for path in paths:
        print(render_info(path))
        print()
    return paths
