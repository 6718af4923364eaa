"""The two-rank side of test_distributed.py; run with ``python -m torch.distributed.run --nproc_per_node=2``.

Usage: ``dist_child.py OUT_DIR``. Each rank takes half of the 8-row global batch (rank 0 rows 0-3 in
one micro-batch: voters only, so under IP it never touches the aggregator's adapter; rank 1 rows 4-7
in two), normalises its loss by the all-reduced token count, probes the step, then sums ``.grad``
over the ranks as a trainer would. Writes ``OUT_DIR/rank<r>.npz``: every case's Gram, group Grams,
tokens, summed gradient and measurement; and whether a probe built differently per rank was refused.
"""
from __future__ import annotations

import datetime
import os
import sys

import numpy as np
import torch
import torch.distributed as dist

from gradscope.errors import ProbeError
from gradscope.probe import Probe
from tests.gradscope.dist_cases import CASES, case_name, run_case
from tests.gradscope.test_probe import AGENTS, ROLES, make_mlp

ROWS = {0: [[0, 1, 2, 3]], 1: [[4, 5], [6, 7]]}
EMPTY_RANK_CASES = [c for c in CASES if c[0] == "lm" and c[1] == "sp" and c[2] == "hooks"]


def global_count(n: int) -> int:
    t = torch.tensor([n])
    dist.all_reduce(t)
    return int(t)


def main(out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    out: dict[str, np.ndarray] = {}
    for case in CASES:
        probe, result, grad = run_case(case, ROWS[rank], global_count)
        dist.all_reduce(grad)  # the trainer's job: sum .grad over the ranks after the probed step
        name = case_name(case)
        out.update({f"{name}/{key}": value for key, value in result.items()})
        out[f"{name}/grad"] = grad.numpy()
        out[f"{name}/measurement"] = np.array(probe.measurement)
        out[f"{name}/fallbacks"] = np.array(getattr(probe._method, "fallback_calls", 0))
    # A rank whose share of the batch is empty enters the step and calls nothing (hooks' first step holds
    # the self-check, whose collective such a rank skipped: a gloo abort).
    for case in EMPTY_RANK_CASES:
        _, result, _ = run_case(case, [list(range(8))] if rank == 0 else [], global_count)
        out[f"empty-rank/{case_name(case)}/gram"] = result["gram"]
    # An explicit process group gives the same as the default one.
    group = dist.new_group([0, 1])
    _, result, _ = run_case(CASES[0], ROWS[rank], global_count, process_group=group)
    out["explicit-group/gram"] = result["gram"]
    out["rearm/methods"] = np.array(rearmed_check_steps(rank))
    # Ranks that disagree on the agents are refused, on every rank, at construction.
    try:
        Probe(make_mlp(), AGENTS if rank == 0 else AGENTS[:3], ROLES)
        out["mismatch"] = np.array("")
    except ProbeError as e:
        out["mismatch"] = np.array(str(e))
    # ... also on the roles and the accumulation dtype (a gloo abort at the first step's end, or each rank
    # its own split of the update); optimizers attached on one rank only: refused at the next step.
    for name, model, roles in (("roles", make_mlp(), ROLES if rank == 0 else dict.fromkeys(ROLES, "one")),
                               ("dtype", make_mlp().to(torch.float64 if rank == 0 else torch.float32), ROLES)):
        try:
            Probe(model, AGENTS, roles)
            out[f"mismatch-{name}"] = np.array("")
        except ProbeError as e:
            out[f"mismatch-{name}"] = np.array(str(e))
    model = make_mlp()
    probe = Probe(model, AGENTS, ROLES, method="split")
    if rank == 0:
        probe.attach(torch.optim.AdamW(model.parameters()))
    try:
        with probe.step(0):
            pass
        out["mismatch-attach"] = np.array("")
    except ProbeError as e:
        out["mismatch-attach"] = np.array(str(e))
    np.savez(os.path.join(out_dir, f"rank{rank}.npz"), **out)
    dist.destroy_process_group()


class SeqFirst(torch.nn.Module):
    """A Linear on sequence-first input (T, B, d): with T == B its batch dimension is a guess."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).squeeze(-1).sum(0)  # (B,) per-row loss


def rearmed_check_steps(rank: int) -> list[str]:
    """Three steps of a probe (auto) whose rank 0 alone guesses a batch dimension at step 1 (rows of two
    agents, T == B) and so re-arms the self-check: at step 2 only rank 0 checked, and the ranks' collectives
    at the step's end differed (a gloo abort). Returns the steps' recorded methods."""
    torch.manual_seed(0)
    model = SeqFirst()
    probe = Probe(model, ["a", "b"], {"a": "r", "b": "r"})
    methods = []
    for step, rows in enumerate(([rank, rank], [0, 1] if rank == 0 else [1, 1], [0, 1] if rank == 0 else [1, 1])):
        model.zero_grad(set_to_none=True)
        with probe.step(step) as s:
            s.backward_rows(model(torch.randn(2, 2, 4)), rows)
        methods.append(s.result.method)
    probe.close()
    return methods


if __name__ == "__main__":
    main(sys.argv[1])
