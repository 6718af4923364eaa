"""Synthetic runs with known ground truth, for validating the detectors in ``analyses``.

Every run is built from per-agent gradient *vectors* (``dim`` dimensions, default 64) and every
stored Gram matrix is ``M = G Gᵀ`` of those vectors, so each is a real Gram (symmetric, PSD,
consistent norms and cosines). A run is specified per training step, per role:

* ``norm[role]`` — the target norm of the role's gradient ``‖g_r‖ = ‖Σ_{k∈r} g_k‖``;
* ``rho[role]`` — the *signal fraction* of the role's agents: agent k's gradient is
  ``s·(√ρ·u_r + √(1−ρ)·ε_k)`` with ``u_r`` a fixed unit direction per role (the role directions are
  orthonormal) and ``ε_k`` fresh isotropic noise of unit expected norm per record. For a role with
  n agents the expected coherence ``AF_r / n`` is ``√(ρ + (1−ρ)/n)``: ``1/√n`` for independent
  agents (ρ = 0; 0.577 for n = 3, 0.5 for n = 4), 1 for identical directions.
  ``s`` is chosen so that ``‖g_r‖`` matches ``norm[role]`` in expectation;
* ``tokens[role]`` — the role's tokens, split evenly (±5 %) over its agents.

Policies: **SP** — one policy ``"shared"``, every agent in every record (roles share one space);
**IP** — one policy per role, named after the role (``"voter"``, ``"aggregator"``): a record of
policy p holds only p's agents (all other entries 0, tokens 0), with several records per training
step (default: 3 for multi-agent roles, 1 otherwise, like verl-style mini-batching).

Layouts: ``VOTING`` (3 voters + aggregator), ``VOTING5`` (4 voters + aggregator: 2 roles,
5 agents), ``PAIR`` (2 voters + aggregator), ``ORCH`` (orchestrator + 3 workers + synthesizer),
``EVALOPT`` (generator + evaluator: one-agent roles only).

Ground truth, per detector (thresholds are the defaults of ``analyses``; cases are planted
clearly on one side of them):

**Amplification** (coherence ≥ 0.75 on ≥ 8 of a 10-step window, with the role's norm rising over
the window or ≥ 2× the other roles' median). Positive (role, onset s0): from s0 on the role's agents
share a direction with ρ ≥ 0.65 (coherence ≥ 0.86 for n ≤ 4), either with its norm growing 3–6 % per
step (``rising``) or flat at 3–5× the other roles (``dominant``); before s0 they are independent.
Negative: independent agents (coherence ≈ 1/√n ≤ 0.58) however much their norm grows;
moderate alignment (coherence ≈ 0.62–0.65) with growing, dominant norm; coherent but with a
shrinking norm that is not dominant (the definition excludes it), also when the norm halves every
25 steps under 10–14 % multiplicative step noise for 150–260 steps (``falling-noisy``: windows whose
noise happens to slope upward must not read as a rising norm); coherent bursts of 3–5 steps,
≥ 12 steps apart (shorter than 80 % of the window); one-agent roles whatever they do.

**Capture** (in a parameter set shared by ≥ 2 roles, one role's contribution share ≥ 0.7 on ≥ 8
of a 10-step window). Positive (role, onset s0, explained_by): SP, all roles balanced (equal norms
and tokens) before s0; from s0 one role's gradient norm is c× the others (share c²/(c²+R−1) ≥ 0.86)
— ``"token count"`` when its tokens grew by the same factor (same per-token gradient magnitude),
``"per-token gradient"`` when its tokens did not. Negative: near-balanced shares (≤ 0.6) with any
token counts; IP runs (no shared set) with one role 5× the others; share spikes of 2–5 steps,
≥ 12 steps apart.

**Cliff** (median-of-3 accuracy drops ≥ max(0.10, 15 % of the running peak) below the running
peak within 5 evaluations of the onset and never recovers to within half the drop). Positive
(onset = the first evaluation of the fall): accuracy rises to a peak, may plateau, then falls by
a depth ≥ max(0.12, 0.15·peak + 0.04) over 1–3 evaluations and stays down for ≥ 6 evaluations to
the end of the run (``terminal``; ``collapse`` falls to ≈ 0). Evaluations every 5–10 steps, noise
sd 0.01–0.02. Negative: dips of 0.15–0.35 that recover to the previous level; single-evaluation
outliers (interior evaluations; see :func:`edge_outlier_accuracy` for the first/last ones);
slow drifts (≤ 0.008 per evaluation, over ≥ 15 evaluations); terminal drops of ≤ 0.05; pure
noise; monotone improvement.

Cases come as :class:`Case` (the series plus its label); :func:`amplification_cases`,
:func:`capture_cases` and :func:`cliff_cases` give ≥ 50 labelled cases each for a few seeds.
:func:`write_run` writes a series to a real run file with :class:`gradscope.runfile.RunWriter`;
``python -m tests.analyses.synthetic slow-writer PATH`` writes one slowly (for kill tests).
"""
from __future__ import annotations

