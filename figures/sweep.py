"""The improvement map: accuracy gained over the base model by workflow × task × scale, IP vs SP.

Each run is placed by its config (``workflow``, ``task``, ``model``, ``policy``; a missing key
reads ``unknown``; a model path is shown by its last component: gradscope.labels). One panel per
policy (IP, SP, then any other sharing map), rows = workflow / task, columns = model ordered by
size (the number before a B/M in its name, e.g. 0.6B < 1.7B < 4B; names without one first). A
cell is the mean over its runs (seeds) of the improvement over the base model — ``final − base``
by default, ``peak − base`` with ``metric="peak"`` — with its value and, for several runs, their
number. Runs that differ only in other settings (learning rate, ...) land
in the same cell: sweep one setting at a time. A cell whose runs have no accuracy evaluations
says "no data"; a combination with no run is blank grey. One colour scale for all panels,
diverging around 0 (blue = better than base, red = worse).
"""
from __future__ import annotations

import re
from collections.abc import Iterable

import numpy as np
from matplotlib.colors import Normalize
from matplotlib.figure import Figure

from gradscope import labels
from gradscope.figures import data
from gradscope.figures.data import RunLike
from gradscope.figures.ipsp import ORDER
from gradscope.figures.style import DIVERGING, new_figure, policy_color, theme, width
from gradscope.errors import ConfigError

METRICS = ("final", "peak")


def improvement(series, metric: str = "final") -> float | None:
    acc = series.accuracy
    if not len(acc):
        return None
    base = float(acc.iloc[0])
    return (float(acc.iloc[-1]) if metric == "final" else float(acc.max())) - base


def scale_key(model: str) -> tuple[float, str]:
    m = re.search(r"(\d+(?:\.\d+)?)\s*([bBmM])(?![a-zA-Z])", model)
    if not m:
        return (-1.0, model)
    return (float(m.group(1)) * (1e9 if m.group(2) in "bB" else 1e6), model)


def sweep_table(runs: Iterable[RunLike], metric: str = "final") -> list[dict]:
    """One dict per run: workflow, task, model, policy, improvement (None without evaluations), run."""
    if metric not in METRICS:
        raise ConfigError(f"sweep: metric must be one of {', '.join(METRICS)}, got {metric!r}")
    out = []
    for s in data.as_series_list(runs):
        d = data.describe(s)
        out.append({**d, "improvement": improvement(s, metric), "run": s.name})
    return out


def sweep_figure(runs: Iterable[RunLike], *, metric: str = "final", size: str = "two") -> Figure:
    """Improvement-over-base heatmap of many runs (RunSeries or paths), one panel per policy."""
    rows_ = sweep_table(runs, metric)
    if all(r["improvement"] is None for r in rows_):
        raise ConfigError("sweep: none of the runs has accuracy evaluations")
    policies = sorted({r["policy"] for r in rows_}, key=lambda p: (ORDER.get(p, 2), p))
    ylabels = sorted({(r["workflow"], r["task"]) for r in rows_})
    models = sorted({r["model"] for r in rows_}, key=scale_key)
    cells: dict[tuple, list] = {}
    for r in rows_:
        cells.setdefault((r["policy"], (r["workflow"], r["task"]), r["model"]), []).append(r["improvement"])
    values = [v for vs in cells.values() for v in vs if v is not None]
    lim = max(0.05, float(np.ceil(max(abs(v) for v in values) / 0.05) * 0.05))
    norm = Normalize(-lim, lim)
    h = max(1.7, 0.95 + 0.3 * len(ylabels))
    if size == "one" and len(policies) * len(models) > 4:
        size = "two"
    w_needed = 1.4 + len(policies) * (0.55 * len(models) + 0.2)
    with theme():
        fig, axes = new_figure(size, h, 1, len(policies), sharey=True)
        if w_needed < width(size):  # narrow maps: do not stretch cells across the page
            fig.set_figwidth(max(w_needed, 3.0))
        for ax, policy in zip(axes[0], policies):
            ax.set_label(f"sweep:{policy}")
            grid = np.full((len(ylabels), len(models)), np.nan)
            for i, yl in enumerate(ylabels):
                for j, model in enumerate(models):
                    vs = cells.get((policy, yl, model))
                    if vs is None:
                        continue
                    ok = [v for v in vs if v is not None]
                    if not ok:
                        ax.text(j, i, "no data", ha="center", va="center", fontsize=5.5, color="#555555",
                                gid="no-data")
                        continue
                    grid[i, j] = float(np.mean(ok))
                    txt = f"{grid[i, j]:+.3f}" + (f"\nn={len(ok)}" if len(ok) > 1 else "")
                    ax.text(j, i, txt, ha="center", va="center", fontsize=6, gid="cell",
                            color="white" if abs(grid[i, j]) > 0.6 * lim else "#222222")
            im = ax.imshow(np.ma.masked_invalid(grid), cmap=DIVERGING, norm=norm, aspect="auto",
                           interpolation="nearest")
            ax.set_facecolor("#EEEEEE")
            ax.grid(False)
            ax.set_xticks(range(len(models)), models)
            ax.set_yticks(range(len(ylabels)), [f"{w} / {t}" for w, t in ylabels])
            ax.set_xlabel("model")
            ax.set_title(labels.policy_label(policy), color=policy_color(policy), fontweight="bold")
            ax.tick_params(length=0)
            for spine in ax.spines.values():
                spine.set_visible(False)
        axes[0, 0].set_ylabel("workflow / task")
        cb = fig.colorbar(im, ax=list(axes[0]), fraction=0.05, pad=0.02, aspect=max(10, 4 * len(ylabels)))
        cb.set_label(f"Δ accuracy ({metric} − base)")
        cb.ax.set_label("<colorbar>")
    return fig
