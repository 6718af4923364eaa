"""Statistics of a training step, derived from its per-agent gradient Gram matrix.

The run file stores only ``M`` (``M_kl = <g_k, g_l>``, K x K per logged step) and the agent->role
map, so every statistic here is a pure function of them and new ones apply to old runs.

Conventions shared by every function (formulas and a table of degenerate values: docs/metrics.md):

* ``M`` has shape ``(..., K, K)``, batched over any leading dims; outputs are float64 arrays whose
  leading dims are ``M.shape[:-2]`` (broadcast with those of ``tokens`` / ``batch_size``).
* ``P`` is the (K, R) one-hot agent->role indicator from :func:`role_indicator`.
* A step whose ``M`` (or ``tokens`` / ``batch_size``, where used) holds any NaN or +-inf gets NaN
  for every output of that step; other steps of a stack are unaffected.
* Degenerate cases (zero vectors, zero total, no tokens, roles without peers) have defined values
  and raise no floating-point warnings: bad steps are zeroed before any arithmetic and every
  division is masked, which is why no ``np.errstate`` is needed.

Update attribution (``gradscope.probe.updates``) stores, per optimizer step, the Gram ``U`` of the
update's C components (units — roles or agents — then :data:`UPDATE_EXTRAS`) and the interference
matrix ``I`` (C x K, ``I_al = <Δθ_a, g_l>``). The same functions apply to ``U`` with the component
indicator of :func:`update_indicator` in place of ``P``; :func:`derive_updates` names the columns.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.typing import ArrayLike

__all__ = [
    "UPDATE_EXTRAS",
    "agent_norms",
    "amplification_factor",
    "coherence",
    "contribution_shares",
    "cosine",
    "derive",
    "derive_updates",
    "finite_mask",
    "interference",
    "mass_shares",
    "noise_scale",
    "norm_shares",
    "per_token_shares",
    "role_gram",
    "role_indicator",
    "role_norms",
    "signal_fraction",
    "token_shares",
    "total_norm",
    "update_indicator",
]

#: The update components after the units: the part of Adam's first moment that no probed step
#: explains, and the weight-decay term.
UPDATE_EXTRAS = ("unattributed", "weight_decay")

# Relative to the summed squared role norms, a smaller total means the roles cancel to rounding
# error; shares of such a step would be ratios of noise.
_ZERO_TOTAL_RTOL = 1e-12


# ---------------------------------------------------------------------------------------------
# Input handling


def _gram(M: ArrayLike) -> np.ndarray:
    M = np.asarray(M, dtype=np.float64)
    if M.ndim < 2 or M.shape[-1] != M.shape[-2]:
        raise ValueError(f"M must be square in its last two dims, (..., K, K); got {M.shape}")
    return M


def _indicator(P: ArrayLike, K: int | None) -> np.ndarray:
    """Validated P; ``K`` is the agent count it must match (None: P itself defines K)."""
    P = np.asarray(P, dtype=np.float64)
    if P.ndim != 2:
        raise ValueError(f"P must be a 2-D (K, R) agent->role indicator; got shape {P.shape}")
    if K is not None and P.shape[0] != K:
        raise ValueError(f"P must have shape (K, R) with K = {K} (from M); got {P.shape}")
    if not (np.isin(P, (0.0, 1.0)).all() and (P.sum(axis=1) == 1.0).all()):
        raise ValueError("P must be a one-hot agent->role indicator: 0/1 entries, one 1 per row")
    return P


def _clean(M: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Zero the steps holding non-finite entries (so they cannot warn) and return them as a mask."""
    ok = np.asarray(np.isfinite(M).all(axis=(-2, -1)))
    return np.where(ok[..., None, None], M, 0.0), ok