import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import pandas as pd

from gradscope.analyses.series import RunSeries

DIM = 64


# ------------------------------------------------------------------ layouts
@dataclass(frozen=True)
class Layout:
    """Roles and their agent counts, in order."""

    name: str
    roles: tuple[tuple[str, int], ...]

    @property
    def role_names(self) -> list[str]:
        return [r for r, _ in self.roles]

    def n(self, role: str) -> int:
        return dict(self.roles)[role]

    @property
    def agents(self) -> list[str]:
        return [f"{r}{i}" if n > 1 else r for r, n in self.roles for i in range(n)]

    @property
    def agent_roles(self) -> list[str]:
        return [r for r, n in self.roles for _ in range(n)]


VOTING = Layout("voting", (("voter", 3), ("aggregator", 1)))
VOTING5 = Layout("voting5", (("voter", 4), ("aggregator", 1)))
PAIR = Layout("pair", (("voter", 2), ("aggregator", 1)))
ORCH = Layout("orch", (("orchestrator", 1), ("worker", 3), ("synthesizer", 1)))
EVALOPT = Layout("evalopt", (("generator", 1), ("evaluator", 1)))
LAYOUTS = {lay.name: lay for lay in (VOTING, VOTING5, PAIR, ORCH, EVALOPT)}


def coherence_of(rho: float, n: int) -> float:
    """Expected coherence ``AF/n`` of n agents with signal fraction ``rho``."""
    return float(np.sqrt(rho + (1 - rho) / n))


def rho_for(coherence: float, n: int) -> float:
    """Signal fraction giving an expected coherence (inverse of :func:`coherence_of`)."""
    return float((coherence ** 2 - 1 / n) / (1 - 1 / n))


# ------------------------------------------------------------------ the series generator
def _track(value, T: int, default: float) -> np.ndarray:
    return np.broadcast_to(np.asarray(default if value is None else value, dtype=float), (T,)).astype(float)


