"""Where a step's per-agent gradient contributions go when they are materialised.

A :class:`Store` holds, for every parameter group g, a linear image ``c_k^g = T_g(g_k^g)`` of each
agent's gradient: the gradient itself (:class:`FlatStore`, exact) or a random projection of it
(:class:`gradscope.probe.sketch.SketchStore`). Linearity is what makes data parallelism work: the
image of the global gradient ``Σ_ranks g_k^(rank)`` is the sum of the ranks' images, so the ranks
all-reduce their stores (sum) and the Gram ``M^g = C_g C_gᵀ`` is that of the global gradients.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Sequence

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn

from gradscope.errors import ProbeError
from gradscope.probe.distributed import all_reduce_sum_

#: Coordinates per chunk of work: bounds temporary copies at K × 2^22 values.
CHUNK = 1 << 22


def accumulation_dtype(params: Sequence[nn.Parameter]) -> torch.dtype:
    """float64 for fp64 models, else float32 (16-bit gradients are accumulated in fp32)."""
    return torch.float64 if any(p.dtype == torch.float64 for p in params) else torch.float32


def squared_norms(grads: Iterable[tuple[int, torch.Tensor]], group_index: Sequence[int], n_groups: int) -> np.ndarray:
    """(G,) ``Σ ‖grad‖²`` per group of ``(parameter index, gradient)`` pairs, in float64."""
    out = np.zeros(n_groups)
    for i, sq in each_squared_norm(grads).items():
        out[group_index[i]] += sq
    return out


def each_squared_norm(tensors: Iterable[tuple[int, torch.Tensor]]) -> dict[int, float]:
    """``{i: ‖t‖²}`` of ``(i, t)`` pairs, reduced in float64 (no underflow of fp32 squares), with one
    transfer to the host per device rather than one per tensor (each a device sync on a GPU)."""
    by_device: dict[torch.device, list[tuple[int, torch.Tensor]]] = {}
    out: dict[int, float] = {}
    for i, t in tensors:
        if type(t) is torch.Tensor:
            by_device.setdefault(t.device, []).append((i, t))
        else:  # a tensor subclass (FSDP2's DTensor gradients): reduced as it defines, one read each
            out[i] = float(t.double().square().sum())
    for pairs in by_device.values():
        norms = torch._foreach_norm([t for _, t in pairs], 2, dtype=torch.float64)  # one call for the list
        out.update(zip((i for i, _ in pairs), torch.stack(norms).square().tolist()))
    return out


def single_device(params: Sequence[nn.Parameter]) -> torch.device:
    devices = {p.device for p in params}
    if len(devices) > 1:
        raise ProbeError(f"materialising per-agent gradients needs all probed parameters on one device, got {devices}")
    return devices.pop() if devices else torch.device("cpu")


class Store(ABC):
    """Per-agent, per-group linear images of a step's gradient contributions.

    Args:
        params: the probed parameters; ``i`` below indexes this list.
        group_index: ``group_index[i]`` is the group of ``params[i]``, in ``0..n_groups-1``.
        n_agents: K.
        group: the process group whose ranks' stores are summed before the Gram, or None (local).
    """

    def __init__(self, params: Sequence[nn.Parameter], group_index: Sequence[int], n_groups: int,
                 n_agents: int, group: dist.ProcessGroup | None = None) -> None:
        self.params = list(params)
        self.group_index = list(group_index)
        self.n_groups = n_groups
        self.n_agents = n_agents
        self.group = group
        self.device = single_device(self.params)
        self.dtype = accumulation_dtype(self.params)

    @abstractmethod
    def zero(self) -> None:
        """Start a step: every contribution 0."""

    @abstractmethod
    def add(self, i: int, agents: Sequence[int], values: torch.Tensor, start: int = 0) -> None:
        """Add ``values`` (len(agents), m) to coordinates ``[start, start + m)`` of ``params[i]``'s flattened
        gradient, row r for agent ``agents[r]``."""

    @abstractmethod
    def scatter(self, i: int, agents: torch.Tensor, coords: torch.Tensor, values: torch.Tensor) -> None:
        """Add ``values[n]`` to coordinate ``coords[n]`` of ``params[i]``'s flattened gradient for agent
        ``agents[n]``; all three (N,), coordinates may repeat."""

    @abstractmethod
    def blocks(self, g: int) -> Iterator[torch.Tensor]:
        """Group g's (K, m) column blocks of C_g (the local contributions; all-reduced after :meth:`grams`)."""

    @abstractmethod
    def norms_sq(self, grads: Iterable[tuple[int, torch.Tensor]]) -> np.ndarray:
        """(G,) ``‖T_g(v)‖²`` for the vector v made of the ``(i, gradient of params[i])`` pairs (others 0)."""

    @abstractmethod
    def _buffers(self) -> list[torch.Tensor]:
        """The tensors that hold the contributions (summed over ranks in :meth:`grams`)."""

    def add_grads(self, agent: int, grads: Sequence[tuple[int, torch.Tensor]]) -> None:
        """Add one agent's whole gradients: ``grad`` of ``params[i]`` for each ``(i, grad)``."""
        for i, grad in grads:
            self.add(i, [agent], grad.reshape(1, -1))

    def small(self, i: int) -> bool:
        """Whether ``params[i]``'s per-agent gradients are cheap to hand over whole (K × numel ≤ CHUNK);
        larger weights go through :meth:`add_outer`."""
        return self.n_agents * self.params[i].numel() <= CHUNK

    def folds_bias(self, weight: int, bias: int) -> bool:
        """Whether :meth:`add_outer` of ``params[weight]`` takes the bias ``params[bias]``'s per-token terms
        ``G_t`` as well (``bias=``), instead of the caller adding their sums by agent."""
        return False

    @abstractmethod
    def add_outer(self, i: int, agents: torch.Tensor, G: torch.Tensor, A: torch.Tensor,
                  bias: int | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Add the per-token outer products ``G_t A_tᵀ`` to agent ``agents[t]``'s gradient of the matrix
        ``params[i]`` (d_out, d_in); agents (N,), G (N, d_out), A (N, d_in); with ``bias`` (only where
        :meth:`folds_bias`), ``G_t`` to its gradient of ``params[bias]`` too. Returns ``(‖G‖_F, ‖A‖_F)``
        where it computed them on the way (else None)."""

    @abstractmethod
    def local_copy(self) -> "Store":
        """An empty store of the same kind over the same parameters, for this process only."""

    def sums(self) -> tuple[np.ndarray, np.ndarray]:
        """Local ``(Σ_kl M^g_kl, M^g_kk)`` per group, (G,) and (G, K), without the Gram's K² cost: with
        :meth:`norms_sq`, what the add-up check compares (a store may compare both through a smaller map,
        as :class:`~gradscope.probe.sketch.SketchStore` does)."""
        total = np.zeros(self.n_groups)
        diag = np.zeros((self.n_groups, self.n_agents))
        for g in range(self.n_groups):
            column_sum = []
            for block in self.blocks(g):
                block = block.double()
                diag[g] += block.square().sum(1).cpu().numpy()
                column_sum.append(block.sum(0))
            total[g] = sum(float(s @ s) for s in column_sum)
        return total, diag

    def grams(self) -> np.ndarray:
        """``M^g = C_g C_gᵀ`` (G, K, K) float64, after summing the stores of every rank of ``group``."""
        if self.group is not None:
            for buffer in self._buffers():
                all_reduce_sum_(buffer, self.group)
        return self.local_grams()

    def local_grams(self) -> np.ndarray:
        """``M^g = C_g C_gᵀ`` (G, K, K) float64 of this process's contributions (no collective)."""
        grams = np.zeros((self.n_groups, self.n_agents, self.n_agents))
        for g in range(self.n_groups):
            for block in self.blocks(g):
                block = block.double()
                grams[g] += (block @ block.T).cpu().numpy()
        return grams


def group_layout(sizes: Sequence[int], group_index: Sequence[int], n_groups: int) -> tuple[list[int], list[slice], int]:
    """Lay parameters of ``sizes`` values out by group, so that each group's values are one column slice:
    (offset of each parameter, slice of each group, total size)."""
    offsets, slices, pos = [0] * len(sizes), [], 0
    for g in range(n_groups):
        start = pos
        for i, n in enumerate(sizes):
            if group_index[i] == g:
                offsets[i] = pos
                pos += n
        slices.append(slice(start, pos))
    return offsets, slices, pos


class FlatStore(Store):
    """Exact: a (K, P) buffer (P = probed parameter values) laid out group by group."""

    def __init__(self, params: Sequence[nn.Parameter], group_index: Sequence[int], n_groups: int,
                 n_agents: int, group: dist.ProcessGroup | None = None) -> None:
        super().__init__(params, group_index, n_groups, n_agents, group)
        self.offsets, self.group_slices, self.size = group_layout([p.numel() for p in self.params], group_index,
                                                                  n_groups)
        self.buffer: torch.Tensor | None = None

    def zero(self) -> None:
        if self.buffer is None:
            self.buffer = torch.zeros(self.n_agents, self.size, dtype=self.dtype, device=self.device)
        else:
            self.buffer.zero_()

    def view(self, i: int) -> torch.Tensor:
        """``params[i]``'s per-agent gradients, a (K, *shape) view of the buffer."""
        start = self.offsets[i]
        return self.buffer[:, start:start + self.params[i].numel()].view(self.n_agents, *self.params[i].shape)

    def add(self, i: int, agents: Sequence[int], values: torch.Tensor, start: int = 0) -> None:
        lo = self.offsets[i] + start
        for r, k in enumerate(agents):
            self.buffer[k, lo:lo + values.shape[1]] += values[r]

    def add_grads(self, agent: int, grads: Sequence[tuple[int, torch.Tensor]]) -> None:
        """One foreach call (split adds ~50-200 gradients per agent and micro-batch: one op each otherwise)."""
        if any(type(grad) is not torch.Tensor for _, grad in grads):  # a tensor subclass (DTensor): as it defines
            return super().add_grads(agent, grads)
        if grads:
            torch._foreach_add_([self.view(i)[agent] for i, _ in grads], [grad for _, grad in grads])

    def scatter(self, i: int, agents: torch.Tensor, coords: torch.Tensor, values: torch.Tensor) -> None:
        index = agents * self.size + self.offsets[i] + coords
        self.buffer.view(-1).index_add_(0, index, values.to(self.dtype))

    def blocks(self, g: int) -> Iterator[torch.Tensor]:
        sl = self.group_slices[g]
        for start in range(sl.start, sl.stop, CHUNK):
            yield self.buffer[:, start:min(start + CHUNK, sl.stop)]

    def add_outer(self, i: int, agents: torch.Tensor, G: torch.Tensor, A: torch.Tensor,
                  bias: int | None = None) -> None:
        """Per agent ``G_kᵀ A_k``, a block of output rows at a time (no (K, d_out, d_in) temporary); returns None."""
        d_in = A.shape[1]
        present = agents.unique().tolist()
        rows = [agents == k for k in present]
        A_k = [A[r].to(self.dtype) for r in rows]
        G_k = [G[r].to(self.dtype) for r in rows]
        step = max(1, CHUNK // (len(present) * d_in))
        for r0 in range(0, G.shape[1], step):
            block = torch.stack([g[:, r0:r0 + step].T @ a for g, a in zip(G_k, A_k)])
            self.add(i, present, block.flatten(1), r0 * d_in)

    def local_copy(self) -> "FlatStore":
        return FlatStore(self.params, self.group_index, self.n_groups, self.n_agents)

    def param_gram(self, i: int) -> np.ndarray:
        """(K, K) float64 Gram of the per-agent gradients of ``params[i]`` alone."""
        flat = self.view(i).reshape(self.n_agents, -1).double()
        return (flat @ flat.T).cpu().numpy()

    def norms_sq(self, grads: Iterable[tuple[int, torch.Tensor]]) -> np.ndarray:
        return squared_norms(grads, self.group_index, self.n_groups)

    def _buffers(self) -> list[torch.Tensor]:
        return [self.buffer]
