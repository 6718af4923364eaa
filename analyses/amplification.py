"""Gradient amplification: same-role agents whose gradients point the same way and add up.

Default (DESIGN.md): a role with n ≥ 2 agents whose coherence ``AF_r / n ≥ 0.75`` on at least 80% of
a 10-step window, while its gradient norm is rising over the window (positive least-squares slope of
log ‖g_r‖) or is at least 2× the median of the other roles' norms.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np

from gradscope.analyses.findings import Finding
from gradscope.analyses.series import RunSeries
from gradscope.analyses.windows import episodes, rolling_slope, sustained


@dataclass(frozen=True)
class AmplificationConfig:
    coherence: float = 0.75   # coherence threshold
    window: int = 10          # steps per window
    fraction: float = 0.8     # share of the window's steps above the threshold
    norm_ratio: float = 2.0   # ... or the role's norm vs the other roles' median


def detect_amplification(series: RunSeries, cfg: AmplificationConfig = AmplificationConfig()) -> list[Finding]:
    out: list[Finding] = []
    if len(series.steps) < cfg.window:
        return out
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
        rising = rolling_slope(log_norm[:, r], cfg.window) > 0
        dominant = sustained(ratio >= cfg.norm_ratio, cfg.window, cfg.fraction)
        qualifies = coherent & (rising | dominant)
        for a, b in episodes(qualifies, cfg.window):
            steps = series.steps
            seg = slice(a, b + 1)
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
                          "norm_growth": _growth(norm[seg, r]),
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


def _growth(x: np.ndarray) -> float | None:
    """Last over first finite value of a segment (how much the norm grew)."""
    x = x[np.isfinite(x) & (x > 0)]
    return float(x[-1] / x[0]) if len(x) >= 2 else None
