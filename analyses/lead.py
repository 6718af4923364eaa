"""Lead indicators: which gradient signals changed first before an accuracy cliff, and by how much.

For every per-step signal (each role's gradient norm, each multi-agent role's coherence, each
role's contribution share in a shared set, each policy's update size), the baseline is the median
and MAD of the signal's last ``BASELINE`` (20) finite steps up to the accuracy peak (its first 5
finite steps when fewer than 5 come up to the peak; a signal with fewer than 5 finite steps has no
baseline and never moves). A signal *moves* at the first step after
the peak at which it leaves the baseline by ``z`` robust standard deviations (at least ``rel`` of
the baseline level, so flat signals do not fire on noise) for ``persist`` consecutive steps. The
lead is ``onset − that step`` (positive: it moved before accuracy fell).
"""
from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from gradscope.analyses.series import RunSeries

BASELINE, Z, REL, PERSIST = 20, 3.0, 0.25, 3


def signals(series: RunSeries) -> Iterator[tuple[str, np.ndarray, np.ndarray]]:
    """(name, steps, values) of every gradient signal of a run."""
    for r, role in enumerate(series.roles):
        yield f"grad_norm[{role}]", series.steps, series.role_norm[:, r]
        if series.n_agents[r] >= 2:
            yield f"coherence[{role}]", series.steps, series.coherence[:, r]
    for policy in series.shared_sets:
        st = series.set_stats(policy)
        for j, role in enumerate(st["roles"]):
            yield f"share[{role}@{policy}]", series.steps, st["share"][:, j]
    for col in series.metrics.columns if not series.metrics.empty else []:
        if col.startswith("update_norm/"):
            m = series.metrics[col].dropna()
            yield f"update_norm[{col.split('/', 1)[1]}]", m.index.to_numpy(), m.to_numpy(dtype=float)


def lead_indicators(series: RunSeries, peak_step: int, onset_step: int) -> list[dict]:
    """Signals that moved between the peak and the end, earliest first, with their lead in steps."""
    out = []
    for name, steps, values in signals(series):
        moved = first_move(steps, values, peak_step)
        if moved is not None:
            step, before, after = moved
            out.append({"signal": name, "step": step, "lead": onset_step - step,
                        "baseline": before, "value": after})
    return sorted(out, key=lambda d: -d["lead"])


def first_move(steps: np.ndarray, values: np.ndarray, peak_step: int) -> tuple[int, float, float] | None:
    """(step, baseline, value) where the signal first leaves its pre-peak baseline, or None."""
    ok = np.isfinite(values)
    steps, values = steps[ok], values[ok]
    pre = np.flatnonzero(steps <= peak_step)[-BASELINE:]
    if len(pre) < 5:  # a peak at the very start: the first steps are the baseline
        pre = np.arange(min(5, len(steps)))
    if len(pre) < 5:
        return None
    base = values[pre]
    med = float(np.median(base))
    spread = max(Z * 1.4826 * float(np.median(np.abs(base - med))), REL * abs(med), 1e-12)
    out_of_band = np.abs(values - med) > spread
    after = np.arange(pre[-1] + 1, len(steps))
    run = 0
    for i in after:
        run = run + 1 if out_of_band[i] else 0
        if run == PERSIST:
            j = i - PERSIST + 1
            if j == after[0]:  # already out of band at the peak: walk back to where it left
                dev = np.sign(values - med)
                while j > 0 and out_of_band[j - 1] and dev[j - 1] == dev[j]:
                    j -= 1
            return int(steps[j]), med, float(values[j])
    return None
