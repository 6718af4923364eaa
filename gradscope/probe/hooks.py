"""The hooks method: every agent's gradient from one ordinary backward.

A forward hook on each probed ``nn.Linear`` / ``nn.Embedding`` keeps the call's input ``A``; a tensor
hook on its output receives the output gradient ``G`` during the backward. peft's ``lora_A.<name>``
and ``lora_B.<name>`` are plain ``nn.Linear`` modules, so LoRA and full fine-tuning are covered
alike (LoRA dropout is inside ``A``, LoRA scaling inside ``G``). A weight's gradient is
``Σ_tokens G_tᵀ A_t``. Attention mixes the positions of a sequence, so a token's ``G`` carries
gradient from every loss term of its sequence: the attribution is exact per **row** (sequence) only,
and every row must belong to one agent. Agent k's part of a Linear layer's gradient is::

    g_k = Σ_{rows b of agent k} G_bᵀ A_b     (d_out, d_in)      bias: Σ_b Σ_t G_bt   (d_out,)

**Which row is whose.** Each forward carries the agent of each of its rows: given with the forward
(``with s.rows(agent_of_row):``, any number of forwards, in any order) or, for the single untagged
forward since the previous backward, taken from the loss's rows. Each layer call is matched to its
forward's B rows by shape: the dimension of the layer input of size B (``batch_dim`` when given).
It is taken unchecked only when it is the input's leading dimension and no other has size B; else
it is a guess (several of size B, the first used: a sequence-first input with T == B; or only a
non-leading one: a sequence-first input, or the sequence axis of a chunk of the batch with T == B)
that the self-check verifies (below) — in a call no check measures, unless an earlier check
confirmed the dimension of this call of the layer (its k-th in the forward), the call falls back to split
and the check is re-armed for the next probed step. Rows all of one agent attribute alike whatever the
dimension: no guess; a call the loss does not reach needs none. Likewise rows of several agents that no passed
check has yet seen with gradient (a first step of one agent's rows cannot show a model mixing rows): split, and
the next step checks. A check confirms only what it gave a non-zero gradient to. An input with no
dimension of size B falls back to split too, naming the layer (where the loss reaches the call). An input of
B positions in a forward of more (its model call's inputs — unknown without one —, its loss's terms, or a call
the loss reaches) — vectors selected or routed to the layer (a head on the scored tokens, MoE experts) or
pooled per row — is a guess in every step unless ``batch_dim`` was declared: a check verifies it for its own
step only.
Several untagged forwards cannot be matched to loss rows without trusting call order: split too.

**Self-check.** On the first probed step with a call that hooks attributes from per-row or per-token
losses (and every ``check_every`` probed steps after, if asked; a step without such a call leaves the
check for the next), each agent's gradient is also computed as split would, with
no row tags: the agent's loss terms alone are differentiated (``autograd.grad``, ``.grad`` untouched)
at the outputs of the call's hooked layer calls, and ``Σ_calls G_kᵀ A`` over all rows is agent k's
gradient. The Grams are compared, per group and per parameter: a mismatch raises (``method="hooks"``) or,
under ``auto``, the record takes the check's Gram and the probe uses split from then on, with a warning.
A check in which every gradient is zero (all advantages 0) verifies nothing: it stays due. The
per-record method says which ran (``StepResult.method``). Differentiating at the layer outputs
rather than at the parameters keeps the check valid where the parameters are not the tensors the
forward computed with (FSDP computes with gathered copies of its sharded parameters, so autograd
gives the parameters no gradient); the add-up check covers what it cannot see (a probed weight used
outside its layer).

**Gradient checkpointing.** A layer call made during a backward is a checkpoint's recomputation of
a forward already seen, not a new forward: it is ignored. Non-reentrant checkpointing
(``use_reentrant=False``, transformers' default) back-propagates through the original calls, so
hooks and the self-check are exact; reentrant checkpointing runs the checkpointed layers without
grad and back-propagates only through their recomputation, which hooks cannot attribute: the call
falls back to split when no hooked call of the forward was seen, and raises when some were.

**grad_reduced.** When the training framework leaves in ``.grad`` something other than this rank's
own gradient (FSDP: sharded and reduced over the ranks; DDP: reduced), the add-up check (which
compares with ``.grad``) is skipped, split cannot measure a call (no fallback: such a call raises),
and the self-check differentiates every agent's terms, present on this rank or not (zero), so that
every rank runs the same backward passes (FSDP gathers parameters inside them).

**Where the contributions go** (:mod:`gradscope.probe.accumulate`): per weight and step, dense (K, d_out, d_in)
per-agent gradients or, for a full-width weight on short batches, the ghost form (token rows whose Gram never
forms a weight-sized matrix); embeddings keep their token rows; with a store, the store.

**The weight gradient.** Where a dense weight's call forms every row's product (per-row products, or
one agent's ``Gᵀ A``), their sum is the call's weight gradient: the layer's backward
(:class:`fused.HookedLinear`, installed while the method is attached) returns it instead of computing
autograd's ``Gᵀ A`` again, so the per-agent gradients cost about no FLOPs beyond the ordinary backward.
"""
from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from functools import partial
from typing import Any

import numpy as np
import torch
import torch.nn as nn
from torch.autograd.graph import GradientEdge, get_gradient_edge

from gradscope.errors import ProbeError
from gradscope.probe import fused
from gradscope.probe.accumulate import Accumulator
from gradscope.probe.distributed import all_reduce_max, all_reduce_sum_
from gradscope.probe.fused import as_dtype
from gradscope.probe.layers import Layer, find_layers
from gradscope.probe.method import GramMethod, Terms
from gradscope.probe.rows import (Fallback, Forward, Piece, by_row, guessed, in_backward, positions, reachable_nodes,
                                  remedy)
from gradscope.probe.split import Grads, backward_per_agent
from gradscope.probe.store import FlatStore, Store, each_squared_norm, squared_norms
from gradscope.probe.tolerance import add_up_tolerance, differs, least_precise

