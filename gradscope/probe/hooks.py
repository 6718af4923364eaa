"""The hooks method: every agent's gradient from one ordinary backward.

A forward hook on each probed ``nn.Linear`` / ``nn.Embedding`` keeps the call's input ``A``; a tensor
hook on its output receives the output gradient ``G`` during the backward. peft's ``lora_A.<name>``
and ``lora_B.<name>`` are plain ``nn.Linear`` modules, so LoRA and full fine-tuning are covered
alike (LoRA dropout is inside ``A``, LoRA scaling inside ``G``). A weight's gradient is
``Σ_tokens G_tᵀ A_t``. Attention mixes the positions of a sequence, so a token's ``G`` carries
gradient from every loss term of its sequence: the attribution is exact per **row** (sequence) only,
and every row must belong to one agent. Agent k's part of a Linear layer's gradient is::

    g_k = Σ_{rows b of agent k} G_bᵀ A_b     (d_out, d_in)      bias: Σ_b Σ_t G_bt   (d_out,)

Row ``b`` of ``token_loss`` is row ``b`` of the grad-enabled forwards of the model since the previous
backward, concatenated in call order (one forward per backward in the usual loop).

Per weight and step, one of two representations, chosen by cost (:data:`GHOST_FACTOR`):

* **dense**: the (K, d_out, d_in) per-agent gradients, added to at every backward (per-row products
  ``G_bᵀ A_b`` summed by agent, costing N·d_in·d_out like the weight gradient itself); Gram ``D Dᵀ``.
  Always the choice for LoRA factors, whose d_out (A) or d_in (B) is the rank r.
* **ghost**: the token rows ``(A, G, agent)`` of every backward of the step, and at ``end``
  ``M_kl = Σ_{i∈k, j∈l} (A Aᵀ)_ij (G Gᵀ)_ij`` (N × N, never a d_out × d_in matrix), chosen while
  ``N (d_in + d_out) < GHOST_FACTOR · d_in d_out`` (N: the step's tokens so far). Keeping the rows of
  all calls gives the cross-call terms, so gradient accumulation is exact; when N passes the rule
  the rows are materialised into the dense form and the weight stays dense for the step.

Embeddings keep their ``(ids, G, agent)`` rows and materialise at ``end`` only the U distinct rows
touched (K × U × d; the ghost form would cost N²·d).

Calls that cannot be attributed by rows fall back to the split method (one backward per agent) for
that call: ``backward({agent: loss})``, a row holding tokens of two agents, or forwards whose rows do
not add up to ``token_loss``'s rows. Both kinds of per-agent gradient add into the same dense state.

**With a store** (sketch mode, or the exact Gram of several ranks) nothing is kept per weight: each
call's per-agent contributions ``G_kᵀA_k`` are formed a block of output rows at a time (at most
:data:`~gradscope.probe.store.CHUNK` values for all agents together) and handed to the store at once;
embedding token rows go straight to the store's coordinates. No ghost form: it yields Gram entries,
not vectors that a sketch or another rank could add to.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from gradscope.errors import ProbeError
from gradscope.probe.method import GramMethod, token_terms
from gradscope.probe.split import backward_per_agent
from gradscope.probe.store import CHUNK, Store, squared_norms

#: A full weight uses the ghost form while N·(d_in + d_out) < GHOST_FACTOR · d_in·d_out.
GHOST_FACTOR = 1.0
#: Per-row products G_bᵀ A_b (rows × d_out × d_in values) up to this size; beyond, one matmul per agent.
PER_ROW_LIMIT = 1 << 24


def supported(module: nn.Module) -> bool:
    """Layers whose parameters hooks can attribute: exactly ``nn.Linear`` or a plain ``nn.Embedding``.

    Subclasses are excluded on purpose: some (``nn.MultiheadAttention.out_proj``) are used without
    calling their ``forward``, so a hook would never see them.
    """
    if type(module) is nn.Linear:
        return True
    return type(module) is nn.Embedding and not module.scale_grad_by_freq and not module.sparse


def find_layers(model: nn.Module, params: Sequence[nn.Parameter]) -> tuple[list["_Layer"], list[int]]:
    """The hookable layers holding ``params``, and the indices of the parameters none covers.

    A parameter is covered when exactly one module of ``model`` holds it and that module is
    :func:`supported` (a weight tied between two modules is not).
    """
    index = {id(p): i for i, p in enumerate(params)}
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if id(p) in index:
                owners.setdefault(index[id(p)], []).append((module, name))
    layers: dict[int, _Layer] = {}
    uncovered = []
    for i in range(len(params)):
        held = owners.get(i, [])
        if len(held) != 1 or not supported(held[0][0]) or held[0][1] not in ("weight", "bias"):
            uncovered.append(i)
            continue
        module, name = held[0]
        layer = layers.setdefault(id(module), _Layer(module))
        setattr(layer, name, i)
    return list(layers.values()), uncovered


@dataclass(eq=False)
class _Layer:
    """A hooked module, the indices of its probed parameters, and this step's ghost / embedding rows."""

    module: nn.Module
    weight: int | None = None
    bias: int | None = None
    rows: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=list)
    n_rows: int = 0  # tokens in ``rows``

    @property
    def embedding(self) -> bool:
        return isinstance(self.module, nn.Embedding)


