"""Update attribution under Adam/AdamW: which role (or agent) actually moves the parameters.

The Gram attributes the *gradient*; AdamW applies, per coordinate, after its moments are updated::

    Δθ = −lr·λ·θ − (lr / bc1) · m / d,     d = √v / √bc2 + ε,   bc1 = 1 − β1^t,  bc2 = 1 − β2^t
    m_t = β1·m_{t−1} + (1 − β1)·ĝ_t        (v likewise with ĝ²; amsgrad divides by √max v instead)

``ĝ_t`` is the gradient the optimizer sees: the probed step's ``Σ_k g_k`` times the factor ``c_t`` the
loop applied in between (gradient clipping, loss-scale unscaling; one factor for every role). The first
moment is linear in the gradients, so per-unit buffers (a unit is a role, or an agent)::

    m_u,t = β1·m_u,t−1 + (1 − β1)·c_t·g_u,t          g_u = Σ_{k∈u} g_k  (0 for a step nobody probed)

add up to m, and the step splits exactly into C = U + 2 components::

    Δθ = Σ_u Δθ_u + Δθ_unattributed + Δθ_weight_decay
    Δθ_u              = −(lr/bc1)·m_u / d                     (d: the optimizer's own v, after its step)
    Δθ_unattributed   = −(lr/bc1)·(m − Σ_u m_u − m_λ) / d     (moment no probed step explains; 0 when
                                                               every step since the first was probed)
    Δθ_weight_decay   = −lr·λ·θ_old (AdamW, decoupled);  −(lr/bc1)·m_λ / d (Adam's L2: ĝ += λθ
                                                               enters the moment, m_λ its buffer)

Per optimizer step the result holds the component Gram ``U_ab = ⟨Δθ_a, Δθ_b⟩`` (C × C) and the
interference matrix ``I_al = ⟨Δθ_a, g_l⟩`` (C × K, the probed step's per-agent gradients before any
clipping): ``I_al`` is the first-order change of agent l's loss term caused by component a. The
statistics (update norms, shares, cosines, role interference) are functions of them
(``gradscope.stats``). ``c_t`` is fitted as ``⟨ĝ, g⟩ / ‖g‖²`` over the probed parameters; a gradient
that is not a multiple of the probed one (per-tensor clipping, an extra loss term outside the probe)
leaves its remainder in ``unattributed``, never in a unit.

A step whose optimizer did not run (a skipped non-finite step) changes nothing: the buffers advance
only in the optimizer's own step hooks, for the parameters whose ``state["step"]`` advanced.

**Sketch mode.** A CountSketch cannot follow the update: ``d`` is coordinate-wise and changes every
step, and ``S(m_u / d_t)`` is not a function of the sketches ``S(g_u,τ)`` of past gradients. A
coordinate *sample* commutes with any coordinate-wise map, so in sketch mode the per-agent gradients
are also kept at a seeded random subset J of coordinates (:class:`SampleStore`: each coordinate of
group g kept with probability ``q_g = T_g / PRIME ≈ min(1, k / P_g)``), the buffers live on J only,
every per-coordinate quantity there is exact, and the inner products are Horvitz–Thompson estimates
``Σ_{j∈J} a_j b_j / q_g`` — unbiased over the hash seed, with variance ``(1/q − 1) Σ_j a_j² b_j²``.
Memory: (K + U) values per sampled coordinate instead of per coordinate.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn

from gradscope.errors import ProbeError
from gradscope.probe.distributed import all_reduce_sum_
from gradscope.probe.sketch import PRIME, Sketch, hash_coefficients, poly_hash
from gradscope.probe.store import CHUNK, FlatStore, Store, group_layout
from gradscope.stats import UPDATE_EXTRAS

if TYPE_CHECKING:
    from gradscope.probe.probe import Probe, StepResult

#: What a unit of update attribution is.
UNITS = ("role", "agent")


@dataclass(frozen=True)
class UpdateResult:
    """One optimizer step of an attached Adam/AdamW, split into components.

    Attributes:
        step, policy: the probed step whose per-agent gradients entered the moments (None: no probed
            step since the previous optimizer step, so this step's gradient is all ``unattributed``).
        components: the C names: the units (roles or agents, in the probe's order), then
            ``"unattributed"`` and ``"weight_decay"``.
        gram: (C, C) float64, ``⟨Δθ_a, Δθ_b⟩`` over the probed parameters this optimizer updates
            (squared parameter units); ``Σ gram = ‖Δθ‖²``.
        interference: (C, K) float64, ``⟨Δθ_a, g_l⟩`` with the probed step's per-agent gradients (NaN
            when ``step`` is None).
        grad_scale: the fitted factor c between the probed gradient and the one the optimizer used
            (1 unclipped, < 1 clipped; NaN when ``step`` is None).
        residual: ``‖Δθ_actual − Σ_a Δθ_a‖ / ‖Δθ_actual‖``, the split's own check (the parameters'
            rounding, ≈ eps·‖θ‖/‖Δθ‖: ~1e-15 in fp64, ~5e-5 in fp32 at lr 1e-4); NaN where it is undefined (a
            non-finite step the loop did not skip, or a split that moves what did not move).
        exact: False in sketch mode (inner products estimated from a coordinate sample).
    """

    step: int | None
    policy: str | None
    components: tuple[str, ...]
    gram: np.ndarray
    interference: np.ndarray
    grad_scale: float
    residual: float
    exact: bool


# ---------------------------------------------------------------------------------------------
# Where the per-agent gradients come from: all coordinates (FlatStore) or a sample of them


class Coordinates(Protocol):
    """The coordinates of each probed parameter that update attribution follows, and the step's
    per-agent gradients there."""

    exact: bool

    def coords(self, i: int) -> torch.Tensor | None:
        """Flat indices into ``params[i]`` (int64, increasing), or None for all of them."""

    def weight(self, i: int) -> float:
        """1 / inclusion probability of ``params[i]``'s coordinates."""

    def values(self, i: int) -> torch.Tensor:
        """(K, m_i) the probed step's per-agent gradients at those coordinates."""