_NO_CONTEXT = nullcontext()
#: The layers an open hooks probe holds (module → its method): a newer probe on one of them closes the older.
_HOOKED: "weakref.WeakKeyDictionary[nn.Module, HooksMethod]" = weakref.WeakKeyDictionary()


class HooksMethod(GramMethod):
    """Per-agent gradients from layer hooks during one ordinary backward; see the module docstring.

    Args (beyond :class:`GramMethod`'s):
        strict: ``method="hooks"`` was asked for: a failed self-check raises instead of switching to split.
        check_every: self-check schedule: None never, 0 the first checkable probed step, n also every
            n probed steps after a check.
        grad_reduced: ``.grad`` is not this rank's own gradient (FSDP, DDP): no add-up check, no split.
    """

    name = "hooks"

    def __init__(self, params: Sequence[nn.Parameter], group_index: Sequence[int], n_groups: int,
                 n_agents: int, *, model: nn.Module | None = None, store: Store | None = None,
                 strict: bool = False, check_every: int | None = 0, grad_reduced: bool = False) -> None:
        super().__init__(params, group_index, n_groups, n_agents, store=store)
        if model is None:
            raise ProbeError("the hooks method needs the model, to hook its layers; pass it or use method='split'")
        self.layers, uncovered = find_layers(model, self.params)
        if uncovered:
            raise ProbeError(f"hooks cannot attribute parameters {sorted(uncovered)}: "
                             f"{'; '.join(uncovered.values())}; use method='split'")
        older = {id(m): m for layer in self.layers if (m := _HOOKED.get(layer.module)) is not None}
        for method in older.values():  # one probe per layer: the newer one's hooks would take the older one's calls
            method.close()
            method.superseded = True
            warnings.warn("gradscope probe: a new Probe hooks layers of one that was not closed; the older probe is "
                          "closed (one probe per layer)", RuntimeWarning, stacklevel=4)
        self.strict, self.check_every, self.grad_reduced = strict or grad_reduced, check_every, grad_reduced
        self.dtype = torch.float64 if any(p.dtype == torch.float64 for p in self.params) else torch.float32
        # the per-row products are the weight gradient: spare autograd computing it again (see fused.py); with
        # a store, the probe reads G and x right after autograd's weight gradient; the installed forward
        # reports each call itself. (Not over a forward someone already replaced on the instance:
        # accelerate's device hooks do that; those layers, and the others, get a forward hook.)
        self._installed = [fused.Installed(layer.module, partial(self._on_forward, layer)) for layer in self.layers
                           if type(layer.module) is nn.Linear and "forward" not in vars(layer.module)]
        installed = {id(i.module) for i in self._installed}
        self._handles = [model.register_forward_pre_hook(self._on_model_call, with_kwargs=True),
                         model.register_forward_hook(self._after_model_call)]
        self._handles += [layer.module.register_forward_hook(partial(self._on_forward_hook, layer), with_kwargs=True)
                          for layer in self.layers if id(layer.module) not in installed]
        for layer in self.layers:
            _HOOKED[layer.module] = self
        self._forwards: list[Forward] = []
        self._tag: tuple[torch.Tensor, int | None, int] | None = None  # an open s.rows block: agents, dim, rows used
        self._tagged: Forward | None = None  # the forward its layer calls go to
        self._whole: Forward | None = None  # an open s.rows block's calls outside the model: all its rows
        self._new_forward = True
        self._positions = 0  # of the untagged model call whose forward is yet to start (Forward.positions)
        self._in_call = False
        self._own = False  # a split fallback's or the self-check's backward is running
        self._aux = False  # since the last probed backward, a backward outside the probe reached hooked calls
        self._outside = False  # this step, a backward outside the probe reached hooked calls
        self._failure: str | None = None  # the failed self-check's message, under strict
        self._missed = False
        self._reentrant = False
        self._compute_dtypes: set[torch.dtype] = set()  # of the probed layers' inputs and gradients, this step
        self._grad0: list[torch.Tensor | None] = []
        self.acc = Accumulator(self.params, self.layers, self.group_index, n_groups, n_agents, self.dtype)
        self._norms: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}  # input → (it, ‖A‖_F), this call
        self._unowned_grad: str | None = None  # a layer whose rows of no agent received gradient
        self.failed_check = False  # under auto, after a failed self-check: split from then on
        self.fallback_calls = 0    # calls that went through split, since construction
        self._steps_since_check: int | None = None  # None: never checked
        self._reasons: list[str] = []
        self._check: Store | None = None      # split's per-agent gradients of a step being checked
        self._checkable = True
        self._told_unverifiable = False  # the scalar-loss warning was given (once per probe)
        self._unverified: list[Piece] = []   # calls whose batch dimension the check must confirm
        self._checked_calls = 0               # this step's hooks-attributed calls the check also measured
        self._seen: set[Piece] = set()         # calls whose output the check gave a non-zero gradient, this step
        self._vacuous = False                 # this step's check passed with every gradient zero: it verified nothing
        self._rows_verified = False           # a passed check has seen rows of several agents with gradient
        self.warnings: list[str] = []         # of the step that just ended
        self.record = "hooks"                 # of the step that just ended (a PROBE_METHODS name)

    # ------------------------------------------------------------------ hooks
    def _on_model_call(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if not torch.is_grad_enabled() or in_backward():
            return
        tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
        held = max(map(positions, tensors), default=0)
        if self._tag is None:
            self._new_forward, self._positions = True, held
            self._prune(lambda f: not f.consumed)
            return
        agents, batch_dim, offset = self._tag
        first = tensors[0] if tensors else None
        dim = batch_dim or 0
        n = first.shape[dim] if first is not None and first.dim() > dim else len(agents) - offset
        if offset + n > len(agents):
            raise ProbeError(f"the model calls inside s.rows(...) hold more rows than its {len(agents)} agents")
        self._tagged = Forward(tag=agents[offset:offset + n], batch_dim=batch_dim, positions=held)
        self._forwards.append(self._tagged)
        self._tag = (agents, batch_dim, offset + n)

    def _on_forward_hook(self, layer: Layer, module: nn.Module, args: tuple, kwargs: dict,
                         output: torch.Tensor) -> None:
        if not args:  # called by keyword (emb(input=ids)): the input is the first tensor argument
            args = tuple(v for v in kwargs.values() if isinstance(v, torch.Tensor))[:1]
        if args:
            self._on_forward(layer, module, args, output)

    def _on_forward(self, layer: Layer, module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        if not (torch.is_grad_enabled() and isinstance(output, torch.Tensor) and output.requires_grad):
            return
        if in_backward():  # a checkpoint recomputing a call already seen (see "Gradient checkpointing")
            if self._in_call:
                output.register_hook(self._on_recomputed_grad)
            return
        forward = self._tagged
        if forward is None:
            if self._new_forward or not self._forwards or self._forwards[-1].tag is not None \
                    or self._forwards[-1].consumed:
                self._forwards.append(Forward(positions=self._positions))
                self._new_forward, self._positions = False, 0  # (a later forward without a model call: unknown)
            forward = self._forwards[-1]
        # (the output is never a leaf: its edge is its grad_fn; get_gradient_edge's checks cost ~40 µs a call)
        edge = GradientEdge(output.grad_fn, output.output_nr) if output.grad_fn is not None else get_gradient_edge(output)
        trained = self._trained(layer.weight, layer.bias)
        if trained == (None, None):
            return  # every probed parameter frozen since the probe was built: nothing of this call to attribute
        piece = Piece(layer, forward, args[0].detach(), edge=edge,
                       trained=None if trained == (layer.weight, layer.bias) else trained)
        forward.pieces.append(piece)
        if fused.is_hooked(output):
            if self.store is None:
                output.grad_fn.on_grad = partial(self._on_grad, piece)
            else:  # it forms no products: after autograd's weight gradient, with G and x in cache
                output.grad_fn.after_grad = partial(self._on_grad, piece)
        else:
            output.register_hook(partial(self._on_grad_hook, piece))

    @contextmanager
    def tag(self, agents: torch.Tensor, batch_dim: int | None = None) -> Iterator[None]:
        """The model calls inside the block hold rows ``agents`` (B,) between them, in call order (one call,
        or chunks of the batch: a call's rows are its first tensor argument's batch dimension). Layers
        called outside a model call (before, between or after them: a head on the concatenated chunks) go to one
        forward holding all B rows, whose positions are unknown."""
        if self._tag is not None:
            raise ProbeError("s.rows(...) blocks cannot nest")
        self._prune(lambda f: not f.consumed)
        self._tag = (agents, batch_dim, 0)
        self._whole = self._tagged = Forward(tag=agents, batch_dim=batch_dim)  # a model call's own while it runs
        try:
            yield
            used = self._tag[2]
            if used not in (0, len(agents)):
                raise ProbeError(f"the model calls inside s.rows(...) hold {used} rows, its agents {len(agents)}")
            if self._whole.pieces:
                self._forwards.append(self._whole)
        finally:
            self._tag, self._tagged, self._whole = None, None, None
            self._new_forward = True

    def _after_model_call(self, module: nn.Module, args: tuple, output: Any) -> None:
        if self._tag is not None:  # layers called from here on, outside the model, hold the block's rows
            self._tagged = self._whole

    def _on_recomputed_grad(self, grad: torch.Tensor) -> None:
        """A recomputed call received gradient: reentrant checkpointing back-propagates through its
        recomputation, never through the call the hooks attributed."""
        self._reentrant = True

    def _on_grad_hook(self, piece: Piece, grad: torch.Tensor) -> None:
        self._on_grad(piece, grad, fused=False)  # a tensor hook: returns None, so the gradient goes on unchanged

    def _on_grad(self, piece: Piece, grad: torch.Tensor,
                 fused: bool = True) -> tuple[torch.Tensor | None, torch.Tensor | None] | None:
        """A hooked call's output gradient ``grad``; for a :class:`fused.HookedLinear` call (``fused``), the weight
        and bias gradients when the per-row products give them (None where autograd must compute them)."""
        forward, x = piece.forward, piece.inputs
        forward.consumed, piece.inputs, piece.edge = True, None, None  # (the edge: see _prune)
        if not self._in_call:  # an unprobed backward, or one of a split fallback's or of the check's
            self._aux = self._aux or not self._own
            self._outside = self._outside or not self._own
            return None
        if x is None or forward.agents is None:
            self._missed = True  # reached by this backward but not one of its forwards
            return None
        probed = piece.trained or (piece.layer.weight, piece.layer.bias)
        if (trained := self._trained(*probed)) != probed:  # frozen after the call: AccumulateGrad drops its gradient
            piece.trained = trained
        if piece.trained is None:
            return self._attribute(piece, x, grad, fused)
        with self._as_trained(piece):
            return self._attribute(piece, x, grad, fused)

    def _trained(self, weight: int | None, bias: int | None) -> tuple[int | None, int | None]:
        """``(weight, bias)`` with the parameters that do not require a gradient now as None."""
        params = self.params  # (no generator: this runs twice per hooked call)
        return (None if weight is None or not params[weight].requires_grad else weight,
                None if bias is None or not params[bias].requires_grad else bias)

    @contextmanager
    def _as_trained(self, piece: Piece) -> Iterator[None]:
        """The call's layer with only the parameters the call trained (see :attr:`Piece.trained`)."""
        layer = piece.layer
        if piece.trained is None:
            yield
            return
        probed = layer.weight, layer.bias
        layer.weight, layer.bias = piece.trained
        try:
            yield
        finally:
            layer.weight, layer.bias = probed

    def _attribute(self, piece: Piece, x: torch.Tensor, grad: torch.Tensor,
                   fused: bool) -> tuple[torch.Tensor | None, torch.Tensor | None] | None:
        """:meth:`_on_grad`'s work for a call of this probed backward: its per-agent contributions."""
        forward = piece.forward
        with torch.no_grad() if torch.is_grad_enabled() else _NO_CONTEXT:  # (a backward runs without grad)
            layer = piece.layer
            if piece.dim:
                x, grad = x.movedim(piece.dim, 0), grad.movedim(piece.dim, 0)
            if forward.unowned is not None and self._unowned_grad is None \
                    and bool(grad.reshape(forward.rows, -1)[forward.unowned].any()):
                self._unowned_grad = layer.name
            if layer.embedding:
                if layer.weight is not None:
                    self.acc.add_magnitude(layer.weight, _norm(grad) * grad[..., 0].numel() ** 0.5)
                    self.acc.embedding_rows(layer, forward, x, grad, self.store)
                return None
            A, G = by_row(x, forward.rows), by_row(grad, forward.rows)
            self._compute_dtypes.update((A.dtype, G.dtype))
            # each on its own: under autocast a layer's input and its output gradient differ (fp32 / bf16)
            A, G = as_dtype(A, self.dtype), as_dtype(G, self.dtype)
            if self.store is not None:
                self._linear_magnitudes(layer, x, grad, self.acc.to_store(layer, forward, A, G, self.store))
                return None
            dW, db, sizes = self.acc.linear(layer, forward, A, G, x)
            if self._check is not None or dW is None or not fused:
                # the self-check compares with split's Gᵀ A, and autograd sums Gᵀ A itself: bound the token terms
                self._linear_magnitudes(layer, x, grad)
            else:
                # .grad and the per-agent gradients are sums of the same per-row products P_b: they differ
                # only by the order of summation, which Σ_b ‖P_b‖ bounds
                for i, size in zip((layer.weight, layer.bias), sizes):
                    if i is None:
                        continue
                    if size is None:  # the sums S are the weight's buffer: their norms are read from it later
                        self.acc.unmeasured.add(i)
                    else:
                        self.acc.add_magnitude(i, size)
            return dW, db

    def _linear_magnitudes(self, layer: Layer, x: torch.Tensor, grad: torch.Tensor,
                           norms: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """The magnitudes of a Linear call's token terms (``‖G‖_F ‖A‖_F``; bias ``√N ‖G‖_F``); ``norms``: ``‖G‖_F``
        and ``‖A‖_F`` over the rows with an agent where the store computed them (rows without one must get
        no gradient: else the per-agent gradients miss it and the add-up check fails, naming the tags)."""
        g_norm, a_norm = norms if norms is not None else (_norm(grad), None)
        if layer.weight is not None:
            self.acc.add_magnitude(layer.weight, g_norm * (self._norm_of(x) if a_norm is None else a_norm))
        if layer.bias is not None:
            self.acc.add_magnitude(layer.bias, g_norm * (grad[..., 0].numel()) ** 0.5)  # Σ_t ‖G_t‖ ≤ √N ‖G‖

    def _norm_of(self, x: torch.Tensor) -> torch.Tensor:
        """‖x‖_F in float64, once per input tensor and call (q, k and v projections share their input)."""
        key = (x.data_ptr(), x.shape, x.stride(), x._version)
        if key not in self._norms:  # the entry keeps x alive, so its address is not reused during the call
            self._norms[key] = (x, _norm(x))
        return self._norms[key][1]

    # ------------------------------------------------------------------ per-agent contributions
    # ------------------------------------------------------------------ the GramMethod protocol
    def begin(self) -> None:
        self._reset()
        self.warnings, self._reasons = [], []
        self._compute_dtypes = set()
        if self.store is not None:
            self.store.zero()
        if not self.grad_reduced:  # for the add-up check
            self._grad0 = [None if p.grad is None else p.grad.detach().clone() for p in self.params]
        if self._steps_since_check is not None:
            self._steps_since_check += 1
        since = self._steps_since_check
        check = self.check_every is not None and not self.failed_check and (
            since is None or (self.check_every > 0 and since >= self.check_every))
        group = None if self.store is None else self.store.group
        if group is not None:  # a rank that re-armed the check alone made the ranks' collectives differ at end
            check = bool(all_reduce_max([int(check)], group)[0])
        if check:
            self._check = (self.store.local_copy() if self.store is not None
                           else FlatStore(self.params, self.group_index, self.n_groups, self.n_agents))
            self._check.zero()

    def _refuse_after_failed_check(self) -> None:
        """Under ``method="hooks"``, every call after a failed self-check raises: no unchecked hooks, no split."""
        if self.failed_check and self.strict:
            self._prune(lambda f: f is self._tagged)  # (an error a loop catches must not keep the graphs alive)
            raise ProbeError((self._failure or "hooks failed its self-check") + " (at an earlier step; method='hooks' "
                             "does not fall back to split: use method='auto' or 'split', or a new probe once the "
                             "cause is fixed)")

    def backward(self, terms: Terms, retain_graph: bool) -> None:
        """No row information: this call goes through split (one backward per term)."""
        self._refuse_after_failed_check()
        self._split(terms, retain_graph, "per-agent-losses", "per-agent loss terms carry no row information")

    def _split(self, terms: Terms, retain_graph: bool, reason: str, why: str) -> None:
        """One backward per term (split), for a call hooks cannot attribute (``reason``, ``why``)."""
        if self.grad_reduced:
            raise ProbeError(f"hooks cannot attribute this call: {why}; and split cannot measure it, since with "
                             "grad_reduced=True .grad is not this rank's own gradient")
        self.fallback_calls += 1
        self._reasons.append(reason)
        sink = self.store.add_grads if self.store is not None else self.acc.add_grads
        if self._check is not None:
            check, inner = self._check, sink

            def sink(k: int, grads: Grads) -> None:  # noqa: F811 (both sides see these gradients)
                inner(k, grads)
                check.add_grads(k, grads)
        self._own = True
        try:
            backward_per_agent(self.params, terms, retain_graph, sink)
        finally:
            self._own, self._aux = False, False
            self._prune(lambda f: f is self._tagged)

    def backward_rows(self, loss: torch.Tensor, row_agents: torch.Tensor | None,
                      terms: Callable[[], Terms] | None, retain_graph: bool) -> None:
        live = [f for f in self._forwards if not f.consumed and f.pieces and f is not self._tagged]
        self._refuse_after_failed_check()
        try:
            if self.failed_check:
                raise Fallback("check-failed", "hooks failed its self-check earlier")
            live = self._match(live, row_agents, loss)
            checking = self._check is not None and terms is not None
            ambiguous = [p for f in live for p in f.pieces if p.ambiguous]
            if ambiguous and not checking:  # no check in this call to tell which dimension is the batch one
                reachable = reachable_nodes(loss)  # (a call this loss does not reach gets no gradient to attribute)
                ambiguous = [p for p in ambiguous if p.edge is None or id(p.edge.node) in reachable]
                if ambiguous:
                    if self.check_every is not None and not self.failed_check:
                        self._steps_since_check = None  # the next probed step checks (and fixes) the dimension
                    raise Fallback("unmatched-rows", f"{guessed(ambiguous[0])} and no self-check runs in this call "
                                   f"to confirm it; {remedy(ambiguous[0])}")
            mixed = any(f.mixed for f in live)
            if mixed and not checking and not self._rows_verified and self.check_every is not None and terms is not None:
                # the checks so far saw rows of one agent only (or no gradient): that the model keeps rows apart
                # is unverified; the next probed step checks it
                self._steps_since_check = None
                if not self.grad_reduced:
                    raise Fallback("unmatched-rows", "this call's forward holds rows of several agents, and no "
                                   "self-check has yet seen such rows (the checks so far had one agent's rows, or no "
                                   "gradient): the next probed step checks them")
        except Fallback as fb:
            if terms is None:
                self._prune(lambda f: f is self._tagged)
                raise ProbeError(f"hooks cannot attribute this loss: {fb}; and split cannot split a scalar loss. "
                                 "Pass per-row losses (backward_rows with a (B,) loss) or per-token losses") from None
            if fb.reason != "check-failed" and not self.grad_reduced:
                self._warn(f"hooks fell back to split for a call: {fb}")
            for f in live:
                f.agents = None
            return self._split(terms(), retain_graph, fb.reason, str(fb))
        if self._check is not None and terms is None:
            self._checkable = False  # a scalar loss cannot be split: the check waits for a later step
            if not self._told_unverifiable:  # once per probe: a scalar-loss loop may never be checked
                self._told_unverifiable = True
                self._warn("the self-check cannot verify a scalar loss's attribution (it needs per-row or per-token "
                           "losses) and waits for a step with them: until then the Gram is right only if the model "
                           "keeps its rows independent (no BatchNorm or other term across rows)")
        self._unverified += ambiguous
        self._checked_calls += checking
        calls = [(p, p.inputs, p.edge) for f in live for p in f.pieces if p.inputs is not None] if checking else []
        self._in_call, self._missed, self._reentrant = True, False, False
        try:
            torch.autograd.backward(loss.sum(), retain_graph=retain_graph or checking)
        finally:
            self._in_call, self._norms, self._aux = False, {}, False
            self._prune(lambda f: f is self._tagged)
        if self._reentrant:
            raise ProbeError("hooks: the backward went through layers recomputed by reentrant gradient checkpointing "
                             "(use_reentrant=True), which hooks cannot attribute; use use_reentrant=False "
                             "(gradient_checkpointing_kwargs={'use_reentrant': False}) or method='split'")
        if self._missed or not all(f.consumed for f in live):
            raise ProbeError("hooks: the backward reached hooked layers of a forward that is not among this "
                             "call's: one already back-propagated (retain_graph), or made before the previous "
                             "backward (a forward is kept until the next backward only: run each forward just before "
                             "its backward); use method='split' for this loop")
        if checking:
            self._check_call(calls, terms(), loss, retain_graph)

    def _match(self, live: list[Forward], row_agents: torch.Tensor | None, loss: torch.Tensor) -> list[Forward]:
        """Give every forward the loss reaches the agents of its rows and every layer call its batch
        dimension; returns those forwards."""
        if len(live) > 1:  # forwards never back-propagated (stale, tagged or not) are no candidates
            reachable = reachable_nodes(loss)
            live = [f for f in live if any(id(p.edge.node) in reachable for p in f.pieces)]
        if not live and self._aux:
            raise Fallback("unmatched-rows", "the forward was already back-propagated by a backward outside the "
                                              "probe (torch.autograd.grad or .backward() of another loss, e.g. a "
                                              "regulariser's); hooks attributes only a forward's first backward")
        if not live:
            raise Fallback("unmatched-rows", "no grad-enabled forward of the model reached a hooked layer "
                                              "since the previous backward: the forward was already back-propagated "
                                              "(a second backward through a graph kept with retain_graph=True: hooks "
                                              "attributes a forward's first backward only), or made before the "
                                              "previous backward (a forward is kept until the next backward only: run "
                                              "each forward just before its backward), or reentrant gradient "
                                              "checkpointing (use_reentrant=True) ran the checkpointed layers without "
                                              "grad: use use_reentrant=False")
        if row_agents is None:  # also for tagged forwards: a row's gradient mixes its agents, whatever its tag
            raise Fallback("mixed-rows", "a row holds tokens of several agents")
        untagged = [f for f in live if f.tag is None]
        if untagged and len(live) > 1:
            raise Fallback("untagged-forwards", f"{len(live)} forwards of the model since the previous backward, "
                            f"{len(untagged)} without row tags: their rows cannot be matched to the loss's rows "
                            "without trusting call order; tag each forward: with s.rows(agent_of_row): model(...)")
        if untagged:
            untagged[0].tag = row_agents
        unmatched: list[tuple[Piece, str]] = []  # calls with no dimension of size B, and why
        reach: set[int] | None = None

        def reached(piece: Piece) -> bool:  # whether the loss reaches the call (a graph walk, once, when asked)
            nonlocal reach
            if reach is None:
                reach = reachable_nodes(loss)
            return piece.edge is None or id(piece.edge.node) in reach
        per_row = loss.numel() // loss.shape[0] if loss.dim() and loss.shape[0] else 1  # the loss's terms a row
        for f in live:
            B = len(f.tag)
            f.attach(torch.as_tensor(f.tag, device=f.pieces[0].layer.module.weight.device))
            calls: dict[Layer, int] = {}
            # the calls' inputs by position (the feature axis dropped; an embedding's ids whole)
            shapes = [None if p.inputs is None else p.inputs.shape if p.layer.embedding else p.inputs.shape[:-1]
                      for p in f.pieces]
            # B vectors — an input of B positions, one a row at most — where the forward holds more (its model input,
            # unknown without a model call; the loss; a call the loss reaches): vectors selected or routed to the
            # layer (a head on the scored tokens, MoE experts) or pooled per row, which shapes cannot tell apart
            vectors = [s is not None and s.numel() == B for s in shapes]
            wide = False
            if any(vectors) and f.batch_dim is None:
                wide = f.positions == 0 or max(f.positions, f.rows * per_row) > B or any(
                    s is not None and s.numel() > B and reached(p) for p, s in zip(f.pieces, shapes))
            for piece, shape, vector in zip(f.pieces, shapes, vectors):
                piece.index = calls.get(piece.layer, 0)
                calls[piece.layer] = piece.index + 1
                if shape is None:
                    continue
                if f.batch_dim is not None:  # declared: it holds the rows (B vectors too)
                    if f.batch_dim >= len(shape) or shape[f.batch_dim] != B:
                        unmatched.append((piece, f"layer {piece.layer.name!r}: input of shape "
                                          f"{tuple(piece.inputs.shape)} has no dimension {f.batch_dim} of size B = {B}"))
                        continue
                    piece.dim = f.batch_dim
                    continue
                # a guess in every step, verified by a check in its own step only (a selection may change)
                piece.pooled = vector and wide
                dims = [d for d, n in enumerate(shape) if n == B]
                if not dims:
                    unmatched.append((piece, f"layer {piece.layer.name!r}: input of shape "
                                      f"{tuple(piece.inputs.shape)} has no dimension of the batch size B = {B}"))
                    continue
                verified = None if piece.pooled else piece.layer.batch_dims.get(piece.index)
                piece.dim = verified if verified in dims else dims[0]
                # a guess unless it is the leading dimension and the only one of size B: a non-leading one may be
                # the batch of a sequence-first input or the sequence axis of a chunk of the batch (T == B); with
                # rows of one agent every dimension attributes alike
                piece.ambiguous = f.mixed and (piece.pooled or (verified not in dims and dims != [0]))
                piece.candidates = tuple(dims)
        if unmatched:  # a call the loss does not reach gets no gradient to attribute (peft DoRA's lora_A(eye(d)))
            unmatched = [(p, why) for p, why in unmatched if reached(p)]
            if unmatched:
                raise Fallback("unmatched-rows", unmatched[0][1])
        return live

    def _check_call(self, calls: list[tuple[Piece, torch.Tensor, GradientEdge]], terms: Terms, loss: torch.Tensor,
                    retain_graph: bool) -> None:
        """The self-check's side of one call: agent k's gradient is ``Σ_calls G_kᵀ A`` over all rows, G_k the
        gradient of k's terms alone at each hooked call's output (``autograd.grad``, ``.grad`` untouched).

        ``calls``: the call's hooked layer calls, their inputs and output edges. Under ``grad_reduced`` every agent is
        differentiated, absent ones as a zero term, so that every rank runs the same backward passes.
        """
        todo = [(k, t) for k, t in terms if t.requires_grad]
        if self.grad_reduced:
            have = {k for k, _ in todo}
            todo += [(k, loss.sum() * 0) for k in range(self.n_agents) if k not in have]
        edges = [edge for _, _, edge in calls]
        for j, (k, term) in enumerate(todo):
            self._own = True  # (this backward goes through the hooked calls too: not the user's)
            try:
                grads = torch.autograd.grad(term, edges, retain_graph=retain_graph or j < len(todo) - 1,
                                            allow_unused=True)
            finally:
                self._own = False
            whole = Forward()  # every row agent k's: no row tag involved
            with torch.no_grad():
                whole.attach(torch.tensor([k], device=term.device))
                for (piece, x, _), G in zip(calls, grads):
                    if G is None:
                        continue
                    if piece not in self._seen and bool(G.any()):  # (a check is a split step: a read per call is cheap)
                        self._seen.add(piece)
                    with self._as_trained(piece):
                        if piece.layer.embedding:
                            if piece.layer.weight is not None:
                                self.acc.embedding_rows(piece.layer, whole, x, G, self._check)
                        else:
                            self.acc.to_store(piece.layer, whole, x.reshape(1, -1, x.shape[-1]).to(self.dtype),
                                                  G.reshape(1, -1, G.shape[-1]).to(self.dtype), self._check)

    def _prune(self, keep: Callable[[Forward], bool]) -> None:
        """Keep the forwards ``keep`` accepts; the others release their calls. A call's edge holds its autograd
        node, and the node holds the call (its ``on_grad``, or the tensor hook on its output): a cycle through
        C++ that Python's garbage collector cannot see, which kept every step's graph alive (+60 MB of
        resident memory a step on the LoRA LM of benchmarks/bench_peers.py) until released."""
        kept = []
        for f in self._forwards:
            if keep(f):
                kept.append(f)
            else:
                f.release()
        self._forwards = kept

    def _warn(self, message: str) -> None:
        if message not in self.warnings:
            self.warnings.append(message)
            warnings.warn(f"gradscope probe: {message}", RuntimeWarning, stacklevel=4)

    def end(self) -> np.ndarray:
        """Per-group Grams: the store's, or ``D Dᵀ`` per dense parameter (in the accumulation dtype, summed in
        float64) plus the ghost / touched-rows Grams of the layers still holding token rows."""
        try:
            ghost = self.acc.ghost()
            per_param: dict[int, np.ndarray] = {}
            if self.store is None:
                grams = self.acc.grams(per_param if self._check is not None else None)
            bad = self._add_up(grams if self.store is None else None, ghost)
            failure = None if self._check is None else self._self_check(
                grams if self.store is None else self.store.local_grams(), per_param, ghost)
            if failure is not None and not self.strict:
                self.failed_check = True
                self._warn(failure + "; this record has the check's Gram and the probe uses split from now on")
                self._reasons.insert(0, "check-failed")
                if self.store is None:
                    grams = self._check.local_grams()
                else:
                    for mine, theirs in zip(self.store._buffers(), self._check._buffers()):
                        mine.copy_(theirs)
                # the check sees only the hooked layers' calls: a weight used outside them must still be caught
                bad = self._add_up(grams if self.store is None else None, ghost)
            uncalled = self._uncalled() if bad else []
            if self.store is not None:
                grams = self.store.grams()  # a collective: every rank takes part, also one that then raises
        finally:
            checked = self._check is not None and self._checkable and self._checked_calls > 0 and not self._vacuous
            unowned, outside = self._unowned_grad, self._outside
            self._reset()
        if failure is not None and self.strict:
            self.failed_check, self._failure = True, failure  # every later call raises too: no unchecked hooks
            raise ProbeError(failure)  # (before the add-up check's error: the check names the layer and the cause)
        if bad:
            if unowned is not None:
                raise ProbeError(f"hooks: rows tagged with no agent (-1) receive gradient at layer {unowned!r}: "
                                 "the forwards' row tags do not match the loss's rows (losses concatenated in another "
                                 "order than the forwards ran?), or the model mixes rows (a term across the batch, "
                                 "e.g. BatchNorm)")
            cause = ("a backward outside the probe (.backward() or torch.autograd.grad of another loss) reached the "
                     "probed layers during this step and added gradient that belongs to no agent, or a probed "
                     "weight is used outside its layer's forward" if outside
                     else "a probed weight is used outside its layer's forward")
            if uncalled:
                cause += (f" (layer{'s' if len(uncalled) > 1 else ''} {', '.join(map(repr, uncalled[:3]))}"
                          f"{' …' if len(uncalled) > 3 else ''}: gradient, but no call of it that a backward reached)")
            raise ProbeError(f"hooks: the per-agent gradients of parameter group(s) {bad} do not add up to their "
                             f"gradient; {cause}. Use method='split'")
        self.record = ("split-fallback:" + self._reasons[0] if self._reasons
                       else "hooks+check" if checked else "hooks")
        return grams

    def _uncalled(self) -> list[str]:
        """The hooked layers with no call hooks attributed this step (none, or none a backward reached) whose probed
        parameters received gradient all the same (their weight is read outside their forward); none when split
        measured a call (its gradients need no layer call)."""
        if self._reasons:
            return []
        attributed = self.acc.magnitudes()  # (every attributed call adds to its parameters' magnitudes)
        moved = {i for i, delta in self._deltas() if i not in attributed and bool(delta.any())}
        return [layer.name for layer in self.layers if layer.weight in moved or layer.bias in moved]

    def _add_up(self, grams: np.ndarray | None, ghost: set[int]) -> list[int]:
        """The add-up check of this rank's per-agent gradients (``grams`` (G, K, K), or the store's before it
        sums the ranks') against ``Δ.grad``: the groups that fail; none under ``grad_reduced`` (there
        ``.grad`` is not this rank's gradient: the caller compares √ΣM with the global norm)."""
        if self.grad_reduced:
            return []
        if grams is None:
            total, diag = self.store.sums()
            return self._check_add_up(total, diag, self.store.norms_sq(self._deltas()), ghost)
        delta_sq = squared_norms(self._deltas(), self.group_index, self.n_groups)
        return self._check_add_up(grams.sum((1, 2)), np.diagonal(grams, axis1=1, axis2=2), delta_sq, ghost)

    def _self_check(self, grams: np.ndarray, per_param: dict[int, np.ndarray], ghost: set[int]) -> str | None:
        """Compare this step's hooks Grams with the check's; a message naming what differs, or None."""
        if self._check is None:
            return None
        mine = self._checkable and self._checked_calls > 0  # this rank has a hooks call to check
        # over ranks, every rank takes part (also one whose share of the batch was empty) and decides alike
        ranks = self._check.group is None and self.store is not None and self.store.group is not None
        if not mine and not ranks:  # no hooks call to check: the check waits
            return None
        tol, eps = add_up_tolerance(self._grad_dtype())
        bad = np.zeros(self.n_groups, dtype=bool)
        wrong: list[int] = []  # the parameters whose own Gram differs (a small layer is lost in its group's Gram)
        theirs = None
        if mine:
            magnitudes = self.acc.magnitudes()
            magnitude = np.zeros(self.n_groups)
            for i, m in magnitudes.items():
                magnitude[self.group_index[i]] += m ** 2
            theirs = self._check.local_grams()
            bad = differs(grams, theirs, tol, eps, np.sqrt(magnitude))
            wrong = [i for i in per_param if differs(per_param[i][None], self._check.param_gram(i)[None], tol, eps,
                                                     np.array([magnitudes.get(i, 0.0)])).any()]
            bad[[self.group_index[i] for i in wrong]] = True
        tested = theirs is not None and bool(np.any(theirs != 0))  # some agent had a gradient to attribute
        # rows of several agents the check gave a gradient to: whether the model mixes rows is then verified (on any
        # rank: it is the model's property, and the ranks must agree on when to fall back)
        mixed = any(piece.forward.mixed for piece in self._seen)
        if ranks:
            flags = all_reduce_sum_(torch.tensor([float(bad.any()), float(mine), float(tested), float(mixed)]),
                                    self.store.group)
            if flags[1] == 0:  # no rank had one: the check waits
                return None
            bad, tested, mixed = bad | bool(flags[0] > 0), bool(flags[2] > 0), bool(flags[3] > 0)
        if not bad.any():
            if not tested:  # every agent's gradient zero (all advantages 0): any attribution agrees; the check stays due
                self._vacuous = True
                return None
            self._steps_since_check = 0
            # verified: what the check gave a gradient to (rows of several agents; a call's guessed dimension)
            self._rows_verified = self._rows_verified or mixed
            for piece in self._unverified:
                if piece in self._seen and not piece.pooled:
                    piece.layer.batch_dims[piece.index] = piece.dim
            return None
        self._steps_since_check = 0
        where = f"parameter group(s) {np.flatnonzero(bad).tolist()}"
        layer = next((lay for lay in self.layers if lay.weight in wrong or lay.bias in wrong), None) if wrong else None
        if layer is not None:
            where = f"layer {layer.name!r}"
        hint = ("the forwards' row tags (s.rows) do not match the rows of the loss, a layer's input is not "
                "row-major in the batch, or the model mixes rows (a term across the batch, e.g. BatchNorm)")
        unverified = [p for p in self._unverified if layer is None or p.layer is layer]
        if unverified:
            hint = f"{guessed(unverified[0])}, and it may not be the batch one: {remedy(unverified[0])}"
        return (f"hooks failed its self-check: the per-agent Gram of {where} differs from split's (autograd per "
                f"agent), so rows are attributed to the wrong agents; {hint}")

    def _grad_dtype(self) -> torch.dtype:
        """The least precise dtype the step's gradients were computed in: the parameters', or a lower one
        a probed layer computed in (autocast: fp32 weights, bf16 matmuls)."""
        return least_precise({p.dtype for p in self.params} | self._compute_dtypes)

    def abort(self) -> None:
        self._reset()  # .grad already holds what the ordinary backward(s) left
        self._prune(lambda f: f is self._tagged)  # the failed step's forwards: not kept alive

    def state_dict(self) -> dict[str, Any]:
        """The self-check's schedule and outcome, the fallback count and the layers' verified batch
        dimensions (by layer name; ``name#k`` for a layer's k-th call in a forward, k > 0)."""
        return {"failed_check": self.failed_check, "fallback_calls": self.fallback_calls,
                "steps_since_check": self._steps_since_check,
                "rows_verified": self._rows_verified,
                "batch_dims": {layer.name + (f"#{k}" if k else ""): dim for layer in self.layers
                               for k, dim in layer.batch_dims.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        layers = {layer.name: layer for layer in self.layers}
        calls = {key: key.rpartition("#") if key not in layers and key.rpartition("#")[2].isdigit() else (key, "", "0")
                 for key in state["batch_dims"]}
        missing = sorted(name for name, _, _ in calls.values() if name not in layers)
        if missing:
            raise ProbeError(f"hooks: the saved state names layers this model lacks: {missing}")
        self.failed_check, self.fallback_calls = bool(state["failed_check"]), int(state["fallback_calls"])
        self._steps_since_check = state["steps_since_check"]
        # (a state saved before rows_verified existed: a check had passed if one had run)
        self._rows_verified = bool(state.get("rows_verified", state["steps_since_check"] is not None))
        for key, dim in state["batch_dims"].items():
            name, _, k = calls[key]
            layers[name].batch_dims[int(k)] = dim

    def close(self) -> None:
        self._prune(lambda f: False)
        for handle in self._handles:
            handle.remove()
        for installed in self._installed:
            installed.remove()
        self._handles, self._installed = [], []
        for layer in self.layers:
            if _HOOKED.get(layer.module) is self:
                del _HOOKED[layer.module]

    def _reset(self) -> None:
        self._grad0 = []
        self.acc.reset()
        self._in_call, self._aux, self._outside = False, False, False
        self._unowned_grad = None
        self._check, self._checkable, self._unverified, self._checked_calls = None, True, [], 0
        self._seen, self._vacuous = set(), False

    def _deltas(self) -> Iterator[tuple[int, torch.Tensor]]:
        """``(i, Δ.grad)`` of every parameter with a gradient: what this step added to ``.grad``."""
        for i, p in enumerate(self.params):
            grad = p.grad
            if grad is None:
                continue
            if grad.requires_grad:  # (a backward with create_graph)
                grad = grad.detach()
            g0 = self._grad0[i]
            yield i, grad if g0 is None else grad.double() - g0.double()

    def _check_add_up(self, total: np.ndarray, diag: np.ndarray, delta_sq: np.ndarray, ghost: set[int]) -> list[int]:
        """The groups whose Gram does not add up to the gradient: ``Σ_kl M^g_kl`` (total, (G,)) must equal
        ``‖Δ.grad_g‖²`` (delta_sq) to within :func:`add_up_tolerance` — with a store, both as the store maps
        them (:meth:`Store.sums`, :meth:`Store.norms_sq`; a sketch: ``‖P S ·‖²``).

        Catches a probed weight that is also used outside its module's forward (hooks cannot see that).
        """
        if not (np.isfinite(total).all() and np.isfinite(diag).all()):
            return []
        magnitude_sq, ghost_sq, before_sq = np.zeros(self.n_groups), np.zeros(self.n_groups), np.zeros(self.n_groups)
        with_grad = [i for i, p in enumerate(self.params) if p.grad is not None]
        dtypes = {self.params[i].grad.dtype for i in with_grad}
        magnitudes = self.acc.magnitudes()
        for i, before in each_squared_norm((i, self._grad0[i]) for i in with_grad if self._grad0[i] is not None).items():
            before_sq[self.group_index[i]] += before
        for i in with_grad:
            if i in magnitudes:
                m_sq = magnitudes[i] ** 2
                magnitude_sq[self.group_index[i]] += m_sq
                ghost_sq[self.group_index[i]] += m_sq if i in ghost else 0.0
        if not dtypes:
            return []
        tol, eps = add_up_tolerance(least_precise(dtypes | self._compute_dtypes))
        scale = np.square(np.sqrt(np.clip(diag, 0, None)).sum(1))
        summands = np.sqrt(magnitude_sq) + np.sqrt(before_sq)
        allowed = (tol * scale + eps * (summands * (np.sqrt(delta_sq) + np.sqrt(np.clip(total, 0, None))) + ghost_sq)
                   + np.finfo(np.float64).tiny)
        return np.flatnonzero(np.abs(total - delta_sq) > allowed).tolist()


def _norm(x: torch.Tensor) -> torch.Tensor:
    """‖x‖_F as a float64 scalar, reduced in x's own precision (fp32 for 16-bit x, which could overflow):
    no float64 copy of x."""
    return torch.linalg.vector_norm(x, dtype=torch.float32 if x.element_size() < 4 else None).double()

