"""Sliding-window helpers shared by the detectors (vectorised: O(T) whatever the window)."""
from __future__ import annotations

import numpy as np


def rolling_sum(x: np.ndarray, window: int) -> np.ndarray:
    """(T, ...) → (T, ...): sum of the ``window`` values ending at each index (shorter at the start)."""
    c = np.cumsum(np.concatenate([np.zeros((1, *x.shape[1:])), x], axis=0), axis=0)
    lo = np.maximum(np.arange(len(x)) - window + 1, 0)
    return c[1:] - c[lo]


def sustained(mask: np.ndarray, window: int, fraction: float) -> np.ndarray:
    """(T, ...) bool: the full window ending here holds ≥ ``fraction`` True (NaN counts as False)."""
    hits = rolling_sum(mask.astype(float), window)
    full = (np.arange(len(mask)) >= window - 1).reshape(-1, *([1] * (mask.ndim - 1)))
    return full & (hits >= fraction * window - 1e-9)


def rolling_slope(y: np.ndarray, window: int) -> np.ndarray:
    """(T, ...) least-squares slope of ``y`` against the index over each trailing window (NaN → 0 weight)."""
    ok = np.isfinite(y)
    yy = np.where(ok, y, 0.0)
    t = np.arange(len(y), dtype=float).reshape(-1, *([1] * (y.ndim - 1)))
    n = rolling_sum(ok.astype(float), window)
    st, sy = rolling_sum(ok * t, window), rolling_sum(yy, window)
    stt, sty = rolling_sum(ok * t * t, window), rolling_sum(yy * t, window)
    den = n * stt - st * st
    return np.divide(n * sty - st * sy, den, out=np.zeros_like(den), where=den > 1e-12)


def episodes(qualifies: np.ndarray, window: int) -> list[tuple[int, int]]:
    """Runs of qualifying windows → (first index, last index) of the data they cover.

    Runs whose covered ranges touch or overlap (a gap shorter than a window) are one episode, so a
    statistic hovering at its threshold gives one finding, not hundreds.
    """
    out: list[tuple[int, int]] = []
    for i in np.flatnonzero(qualifies):
        a, b = max(int(i) - window + 1, 0), int(i)
        if out and a <= out[-1][1] + 1:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out
