"""Where the hooks method puts each layer call's per-agent gradient contributions during a step.

Per weight and step, one of two representations, chosen by cost (:data:`GHOST_FACTOR`):

* **dense**: the (K, d_out, d_in) per-agent gradients, added to at every backward (per-row products
  ``G_bᵀ A_b`` summed by agent, costing N·d_in·d_out like the weight gradient itself); Gram ``D Dᵀ``.
  The choice for LoRA factors, whose d_out (A) or d_in (B) is the rank r, once N > r.
* **ghost**: the token rows ``(A, G, agent)`` of every backward of the step, and at ``end``
  ``M_kl = Σ_{i∈k, j∈l} (A Aᵀ)_ij (G Gᵀ)_ij`` (N × N, never a d_out × d_in matrix), chosen while
  ``N (d_in + d_out) < GHOST_FACTOR · d_in d_out`` (N: the step's tokens so far). Keeping the rows of
  all calls gives the cross-call terms, so gradient accumulation is exact; when N passes the rule
  the rows are materialised into the dense form and the weight stays dense for the step.

Embeddings keep their ``(ids, G, agent)`` rows and materialise at ``end`` only the U distinct rows
touched (K × U × d; the ghost form would cost N²·d). With a store (sketch mode, or the exact Gram of
several ranks) nothing is kept per weight: each call's per-agent contributions go to the store.

Beside the gradients, the step's rounding scale ``S`` of every parameter (:meth:`Accumulator.add_magnitude`),
which the add-up check and the self-check allow for (:mod:`gradscope.probe.tolerance`).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch
import torch.nn as nn

from gradscope.probe.grams import flat_gram, ghost_gram, in_float64, touched_rows_gram
from gradscope.probe.layers import Layer
from gradscope.probe.rows import Forward
from gradscope.probe.split import Grads
from gradscope.probe.store import Store

#: A full weight uses the ghost form while N·(d_in + d_out) < GHOST_FACTOR · d_in·d_out.
GHOST_FACTOR = 1.0
#: Per-row products G_bᵀ A_b (rows × d_out × d_in values) up to this size; beyond, one matmul per agent.
PER_ROW_LIMIT = 1 << 24
#: A weight's fp32 Gram in which an agent with a gradient has a squared norm below this (or which is all
#: zeros) is computed again in float64: fp32 squares of gradient entries below ~1e-19 underflow (the relative
#: error of n summed squares is at most n · 1.2e-38 / 1e-20 = 1.2e-18 · n, negligible above it).
PRECISE_BELOW = 1e-20


class Accumulator:
    """One step's per-agent gradients of the hooked layers' parameters, and their rounding scale ``S``.

    Args:
        params: the probed parameters (``i`` below indexes them); ``layers``: the hooked layers holding them.
        group_index, n_groups, n_agents: as :class:`gradscope.probe.method.GramMethod`'s.
        dtype: the accumulation dtype (float32, or float64 for fp64 models).
    """

    def __init__(self, params: Sequence[nn.Parameter], layers: Sequence[Layer], group_index: Sequence[int],
                 n_groups: int, n_agents: int, dtype: torch.dtype) -> None:
        self.params, self.layers, self.group_index = params, layers, group_index
        self.n_groups, self.n_agents, self.dtype = n_groups, n_agents, dtype
        self.buffers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # per parameter, kept across steps (_buffer)
        self._scratches: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}  # per-row product buffers (_scratch)
        self.reset()

    def reset(self) -> None:
        """Start a step: no per-agent gradients, no token rows, no magnitudes."""
        self.dense: set[int] = set()  # param indices whose buffer holds this step's per-agent gradients
        self.unmeasured: set[int] = set()  # dense weights holding one call's sums S whose norms are not yet read
        self._parts: list[tuple[int | list[int], torch.Tensor]] = []  # (param index, a part of its magnitude S)
        self._resolved: dict[int, float] | None = None  # the same as floats, once read (magnitudes)
        for layer in self.layers:
            layer.rows, layer.n_rows = [], 0

    def magnitudes(self) -> dict[int, float]:
        """The step's magnitudes ``S`` by parameter index, as floats, summed once per step with one transfer to
        the host per device (not one per parameter or call: each would be a device sync on a GPU)."""
        if self._resolved is None:
            by_device: dict[torch.device, list[tuple[int | list[int], torch.Tensor]]] = {}
            for i, value in self._parts:
                by_device.setdefault(value.device, []).append((i, value.reshape(-1)))
            self._resolved = {}
            for device, parts in by_device.items():
                values = torch.cat([v for _, v in parts]).double()  # (cat promotes fp32 parts beside fp64 ones)
                ids, counts = [], []  # (a list per value, not per part: 0.2 ms a step)
                for i, v in parts:
                    ids += i if isinstance(i, list) else [i]
                    counts += [1] * len(i) if isinstance(i, list) else [len(v)]
                index = torch.tensor(ids, device=device).repeat_interleave(
                    torch.tensor(counts, device=device), output_size=len(values))
                sums = values.new_zeros(len(self.params)).index_add_(0, index, values).tolist()
                self._resolved.update((i, sums[i]) for i in ids)
        return self._resolved

    def add_magnitude(self, i: int | list[int], value: torch.Tensor) -> None:
        """Add ``value`` (any shape: its entries are summed; for a list ``i``, (len(i),): one entry per parameter) to
        the magnitude ``S`` of ``params[i]``: ``‖G‖_F ‖A‖_F``
        per call (≥ ``Σ_tokens ‖G_t‖‖A_t‖`` by Cauchy–Schwarz; for a bias or an embedding ``A_t`` is one), or the
        norms of the products a call formed, which bounds the norm of the rank-one terms that autograd (and this
        method) sum into the gradient, and so scales their rounding error. Summed at ``end`` (:meth:`magnitudes`):
        no operation per call beyond the norms."""
        self._parts.append((i, value))

    def linear(self, layer: Layer, fwd: Forward, A: torch.Tensor, G: torch.Tensor,
               x: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, tuple]:
        """Add one call's ``G_bᵀ A_b`` (A: (rows, T, d_in), G: (rows, T, d_out)) by row agent; ``x`` is the
        layer's input A comes from (rows kept until ``end`` must not be views of it).

        Returns ``(dW, db, sizes)``: the call's weight gradient ``Σ_b G_bᵀ A_b`` (d_out, d_in) and bias
        gradient (d_out,) where the products formed for the agents (per row, or per agent over its
        rows) add up to the weight's, else both None (autograd computes them: ``.grad`` bit for bit the
        unprobed one); and the norms ``‖P‖_F`` of those products ``P`` (any shape: their sum
        is the scale of the rounding between the products' sum and the per-agent sums) — None for the weight
        where they are the norms of its per-agent buffer's rows, which hold just this call's sums (read at
        ``end``, or before a later call adds to them: see :attr:`unmeasured`)."""
        dW = dW_size = per_row = None
        if layer.bias is not None:
            per_row = G.sum(1)                                        # (rows, d_out)
            self.add_by_row(layer.bias, per_row, fwd)
        if layer.weight is None:
            return None, None, (None, None)
        d_out, d_in = self.params[layer.weight].shape
        n_new = fwd.n_kept * A.shape[1]
        if layer.weight not in self.dense and (layer.n_rows + n_new) * (d_in + d_out) < GHOST_FACTOR * d_in * d_out:
            tokens = fwd.kept.repeat_interleave(A.shape[1])
            rows = fwd.owned(A).flatten(0, 1)
            if rows.untyped_storage().data_ptr() == x.untyped_storage().data_ptr():
                rows = rows.clone()  # kept until end(): not a view of the caller's input, which may be reused
            layer.rows.append((rows, fwd.owned(G).flatten(0, 1), tokens))
            layer.n_rows += n_new
            return None, None, (None, None)
        self.materialise(layer)
        if fwd.single is not None:
            dW = G.flatten(0, 1).T @ A.flatten(0, 1)                  # (d_out, d_in)
            self.dense_of(layer.weight)[fwd.single] += dW
            dW_size = torch.linalg.vector_norm(dW)
        elif _per_row(fwd.rows, A.shape[1], d_out, d_in):
            P, flat = self._scratch(fwd.rows, d_out, d_in, A)        # (rows, d_out, d_in), its (rows, d_out·d_in) view
            torch.bmm(G.transpose(1, 2), A, out=P)
            first = layer.weight not in self.dense
            S = self.add_by_row(layer.weight, flat, fwd)             # (K, d_out·d_in)
            if fwd.unowned is None:
                # .grad and the per-agent gradients both sum the per-agent sums S_k: Σ_k ‖S_k‖ bounds the
                # rounding between them (and S is K rows, P many)
                if first:  # S is the buffer, whose (K, d_out, d_in) view is at hand
                    dW, dW_size = self.buffers[layer.weight][0].sum(0), None
                else:
                    dW, dW_size = S.sum(0).view(d_out, d_in), torch.linalg.vector_norm(S, dim=1)
            else:  # rows of no agent: .grad holds their products too (they must be 0: see HooksMethod._unowned_grad)
                dW, dW_size = P.sum(0), torch.linalg.vector_norm(flat, dim=1)
        else:
            D = self.dense_of(layer.weight)
            if fwd.unowned is not None or not fwd.by_agent:  # rows of no agent: autograd's Gᵀ A holds them
                for k, rows in fwd.by_agent.items():
                    D[k].addmm_(G[rows].flatten(0, 1).T, A[rows].flatten(0, 1))
                return None, None, (None, None)
            sizes = []
            for k, rows in fwd.by_agent.items():
                P = G[rows].flatten(0, 1).T @ A[rows].flatten(0, 1)  # (d_out, d_in): agent k's rows
                D[k] += P
                dW = P if dW is None else dW.add_(P)
                sizes.append(torch.linalg.vector_norm(P))
            dW_size = torch.stack(sizes)
        if per_row is None:
            return dW, None, (dW_size, None)
        return dW, per_row.sum(0), (dW_size, torch.linalg.vector_norm(per_row, dim=1))

    def to_store(self, layer: Layer, fwd: Forward, A: torch.Tensor, G: torch.Tensor,
                 store: Store) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Hand ``store`` one call's per-agent contributions (A: (rows, T, d_in),
        G: (rows, T, d_out)); ``(‖G‖_F, ‖A‖_F)`` of the rows with an agent where the store took them on the way."""
        agents = list(fwd.by_agent)
        if not agents:
            return None
        fold = layer.bias is not None and layer.weight is not None and store.folds_bias(layer.weight, layer.bias)
        if layer.bias is not None and not fold:
            store.add(layer.bias, agents, self._sum_by_agent(G.sum(1), fwd)[agents])
        if layer.weight is None:
            return None
        d_out, d_in = self.params[layer.weight].shape
        if not fold and _per_row(fwd.rows, A.shape[1], d_out, d_in) and store.small(layer.weight):
            store.add(layer.weight, agents, self._sum_by_agent(torch.bmm(G.transpose(1, 2), A), fwd)[agents])
            return None
        token_agents = fwd.kept.repeat_interleave(A.shape[1])
        return store.add_outer(layer.weight, token_agents, fwd.owned(G).flatten(0, 1), fwd.owned(A).flatten(0, 1),
                               bias=layer.bias if fold else None)

    def _sum_by_agent(self, per_row: torch.Tensor, fwd: Forward) -> torch.Tensor:
        """(K, m): row b of ``per_row`` (rows, ...) flattened and added to its agent's row."""
        per_row = per_row.reshape(fwd.rows, -1)
        return per_row.new_zeros(self.n_agents, per_row.shape[1]).index_add_(0, fwd.kept, fwd.owned(per_row))

    def add_by_row(self, i: int, per_row: torch.Tensor, fwd: Forward) -> torch.Tensor | None:
        """``dense[i][agent(b)] += per_row[b]`` for every row b with an agent; per_row: (rows, m), m the parameter's
        size. Returns the call's per-agent sums S (K, m) where the rows are of several agents (or of none), else
        None.

        ``S = onehot @ per_row``: one matmul, which reads the rows once (``index_add_`` and then the rows' sum
        and norms read them three times); on the parameter's first call of the step S is written straight into
        its per-agent buffer, which then needs no zeroing. A non-finite row makes every agent's S non-finite
        (0 · NaN = NaN); the step's statistics are NaN either way, and telling the agent apart would cost a
        host read (a device sync) per call."""
        if fwd.single is not None:
            self.flat_dense(i)[fwd.single] += per_row.sum(0)
            return None
        onehot = fwd.onehot(self.n_agents, per_row.dtype)             # (K, rows)
        if i not in self.dense:
            self.dense.add(i)
            return torch.mm(onehot, per_row, out=self._buffer(i)[1])
        S = onehot @ per_row
        self.flat_dense(i).add_(S)
        return S

    def embedding_rows(self, layer: Layer, fwd: Forward, ids: torch.Tensor, grad: torch.Tensor,
                       store: Store | None) -> None:
        """The token rows (ids, G, agent) of the rows with an agent, kept for ``end`` or, given a ``store``,
        added to it at once; padding_idx gets no gradient."""
        ids = fwd.owned(ids.reshape(fwd.rows, -1))
        G = fwd.owned(grad.reshape(fwd.rows, ids.shape[1], -1)).to(self.dtype)
        agents = fwd.kept[:, None].expand_as(ids)
        use = ids != (-1 if layer.module.padding_idx is None else layer.module.padding_idx)
        ids, G, agents = ids[use], G[use], agents[use]
        if store is None:
            layer.rows.append((ids, G, agents))
            return
        d = G.shape[1]
        coords = ids[:, None] * d + torch.arange(d, device=ids.device)
        store.scatter(layer.weight, agents[:, None].expand_as(coords).reshape(-1), coords.reshape(-1),
                      G.reshape(-1))

    def _scratch(self, rows: int, d_out: int, d_in: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A (rows, d_out, d_in) buffer for one call's per-row products and its (rows, d_out·d_in) view, kept across
        calls and steps: 56 fresh 0.5-1 MB products a step on bench_peers' LM otherwise reach the system allocator
        (occasional bursts of ~3000 page faults a step, measured)."""
        key = (rows, d_out, d_in, like.dtype, like.device)
        if key not in self._scratches:
            flat = torch.empty(rows, d_out * d_in, dtype=like.dtype, device=like.device)
            self._scratches[key] = flat.view(rows, d_out, d_in), flat
        return self._scratches[key]

    def dense_of(self, i: int) -> torch.Tensor:
        """(K, *shape) the per-agent gradients of ``params[i]`` this step, to add to: zeros at the first use."""
        if i not in self.dense:
            self.dense.add(i)
            self._buffer(i)[0].zero_()
        elif i in self.unmeasured:  # they hold one call's sums S, whose norms are due before anything is added
            self.unmeasured.discard(i)
            self.add_magnitude(i, torch.linalg.vector_norm(self.buffers[i][1], dim=1))
        return self.buffers[i][0]

    def flat_dense(self, i: int) -> torch.Tensor:
        """(K, m) :meth:`dense_of` as one row per agent."""
        self.dense_of(i)
        return self.buffers[i][1]

    def _buffer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(K, *shape) uninitialised storage for the per-agent gradients of ``params[i]`` and its (K, m) view, kept
        across steps (no allocation per step)."""
        buffer = self.buffers.get(i)
        if buffer is None:
            p = self.params[i]
            flat = torch.empty(self.n_agents, p.numel(), dtype=self.dtype, device=p.device)
            buffer = self.buffers[i] = flat.view(self.n_agents, *p.shape), flat
        return buffer

    def materialise(self, layer: Layer) -> None:
        """Turn the layer's kept token rows into dense per-agent gradients."""
        if not layer.rows or layer.weight is None:
            return
        D = self.dense_of(layer.weight)
        for A, G, agents in layer.rows:
            if layer.embedding:  # A holds token ids
                V = D.shape[1]
                D.view(-1, D.shape[-1]).index_add_(0, agents * V + A, G)
                continue
            for k in agents.unique().tolist():
                rows = agents == k
                D[k].addmm_(G[rows].T, A[rows])
        layer.rows, layer.n_rows = [], 0

    def add_grads(self, agent: int, grads: Grads) -> None:
        """``dense[i][agent] += grad`` for split's gradients ``grads`` ((i, grad) pairs) of one agent."""
        if grads:
            torch._foreach_add_([self.dense_of(i)[agent] for i, _ in grads], [grad for _, grad in grads])

    def grams(self, per_param: dict[int, np.ndarray] | None = None) -> np.ndarray:
        """(G, K, K) float64: ``D Dᵀ`` per dense weight and the ghost / touched-rows Grams, in the accumulation
        dtype; a weight's Gram with an agent's squared norm below :data:`PRECISE_BELOW` is computed again in
        float64 (squares of fp32 values below ~1e-19 underflow to zero)."""
        pending: list[tuple[int, Callable[..., torch.Tensor], list[torch.Tensor]]] = []  # (param, Gram of, rows)
        for layer in self.layers:
            if not layer.rows:
                continue
            if layer.weight in self.dense:
                self.materialise(layer)
                continue
            rows = [torch.cat(parts) for parts in zip(*layer.rows)]
            pending.append((layer.weight, touched_rows_gram if layer.embedding else ghost_gram, rows))
        pending += [(i, flat_gram, [self.buffers[i][1]]) for i in self.dense]  # (K, m) views of the buffers
        computed = [gram_of(*rows, self.n_agents) for _, gram_of, rows in pending]  # (K, K) each
        grams = torch.zeros(self.n_groups, self.n_agents, self.n_agents, dtype=torch.float64)
        on: dict[torch.device, list[int]] = {}
        for j, gram in enumerate(computed):
            on.setdefault(gram.device, []).append(j)
        for device, js in on.items():  # a few ops (and one sync) per device, not per weight
            stacked = torch.stack([computed[j] for j in js]).double()                     # (n, K, K)
            if self.dtype != torch.float64:
                # an agent's squared norm below PRECISE_BELOW with a non-zero row (it has a gradient), or an
                # all-zero Gram (every agent's squares may have underflowed): computed again in float64
                low = ((stacked.diagonal(dim1=1, dim2=2) < PRECISE_BELOW) & (stacked != 0).any(2)).any(1)
                low |= ~(stacked != 0).flatten(1).any(1)
                for r in low.nonzero().flatten().tolist():
                    precise = in_float64(*pending[js[r]][1:], self.n_agents)
                    if precise is not None:
                        stacked[r] = precise
            index = torch.tensor([self.group_index[pending[j][0]] for j in js], device=device)
            grams += torch.zeros_like(grams, device=device).index_add_(0, index, stacked).cpu()
            unmeasured = [r for r, j in enumerate(js) if pending[j][0] in self.unmeasured]
            if unmeasured:  # Σ_k ‖S_k‖ of a buffer holding one call's sums S: from its Gram's diagonal
                self.add_magnitude([pending[js[r]][0] for r in unmeasured],
                                    stacked[unmeasured].diagonal(dim1=1, dim2=2).clamp(min=0).sqrt().sum(1))
            if per_param is not None:
                for r, j in enumerate(js):
                    per_param[pending[j][0]] = stacked[r].cpu().numpy()
        return grams.numpy()

    def ghost(self) -> set[int]:
        """The weights still in ghost form (their Gram is summed from token-pair products)."""
        return {layer.weight for layer in self.layers
                if layer.rows and not layer.embedding and layer.weight not in self.dense}

def _per_row(rows: int, T: int, d_out: int, d_in: int) -> bool:
    """Per-row products ``G_bᵀ A_b`` (one bmm, then summed by agent) rather than one matmul per agent over
    gathered rows: when the rows × d_out × d_in products are no bigger than a few copies of the rows
    themselves (LoRA factors), and at most :data:`PER_ROW_LIMIT` values."""
    size = rows * d_out * d_in
    return size <= PER_ROW_LIMIT and size <= 4 * rows * T * (d_out + d_in)