def make_series(layout: Layout, T: int, *, norm: Mapping[str, object] | None = None,
                rho: Mapping[str, object] | None = None, tokens: Mapping[str, object] | None = None,
                policy: str = "sp", records: Mapping[str, int] | int | None = None, seed: int = 0,
                dim: int = DIM, evals: pd.DataFrame | None = None, metrics: pd.DataFrame | None = None,
                name: str = "", config: dict | None = None, first_step: int = 0) -> RunSeries:
    """A run of ``T`` training steps (``first_step`` .. ``first_step + T − 1``) from per-role tracks.

    ``norm`` / ``rho`` / ``tokens``: role → scalar or (T,) array (defaults 1.0 / 0.0 / 300).
    ``policy``: ``"sp"`` or ``"ip"``. ``records``: records per step (SP: an int, default 1; IP: role →
    count, default 3 for multi-agent roles, 1 otherwise).
    """
    rng = np.random.default_rng(seed)
    roles = layout.role_names
    R, K = len(roles), len(layout.agents)
    norm, rho, tokens = dict(norm or {}), dict(rho or {}), dict(tokens or {})
    unknown = (set(norm) | set(rho) | set(tokens)) - set(roles)
    if unknown:
        raise ValueError(f"unknown roles {sorted(unknown)} for layout {layout.name}")
    N_r = np.stack([_track(norm.get(r), T, 1.0) for r in roles], axis=1)      # (T, R)
    P_r = np.clip(np.stack([_track(rho.get(r), T, 0.0) for r in roles], axis=1), 0.0, 1.0)
    T_r = np.stack([_track(tokens.get(r), T, 300.0) for r in roles], axis=1)
    role_of = np.array([roles.index(r) for r in layout.agent_roles])
    n_of = np.array([layout.n(r) for r in roles], dtype=float)

    # Records: (step index, policy) pairs.
    if policy == "sp":
        m = 1 if records is None else int(records)
        rec_t = np.repeat(np.arange(T), m)
        rec_pol = np.full(len(rec_t), "shared", dtype=object)
        present = np.ones((len(rec_t), K), dtype=bool)
    elif policy == "ip":
        counts = {r: (3 if layout.n(r) >= 2 else 1) for r in roles}
        if isinstance(records, Mapping):
            counts.update(records)
        order = [(r, j) for r in roles for j in range(counts[r])]
        rec_t = np.repeat(np.arange(T), len(order))
        rec_pol = np.array([r for r, _ in order] * T, dtype=object)
        pol_idx = np.array([roles.index(r) for r in rec_pol])
        present = role_of[None, :] == pol_idx[:, None]
    else:
        raise ValueError(f"policy must be 'sp' or 'ip', got {policy!r}")
    N = len(rec_t)

    # Orthonormal role directions; agent vectors s·(√ρ u_r + √(1−ρ) ε_k).
    U = np.linalg.qr(rng.normal(size=(dim, R)))[0].T                          # (R, dim)
    rho_k = P_r[rec_t][:, role_of]                                             # (N, K)
    n_k = n_of[role_of]
    s_k = N_r[rec_t][:, role_of] / np.sqrt(n_k ** 2 * rho_k + n_k * (1 - rho_k))
    eps = rng.normal(size=(N, K, dim)) / np.sqrt(dim)
    G = s_k[..., None] * (np.sqrt(rho_k)[..., None] * U[role_of][None] + np.sqrt(1 - rho_k)[..., None] * eps)
    G *= present[..., None]
    gram = np.ascontiguousarray(np.einsum("nkd,nld->nkl", G, G))

    tok = T_r[rec_t][:, role_of] / n_k * (1 + 0.05 * rng.standard_normal((N, K)))
    tok = np.maximum(np.rint(tok), 0) * present

    return RunSeries(agents=layout.agents, agent_roles=layout.agent_roles, gram=gram,
                     record_step=(rec_t + first_step).astype(np.int64),
                     record_policy=np.asarray(rec_pol, dtype=str), tokens=tok.astype(np.int64),
                     evals=evals if evals is not None else pd.DataFrame(),
                     metrics=metrics if metrics is not None else pd.DataFrame(),
                     config=dict(config or {"workflow": layout.name, "policy": policy}), name=name)


def eval_frame(steps, accuracy, **columns) -> pd.DataFrame:
    """A wide evaluation table as ``RunSeries.evals`` holds it (index = step)."""
    data = {"accuracy": np.asarray(accuracy, dtype=float)}
    data.update({k.replace("__", "/"): np.asarray(v, dtype=float) for k, v in columns.items()})
    return pd.DataFrame(data, index=pd.Index(np.asarray(steps, dtype=np.int64), name="step"))


def with_evals(series: RunSeries, evals: pd.DataFrame) -> RunSeries:
    """A copy of ``series`` with another evaluation table."""
    return RunSeries(agents=series.agents, agent_roles=series.agent_roles, gram=series.gram,
                     record_step=series.record_step, record_policy=series.record_policy,
                     tokens=series.tokens, evals=evals, metrics=series.metrics, config=series.config,
                     name=series.name)


# ------------------------------------------------------------------ labelled cases
@dataclass
class Case:
    """A synthetic run and its ground truth for one detector.

    ``positive``: the detector should fire; then ``role`` (amplification, capture), ``onset`` (the
    planted onset step), ``explained_by`` (capture) and ``tolerance`` (steps) say what it should
    report.
    """

    detector: str
    family: str
    seed: int
    series: RunSeries
    positive: bool
    role: str | None = None
    onset: int | None = None
    explained_by: str | None = None
    tolerance: int = 10

    @property
    def label(self) -> str:
        return f"{self.detector}/{self.family}/seed{self.seed}"


def _onset_track(T: int, s0: int, before, after) -> np.ndarray:
    """``before`` for t < s0, ``after(t − s0)`` from s0 on (both may be scalars)."""
    t = np.arange(T, dtype=float)
    a = after(t - s0) if callable(after) else np.full(T, float(after))
    return np.where(t < s0, before, a)