class AllCoordinates:
    """Every coordinate, read from a :class:`FlatStore`."""

    exact = True

    def __init__(self, store: FlatStore) -> None:
        self.store = store

    def coords(self, i: int) -> None:
        return None

    def weight(self, i: int) -> float:
        return 1.0

    def values(self, i: int) -> torch.Tensor:
        return self.store.view(i).reshape(self.store.n_agents, -1)


class SampleStore(Store):
    """Per-agent gradients at a seeded random coordinate sample: coordinate j of parameter ``name`` in
    group g is kept iff ``poly(j) mod PRIME < T_g``, ``T_g = max(1, round(PRIME · min(1, k / P_g)))``
    (the polynomial is the sketch's, keyed by ``("sample", seed, name)``), so each is kept with
    probability exactly ``T_g / PRIME``. Its blocks are scaled by ``√(PRIME / T_g)``: their Gram is the
    Horvitz–Thompson estimate of the gradient Gram.
    """

    exact = False

    def __init__(self, params: Sequence[nn.Parameter], names: Sequence[str], group_index: Sequence[int],
                 n_groups: int, n_agents: int, sketch: Sketch, group: dist.ProcessGroup | None = None) -> None:
        super().__init__(params, group_index, n_groups, n_agents, group)
        self.names, self.sketch = list(names), sketch
        sizes = np.zeros(n_groups)
        for p, g in zip(self.params, self.group_index):
            sizes[g] += p.numel()
        thresholds = [max(1, round(PRIME * min(1.0, sketch.k / n))) if n else PRIME for n in sizes]
        self._weights = [PRIME / thresholds[g] for g in self.group_index]
        self._coords = []
        for p, name, g in zip(self.params, names, self.group_index):
            coeffs = hash_coefficients(sketch.seed, f"sample\0{name}")
            kept = [lo + torch.nonzero(poly_hash(coeffs, torch.arange(lo, min(lo + CHUNK, p.numel()),
                                                                          device=self.device)) < thresholds[g])[:, 0]
                    for lo in range(0, p.numel(), CHUNK)]
            self._coords.append(torch.cat(kept) if kept else torch.zeros(0, dtype=torch.long, device=self.device))
        self.offsets, self.group_slices, pos = group_layout([len(c) for c in self._coords], group_index, n_groups)
        self.buffer = torch.zeros(n_agents, pos, dtype=self.dtype, device=self.device)

    # the Coordinates protocol
    def coords(self, i: int) -> torch.Tensor:
        return self._coords[i]

    def weight(self, i: int) -> float:
        return self._weights[i]

    def values(self, i: int) -> torch.Tensor:
        return self.buffer[:, self.offsets[i]:self.offsets[i] + len(self._coords[i])]

    # the Store protocol
    def zero(self) -> None:
        self.buffer.zero_()

    def add(self, i: int, agents: Sequence[int], values: torch.Tensor, start: int = 0) -> None:
        c = self._coords[i]
        lo, hi = (int(x) for x in torch.searchsorted(c, torch.tensor([start, start + values.shape[1]],
                                                                    device=c.device)))
        if hi > lo:
            at = self.offsets[i]
            self.buffer[list(agents), at + lo:at + hi] += values[:, c[lo:hi] - start].to(self.device, self.dtype)

    def add_outer(self, i: int, agents: torch.Tensor, G: torch.Tensor, A: torch.Tensor,
                  bias: int | None = None) -> None:
        """Agent k's ``Σ_{t of k} G_t A_tᵀ`` at the sampled coordinates only: O(tokens × sampled)."""
        c = self._coords[i]
        if not len(c):
            return
        rows, cols = c // A.shape[1], c % A.shape[1]
        present = agents.unique().tolist()
        step = max(1, CHUNK // len(c))
        at = self.offsets[i]
        for k in present:
            G_k, A_k = G[agents == k], A[agents == k]
            total = torch.zeros(len(c), dtype=self.dtype, device=self.device)
            for lo in range(0, len(G_k), step):
                g = G_k[lo:lo + step].to(self.device, self.dtype)
                a = A_k[lo:lo + step].to(self.device, self.dtype)
                total += (g[:, rows] * a[:, cols]).sum(0)
            self.buffer[k, at:at + len(c)] += total

    def local_copy(self) -> "SampleStore":
        return SampleStore(self.params, self.names, self.group_index, self.n_groups, self.n_agents, self.sketch)

    def scatter(self, i: int, agents: torch.Tensor, coords: torch.Tensor, values: torch.Tensor) -> None:
        c = self._coords[i]
        if not len(c):
            return
        coords = coords.to(self.device)
        pos = torch.searchsorted(c, coords).clamp_(max=len(c) - 1)
        hit = c[pos] == coords
        index = agents.to(self.device)[hit] * self.buffer.shape[1] + self.offsets[i] + pos[hit]
        self.buffer.view(-1).index_add_(0, index, values.to(self.device, self.dtype)[hit])

    def blocks(self, g: int) -> Iterator[torch.Tensor]:
        for i in range(len(self.params)):
            if self.group_index[i] == g and len(self._coords[i]):
                yield self.values(i) * self._weights[i] ** 0.5

    def norms_sq(self, grads: Iterable[tuple[int, torch.Tensor]]) -> np.ndarray:
        out = np.zeros(self.n_groups)
        for i, grad in grads:
            out[self.group_index[i]] += self._weights[i] * float(
                grad.reshape(-1)[self._coords[i].to(grad.device)].double().square().sum())
        return out

    def _buffers(self) -> list[torch.Tensor]:
        return [self.buffer]


class TeeStore(Store):
    """Hands every contribution to two stores; the Gram is the first one's (the sketch), the second
    (the coordinate sample) is summed over the ranks alongside."""

    def __init__(self, first: Store, second: Store) -> None:
        super().__init__(first.params, first.group_index, first.n_groups, first.n_agents, first.group)
        self.first, self.second = first, second

    def zero(self) -> None:
        self.first.zero()
        self.second.zero()

    def add(self, i: int, agents: Sequence[int], values: torch.Tensor, start: int = 0) -> None:
        self.first.add(i, agents, values, start)
        self.second.add(i, agents, values, start)

    def scatter(self, i: int, agents: torch.Tensor, coords: torch.Tensor, values: torch.Tensor) -> None:
        self.first.scatter(i, agents, coords, values)
        self.second.scatter(i, agents, coords, values)

    def small(self, i: int) -> bool:
        return self.first.small(i)

    def add_outer(self, i: int, agents: torch.Tensor, G: torch.Tensor, A: torch.Tensor,
                  bias: int | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
        if bias is not None:  # folds_bias is False here: callers add the bias themselves
            raise ProbeError("a TeeStore folds no bias into a weight's sketch")
        self.second.add_outer(i, agents, G, A)
        return self.first.add_outer(i, agents, G, A)

    def local_copy(self) -> "TeeStore":
        return TeeStore(self.first.local_copy(), self.second.local_copy())

    def blocks(self, g: int) -> Iterator[torch.Tensor]:
        return self.first.blocks(g)

    def sums(self) -> tuple[np.ndarray, np.ndarray]:
        return self.first.sums()

    def norms_sq(self, grads: Iterable[tuple[int, torch.Tensor]]) -> np.ndarray:
        return self.first.norms_sq(grads)

    def _buffers(self) -> list[torch.Tensor]:
        return self.first._buffers()

    def grams(self) -> np.ndarray:
        if self.group is not None:
            for buffer in self.second._buffers():
                all_reduce_sum_(buffer, self.group)
        return self.first.grams()


# ---------------------------------------------------------------------------------------------
# The attribution


class UpdateAttribution:
    """The probe's update attribution: the store it needs and one tracker per attached optimizer.

    Args:
        probe: the probe (its parameters, agents, roles, sketch, process group).
        store: the store the probe's method has now (None: none yet).
        unit: ``"role"`` or ``"agent"``.

    ``store`` (after construction) is the one the probe's method must use from now on.
    """

    def __init__(self, probe: Probe, store: Store | None, unit: str) -> None:
        self.unit = unit
        units = unit_names(unit, probe.roles, probe.agents)
        owners = probe.agent_roles if unit == "role" else probe.agents
        self.components = (*units, *UPDATE_EXTRAS)
        self.params = list(probe.params)
        K = len(probe.agents)
        self.unit_of_agent = torch.zeros(len(units), K, dtype=torch.float64)  # (U, K) 0/1
        for k, owner in enumerate(owners):
            self.unit_of_agent[units.index(owner), k] = 1.0
        if probe.sketch is not None:
            sample = SampleStore(self.params, probe.param_names, probe.group_index, len(probe.groups), K,
                                 probe.sketch, probe.process_group)
            self.store: Store = TeeStore(store, sample)
            self.coordinates: Coordinates = sample
        else:
            flat = store if isinstance(store, FlatStore) else FlatStore(
                self.params, probe.group_index, len(probe.groups), K, probe.process_group)
            self.store, self.coordinates = flat, AllCoordinates(flat)
        self.trackers: list[AdamTracker] = []
        self.pending: tuple[int, str | None] | None = None  # (step, policy) of the gradients in the store
        self.pending_id = 0
        self.last: UpdateResult | None = None

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        if any(t.optimizer is optimizer for t in self.trackers):
            raise ProbeError("this optimizer is already attached to the probe")
        self.trackers.append(AdamTracker(self, optimizer))

    def begin(self) -> None:
        """A probed step starts: the store is about to be zeroed."""
        self.pending = None
        self.last = None

    def collected(self, result: StepResult) -> None:
        """A probed step ended: its per-agent gradients are in the store (unless non-finite)."""
        self.pending_id += 1
        self.pending = (result.step, result.policy) if result.finite else None

    def close(self) -> None:
        for tracker in self.trackers:
            tracker.close()
        self.trackers = []

    def layout(self) -> str:
        """What the moments are of: the components, and the coordinates followed (all, or the sample's k and seed)."""
        sketch = getattr(self.coordinates, "sketch", None)
        where = "all coordinates" if sketch is None else f"a coordinate sample (k={sketch.k}, seed={sketch.seed})"
        return f"components {list(self.components)} at {where}"

    def state_dict(self) -> list[dict[int | str, Any]]:
        """The per-unit moments of every attached optimizer (attach order), for a checkpoint: per optimizer,
        parameter index → (U + 1, m) moments, and ``"layout"``: :meth:`layout`."""
        return [{"layout": self.layout(), **{i: m.detach().cpu().clone() for i, m in t.moments.items()}}
                for t in self.trackers]

    def load_state_dict(self, state: list[dict[int | str, Any]]) -> None:
        """Restore :meth:`state_dict` into the same optimizers, attached in the same order; ProbeError for a
        state of another layout (unit, sketch), parameter or shape, before anything is restored."""
        if not isinstance(state, (list, tuple)) or not all(isinstance(s, dict) for s in state):
            got = type(state).__name__ if not isinstance(state, (list, tuple)) else \
                f"a {type(state).__name__} holding {next(type(s).__name__ for s in state if not isinstance(s, dict))}"
            raise ProbeError(f"update-attribution state must be a list of dicts, as Probe.update_state() returns, "
                             f"got {got}")
        if len(state) != len(self.trackers):
            raise ProbeError(f"update-attribution state of {len(state)} optimizers for {len(self.trackers)} attached")
        U, layout = len(self.components) - len(UPDATE_EXTRAS), self.layout()
        restored = []
        for moments in state:
            saved = moments.get("layout", layout)  # (states saved before the layout was: shapes checked only)
            if saved != layout:
                raise ProbeError(f"update-attribution state of {saved}; this probe's: {layout}")
            loaded = {}
            for i, m in moments.items():
                if i == "layout":
                    continue
                if not isinstance(i, int) or not 0 <= i < len(self.params):
                    raise ProbeError(f"update-attribution state names parameter {i!r}; the probe has "
                                     f"{len(self.params)} (indices 0..{len(self.params) - 1})")
                coords = self.coordinates.coords(i)
                shape = (U + 1, self.params[i].numel() if coords is None else len(coords))
                if not isinstance(m, torch.Tensor) or tuple(m.shape) != shape:
                    raise ProbeError(f"update-attribution state of parameter {i}: expected a tensor of shape {shape}, "
                                     f"got {tuple(m.shape) if isinstance(m, torch.Tensor) else type(m).__name__}")
                loaded[i] = m.to(self.params[i].device, self.store.dtype)
            restored.append(loaded)
        for tracker, moments in zip(self.trackers, restored):
            tracker.moments = moments


def unit_names(unit: str, roles: Sequence[str], agents: Sequence[str]) -> list[str]:
    """The units updates are split into (``roles`` or ``agents``); ProbeError for an unknown ``unit`` or a unit
    named like one of the extra components (:data:`UPDATE_EXTRAS`)."""
    if unit not in UNITS:
        raise ProbeError(f"update attribution unit must be one of {UNITS}, got {unit!r}")
    units = list(roles if unit == "role" else agents)
    clash = set(units) & set(UPDATE_EXTRAS)
    if clash:
        raise ProbeError(f"a {unit} may not be named {sorted(clash)[0]!r} (an update component's name)")
    return units


def covered_params(optimizer: Any, params: Sequence[torch.nn.Parameter]) -> list[int]:
    """The indices of ``params`` that ``optimizer`` updates; ProbeError unless it is a torch Adam / AdamW
    that updates some of them."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ProbeError(f"update attribution needs a torch optimizer, got {type(optimizer).__name__}")
    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        raise ProbeError(f"update attribution is unavailable for {type(optimizer).__name__}: it follows the "
                         "moments of torch.optim.AdamW / Adam only (their update is linear in the first moment)")
    mine = {id(p) for group in optimizer.param_groups for p in group["params"]}
    covered = [i for i, p in enumerate(params) if id(p) in mine]
    if not covered:
        raise ProbeError("the optimizer updates none of the probed parameters")
    return covered


def _at(t: torch.Tensor, coords: torch.Tensor | None, lo: int, hi: int) -> torch.Tensor:
    """Float64 values of ``t`` flattened, at coordinates ``[lo, hi)`` of the followed ones."""
    flat = t.detach().reshape(-1)
    return (flat[lo:hi] if coords is None else flat[coords[lo:hi].to(flat.device)]).to(torch.float64, copy=True)


class AdamTracker:
    """Per-unit first moments of one Adam/AdamW over the probed parameters it updates, advanced in the
    optimizer's own step hooks."""

    def __init__(self, owner: UpdateAttribution, optimizer: torch.optim.Optimizer) -> None:
        self.covered = covered_params(optimizer, owner.params)
        self.owner, self.optimizer = owner, optimizer
        self.moments: dict[int, torch.Tensor] = {}   # param index → (U + 1, m_i): units, then Adam's L2 term
        self.consumed = 0                             # pending_id of the last probed step used
        self._before: dict[int, tuple[torch.Tensor, float]] = {}
        self._scale = float("nan")
        self._use = False
        self._handles = [optimizer.register_step_pre_hook(self._pre), optimizer.register_step_post_hook(self._post)]

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _hyper(self) -> dict[int, dict]:
        by_id = {id(p): group for group in self.optimizer.param_groups for p in group["params"]}
        return {i: by_id[id(self.owner.params[i])] for i in self.covered}

    def _pre(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        """Before the step: θ and Adam's step count of every parameter about to move, and the factor c."""
        own = self.owner
        mine = {id(p) for group in optimizer.param_groups for p in group["params"]}  # add_param_group since
        self.covered = [i for i, p in enumerate(own.params) if id(p) in mine]
        self._use = own.pending is not None and own.pending_id != self.consumed
        self._before = {}
        if any(own.params[i].grad is not None and own.params[i].grad.is_sparse for i in self.covered):
            return  # Adam refuses sparse gradients in its step, with its own message: no split to make
        dot = norm = 0.0
        for i in self.covered:
            p = own.params[i]
            if p.grad is None:
                continue
            coords = own.coordinates.coords(i)
            state = optimizer.state.get(p, {})
            self._before[i] = (_at(p, coords, 0, p.numel() if coords is None else len(coords)),
                               float(state["step"]) if "step" in state else 0.0)
            if self._use:
                w = own.coordinates.weight(i)
                g = own.coordinates.values(i).double().sum(0)
                dot += w * float(_at(p.grad, coords, 0, len(g)) @ g)
                norm += w * float(g @ g)
        self._scale = dot / norm if norm > 0 else 0.0

    def _post(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        own = self.owner
        C, K = len(own.components), own.unit_of_agent.shape[1]
        U = C - len(UPDATE_EXTRAS)
        gram = torch.zeros(C, C, dtype=torch.float64)
        inter = torch.zeros(C, K, dtype=torch.float64)
        moved = actual_sq = residual_sq = 0.0
        hyper = self._hyper()
        for i, (theta0, step0) in self._before.items():
            p = own.params[i]
            state = optimizer.state.get(p, {})
            if "step" not in state or float(state["step"]) <= step0:
                continue  # Adam skipped this parameter (or the whole step): the moments stay
            moved += 1
            gr, w, coords = hyper[i], own.coordinates.weight(i), own.coordinates.coords(i)
            lr, wd, eps = float(gr["lr"]), float(gr["weight_decay"]), float(gr["eps"])
            beta1, beta2 = (float(b) for b in gr["betas"])
            decoupled = isinstance(optimizer, torch.optim.AdamW) or gr.get("decoupled_weight_decay", False)
            sign = -1.0 if gr.get("maximize", False) else 1.0
            t = float(state["step"])
            step_size, bc2_sqrt = lr / (1 - beta1 ** t), (1 - beta2 ** t) ** 0.5
            v_t = state["max_exp_avg_sq"] if gr.get("amsgrad", False) else state["exp_avg_sq"]
            m_i = len(theta0)
            if i not in self.moments:
                self.moments[i] = torch.zeros(U + 1, m_i, dtype=own.store.dtype, device=p.device)
            mom = self.moments[i]
            G_all = own.coordinates.values(i) if self._use else None
            for lo in range(0, m_i, max(1, CHUNK // (C + K))):
                hi = min(m_i, lo + max(1, CHUNK // (C + K)))
                th0 = theta0[lo:hi]
                mom_c = mom[:, lo:hi]
                mom_c.mul_(beta1)
                G = None
                if G_all is not None:
                    G = G_all[:, lo:hi].double()
                    mom_c[:U] += ((1 - beta1) * sign * self._scale * (own.unit_of_agent.to(G.device) @ G)).to(mom.dtype)
                if not decoupled and wd:
                    mom_c[U] += ((1 - beta1) * wd * th0).to(mom.dtype)  # L2 enters after maximize's sign
                m = _at(state["exp_avg"], coords, lo, hi)
                d = _at(v_t, coords, lo, hi).sqrt() / bc2_sqrt + eps
                parts = mom_c.double()
                unattributed = m - parts.sum(0)
                decay = -lr * wd * th0 if decoupled else -step_size * parts[U] / d
                D = torch.cat([-step_size * parts[:U] / d, (-step_size * unattributed / d)[None], decay[None]])
                delta = _at(p, coords, lo, hi) - th0
                gram += w * (D @ D.T).cpu()
                if G is not None:
                    inter += w * (D @ G.T).cpu()
                actual_sq += w * float(delta @ delta)
                residual_sq += w * float((delta - D.sum(0)).square().sum())
        self._before = {}
        if not moved:
            return
        used = own.pending if self._use else None
        if self._use:
            self.consumed = own.pending_id
        own.last = UpdateResult(
            step=None if used is None else used[0], policy=None if used is None else used[1],
            components=own.components, gram=gram.numpy(),
            interference=inter.numpy() if used is not None else np.full((C, K), np.nan),
            grad_scale=self._scale if used is not None else float("nan"),
            residual=(residual_sq / actual_sq) ** 0.5 if actual_sq > 0 else 0.0 if residual_sq == 0 else float("nan"),
            exact=own.coordinates.exact)