@dataclass(eq=False)
class _Forward:
    """One grad-enabled forward of the model: its rows and, during a hooks call, their agents."""

    rows: int
    ok: bool = True          # every hooked layer saw ``rows`` rows
    consumed: bool = False   # a backward has reached it
    agents: torch.Tensor | None = None  # (rows,) agent per row, -1 for none; set during a call
    keep: torch.Tensor | None = None    # indices of the rows with an agent
    kept: torch.Tensor | None = None    # their agents
    single: int | None = None           # the agent, when every row is that agent's
    by_agent: dict[int, torch.Tensor] = field(default_factory=dict)  # row indices per agent

    def attach(self, agents: torch.Tensor) -> None:
        self.agents = agents
        self.keep = (agents >= 0).nonzero().squeeze(1)
        self.kept = agents[self.keep]
        present = sorted(set(agents.tolist()))
        self.single = present[0] if len(present) == 1 and present[0] >= 0 else None
        self.by_agent = {k: (agents == k).nonzero().squeeze(1) for k in present if k >= 0}


@dataclass(eq=False)
class _Piece:
    """One call of a hooked layer, waiting for its output gradient."""

    layer: _Layer
    forward: _Forward
    inputs: torch.Tensor | None


class HooksMethod(GramMethod):
    """Per-agent gradients from layer hooks during one ordinary backward; see the module docstring."""

    name = "hooks"

    def __init__(self, params: Sequence[nn.Parameter], group_index: Sequence[int], n_groups: int,
                 n_agents: int, *, model: nn.Module | None = None, store: Store | None = None) -> None:
        super().__init__(params, group_index, n_groups, n_agents, store=store)
        if model is None:
            raise ProbeError("the hooks method needs the model, to hook its layers; pass it or use method='split'")
        self.layers, uncovered = find_layers(model, self.params)
        if uncovered:
            raise ProbeError(f"hooks cannot attribute parameters {uncovered}; use method='split'")
        self.dtype = torch.float64 if any(p.dtype == torch.float64 for p in self.params) else torch.float32
        self._handles = [model.register_forward_pre_hook(self._on_model_call)]
        self._handles += [layer.module.register_forward_hook(partial(self._on_forward, layer))
                          for layer in self.layers]
        self._forwards: list[_Forward] = []
        self._new_forward = True
        self._in_call = False
        self._missed = False
        self._dense: dict[int, torch.Tensor] = {}  # param index → (K, *shape) per-agent gradients
        self._grad0: list[torch.Tensor | None] = []
        self._magnitude: dict[int, torch.Tensor] = {}  # param index → Σ_tokens ‖G_t‖‖A_t‖ (float64 scalar)
        self.fallback_calls = 0  # calls that went through split, since construction

    # ------------------------------------------------------------------ hooks
    def _on_model_call(self, module: nn.Module, args: tuple) -> None:
        if torch.is_grad_enabled():
            self._new_forward = True
            self._forwards = [f for f in self._forwards if not f.consumed]

    def _on_forward(self, layer: _Layer, module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        if not (torch.is_grad_enabled() and isinstance(output, torch.Tensor) and output.requires_grad):
            return
        x = args[0]
        rows = x.shape[0] if x.dim() >= (1 if layer.embedding else 2) else -1
        if self._new_forward or not self._forwards or self._forwards[-1].consumed:
            self._forwards.append(_Forward(rows))
            self._new_forward = False
        forward = self._forwards[-1]
        forward.ok &= rows == forward.rows
        output.register_hook(partial(self._on_grad, _Piece(layer, forward, x.detach())))

    def _on_grad(self, piece: _Piece, grad: torch.Tensor) -> None:
        forward, x = piece.forward, piece.inputs
        forward.consumed, piece.inputs = True, None
        if not self._in_call:  # an unprobed backward, or one of a split fallback's
            return
        if x is None or forward.agents is None:
            self._missed = True  # reached by this backward but not one of its forwards
            return
        with torch.no_grad():
            layer = piece.layer
            if layer.embedding:
                self._add_magnitude(layer.weight, grad.reshape(-1, grad.shape[-1]).double().norm(dim=1).sum())
                self._embedding_rows(layer, forward, x, grad)
            else:
                A = x.reshape(forward.rows, -1, x.shape[-1]).to(self.dtype)
                G = grad.reshape(forward.rows, -1, grad.shape[-1]).to(self.dtype)
                g_norm = G.norm(dim=-1).double()
                if layer.weight is not None:
                    self._add_magnitude(layer.weight, (A.norm(dim=-1).double() * g_norm).sum())
                if layer.bias is not None:
                    self._add_magnitude(layer.bias, g_norm.sum())
                (self._linear if self.store is None else self._linear_to_store)(layer, forward, A, G)

    def _add_magnitude(self, i: int, value: torch.Tensor) -> None:
        """Add to ``Σ_tokens ‖G_t‖‖A_t‖`` of ``params[i]``: the Frobenius norm bound of the rank-one terms that
        autograd (and this method) sum into the gradient, which scales their rounding error."""
        self._magnitude[i] = value if i not in self._magnitude else self._magnitude[i] + value

    # ------------------------------------------------------------------ per-agent contributions
    def _linear(self, layer: _Layer, fwd: _Forward, A: torch.Tensor, G: torch.Tensor) -> None:
        """Add one call's ``G_bᵀ A_b`` (A: (rows, T, d_in), G: (rows, T, d_out)) by row agent."""
        if layer.bias is not None:
            self._add_by_row(layer.bias, G.sum(1), fwd)
        if layer.weight is None:
            return
        d_out, d_in = self.params[layer.weight].shape
        n_new = len(fwd.keep) * A.shape[1]
        if layer.weight not in self._dense and (layer.n_rows + n_new) * (d_in + d_out) < GHOST_FACTOR * d_in * d_out:
            tokens = fwd.kept.repeat_interleave(A.shape[1])
            layer.rows.append((A[fwd.keep].flatten(0, 1), G[fwd.keep].flatten(0, 1), tokens))
            layer.n_rows += n_new
            return
        self._materialise(layer)
        if fwd.single is not None:
            self._dense_of(layer.weight)[fwd.single].addmm_(G.flatten(0, 1).T, A.flatten(0, 1))
        elif fwd.rows * d_out * d_in <= PER_ROW_LIMIT:
            self._add_by_row(layer.weight, torch.bmm(G.transpose(1, 2), A), fwd)
        else:
            D = self._dense_of(layer.weight)
            for k, rows in fwd.by_agent.items():
                D[k].addmm_(G[rows].flatten(0, 1).T, A[rows].flatten(0, 1))

    def _linear_to_store(self, layer: _Layer, fwd: _Forward, A: torch.Tensor, G: torch.Tensor) -> None:
        """Hand the store one call's per-agent ``G_kᵀ A_k`` (A: (rows, T, d_in), G: (rows, T, d_out)).

        Small (LoRA) weights: per-row products summed by agent, as in :meth:`_linear`. Others: a block
        of output rows at a time, so that no (K, d_out, d_in) tensor is formed.
        """
        agents = list(fwd.by_agent)
        if not agents:
            return
        if layer.bias is not None:
            self.store.add(layer.bias, agents, self._sum_by_agent(G.sum(1), fwd)[agents])
        if layer.weight is None:
            return
        d_out, d_in = self.params[layer.weight].shape
        if fwd.rows * d_out * d_in <= PER_ROW_LIMIT and self.n_agents * d_out * d_in <= CHUNK:
            self.store.add(layer.weight, agents, self._sum_by_agent(torch.bmm(G.transpose(1, 2), A), fwd)[agents])
            return
        A_k = [A[fwd.by_agent[k]].flatten(0, 1) for k in agents]
        G_k = [G[fwd.by_agent[k]].flatten(0, 1) for k in agents]
        step = max(1, CHUNK // (len(agents) * d_in))
        for r0 in range(0, d_out, step):
            block = torch.stack([g[:, r0:r0 + step].T @ a for g, a in zip(G_k, A_k)])
            self.store.add(layer.weight, agents, block.flatten(1), r0 * d_in)

    def _sum_by_agent(self, per_row: torch.Tensor, fwd: _Forward) -> torch.Tensor:
        """(K, m): row b of ``per_row`` (rows, ...) flattened and added to its agent's row."""
        per_row = per_row.reshape(fwd.rows, -1)
        return per_row.new_zeros(self.n_agents, per_row.shape[1]).index_add_(0, fwd.kept, per_row[fwd.keep])

    def _add_by_row(self, i: int, per_row: torch.Tensor, fwd: _Forward) -> None:
        """``dense[i][agent(b)] += per_row[b]`` for every row b with an agent; per_row: (rows, *shape)."""
        D = self._dense_of(i)
        if fwd.single is not None:
            D[fwd.single] += per_row.sum(0)
            return
        per_row = per_row.reshape(fwd.rows, -1)
        D.view(self.n_agents, -1).index_add_(0, fwd.kept, per_row if len(fwd.keep) == fwd.rows else per_row[fwd.keep])

    def _embedding_rows(self, layer: _Layer, fwd: _Forward, ids: torch.Tensor, grad: torch.Tensor) -> None:
        """The token rows (ids, G, agent) of the rows with an agent, kept for ``end`` or, with a store,
        added to it at once; padding_idx gets no gradient."""
        ids = ids.reshape(fwd.rows, -1)[fwd.keep]
        G = grad.reshape(fwd.rows, ids.shape[1], -1)[fwd.keep].to(self.dtype)
        agents = fwd.kept[:, None].expand_as(ids)
        use = ids != (-1 if layer.module.padding_idx is None else layer.module.padding_idx)
        ids, G, agents = ids[use], G[use], agents[use]
        if self.store is None:
            layer.rows.append((ids, G, agents))
            return
        d = G.shape[1]
        coords = ids[:, None] * d + torch.arange(d, device=ids.device)
        self.store.scatter(layer.weight, agents[:, None].expand_as(coords).reshape(-1), coords.reshape(-1),
                           G.reshape(-1))

    def _dense_of(self, i: int) -> torch.Tensor:
        if i not in self._dense:
            p = self.params[i]
            self._dense[i] = torch.zeros(self.n_agents, *p.shape, dtype=self.dtype, device=p.device)
        return self._dense[i]

    def _materialise(self, layer: _Layer) -> None:
        """Turn the layer's kept token rows into dense per-agent gradients."""
        if not layer.rows or layer.weight is None:
            return
        D = self._dense_of(layer.weight)
        for A, G, agents in layer.rows:
            if layer.embedding:  # A holds token ids
                V = D.shape[1]
                D.view(-1, D.shape[-1]).index_add_(0, agents * V + A, G)
                continue
            for k in agents.unique().tolist():
                rows = agents == k
                D[k].addmm_(G[rows].T, A[rows])
        layer.rows, layer.n_rows = [], 0

    # ------------------------------------------------------------------ the GramMethod protocol
    def begin(self) -> None:
        self._reset()
        if self.store is not None:
            self.store.zero()
        self._grad0 = [None if p.grad is None else p.grad.detach().clone() for p in self.params]

    def backward(self, terms: Sequence[tuple[int, torch.Tensor]], retain_graph: bool) -> None:
        """No row information: this call goes through split (one backward per term)."""
        self.fallback_calls += 1
        sink = self.store.add_grad if self.store is not None else self._add_agent_grad
        try:
            backward_per_agent(self.params, terms, retain_graph, sink)
        finally:
            self._forwards.clear()

    def _add_agent_grad(self, i: int, agent: int, grad: torch.Tensor) -> None:
        self._dense_of(i)[agent].add_(grad)

    def backward_tokens(self, token_loss: torch.Tensor, agent_ids: torch.Tensor, agents: Sequence[int],
                        retain_graph: bool) -> None:
        if not token_loss.requires_grad:
            return
        rows = _row_agents(agent_ids)
        live = [f for f in self._forwards if not f.consumed]
        if (rows is None or not live or not all(f.ok for f in live)
                or sum(f.rows for f in live) != len(rows)):
            return self.backward(token_terms(token_loss, agent_ids, agents), retain_graph)
        start = 0
        for f in live:
            f.attach(rows[start:start + f.rows])
            start += f.rows
        self._in_call, self._missed = True, False
        try:
            torch.autograd.backward(token_loss.sum(), retain_graph=retain_graph)
        finally:
            self._in_call = False
            self._forwards.clear()
        if self._missed or not all(f.consumed for f in live):
            raise ProbeError("hooks: the rows of token_loss are not the rows of the model's forwards since the "
                             "previous backward (in call order); use method='split' for this loop")

    def end(self) -> np.ndarray:
        """Per-group Grams: the store's, or ``D Dᵀ`` per dense parameter (in the accumulation dtype, summed in
        float64) plus the ghost / touched-rows Grams of the layers still holding token rows."""
        try:
            ghost = self._ghost_params()
            if self.store is None:
                grams = self._local_grams()
                total, diag = grams.sum((1, 2)), np.diagonal(grams, axis1=1, axis2=2)
                delta_sq = squared_norms(self._deltas(), self.group_index, self.n_groups)
            else:  # check this rank's contributions before the store sums the ranks'
                total, diag = self.store.sums()
                delta_sq = self.store.norms_sq(self._deltas())
            bad = self._check(total, diag, delta_sq, ghost)
            if self.store is not None:
                grams = self.store.grams()  # a collective: every rank takes part, also one that then raises
        finally:
            self._reset()
        if bad:
            raise ProbeError(f"hooks: the per-agent gradients of parameter group(s) {bad} do not add up to their "
                             "gradient; a probed weight is used outside its layer's forward. Use method='split'")
        return grams

    def _local_grams(self) -> np.ndarray:
        per_device: dict[torch.device, torch.Tensor] = {}

        def add(i: int, gram: torch.Tensor) -> None:
            if gram.device not in per_device:
                per_device[gram.device] = gram.new_zeros(self.n_groups, self.n_agents, self.n_agents,
                                                         dtype=torch.float64)
            per_device[gram.device][self.group_index[i]] += gram

        for layer in self.layers:
            if not layer.rows:
                continue
            if layer.weight in self._dense:
                self._materialise(layer)
                continue
            rows = [torch.cat(parts) for parts in zip(*layer.rows)]
            add(layer.weight, (_touched_rows_gram if layer.embedding else _ghost_gram)(*rows, self.n_agents))
        for i, D in self._dense.items():
            flat = D.reshape(self.n_agents, -1)
            add(i, (flat @ flat.T).double())
        grams = sum((g.cpu() for g in per_device.values()),
                    torch.zeros(self.n_groups, self.n_agents, self.n_agents, dtype=torch.float64))
        return grams.numpy()

    def abort(self) -> None:
        self._reset()  # .grad already holds what the ordinary backward(s) left

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _reset(self) -> None:
        self._dense, self._grad0, self._magnitude = {}, [], {}
        self._in_call = False
        for layer in self.layers:
            layer.rows, layer.n_rows = [], 0

    def _deltas(self) -> Iterator[tuple[int, torch.Tensor]]:
        """``(i, Δ.grad)`` of every parameter with a gradient: what this step added to ``.grad``."""
        for i, p in enumerate(self.params):
            if p.grad is not None:
                g0 = self._grad0[i]
                yield i, p.grad.detach() if g0 is None else p.grad.detach().double() - g0.double()

    def _ghost_params(self) -> set[int]:
        """The weights still in ghost form (their Gram is summed from token-pair products)."""
        return {layer.weight for layer in self.layers
                if layer.rows and not layer.embedding and layer.weight not in self._dense}

    def _check(self, total: np.ndarray, diag: np.ndarray, delta_sq: np.ndarray, ghost: set[int]) -> list[int]:
        """The groups whose Gram does not add up to the gradient: ``Σ_kl M^g_kl`` (total, (G,)) must equal
        ``‖Δ.grad_g‖²`` (delta_sq, through the store's map) to within :func:`add_up_tolerance`.

        Catches a probed weight that is also used outside its module's forward (hooks cannot see that).
        """
        if not (np.isfinite(total).all() and np.isfinite(diag).all()):
            return []
        magnitude_sq, ghost_sq, before_sq = np.zeros(self.n_groups), np.zeros(self.n_groups), np.zeros(self.n_groups)
        dtypes = set()
        for i, p in enumerate(self.params):
            if p.grad is None:
                continue
            g = self.group_index[i]
            dtypes.add(p.grad.dtype)
            if i in self._magnitude:
                m_sq = float(self._magnitude[i]) ** 2
                magnitude_sq[g] += m_sq
                ghost_sq[g] += m_sq if i in ghost else 0.0
            if self._grad0[i] is not None:
                before_sq[g] += float(self._grad0[i].double().square().sum())
        if not dtypes:
            return []
        tol, eps = add_up_tolerance(min(dtypes, key=lambda d: torch.finfo(d).bits))
        scale = np.square(np.sqrt(np.clip(diag, 0, None)).sum(1))
        summands = np.sqrt(magnitude_sq) + np.sqrt(before_sq)
        allowed = (tol * scale + eps * (summands * (np.sqrt(delta_sq) + np.sqrt(np.clip(total, 0, None))) + ghost_sq)
                   + np.finfo(np.float64).tiny)
        return np.flatnonzero(np.abs(total - delta_sq) > allowed).tolist()


def add_up_tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """``(tol, eps)`` of the add-up check for gradients of ``dtype``.

    ``|Σ_kl M_kl − ‖Δ.grad‖²|`` may be at most ``tol · (Σ_k ‖g_k‖)² + eps · (S (‖Δ.grad‖ + ‖Σ_k g_k‖) + S_ghost²)``:
    the first term is rounding relative to the agents' gradients (1e-4 fp32, 1e-8 fp64, 3e-2 16-bit);
    the second is rounding relative to what was summed into them. ``S`` bounds the norm of the
    rank-one token terms ``G_t A_tᵀ`` (``Σ_t ‖G_t‖‖A_t‖`` per weight, root-sum-square over the group's
    weights, plus ‖.grad‖ before the step); when they cancel (two identical rows with opposite
    advantages) the gradient is rounding noise of size ``eps · S`` that no relative tolerance allows.
    ``S_ghost²`` covers ghost weights, whose Gram is summed from products of token pairs. ``eps`` is
    64 machine epsilons, at most ``tol``.
    """
    tol = {torch.float64: 1e-8, torch.float32: 1e-4}.get(dtype, 3e-2)
    return tol, min(tol, 64 * torch.finfo(dtype).eps)


def _row_agents(agent_ids: torch.Tensor) -> torch.Tensor | None:
    """(B,) the agent of each row (-1: no agent tokens), or None if some row holds two agents' tokens."""
    ids = agent_ids.reshape(agent_ids.shape[0], -1)
    hi = ids.max(1).values
    lo = torch.where(ids < 0, hi[:, None], ids).min(1).values
    return None if bool((lo != hi).any()) else hi


def _ghost_gram(A: torch.Tensor, G: torch.Tensor, agents: torch.Tensor, K: int) -> torch.Tensor:
    """``M_kl = Σ_{i∈k, j∈l} (A Aᵀ)_ij (G Gᵀ)_ij`` for token rows A (N, d_in), G (N, d_out); (K, K) float64."""
    S = (A @ A.T).double() * (G @ G.T).double()
    P = F.one_hot(agents, K).double()
    return P.T @ S @ P


def _touched_rows_gram(ids: torch.Tensor, G: torch.Tensor, agents: torch.Tensor, K: int) -> torch.Tensor:
    """Embedding Gram from token rows: per-agent gradients on the U distinct ids only, (K, U·d)."""
    uniq, inv = torch.unique(ids, return_inverse=True)
    R = G.new_zeros(K * len(uniq), G.shape[-1]).index_add_(0, agents * len(uniq) + inv, G)
    R = R.view(K, -1)
    return (R @ R.T).double()