def _bursts(T: int, rng: np.random.Generator, length: tuple[int, int], gap: int) -> np.ndarray:
    """(T,) bool: bursts of ``length`` steps, separated by at least ``gap`` steps."""
    out = np.zeros(T, dtype=bool)
    t = int(rng.integers(gap // 2, gap))
    while t < T - length[1]:
        L = int(rng.integers(length[0], length[1] + 1))
        out[t:t + L] = True
        t += L + gap + int(rng.integers(0, 6))
    return out


# --- amplification
def amplification_case(family: str, seed: int) -> Case:
    """One amplification case (see the module docstring for each family's ground truth)."""
    rng = np.random.default_rng([1, seed, zlib_hash(family)])
    T = int(rng.integers(60, 110))
    s0 = int(rng.integers(15, T - 30))
    kind, _, variant = family.partition("/")
    layout = {"voting": VOTING, "voting-ip": VOTING, "voting5": VOTING5, "pair-ip": PAIR, "orch": ORCH,
              "evalopt": EVALOPT}[variant]
    policy = "ip" if variant.endswith("-ip") else "sp"
    role = "worker" if layout is ORCH else "voter" if layout is not EVALOPT else "generator"
    n = layout.n(role)
    others = [r for r in layout.role_names if r != role]
    norm: dict[str, object] = {r: 1.0 for r in others}
    rho: dict[str, object] = {r: 0.0 for r in layout.role_names}
    growth = float(rng.uniform(0.03, 0.06))
    positive, onset = False, None
    if kind == "rising":          # coherent from s0, norm growing from s0
        rho1 = float(rng.uniform(0.65, 0.8))
        rho[role] = _onset_track(T, s0, 0.0, lambda d: rho1 + (0.95 - rho1) * np.minimum(d / 20, 1))
        norm[role] = _onset_track(T, s0, 1.0, lambda d: np.exp(growth * d))
        positive, onset = True, s0
    elif kind == "dominant":      # coherent from s0, flat norm 3-5x the other roles
        rho[role] = _onset_track(T, s0, 0.0, float(rng.uniform(0.7, 0.9)))
        norm[role] = float(rng.uniform(3, 5))
        positive, onset = True, s0
    elif kind == "noise":         # independent agents, norm growing to dominance
        norm[role] = _onset_track(T, s0, 1.0, lambda d: np.exp(growth * d))
    elif kind == "moderate":      # coherence ~0.62-0.65, growing and dominant
        rho[role] = rho_for(float(rng.uniform(0.62, 0.65)), n)
        norm[role] = _onset_track(T, s0, 2.5, lambda d: 2.5 * np.exp(growth * d))
    elif kind == "shrinking":     # coherent from s0, shrinking norm, other roles alike
        rho[role] = _onset_track(T, s0, 0.0, float(rng.uniform(0.7, 0.9)))
        track = _onset_track(T, s0, 1.0, lambda d: np.exp(-growth * d))
        norm[role] = track
        norm.update({r: track * float(rng.uniform(0.8, 1.2)) for r in others})
    elif kind == "shrinking-all":  # coherent throughout, shrinking
        rho[role] = float(rng.uniform(0.7, 0.9))
        track = np.exp(-growth * np.arange(T))
        norm[role] = track
        norm.update({r: track * float(rng.uniform(0.8, 1.2)) for r in others})
    elif kind == "falling-noisy":  # coherent throughout, norm halving every 25 steps, 10-14% step noise
        T = int(rng.integers(150, 260))
        rho[role] = float(rng.uniform(0.7, 0.9))
        fall = 0.5 ** (np.arange(T) / 25)
        sd = float(rng.uniform(0.10, 0.14))
        norm[role] = fall * np.maximum(1 + sd * rng.standard_normal(T), 0.05)
        norm.update({r: fall * float(rng.uniform(0.8, 1.2)) * np.maximum(1 + sd * rng.standard_normal(T), 0.05)
                     for r in others})
    elif kind == "burst":         # coherent bursts of 3-5 steps, rising norm
        burst = _bursts(T, rng, (3, 5), 12)
        rho[role] = np.where(burst, 0.9, 0.0)
        norm[role] = np.exp(0.02 * np.arange(T)) * np.where(burst, 2.0, 1.0)
    elif kind == "single":        # one-agent role, aligned over time and growing 10x
        rho[role] = 0.9
        norm[role] = _onset_track(T, s0, 1.0, lambda d: np.minimum(np.exp(0.1 * d), 10.0))
    else:
        raise ValueError(family)
    series = make_series(layout, T, norm=norm, rho=rho, policy=policy, seed=seed,
                         name=f"amplification/{family}/{seed}")
    return Case("amplification", family, seed, series, positive, role if positive else None, onset, None, 10)


AMPLIFICATION_FAMILIES = (
    # positives
    "rising/voting", "rising/voting-ip", "rising/voting5", "rising/orch", "rising/pair-ip",
    "dominant/voting", "dominant/voting-ip", "dominant/orch",
    # negatives
    "noise/voting", "noise/voting-ip", "noise/voting5", "noise/orch",
    "moderate/voting", "moderate/voting-ip",
    "shrinking/voting", "shrinking/voting-ip", "shrinking-all/voting", "shrinking-all/orch",
    "falling-noisy/voting", "falling-noisy/voting-ip", "falling-noisy/pair-ip", "falling-noisy/orch",
    "burst/voting", "burst/voting-ip",
    "single/evalopt",
)


def amplification_cases(seeds=range(5)) -> list[Case]:
    return [amplification_case(f, s) for s in seeds for f in AMPLIFICATION_FAMILIES]


# --- capture
def capture_case(family: str, seed: int) -> Case:
    """One capture case (see the module docstring for each family's ground truth)."""
    rng = np.random.default_rng([2, seed, zlib_hash(family)])
    T = int(rng.integers(60, 110))
    s0 = int(rng.integers(15, T - 30))
    kind, _, variant = family.partition("/")
    layout = {"voting": VOTING, "voting-agg": VOTING, "orch": ORCH, "orch-worker": ORCH, "evalopt": EVALOPT,
              "voting5": VOTING5, "voting-ip": VOTING}[variant]
    policy = "ip" if variant.endswith("-ip") else "sp"
    role = {"voting": "voter", "voting-agg": "aggregator", "orch": "synthesizer", "orch-worker": "worker",
            "evalopt": "generator", "voting5": "aggregator", "voting-ip": "aggregator"}[variant]
    R = len(layout.roles)
    # c such that the share c²/(c²+R−1) is clearly above 0.7 (0.86-0.94)
    c = float(rng.uniform(2.5, 4.0)) if R == 2 else float(rng.uniform(3.5, 5.0))
    norm: dict[str, object] = {r: 1.0 for r in layout.role_names}
    tokens: dict[str, object] = {r: 300.0 for r in layout.role_names}
    rho = {r: float(rng.uniform(0.0, 0.3)) for r in layout.role_names}
    positive, onset, explained = False, None, None
    if kind == "tokens":        # more tokens, same per-token gradient: the token-count confound
        norm[role] = _onset_track(T, s0, 1.0, c)
        tokens[role] = _onset_track(T, s0, 300.0, 300.0 * c)
        positive, onset, explained = True, s0, "token count"
    elif kind == "per-token":   # same tokens, bigger gradient
        norm[role] = _onset_track(T, s0, 1.0, c)
        positive, onset, explained = True, s0, "per-token gradient"
    elif kind == "balanced":    # shares <= 0.6 whatever the token counts
        top = float(rng.uniform(1.0, 1.2)) if R == 2 else float(rng.uniform(1.0, 1.5))
        norm[role] = _onset_track(T, s0, 1.0, top)
        tokens[role] = _onset_track(T, s0, 300.0, 300.0 * float(rng.uniform(1, 4)))
    elif kind == "ip":          # no shared set: one role 5x in norm and tokens
        norm[role] = _onset_track(T, s0, 1.0, 5.0)
        tokens[role] = _onset_track(T, s0, 300.0, 1500.0)
    elif kind == "spikes":      # share spikes of 2-5 steps
        spikes = _bursts(T, rng, (2, 5), 12)
        norm[role] = np.where(spikes, c, 1.0)
        tokens[role] = np.where(spikes, 300.0 * c, 300.0) if rng.uniform() < 0.5 else 300.0
    else:
        raise ValueError(family)
    series = make_series(layout, T, norm=norm, rho=rho, tokens=tokens, policy=policy, seed=seed,
                         records=int(rng.integers(1, 3)) if policy == "sp" else None,
                         name=f"capture/{family}/{seed}")
    return Case("capture", family, seed, series, positive, role if positive else None, onset, explained, 10)


CAPTURE_FAMILIES = (
    "tokens/voting", "tokens/voting-agg", "tokens/orch", "tokens/orch-worker", "tokens/evalopt",
    "per-token/voting", "per-token/voting-agg", "per-token/orch", "per-token/evalopt", "per-token/voting5",
    "balanced/voting", "balanced/voting-agg", "balanced/orch", "balanced/evalopt",
    "ip/voting-ip",
    "spikes/voting-agg", "spikes/orch", "spikes/evalopt",
)


def capture_cases(seeds=range(4)) -> list[Case]:
    return [capture_case(f, s) for s in seeds for f in CAPTURE_FAMILIES]


# --- cliffs
def _rise(E: int, base: float, peak: float, e_peak: int) -> np.ndarray:
    """Concave rise from ``base`` to ``peak`` at evaluation ``e_peak``, flat after."""
    x = np.clip(np.arange(E) / max(e_peak, 1), 0, 1)
    return base + (peak - base) * (1 - (1 - x) ** 2)


def cliff_accuracy(family: str, rng: np.random.Generator) -> tuple[np.ndarray, int, int | None]:
    """(accuracy at each evaluation, evaluation interval in steps, planted onset evaluation or None)."""
    E = int(rng.integers(30, 81))
    interval = int(rng.integers(5, 11))
    sd = float(rng.uniform(0.01, 0.02))
    base, peak = float(rng.uniform(0.2, 0.4)), float(rng.uniform(0.45, 0.7))
    onset = None
    if family in ("terminal", "collapse", "terminal-rising"):
        f = int(rng.integers(1, 4))                       # evaluations the fall takes
        e0 = int(rng.integers(max(8, int(0.3 * E)), E - f - 6 + 1))
        e_peak = int(rng.integers(4, e0 + 1)) if family != "terminal-rising" else e0
        depth = peak - 0.02 if family == "collapse" else \
            float(rng.uniform(max(0.12, 0.15 * peak + 0.04), min(0.5, peak - 0.05)))
        curve = _rise(E, base, peak, e_peak)
        level = curve[e0 - 1]
        fall = level - depth * np.minimum((np.arange(E) - e0 + 1) / f, 1.0)
        curve = np.where(np.arange(E) >= e0, fall, curve)
        if family == "terminal" and rng.uniform() < 0.5:  # drifting further down after the cliff
            curve = curve - np.where(np.arange(E) >= e0 + f, 0.002 * (np.arange(E) - e0 - f), 0)
        onset = e0
    elif family == "dip":
        e_peak = int(rng.integers(4, E // 3))
        d = int(rng.integers(e_peak + 2, E - 18))          # dip start
        fall, hold, back = int(rng.integers(1, 3)), int(rng.integers(1, 5)), int(rng.integers(1, 3))
        depth = float(rng.uniform(0.15, 0.35))
        curve = _rise(E, base, peak, e_peak)
        t = np.arange(E)
        shape = np.interp(t, [d - 1, d - 1 + fall, d - 1 + fall + hold, d - 1 + fall + hold + back],
                          [0, depth, depth, 0], left=0, right=0)
        curve = curve - shape
    elif family == "outlier":
        curve = _rise(E, base, peak, int(rng.integers(4, E)))
        for _ in range(int(rng.integers(1, 3))):
            j = int(rng.integers(2, E - 2))
            curve[j] += -float(rng.uniform(0.2, 0.4)) if rng.uniform() < 0.7 else float(rng.uniform(0.2, 0.3))
    elif family == "drift":
        rate = float(rng.uniform(0.005, 0.008))
        n = int(max(15, np.ceil(float(rng.uniform(0.12, 0.3)) / rate)))
        E = max(E, n + 12)
        e_peak = int(rng.integers(4, E - n))
        curve = _rise(E, base, peak, e_peak)
        curve = curve - rate * np.clip(np.arange(E) - e_peak, 0, n)
        sd = float(rng.uniform(0.01, 0.015))
    elif family == "shallow":
        curve = _rise(E, base, peak, int(rng.integers(4, E // 2)))
        e0 = int(rng.integers(E // 2, E - 5))
        curve = curve - np.where(np.arange(E) >= e0, float(rng.uniform(0.03, 0.05)), 0.0)
    elif family == "noise":
        curve = np.full(E, float(rng.uniform(0.25, 0.65)))
    elif family == "improving":
        curve = _rise(E, base, peak, int(rng.integers(E // 2, E + 1)))
    else:
        raise ValueError(family)
    acc = np.clip(curve + sd * rng.standard_normal(len(curve)), 0.0, 1.0)
    return acc, interval, onset


_BLAND: dict[tuple[int, int], RunSeries] = {}


def bland_series(T: int, seed: int = 0) -> RunSeries:
    """Voting/SP gradients without any pathology (independent voters, balanced shares), T steps."""
    key = (T, seed)
    if key not in _BLAND:
        _BLAND[key] = make_series(VOTING, T, seed=seed, dim=16)
    return _BLAND[key]


def cliff_case(family: str, seed: int) -> Case:
    """One cliff case (see the module docstring for each family's ground truth)."""
    rng = np.random.default_rng([3, seed, zlib_hash(family)])
    acc, interval, e0 = cliff_accuracy(family, rng)
    steps = interval * np.arange(len(acc))
    series = with_evals(bland_series(int(steps[-1]) + 1), eval_frame(steps, acc))
    series.name = f"cliff/{family}/{seed}"
    positive = e0 is not None
    return Case("cliff", family, seed, series, positive, None, int(steps[e0]) if positive else None, None,
                2 * interval)


CLIFF_POSITIVE = ("terminal", "terminal-rising", "collapse")
CLIFF_NEGATIVE = ("dip", "outlier", "drift", "shallow", "noise", "improving")


def cliff_cases(seeds=range(12)) -> list[Case]:
    fams = CLIFF_POSITIVE + CLIFF_NEGATIVE
    return [cliff_case(f, s) for s in seeds for f in fams]


def edge_outlier_accuracy(where: str, seed: int = 0) -> pd.Series:
    """A healthy, improving accuracy series with one bad evaluation at the ``"first"`` (spuriously
    high) or ``"last"`` (spuriously low) position. Ground truth: no cliff (a single outlier)."""
    rng = np.random.default_rng([4, seed])
    E = 40
    acc = np.clip(_rise(E, 0.3, 0.55, 30) + 0.01 * rng.standard_normal(E), 0, 1)
    if where == "first":
        acc[0] = 0.9
    else:
        acc[-1] = 0.1
    return pd.Series(acc, index=pd.Index(10 * np.arange(E), name="step"))


# --- lead indicators
def lead_case(k: int, seed: int = 0, *, shape: str = "rising", jump: float = 10.0,
              role: str = "aggregator", policy: str = "sp") -> tuple[RunSeries, int]:
    """A Voting run whose cliff (onset step S, evaluations every 10 steps) is preceded by ``role``'s
    gradient norm jumping ``jump``× at step S − k and staying there; everything else stays flat.

    ``shape``: ``"rising"`` — accuracy rises slowly up to the evaluation before the onset;
    ``"plateau"`` — accuracy is flat (noise 0.01) for 80 steps before the onset.
    Returns (series, S).
    """
    rng = np.random.default_rng([5, seed, k])
    T, S, interval = 300, 200, 10
    steps = np.arange(0, T, interval)
    if shape == "rising":
        acc = 0.3 + 0.3 * steps / S + 0.002 * rng.standard_normal(len(steps))
    else:
        acc = np.minimum(0.3 + 0.3 * steps / (S - 80), 0.6) + 0.01 * rng.standard_normal(len(steps))
    acc = np.where(steps >= S, 0.25 + 0.01 * rng.standard_normal(len(steps)), acc)
    norm = {role: np.where(np.arange(T) >= S - k, jump, 1.0)}
    series = make_series(VOTING, T, norm=norm, policy=policy, seed=seed, evals=eval_frame(steps, acc),
                         name=f"lead/{shape}/k{k}")
    return series, S


# ------------------------------------------------------------------ run files
def write_run(series: RunSeries, path, *, flush_every: int = 100, close: bool = True,
              on_open: Callable[[], None] | None = None, on_commit: Callable[[int], None] | None = None,
              sleep_s: float = 0.0):
    """Write ``series`` to a run file with ``RunWriter`` (evaluations and metrics at their steps).

    Records are logged in order; the evaluations of a step after its last record (those of steps
    without records at the end). ``close=False`` returns the open writer instead of closing it.
    ``on_open()`` is called once the file exists (in SWMR mode), ``on_commit(n)`` whenever the
    committed record count advances; ``sleep_s`` is slept after each record (for kill tests).
    """
    from gradscope.runfile import RunMeta, RunWriter

    policies = [p for p in dict.fromkeys(series.record_policy.tolist()) if p]
    meta = RunMeta(agents=series.agents, agent_roles=series.agent_roles, policies=policies,
                   config=series.config, scalar_names=["loss"])
    evals = {int(s): {k: float(v) for k, v in row.items() if np.isfinite(v) or k == "accuracy"}
             for s, row in series.evals.iterrows()} if not series.evals.empty else {}
    metrics = {int(s): {k: float(v) for k, v in row.items() if np.isfinite(v)}
               for s, row in series.metrics.iterrows()} if not series.metrics.empty else {}
    w = RunWriter(path, meta, flush_every=flush_every, overwrite=True)
    if on_open is not None:
        on_open()
    steps = series.record_step
    last_of_step = np.r_[steps[1:] != steps[:-1], True]
    reported = 0
    # Evaluations of steps before the first record (e.g. the base evaluation at step 0).
    first = int(steps[0]) if len(steps) else None
    for s in sorted(evals):
        if first is None or s < first:
            w.log_eval(s, evals.pop(s))
    for i in range(len(steps)):
        s = int(steps[i])
        w.log_step(s, series.gram[i], series.tokens[i], policy=series.record_policy[i] or None,
                   scalars={"loss": float(i)})
        if last_of_step[i]:
            if s in evals:
                w.log_eval(s, evals.pop(s))
            if s in metrics:
                w.log_metrics(s, metrics.pop(s))
        if on_commit is not None and w.n_committed != reported:
            reported = w.n_committed
            on_commit(reported)
        if sleep_s:
            time.sleep(sleep_s)
    for s in sorted(evals):
        w.log_eval(s, evals[s])
    for s in sorted(metrics):
        w.log_metrics(s, metrics[s])
    if not close:
        return w
    w.close()
    return None


def cliff_run(seed: int = 0, *, cliff: bool = True, T: int = 200, policy: str = "sp") -> RunSeries:
    """A Voting run with evaluations every 10 steps: a planted terminal cliff at step 120 preceded
    by the aggregator's norm jumping 10× at step 115 (``cliff=True``), or a healthy run."""
    rng = np.random.default_rng([6, seed])
    steps = np.arange(0, T + 1, 10)
    acc = 0.3 + 0.25 * np.minimum(steps / 100, 1) + 0.01 * rng.standard_normal(len(steps))
    if cliff:
        acc = np.where(steps >= 120, 0.15 + 0.01 * rng.standard_normal(len(steps)), acc)
    norm = {"aggregator": np.where(np.arange(1, T + 1) >= 115, 10.0, 1.0)} if cliff else {}
    lengths = {"length/voter": 100 + 5 * rng.standard_normal(len(steps)),
               "length/aggregator": np.where(steps >= 120, 90.0, 20.0) if cliff else np.full(len(steps), 20.0)}
    evals = eval_frame(steps, acc, **{k.replace("/", "__"): v for k, v in lengths.items()})
    return make_series(VOTING, T, norm=norm, policy=policy, seed=seed, evals=evals, first_step=1,
                       name="cliff" if cliff else "healthy",
                       config={"workflow": "voting", "policy": policy, "task": "math", "model": "synthetic"})


def zlib_hash(text: str) -> int:
    """A stable (not salted) hash of a string, for seeding."""
    import zlib

    return zlib.crc32(text.encode())


# ------------------------------------------------------------------ slow writer (kill tests)
def _slow_writer(path: str, sleep_s: float = 0.01) -> None:
    """Write :func:`cliff_run` slowly (flush every 5 records, ``sleep_s`` per record), printing
    ``ready`` once the file exists, ``committed <n>`` as records are committed, ``done`` at the end."""
    series = cliff_run(0)
    write_run(series, path, flush_every=5, sleep_s=sleep_s, on_open=lambda: print("ready", flush=True),
              on_commit=lambda n: print(f"committed {n}", flush=True))
    print("done", flush=True)


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "slow-writer":
        _slow_writer(sys.argv[2], float(sys.argv[3]) if len(sys.argv) > 3 else 0.01)
    else:
        print("usage: python -m tests.analyses.synthetic slow-writer PATH [SLEEP_S]", file=sys.stderr)
        sys.exit(2)
