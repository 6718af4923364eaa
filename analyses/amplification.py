"""Gradient amplification: same-role agents whose gradients point the same way and add up.

Default: a role with n ≥ 2 agents whose coherence ``AF_r / n ≥ 0.75`` on at least 80% of a 10-step
window, while its gradient norm is *significantly* rising over the window (least-squares slope of
log ‖g_r‖ at least 2 standard errors above 0) or is at least 2× the median of the other roles'
norms on 80% of the window. Qualifying windows of one role fewer than ``gap`` (20) steps apart are
one finding; a finding that never qualified by dominance must show net growth (its fitted norm
growth over the finding > 1), so noise on a falling norm is never read as a rising one.
"""
from __future__ import annotations

import warnings

import numpy as np

from gradscope.analyses.findings import Finding
from gradscope.analyses.series import RunSeries
from gradscope.analyses.thresholds import AmplificationConfig
from gradscope.analyses.windows import episodes, merge_close, rolling_fit, sustained

__all__ = ["AmplificationConfig", "detect_amplification"]


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
                          "steps_coherent": int(np.sum(coh[seg] >= cfg.coherence)), "steps": b - a + 1}))
    return out


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