def _tokens(tokens: ArrayLike, K: int) -> tuple[np.ndarray, np.ndarray]:
    t = np.asarray(tokens, dtype=np.float64)
    if t.ndim < 1 or t.shape[-1] != K:
        raise ValueError(f"tokens must have shape (..., K) with K = {K}; got {t.shape}")
    ok = np.asarray(np.isfinite(t).all(axis=-1))
    t = np.where(ok[..., None], t, 0.0)
    if (t < 0).any():
        raise ValueError("token counts must be >= 0")
    return t, ok


def _prepare(M: ArrayLike, P: ArrayLike) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    M = _gram(M)
    P = _indicator(P, M.shape[-1])
    Mc, ok = _clean(M)
    return Mc, P, ok


def _nan_where_bad(x: np.ndarray, ok: np.ndarray, trailing: int) -> np.ndarray:
    ok = np.asarray(ok)
    return np.where(ok.reshape(ok.shape + (1,) * trailing), x, np.nan)


def _div(num: np.ndarray, den: np.ndarray, where: np.ndarray, fill: float = 0.0) -> np.ndarray:
    """``num / den`` where ``where`` holds, else ``fill``; masked entries are never evaluated."""
    num, den, where = np.broadcast_arrays(num, den, where)
    return np.divide(num, den, out=np.full(num.shape, fill), where=where)


# ---------------------------------------------------------------------------------------------
# Kernels on clean (finite) arrays


def _diag(M: np.ndarray) -> np.ndarray:
    return np.diagonal(M, axis1=-2, axis2=-1)


def _sqrt_diag(M: np.ndarray) -> np.ndarray:
    # A Gram diagonal is >= 0; negative values are rounding from summed per-layer products.
    return np.sqrt(np.maximum(_diag(M), 0.0))


def _role_gram(M: np.ndarray, P: np.ndarray) -> np.ndarray:
    return P.T @ M @ P


def _cosine(M: np.ndarray) -> np.ndarray:
    d = _sqrt_diag(M)
    den = d[..., :, None] * d[..., None, :]
    c = np.clip(_div(M, den, den > 0), -1.0, 1.0)
    # Set the diagonal exactly: M_kk / (sqrt(M_kk))^2 may round to 1 +- eps.
    eye = np.eye(M.shape[-1], dtype=bool)
    return np.where(eye, (d[..., :, None] > 0).astype(np.float64), c)


def _contribution(MR: np.ndarray) -> np.ndarray:
    tot = MR.sum(axis=(-2, -1))
    nonzero = tot > np.maximum(_ZERO_TOTAL_RTOL * _diag(MR).sum(axis=-1), 0.0)
    return _div(MR.sum(axis=-1), tot[..., None], nonzero[..., None])


def _normalise(x: np.ndarray) -> np.ndarray:
    """Fractions of the last axis' total; all 0 when the total is 0."""
    s = x.sum(axis=-1, keepdims=True)
    return _div(x, s, s > 0)


def _amplification(M: np.ndarray, P: np.ndarray) -> np.ndarray:
    n = P.sum(axis=0)
    summed_agent_norms = _sqrt_diag(M) @ P
    af = _div(n * _sqrt_diag(_role_gram(M, P)), summed_agent_norms, summed_agent_norms > 0)
    return np.where(n >= 2, af, np.nan)


