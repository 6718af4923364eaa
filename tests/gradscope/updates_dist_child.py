"""Update attribution under torchrun (2 ranks, gloo), and the one-process reference it must equal.

Usage: ``python -m torch.distributed.run --nproc_per_node=2 updates_dist_child.py OUT_DIR``. Each rank
takes half of the 8-row batch of ``test_hooks.LMCase`` (SP LoRA LM in fp64, hooks), normalises its loss by the
all-reduced token count, probes the step, sums ``.grad`` over the ranks as a trainer does, clips and
steps its AdamW; two steps, exact and sketched. Writes ``OUT_DIR/rank<r>.npz``.
"""
from __future__ import annotations

import datetime
import os
import sys
from collections.abc import Callable

import numpy as np
import torch
import torch.distributed as dist

from gradscope.probe import Probe, Sketch
from tests.gradscope.test_hooks import LMCase, lora_model
from tests.gradscope.test_probe import AGENTS, ROLES

ROWS = {0: [[0, 1, 2, 3]], 1: [[4, 5], [6, 7]]}
SKETCHES = {"exact": None, "sampled": Sketch(64, seed=7)}


def run_updates(micro_batches: list[list[int]], count: Callable[[int], int], sketch: Sketch | None,
                reduce: Callable[[torch.Tensor], None] = lambda t: None, steps: int = 2) -> dict[str, np.ndarray]:
    """Two AdamW steps; (steps, C, C) update Grams and (steps, C, K) interference of the last optimizer."""
    model = lora_model("sp", torch.float64)  # fp64: where the roles' gradients cancel, d is tiny and the
    # roles' parts are large and opposite, so fp32 rounding of the rank sum would show at ~1e-4
    data = LMCase(model, "sp")
    rows = sorted(r for mb in micro_batches for r in mb)
    data.n_total = count(int((data.agent_ids[rows] >= 0).sum()))
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    probe = Probe(model, AGENTS, ROLES, method="hooks", sketch=sketch, optimizer=opt)
    grams, inters = [], []
    for t in range(steps):
        opt.zero_grad(set_to_none=True)
        with probe.step(t) as s:
            for mb in micro_batches:
                s.backward_tokens(*data.call(mb)())
        for p in params:  # the trainer's job: sum .grad over the ranks
            if p.grad is not None:
                reduce(p.grad)
        torch.nn.utils.clip_grad_norm_(params, 0.05)
        opt.step()
        grams.append(probe.last_update.gram)
        inters.append(probe.last_update.interference)
    probe.close()
    return {"gram": np.stack(grams), "interference": np.stack(inters)}


def main(out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()

    def count(n: int) -> int:
        t = torch.tensor([n])
        dist.all_reduce(t)
        return int(t)

    out = {}
    for name, sketch in SKETCHES.items():
        result = run_updates(ROWS[rank], count, sketch, reduce=dist.all_reduce)
        out.update({f"{name}/{key}": value for key, value in result.items()})
    np.savez(os.path.join(out_dir, f"rank{rank}.npz"), **out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
