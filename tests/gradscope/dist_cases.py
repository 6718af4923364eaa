"""Probed steps shared by the two-rank child (``dist_child.py``) and the single-process reference.

A case is (model, policy, method, sketch). The global batch is fixed; a process runs the micro-batches
(row lists) it is given and normalises the loss by ``count(local tokens)``: the identity in one
process, the all-reduced (global) count under torchrun, so that per-rank gradients sum to the
global gradient.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
import torch.distributed as dist

from gradscope.probe import Probe
from gradscope.probe.sketch import Sketch
from tests.gradscope.test_hooks import LMCase, EmbedLM, embed_case, lora_model
from tests.gradscope.test_probe import AGENTS, ROLES

CASES: list[tuple[str, str, str, Sketch | None]] = [
    (model, policy, method, sketch)
    for model, policies, sketch in (("lm", ("sp", "ip"), Sketch(64, seed=7)), ("embed", ("full",), Sketch(16)))
    for policy in policies for method in ("split", "hooks") for sketch in (None, sketch)
]


def case_name(case: tuple[str, str, str, Sketch | None]) -> str:
    model, policy, method, sketch = case
    return f"{model}-{policy}-{method}-{'exact' if sketch is None else f'k{sketch.k}'}"


def run_case(case: tuple[str, str, str, Sketch | None], micro_batches: list[list[int]],
             count: Callable[[int], int], process_group: dist.ProcessGroup | bool | None = None,
             ) -> tuple[Probe, dict[str, np.ndarray], torch.Tensor]:
    """One probed step over ``micro_batches`` (rows of the 8-row global batch); returns the probe, the
    result's arrays, and the flat ``.grad`` (P,) of the probed parameters as this process left it."""
    kind, policy, method, sketch = case
    if kind == "lm":
        model = lora_model(policy, torch.float32)
        data = LMCase(model, policy)
        rows = sorted(r for mb in micro_batches for r in mb)
        data.n_total = count(int((data.agent_ids[rows] >= 0).sum()))
        calls = [data.call(mb) for mb in micro_batches]
        groups = "adapter" if policy == "ip" else "layer"
    else:
        model = EmbedLM()
        call = embed_case(model)  # normalised by a global constant
        calls = [call(mb) for mb in micro_batches]
        groups = {"emb": ["emb."], "head": ["head."]}
    probe = Probe(model, AGENTS, ROLES, method=method, sketch=sketch, groups=groups, process_group=process_group)
    try:
        with probe.step(0) as s:
            for forward in calls:
                s.backward_tokens(*(forward(s) if getattr(forward, "tags", False) else forward()))
    finally:
        probe.close()
    params = [p for _, p in _probed(model, probe)]
    grad = torch.cat([(torch.zeros_like(p) if p.grad is None else p.grad).reshape(-1) for p in params])
    r = s.result
    return probe, {"gram": r.gram, "group_gram": r.group_gram, "tokens": r.tokens}, grad


def _probed(model: torch.nn.Module, probe: Probe) -> list[tuple[str, torch.nn.Parameter]]:
    named = dict(model.named_parameters())
    return [(n, named[n]) for n in probe.param_names]
