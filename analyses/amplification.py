"""Gradient amplification: same-role agents whose gradients point the same way and add up.

Default: a role with n ≥ 2 agents whose coherence ``AF_r / n ≥ 0.75`` on at least 80% of a 10-step
window, while its gradient norm is *significantly* rising over the window (least-squares slope of
log ‖g_r‖ at least 2 standard errors above 0) or is at least 2× the median of the other roles'
norms on 80% of the window. Qualifying windows of one role at most ``gap`` (20) steps apart are
one finding; a finding that never qualified by dominance must show net growth (its fitted norm
growth over the finding > 1), so noise on a falling norm is never read as a rising one.

The **update channel** (:func:`detect_update_amplification`): the same role amplified through the
optimizer instead of the gradient's direction. Under verl-style mini-batching a role with n agents
takes about n optimizer steps per training step on its own adapter (IP), so its adapter moves
further than a one-agent role's even when every per-step gradient is normalised. A policy that trains
a role with n ≥ 2 agents and no other policy's roles, whose relative update per training step
(``update_rel/<policy>``) is ≥ ``update_ratio`` × the median of the other policies' on ``fraction`` of a
``window``, is a finding with ``evidence["channel"] = "update"``, split into the optimizer-step ratio
and the per-step size ratio (their product is the update ratio).
"""
from __future__ import annotations

import warnings

import numpy as np

from gradscope.analyses.findings import Finding
from gradscope.analyses.series import RunSeries
from gradscope.analyses.thresholds import AmplificationConfig
from gradscope.analyses.windows import episodes, merge_close, rolling_fit, rolling_sum, sustained

__all__ = ["AmplificationConfig", "detect_amplification", "detect_update_amplification"]


def detect_amplification(series: RunSeries, cfg: AmplificationConfig = AmplificationConfig()) -> list[Finding]:
    out: list[Finding] = []
    if len(series.steps) < cfg.window:
        return out
    steps = series.steps
    norm = series.role_norm
    with np.errstate(divide="ignore", invalid="ignore"):
        log_norm = np.log(np.where(norm > 0, norm, np.nan))
    for r, role in enumerate(series.roles):
        n = series.n_agents[r]
        if n < 2:
            continue
        coh = series.coherence[:, r]
        med = _others_median(norm, r)
        ratio = np.divide(norm[:, r], med, out=np.full(len(norm), np.nan), where=np.isfinite(med) & (med > 0))
        coherent = sustained(coh >= cfg.coherence, cfg.window, cfg.fraction)
        slope, se = rolling_fit(log_norm[:, r], cfg.window)
        with np.errstate(invalid="ignore"):
            rising = sustained((slope > 0) & (slope >= cfg.rise_z * se), cfg.window, cfg.fraction)
        dominant = sustained(ratio >= cfg.norm_ratio, cfg.window, cfg.fraction)
        qualifies = coherent & (rising | dominant)
        for a, b in merge_close(episodes(qualifies, cfg.window), steps, cfg.gap):
            seg = slice(a, b + 1)
            growth = _growth(steps[seg], log_norm[seg, r])
            by_dominance = bool((coherent & dominant)[seg].any())
            if not by_dominance and not (growth is not None and growth > 1):
                continue  # "rising" windows inside a net fall: noise, not growth
            onset = a + int(np.argmax(coh[seg] >= cfg.coherence))
            mean_coh = float(np.nanmean(coh[seg]))
            out.append(Finding(
                kind="amplification",
                severity="critical" if mean_coh >= 0.9 else "warning",
                summary=(f"{n} '{role}' agents push the same direction (coherence {mean_coh:.2f}, "
                         f"AF {np.nanmean(series.amplification[seg, r]):.2f} of max {n}) from step {steps[onset]}"),
                onset=int(steps[onset]), start=int(steps[a]), end=int(steps[b]), role=role,
                evidence={"agents": int(n), "mean_coherence": mean_coh,
                          "max_coherence": float(np.nanmax(coh[seg])),
                          "mean_amplification_factor": float(np.nanmean(series.amplification[seg, r])),
                          "norm_growth": growth, "rising_windows": int((coherent & rising)[seg].sum()),
                          "dominant_windows": int((coherent & dominant)[seg].sum()),
                          "norm_vs_other_roles": float(np.nanmedian(ratio[seg])) if np.isfinite(ratio[seg]).any() else None,
                          "steps_coherent": int(np.sum(coh[seg] >= cfg.coherence)), "steps": b - a + 1,
                          "channel": "gradient"}))
    return out


