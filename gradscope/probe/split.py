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


Grads = list[tuple[int, torch.Tensor]]  # (index into params, that parameter's gradient)


def backward_per_agent(params: Sequence[nn.Parameter], terms: Sequence[tuple[int, torch.Tensor]],
                       retain_graph: bool, sink: Callable[[int, Grads], None]) -> None:
    """Back-propagate each ``(agent, loss)`` term on its own and hand ``sink(agent, [(i, grad), ...])`` the
    gradients it leaves on ``params`` (those it reaches), once per term.

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
            # (a sparse gradient, of nn.Embedding(sparse=True), as its dense values)
            sink(k, [(i, p.grad.to_dense() if p.grad.is_sparse else p.grad)
                     for i, p in enumerate(params) if p.grad is not None])
        finally:
            _add_back(params, before)


def _add_back(params: Sequence[nn.Parameter], before: Sequence[torch.Tensor | None]) -> None:
    """``.grad = before + .grad`` (None + g = g), in place into ``before``; the dense pairs in one foreach call
    (sparse gradients and tensor subclasses one by one)."""
    dense: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
    for p, grad in zip(params, before):
        if grad is None:
            continue
        plain = p.grad is not None and type(grad) is type(p.grad) is torch.Tensor
        if plain and not (grad.is_sparse or p.grad.is_sparse):
            dense[0].append(grad)
            dense[1].append(p.grad)
        elif p.grad is not None:
            grad = grad.add_(p.grad)
        p.grad = grad
    if dense[0]:
        torch._foreach_add_(*dense)


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
        backward_per_agent(self.params, terms, retain_graph, self.store.add_grads)

    def end(self) -> np.ndarray:
        return self.store.grams()

    def abort(self) -> None:
        """Nothing to undo: ``.grad`` always holds the running sum."""
