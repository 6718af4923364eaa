"""The split method: one backward per agent, each agent's gradient handed to a store.

Exact for any model and any autograd graph. Costs one backward pass per agent present in a
micro-batch. Memory: the store's (a K × P buffer when exact, K × k per group when sketched), plus
the gradient that autograd produces anyway.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch
import torch.nn as nn

from gradscope.probe.method import GramMethod
from gradscope.probe.store import FlatStore, Store


def backward_per_agent(params: Sequence[nn.Parameter], terms: Sequence[tuple[int, torch.Tensor]],
                       retain_graph: bool, sink: Callable[[int, int, torch.Tensor], None]) -> None:
    """Back-propagate each ``(agent, loss)`` term on its own and hand ``sink(i, agent, grad)`` the gradient
    it leaves on ``params[i]``.

    ``.grad`` keeps the running sum: after every term it holds what it held before plus that term's
    gradient (None where no term has reached yet), as one ``(Σ terms).backward()`` would, also if a
    backward raises.
    """
    live = [(k, t) for k, t in terms if t.requires_grad]
    for j, (k, term) in enumerate(live):
        before = [p.grad for p in params]
        for p in params:
            p.grad = None
        try:
            torch.autograd.backward(term, retain_graph=retain_graph or j < len(live) - 1)
            for i, p in enumerate(params):
                if p.grad is not None:  # (a sparse gradient, of nn.Embedding(sparse=True), as its dense values)
                    sink(i, k, p.grad.to_dense() if p.grad.is_sparse else p.grad)
        finally:
            for p, grad in zip(params, before):
                if grad is not None and p.grad is not None:
                    p.grad = grad.add_(p.grad)
                elif grad is not None:
                    p.grad = grad


class SplitMethod(GramMethod):
    """Per-agent gradients from one backward per agent, kept in a store (exact unless given a sketch)."""

    name = "split"

    def __init__(self, params: Sequence[nn.Parameter], group_index: Sequence[int], n_groups: int,
                 n_agents: int, *, model: nn.Module | None = None, store: Store | None = None) -> None:
        super().__init__(params, group_index, n_groups, n_agents,
                         store=store or FlatStore(params, group_index, n_groups, n_agents))

    def begin(self) -> None:
        self.store.zero()

    def backward(self, terms: Sequence[tuple[int, torch.Tensor]], retain_graph: bool) -> None:
        backward_per_agent(self.params, terms, retain_graph, self.store.add_grad)

    def end(self) -> np.ndarray:
        return self.store.grams()

    def abort(self) -> None:
        """Nothing to undo: ``.grad`` always holds the running sum."""