def detect_update_amplification(series: RunSeries, cfg: AmplificationConfig = AmplificationConfig()
                                ) -> list[Finding]:
    """Amplification through the update (module doc): per training step, ``update_rel`` of a policy
    owning a multi-agent role against the median of the other policies' (steps where a policy did
    not move — every advantage 0 — do not count)."""
    m = series.metrics
    rel = {c.split("/", 1)[1]: m[c].to_numpy(dtype=float) for c in m.columns if c.startswith("update_rel/")}
    if len(rel) < 2 or len(m) < cfg.window:
        return []
    n_by_role = dict(zip(series.roles, series.n_agents))
    opt = {p: m[f"opt_steps/{p}"].to_numpy(dtype=float) if f"opt_steps/{p}" in m else np.full(len(m), np.nan)
           for p in rel}
    steps = m.index.to_numpy()
    out = []
    for policy, roles in series.role_sets.items():
        multi = [r for r in roles if n_by_role.get(r, 0) >= 2]
        if policy not in rel or len(roles) != 1 or not multi:
            continue
        others = [q for q in rel if q != policy]
        with warnings.catch_warnings(), np.errstate(divide="ignore", invalid="ignore"):
            warnings.simplefilter("ignore", RuntimeWarning)
            other = np.nanmedian(np.stack([np.where(rel[q] > 0, rel[q], np.nan) for q in others], axis=1), axis=1)
            other_opt = np.nanmedian(np.stack([opt[q] for q in others], axis=1), axis=1)
            ratio = np.where(rel[policy] > 0, rel[policy] / other, np.nan)
            steps_ratio = opt[policy] / other_opt
        qualifies = _sustained_where_defined(ratio, cfg.update_ratio, cfg.window, cfg.fraction)
        for a, b in merge_close(episodes(qualifies, cfg.window), steps, cfg.gap):
            onset = a + int(np.argmax(ratio[a:b + 1] >= cfg.update_ratio))
            seg = slice(onset, b + 1)  # the evidence from the onset on (the first window reaches back before it)
            mean_ratio = float(np.nanmean(ratio[seg]))
            by_steps = float(np.nanmean(steps_ratio[seg])) if np.isfinite(steps_ratio[seg]).any() else None
            per_step = mean_ratio / by_steps if by_steps else None
            role = multi[0]
            how = (f"{by_steps:.1f}x the optimizer steps x {per_step:.1f}x the update per step"
                   if by_steps and per_step else "the update per step")
            out.append(Finding(
                kind="amplification", severity="warning" if per_step is not None and per_step >= cfg.update_ratio
                else "info",
                summary=(f"the {n_by_role[role]} '{role}' agents' adapter '{policy}' moves {mean_ratio:.1f}x as far "
                         f"per training step as the other adapters ({how}) from step {int(steps[onset])}"),
                onset=int(steps[onset]), start=int(steps[a]), end=int(steps[b]), role=role, policy=policy,
                evidence={"channel": "update", "agents": int(n_by_role[role]), "update_ratio": mean_ratio,
                          "optimizer_step_ratio": by_steps, "per_step_ratio": per_step,
                          "steps_above": int(np.sum(ratio[seg] >= cfg.update_ratio)), "steps": b - onset + 1}))
    return out


def _sustained_where_defined(ratio: np.ndarray, threshold: float, window: int, fraction: float) -> np.ndarray:
    """(T,) bool: the full window ending here has ≥ ``fraction`` of its *defined* (finite) values at or
    above ``threshold``, and at least half of its values defined (a step where a policy did not move
    says nothing either way)."""
    defined = rolling_sum(np.isfinite(ratio).astype(float), window)
    with np.errstate(invalid="ignore"):
        hits = rolling_sum((ratio >= threshold).astype(float), window)
    full = np.arange(len(ratio)) >= window - 1
    return full & (defined >= window / 2) & (hits >= fraction * defined - 1e-9)


def _others_median(norm: np.ndarray, r: int) -> np.ndarray:
    """(T,) median norm of the roles other than ``r`` present at each step (NaN if none)."""
    others = np.delete(norm, r, axis=1)
    others = np.where(others > 0, others, np.nan)
    if not others.shape[1]:
        return np.full(len(norm), np.nan)
    with warnings.catch_warnings():  # steps where no other role is present: NaN is the answer
        warnings.simplefilter("ignore", RuntimeWarning)
        return np.nanmedian(others, axis=1)


def _growth(steps: np.ndarray, log_norm: np.ndarray) -> float | None:
    """The norm's least-squares growth factor over a segment: ``exp(slope · (last − first step))``
    of log ‖g_r‖ against the step (None with fewer than two finite values)."""
    ok = np.isfinite(log_norm)
    if ok.sum() < 2 or np.ptp(steps[ok]) == 0:
        return None
    slope = np.polyfit(steps[ok].astype(float), log_norm[ok], 1)[0]
    return float(np.exp(slope * (steps[ok][-1] - steps[ok][0])))