def _block_means(M: np.ndarray, P: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per role: agent count, mean diagonal and mean off-diagonal entry of the role's block of M."""
    n = P.sum(axis=0)
    diag_sum = _diag(M) @ P
    block_sum = _diag(_role_gram(M, P))
    diag = _div(diag_sum, n, n > 0)
    off = _div(block_sum - diag_sum, n * (n - 1), n >= 2)
    return n, diag, off


# ---------------------------------------------------------------------------------------------
# Public API


def role_indicator(
    agent_roles: Sequence[str], roles: Sequence[str] | None = None
) -> tuple[np.ndarray, list[str]]:
    """One-hot agent->role indicator ``P`` of shape (K, R) and the role names (column order).

    ``roles`` defaults to the order of first appearance in ``agent_roles``; a given ``roles`` may
    list roles no agent has (an all-zero column).
    """
    if roles is None:
        roles = list(dict.fromkeys(agent_roles))
    else:
        roles = list(roles)
        if len(set(roles)) != len(roles):
            raise ValueError(f"duplicate role names in {roles}")
    column = {r: j for j, r in enumerate(roles)}
    P = np.zeros((len(agent_roles), len(roles)), dtype=np.float64)
    for k, r in enumerate(agent_roles):
        if r not in column:
            raise ValueError(f"agent {k} has role {r!r}, which is not in roles {roles}")
        P[k, column[r]] = 1.0
    return P, roles


def finite_mask(M: ArrayLike) -> np.ndarray:
    """(...) bool: True for steps whose K x K matrix is entirely finite."""
    return np.asarray(np.isfinite(_gram(M)).all(axis=(-2, -1)))


def role_gram(M: ArrayLike, P: ArrayLike) -> np.ndarray:
    """(..., R, R) role Gram ``M^R = P^T M P``: inner products of the per-role gradients."""
    Mc, P, ok = _prepare(M, P)
    return _nan_where_bad(_role_gram(Mc, P), ok, 2)


def agent_norms(M: ArrayLike) -> np.ndarray:
    """(..., K) per-agent gradient norms ``sqrt(M_kk)``."""
    Mc, ok = _clean(_gram(M))
    return _nan_where_bad(_sqrt_diag(Mc), ok, 1)


def role_norms(M: ArrayLike, P: ArrayLike) -> np.ndarray:
    """(..., R) per-role gradient norms ``||g_r|| = sqrt(M^R_rr)``."""
    Mc, P, ok = _prepare(M, P)
    return _nan_where_bad(_sqrt_diag(_role_gram(Mc, P)), ok, 1)


def total_norm(M: ArrayLike) -> np.ndarray:
    """(...) norm of the step's total gradient ``sqrt(sum M)``."""
    Mc, ok = _clean(_gram(M))
    return _nan_where_bad(np.sqrt(np.maximum(Mc.sum(axis=(-2, -1)), 0.0)), ok, 0)


def cosine(M: ArrayLike) -> np.ndarray:
    """(..., K, K) cosines ``M_kl / sqrt(M_kk M_ll)`` in [-1, 1]; pass a role Gram for role cosines.

    Cosine with a zero vector is 0; the diagonal is 1 for a non-zero vector and 0 for a zero one.
    """
    Mc, ok = _clean(_gram(M))
    return _nan_where_bad(_cosine(Mc), ok, 2)


def contribution_shares(M: ArrayLike, P: ArrayLike) -> np.ndarray:
    """(..., R) signed shares ``s_r = <g_r, g> / ||g||^2 = sum_l M^R_rl / sum M^R``; sum to 1.

    Negative: the role pulls against the step. All 0 when the total gradient is zero
    (``sum M^R <= 0`` or ``<= 1e-12 * sum_r M^R_rr``).
    """
    Mc, P, ok = _prepare(M, P)
    return _nan_where_bad(_contribution(_role_gram(Mc, P)), ok, 1)


def mass_shares(M: ArrayLike, P: ArrayLike) -> np.ndarray:
    """(..., R) gradient-mass shares ``||g_r|| / sum_s ||g_s||``; all 0 if every role norm is 0."""
    Mc, P, ok = _prepare(M, P)
    return _nan_where_bad(_normalise(_sqrt_diag(_role_gram(Mc, P))), ok, 1)


def norm_shares(norms: ArrayLike) -> np.ndarray:
    """(..., R) ``x_r / Σ_s x_s`` of per-role norms (gradient or update) given directly, e.g. per-step
    means; all 0 when every norm is 0, NaN where any is non-finite. ``mass_shares(M, P)`` is
    ``norm_shares(role_norms(M, P))``."""
    x = np.asarray(norms, dtype=np.float64)
    ok = np.asarray(np.isfinite(x).all(axis=-1))
    return _nan_where_bad(_normalise(np.where(ok[..., None], x, 0.0)), ok, 1)


def token_shares(tokens: ArrayLike, P: ArrayLike) -> np.ndarray:
    """(..., R) token shares ``n_r / sum n`` from per-agent token counts ``tokens`` (..., K).

    All 0 when there are no tokens at all.
    """
    P = _indicator(P, None)
    t, ok = _tokens(tokens, P.shape[0])
    return _nan_where_bad(_normalise(t @ P), ok, 1)


def per_token_shares(M: ArrayLike, tokens: ArrayLike, P: ArrayLike) -> np.ndarray:
    """(..., R) per-token shares ``q_r = (||g_r|| / n_r) / sum_s (||g_s|| / n_s)``.

    With the mass share ``m_r`` proportional to ``n_r * (||g_r|| / n_r)``, comparing ``m``, the
    token share and ``q`` tells "more tokens" from "bigger per-token gradient". A role with 0
    tokens has per-token mass 0; all shares are 0 when every role's per-token mass is 0.
    """
    Mc, P, ok = _prepare(M, P)
    t, t_ok = _tokens(tokens, Mc.shape[-1])
    n = t @ P
    per_token = _div(_sqrt_diag(_role_gram(Mc, P)), n, n > 0)
    return _nan_where_bad(_normalise(per_token), ok & t_ok, 1)


def amplification_factor(M: ArrayLike, P: ArrayLike) -> np.ndarray:
    """(..., R) ``AF_r = ||sum_{k in r} g_k|| / mean_{k in r} ||g_k||``.

    n for identical directions, about sqrt(n) for orthogonal equal norms. NaN for roles with fewer
    than 2 agents (no peers to amplify); 0 for a role whose agents all have zero norm.
    """
    Mc, P, ok = _prepare(M, P)
    return _nan_where_bad(_amplification(Mc, P), ok, 1)


def coherence(M: ArrayLike, P: ArrayLike) -> np.ndarray:
    """(..., R) ``AF_r / n_r`` in [0, 1]: 1 for identical directions, ~1/sqrt(n) for orthogonal ones of equal norm.

    Same degenerate values as :func:`amplification_factor`.
    """
    Mc, P, ok = _prepare(M, P)
    n = P.sum(axis=0)
    return _nan_where_bad(_div(_amplification(Mc, P), n, n >= 2, fill=np.nan), ok, 1)


def signal_fraction(M: ArrayLike, P: ArrayLike) -> np.ndarray:
    """(..., R) mean off-diagonal / mean diagonal entry of each role's block of M.

    For n >= 2 exchangeable agents (same role, same prompts) the off-diagonal mean estimates
    ``||mu||^2`` (the shared expected gradient) and the diagonal mean ``||mu||^2 + tr(Sigma)/B``,
    so the ratio is the fraction of a single agent's squared norm that is shared signal. A ratio of
    unbiased estimates, it is not clipped: it lies in [-1/(n-1), 1] for a positive semi-definite M.
    NaN for n < 2; 0 when the mean diagonal is 0.
    """
    Mc, P, ok = _prepare(M, P)
    n, diag, off = _block_means(Mc, P)
    return _nan_where_bad(np.where(n >= 2, _div(off, diag, diag > 0), np.nan), ok, 1)


def noise_scale(M: ArrayLike, P: ArrayLike, batch_size: float | np.ndarray) -> np.ndarray:
    """(..., R) gradient noise scale ``B_noise = B * (diag - off) / off`` (McCandlish et al. 2018).

    ``diag`` / ``off`` are the role block's mean diagonal / off-diagonal entries (see
    :func:`signal_fraction`), ``B`` the batch size behind each agent's gradient: a scalar or an
    array broadcasting against ``M.shape[:-2]`` (one per step). Single steps are noisy estimates;
    average M over steps first for a stable value.

    Degenerate values: NaN for n < 2 roles; +inf when ``off <= 0`` and ``diag > 0`` (no shared
    signal measurable); NaN when ``diag`` and ``off`` are both 0 (no gradient at all).
    """
    Mc, P, ok = _prepare(M, P)
    B = np.asarray(batch_size, dtype=np.float64)
    B_ok = np.isfinite(B)
    B = np.where(B_ok, B, 1.0)
    if (B <= 0).any():
        raise ValueError("batch_size must be > 0")
    n, diag, off = _block_means(Mc, P)
    B = B[..., None]
    ns = np.where(
        off > 0, _div(B * (diag - off), off, off > 0), np.where(diag > 0, np.inf, np.nan)
    )
    return _nan_where_bad(np.where(n >= 2, ns, np.nan), ok & B_ok, 1)


def derive(
    M: ArrayLike, tokens: ArrayLike, agents: Sequence[str], agent_roles: Sequence[str]
) -> dict[str, np.ndarray]:
    """Every statistic as named columns of shape ``M.shape[:-2]`` (one value per step).

    Roles are taken in order of first appearance in ``agent_roles``. Columns, in this order:
    ``total_norm``, ``norm/<agent>``, ``role_norm/<role>``, ``share/<role>``,
    ``mass_share/<role>``, ``token_share/<role>``, ``per_token_share/<role>``, ``af/<role>``,
    ``coherence/<role>``, ``signal_fraction/<role>``, ``cos/<A>|<B>`` and ``role_cos/<A>|<B>``
    (upper triangles, A before B). A step whose M or tokens hold a non-finite entry is NaN in
    every column. ``noise_scale`` needs the batch size and is not included.
    """
    M = _gram(M)
    K = M.shape[-1]
    agents = list(agents)
    agent_roles = list(agent_roles)
    if len(agents) != K or len(agent_roles) != K:
        raise ValueError(
            f"M has K = {K} agents but got {len(agents)} agent names and {len(agent_roles)} roles"
        )
    if len(set(agents)) != K:
        raise ValueError(f"agent names must be unique; got {agents}")
    steps = M.shape[:-2]
    t = np.asarray(tokens, dtype=np.float64)
    if t.ndim < 1 or t.shape[-1] != K or not _broadcasts_to(t.shape[:-1], steps):
        raise ValueError(f"tokens must have shape (..., {K}) broadcasting to {steps}: {t.shape}")
    P, roles = role_indicator(agent_roles)

    MR = role_gram(M, P)
    per_role = {
        "role_norm": role_norms(M, P),
        "share": contribution_shares(M, P),
        "mass_share": mass_shares(M, P),
        "token_share": token_shares(t, P),
        "per_token_share": per_token_shares(M, t, P),
        "af": amplification_factor(M, P),
        "coherence": coherence(M, P),
        "signal_fraction": signal_fraction(M, P),
    }
    cols: dict[str, np.ndarray] = {"total_norm": total_norm(M)}
    norms = agent_norms(M)
    cols.update({f"norm/{a}": norms[..., k] for k, a in enumerate(agents)})
    for name, values in per_role.items():
        cols.update({f"{name}/{r}": values[..., j] for j, r in enumerate(roles)})
    for name, cos, names in (("cos", cosine(M), agents), ("role_cos", cosine(MR), roles)):
        for i, j in zip(*np.triu_indices(len(names), k=1)):
            cols[f"{name}/{names[i]}|{names[j]}"] = cos[..., i, j]

    ok = finite_mask(M) & np.isfinite(t).all(axis=-1)
    return {n: np.broadcast_to(np.where(ok, v, np.nan), steps).copy() for n, v in cols.items()}


def update_indicator(unit_roles: Sequence[str], roles: Sequence[str]) -> tuple[np.ndarray, list[str]]:
    """(C, R + 2) one-hot map of the update components onto ``roles + UPDATE_EXTRAS``, and those names.

    ``unit_roles`` (U = C - 2) is the role of each unit: ``roles`` themselves when updates were split
    by role, ``agent_roles`` when by agent. ``role_gram(U, Q)``, ``role_norms``, ``contribution_shares``
    and ``cosine`` then give the update's per-role Gram, norms, shares and cosines.
    """
    P, names = role_indicator(list(unit_roles), list(roles))
    Q = np.zeros((P.shape[0] + len(UPDATE_EXTRAS), P.shape[1] + len(UPDATE_EXTRAS)))
    Q[:P.shape[0], :P.shape[1]] = P
    Q[P.shape[0]:, P.shape[1]:] = np.eye(len(UPDATE_EXTRAS))
    return Q, [*names, *UPDATE_EXTRAS]


def interference(I: ArrayLike, Q: ArrayLike, P: ArrayLike) -> np.ndarray:
    """(..., R + 2, R) ``Qᵀ I P``: entry (a, s) is ``<Δθ_a, g_s>``, the first-order change of role s's
    loss caused by component a of the update (negative: a lowers s's loss, i.e. helps s).

    ``I`` (..., C, K) per-component, per-agent interference; ``Q`` (C, R + 2) from
    :func:`update_indicator`; ``P`` (K, R) the agent->role indicator. NaN for a step with a
    non-finite entry.
    """
    I = np.asarray(I, dtype=np.float64)
    Q = _indicator(Q, I.shape[-2] if I.ndim >= 2 else None)
    P = _indicator(P, I.shape[-1] if I.ndim >= 2 else None)
    ok = np.asarray(np.isfinite(I).all(axis=(-2, -1)))
    return _nan_where_bad(Q.T @ np.where(ok[..., None, None], I, 0.0) @ P, ok, 2)


def derive_updates(U: ArrayLike, I: ArrayLike, unit_roles: Sequence[str], agent_roles: Sequence[str],
                   roles: Sequence[str] | None = None) -> dict[str, np.ndarray]:
    """Update-attribution columns of shape ``U.shape[:-2]`` (one value per optimizer step).

    ``U`` (..., C, C) component Gram, ``I`` (..., C, K) interference; ``unit_roles`` the role of each
    unit (C - 2 of them); ``roles`` default to the order of first appearance in ``agent_roles``. Columns,
    with c over ``roles + UPDATE_EXTRAS`` and r, s over roles: ``total_update_norm`` (``‖Δθ‖``),
    ``role_update_norm/<c>``, ``update_share/<c>`` (``<Δθ_c, Δθ>/‖Δθ‖²``, sums to 1),
    ``update_cos/<r>|<s>`` (upper triangle) and ``interference/<c>|<s>``. A step whose U holds a
    non-finite entry is NaN in every column derived from U; the interference columns derive from I
    alone, NaN where I is.
    """
    roles = list(dict.fromkeys(agent_roles)) if roles is None else list(roles)
    U = _gram(U)
    Q, names = update_indicator(unit_roles, roles)
    P, _ = role_indicator(agent_roles, roles)
    UR = role_gram(U, Q)
    cols: dict[str, np.ndarray] = {"total_update_norm": total_norm(U)}
    for name, values in (("role_update_norm", role_norms(U, Q)), ("update_share", contribution_shares(U, Q))):
        cols.update({f"{name}/{c}": values[..., j] for j, c in enumerate(names)})
    cos = cosine(UR)
    for i, j in zip(*np.triu_indices(len(roles), k=1)):
        cols[f"update_cos/{roles[i]}|{roles[j]}"] = cos[..., i, j]
    inter = interference(I, Q, P)
    for a, c in enumerate(names):
        cols.update({f"interference/{c}|{r}": inter[..., a, s] for s, r in enumerate(roles)})
    return {n: np.asarray(v, dtype=np.float64) for n, v in cols.items()}


def _broadcasts_to(shape: tuple[int, ...], target: tuple[int, ...]) -> bool:
    try:
        return np.broadcast_shapes(shape, target) == target
    except ValueError:
        return False
