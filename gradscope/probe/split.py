"""The split method: one backward per agent, with snapshots of ``.grad``.

Exact for any model and any autograd graph. Costs one backward pass per agent present in a
micro-batch and a buffer of K × P gradient values (P = number of probed parameter values).
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.nn as nn

from gradscope.errors import ProbeError
from gradscope.probe.method import GramMethod

# Columns per float64 matmul chunk: bounds the temporary copy at K × 2^22 × 8 bytes.
_CHUNK = 1 << 22


class SplitMethod(GramMethod):
    """Per-agent gradients accumulated in a flat (K, P) buffer laid out group by group."""

    name = "split"

    def __init__(self, params: Sequence[nn.Parameter], group_index: Sequence[int], n_groups: int,
                 n_agents: int, *, model: nn.Module | None = None) -> None:
        super().__init__(params, group_index, n_groups, n_agents)
        devices = {p.device for p in self.params}
        if len(devices) > 1:
            raise ProbeError(f"the split method needs all probed parameters on one device, got {devices}")
        self.device = devices.pop() if devices else torch.device("cpu")
        self.dtype = torch.float64 if any(p.dtype == torch.float64 for p in self.params) else torch.float32
        # Lay parameters out by group so each group's gradients are one contiguous column slice.
        order = sorted(range(len(self.params)), key=lambda i: (self.group_index[i], i))
        self.offsets: list[tuple[int, int]] = [(0, 0)] * len(self.params)
        self.group_slices: list[slice] = []
        pos = 0
        for g in range(n_groups):
            start = pos
            for i in order:
                if self.group_index[i] == g:
                    self.offsets[i] = (pos, pos + self.params[i].numel())
                    pos = self.offsets[i][1]
            self.group_slices.append(slice(start, pos))
        self.size = pos
        self.buffer: torch.Tensor | None = None
        self._saved: list[torch.Tensor | None] = []
        self._touched: list[bool] = []

    def begin(self) -> None:
        if self.buffer is None:
            self.buffer = torch.zeros(self.n_agents, self.size, dtype=self.dtype, device=self.device)
        else:
            self.buffer.zero_()
        self._saved = [p.grad for p in self.params]
        self._touched = [False] * len(self.params)
        for p in self.params:
            p.grad = None

    def backward(self, terms: Sequence[tuple[int, torch.Tensor]], retain_graph: bool) -> None:
        live = [(k, t) for k, t in terms if t.requires_grad]
        for j, (k, term) in enumerate(live):
            torch.autograd.backward(term, retain_graph=retain_graph or j < len(live) - 1)
            self._collect(k)

    def _collect(self, agent: int) -> None:
        row = self.buffer[agent]
        for i, p in enumerate(self.params):
            if p.grad is None:
                continue
            start, stop = self.offsets[i]
            row[start:stop] += p.grad.reshape(-1).to(self.dtype)
            self._touched[i] = True
            p.grad = None

    def agent_grads(self, i: int) -> torch.Tensor | None:
        """``params[i]``'s per-agent gradients so far in this step, a (K, *shape) view; None if none flowed."""
        if not self._touched[i]:
            return None
        start, stop = self.offsets[i]
        return self.buffer[:, start:stop].view(self.n_agents, *self.params[i].shape)

    def end(self) -> np.ndarray:
        grams = np.zeros((self.n_groups, self.n_agents, self.n_agents))
        for g, sl in enumerate(self.group_slices):
            for start in range(sl.start, sl.stop, _CHUNK):
                block = self.buffer[:, start:min(start + _CHUNK, sl.stop)].to(torch.float64)
                grams[g] += (block @ block.T).cpu().numpy()
        self._restore()
        return grams

    def abort(self) -> None:
        self._restore()

    def _restore(self) -> None:
        """``.grad`` = what was there before the step + Σ_k g_k (None where nothing flowed)."""
        total = self.buffer.sum(dim=0)
        for i, p in enumerate(self.params):
            saved = self._saved[i]
            if not self._touched[i]:
                p.grad = saved
                continue
            start, stop = self.offsets[i]
            grad = total[start:stop].view(p.shape).to(p.dtype)
            p.grad = grad if saved is None else saved + grad
        self._saved = []
