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
    return rolling_fit(y, window)[0]


def rolling_fit(y: np.ndarray, window: int) -> tuple[np.ndarray, np.ndarray]:
    """(slope, standard error), each (T, ...): the least-squares line of ``y`` against the index over
    each trailing window, NaN values left out.

    The slope is 0 where fewer than two distinct indices are finite; the standard error is
    ``√(SSR / (n − 2) / Σ(t − t̄)²)`` from the window's residuals, NaN where n < 3.
    """
    ok = np.isfinite(y)
    yy = np.where(ok, y, 0.0)
    t = np.arange(len(y), dtype=float).reshape(-1, *([1] * (y.ndim - 1)))
    n = rolling_sum(ok.astype(float), window)
    st, sy = rolling_sum(ok * t, window), rolling_sum(yy, window)
    stt, sty, syy = rolling_sum(ok * t * t, window), rolling_sum(yy * t, window), rolling_sum(yy * yy, window)
    den = n * stt - st * st                      # n² Var(t)
    num = n * sty - st * sy                      # n² Cov(t, y), from running sums: rounding ~1e-16 of its terms
    num = np.where(np.abs(num) <= 1e-9 * (np.abs(n * sty) + np.abs(st * sy)), 0.0, num)  # a flat y is flat
    slope = np.divide(num, den, out=np.zeros_like(den), where=den > 1e-12)
    with np.errstate(divide="ignore", invalid="ignore"):
        sxx = den / n                            # Σ(t − t̄)²
        ssr = np.maximum(syy - sy * sy / n - slope * slope * sxx, 0.0)
        se = np.sqrt(ssr / (n - 2) / sxx)
    return slope, np.where((n >= 3) & (den > 1e-12), se, np.nan)


def episodes(qualifies: np.ndarray, window: int) -> list[tuple[int, int]]:
    """Runs of qualifying windows → (first index, last index) of the data they cover.

    Runs whose covered ranges touch or overlap are one episode, so a
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


def merge_close(spans: list[tuple[int, int]], steps: np.ndarray, gap: int) -> list[tuple[int, int]]:
    """Merge (first, last) index spans whose steps are at most ``gap`` apart (from the last step of
    one to the first step of the next): one finding for a statistic that hovers at its threshold."""
    out: list[tuple[int, int]] = []
    for a, b in spans:
        if out and steps[a] - steps[out[-1][1]] <= gap:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out
