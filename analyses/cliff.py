"""Terminal accuracy cliffs, and the gradient signals that moved before them.

Default, on the held-out accuracy series smoothed by a running median of 3 (removes
single-evaluation outliers): a drop of at least 0.10 absolute and 15% relative below the running
peak, reached within 5 evaluations of the fall's onset, with no recovery to within half the drop of
the peak before the run ends. A drop that takes longer is a slow decline (reported as ``info``);
one that recovers is a dip (not reported).

Onset: the first evaluation of the fall, i.e. the one after the last evaluation still within a
quarter of the drop (peak − value where the threshold is crossed) of the peak. The median is
mirrored at the ends, so a single outlier at the first or last evaluation is removed too.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd
from scipy.ndimage import median_filter

from gradscope.analyses.findings import Finding
from gradscope.analyses.lead import lead_indicators
from gradscope.analyses.series import RunSeries
from gradscope.analyses.thresholds import CliffConfig

__all__ = ["Cliff", "CliffConfig", "detect_cliff", "find_cliffs"]


@dataclass(frozen=True)
class Cliff:
    peak_step: int
    peak: float
    onset_step: int
    trough_step: int
    trough: float
    final: float


def find_cliffs(accuracy: pd.Series, cfg: CliffConfig = CliffConfig()) -> tuple[list[Cliff], list[Cliff]]:
    """(cliffs, slow declines) of an accuracy series indexed by step."""
    acc = accuracy.dropna()
    steps, raw = acc.index.to_numpy(), acc.to_numpy(dtype=float)
    if len(raw) < 3:
        return [], []
    s = median_filter(raw, size=cfg.smooth, mode="mirror") if cfg.smooth > 1 else raw
    cliffs, declines = [], []
    i, peak_i = 0, 0
    while i < len(s):
        if s[i] > s[peak_i]:
            peak_i = i
        peak = s[peak_i]
        need = max(cfg.min_drop, cfg.min_rel_drop * peak)
        if peak - s[i] <= 0 or peak - s[i] < need - 1e-12:  # no drop is a drop, even at a threshold of 0
            i += 1
            continue
        near = [j for j in range(peak_i, i) if s[j] >= peak - (peak - s[i]) / 4]
        onset = (near[-1] if near else peak_i) + 1
        trough, recovered = i, None
        for j in range(i, len(s)):  # the drop's trough so far; it recovers half-way back to its peak, or never
            if s[j] < s[trough]:
                trough = j
            if s[j] >= peak - (peak - s[trough]) / 2:
                recovered = j
                break
        if recovered is not None:  # a dip: scan on from the recovery with a fresh peak
            i = peak_i = recovered
            continue
        event = Cliff(int(steps[peak_i]), float(peak), int(steps[onset]), int(steps[trough]), float(s[trough]),
                      float(raw[-1]))
        (cliffs if i - onset + 1 <= cfg.within else declines).append(event)
        break  # no recovery before the end: nothing later can be another cliff
    return cliffs, declines


def detect_cliff(series: RunSeries, cfg: CliffConfig = CliffConfig()) -> list[Finding]:
    out = []
    cliffs, declines = find_cliffs(series.accuracy, cfg)
    base = float(series.accuracy.iloc[0]) if len(series.accuracy) else float("nan")
    for c in cliffs:
        leads = lead_indicators(series, c.peak_step, c.onset_step)
        first = f"; first signal: {leads[0]['signal']} {leads[0]['lead']} steps earlier" if leads else ""
        out.append(Finding(
            kind="cliff", severity="critical" if c.final <= base else "warning",
            summary=(f"accuracy (median of 3 evaluations) fell from {c.peak:.3f} (step {c.peak_step}) to {c.trough:.3f} and did not recover; "
                     f"onset step {c.onset_step}{first}"),
            onset=c.onset_step, start=c.peak_step, end=c.trough_step,
            evidence={"peak": c.peak, "peak_step": c.peak_step, "onset_step": c.onset_step, "depth": c.peak - c.trough,
                      "trough": c.trough, "trough_step": c.trough_step, "final": c.final, "base": base,
                      "lead_indicators": leads}))
    for c in declines:
        out.append(Finding(
            kind="decline", severity="info",
            summary=f"slow decline of accuracy (median of 3 evaluations) from {c.peak:.3f} (step {c.peak_step}) to {c.trough:.3f}: too gradual for a cliff",
            onset=c.onset_step, start=c.peak_step, end=c.trough_step,
            evidence={"peak": c.peak, "trough": c.trough, "final": c.final, "base": base, "slow": True}))
    return out
