"""The cliff-dynamics figure: what the gradients did around an accuracy cliff.

One column per run, panels sharing the step axis, top to bottom:

1. held-out accuracy, the base model (dashed), the peak (★); when ``analyses.cliff.detect_cliff``
   found a terminal cliff: its onset (dashed red line, drawn through every panel) and the
   collapsed region from the onset to the end of the run (shaded red, every panel);
2. per-role gradient norm ‖g_r‖ (log scale), one line per role; hatched where a whole step had no
   gradient at all (every reward equal → every advantage 0);
3. coherence AF/n of the roles with ≥ 2 agents, with the amplification threshold (0.75) and the
   level of independent agents (1/√n); a right axis in AF units when every column has one n;
4. signed contribution shares of a shared parameter set, stacked (SP; "no data" under IP);
5. agent cosine alignment: mean pairwise cosine within each role and across roles sharing
   parameters.

The detector's *lead indicators* (gradient signals that left their pre-peak baseline before the
onset) are marked with a ▼ at the top of their panel. Several runs share every scale: the same
step axis, and the same y-axis per row. A run with neither evaluations nor gradient records raises
ConfigError (its column would be empty).
"""
from __future__ import annotations

from collections.abc import Iterable

import numpy as np
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import MaxNLocator
from matplotlib.transforms import blended_transform_factory

from gradscope.errors import ConfigError
from gradscope.figures import data, panels
from gradscope.figures.data import RunLike
from gradscope.figures.style import NEUTRAL, is_no_data, new_figure, role_color, theme

ROWS = ("accuracy", "grad_norm", "coherence", "shares", "alignment")
YLABELS = {
    "accuracy": "held-out\naccuracy",
    "grad_norm": "gradient norm\n" + r"$\|g_r\|$ (log)",
    "coherence": "coherence\nAF / n",
    "shares": "contribution\nshare",
    "alignment": "agent\ncosine",
}
#: font size of the column titles (points)
TITLE_PT = 7
#: lead-indicator signal name prefix → panel
_LEAD_PANEL = {"grad_norm": "grad_norm", "coherence": "coherence", "share": "shares"}


def cliff_figure(runs: RunLike | Iterable[RunLike], *, size: str = "two", smooth: int = 1,
                 height: float | None = None) -> Figure:
    """The cliff-dynamics figure of one or several runs (RunSeries or paths), one column each.

    Args:
        size: ``"one"`` or ``"two"`` (paper columns; see ``figures.style.WIDTHS``).
        smooth: centred rolling mean over this many logged steps for the gradient panels (1 = raw;
            ``data.smooth``: a gap stays a gap).
        height: inches (default: 1.05 per panel plus room for titles and the legend).
    """
    series = data.as_series_list(runs)
    for s in series:  # a column of "no data" panels only would say nothing
        if not len(s.accuracy) and not len(s.gram):
            raise ConfigError(f"{s.name}: no accuracy evaluations and no gradient records: nothing to draw")
    ncols = len(series)
    with theme(r for s in series for r in s.roles):
        fig, axes = new_figure(size, height or 1.05 * len(ROWS) + 0.9, len(ROWS), ncols,
                               sharex=True, sharey="row")
        end = max(data.last_step(s) for s in series)
        chars = int(0.9 * fig.get_figwidth() / ncols * 72 / (0.75 * TITLE_PT))  # of a title line in one column
        top_acc = 0.0
        for c, s in enumerate(series):
            col = {name: axes[i, c] for i, name in enumerate(ROWS)}
            cliff = data.cliff_of(s)
            panels.accuracy(col["accuracy"], s, cliff)
            panels.grad_norms(col["grad_norm"], s, smooth)
            panels.coherence(col["coherence"], s, smooth)
            panels.shares(col["shares"], s, window=smooth)
            panels.alignment(col["alignment"], s, smooth)
            for ax in col.values():
                panels.mark_cliff(ax, cliff, data.last_step(s))
            if cliff is not None:
                _mark_leads(col, cliff)
            if len(s.accuracy):
                top_acc = max(top_acc, float(s.accuracy.max()))
            col["accuracy"].set_title(data.title(s, width=chars) + data.smoothed(smooth, "gradients: "),
                                      fontsize=TITLE_PT)
        _finish(fig, axes, series, end, top_acc)
    return fig


def _mark_leads(col: dict, cliff) -> None:
    """▼ at the top of a panel where a gradient signal left its baseline before the onset."""
    done = set()
    for lead in cliff.evidence.get("lead_indicators", []):
        if lead["lead"] <= 0:
            continue
        kind, _, rest = lead["signal"].partition("[")
        panel = _LEAD_PANEL.get(kind)
        role = rest.rstrip("]").split("@")[0]
        if panel is None or (panel, role) in done:
            continue
        done.add((panel, role))
        ax = col[panel]
        ax.plot([lead["step"]], [0.95], transform=blended_transform_factory(ax.transData, ax.transAxes),
                linestyle="none", marker="v", markersize=5, color=role_color(role), markeredgecolor="#333333",
                markeredgewidth=0.4, label="_lead", gid="lead", clip_on=False, zorder=6)


def _finish(fig: Figure, axes: np.ndarray, series: list, end: int, top_acc: float) -> None:
    nrows, ncols = axes.shape
    for i, name in enumerate(ROWS):
        axes[i, 0].set_ylabel(YLABELS[name])
    for c in range(ncols):
        axes[-1, c].set_xlabel("training step")
    margin = max(0.6, 0.02 * end)
    axes[0, 0].set_xlim(-margin, end + margin)
    axes[0, 0].xaxis.set_major_locator(MaxNLocator(nbins=8, integer=True, steps=[1, 2, 2.5, 5, 10]))
    row = {name: axes[i] for i, name in enumerate(ROWS)}
    # accuracies in [0, 1]: up to just above 1; logged otherwise (e.g. in percent): up to their top
    hi = (min(1.02, top_acc + 0.1) if top_acc <= 1 else 1.05 * top_acc) if top_acc > 0 else 1.0
    row["accuracy"][0].set_ylim(-0.03, hi)
    row["coherence"][0].set_ylim(0, 1.05)
    _share_limits(row["shares"])
    for ax_row in axes:  # room above the data for the lead markers (▼ at 95% of the height)
        if any(ln.get_gid() == "lead" for ax in ax_row for ln in ax.lines):
            lo, hi = ax_row[0].get_ylim()
            if ax_row[0].get_yscale() == "log":
                ax_row[0].set_ylim(lo, hi * (hi / lo) ** 0.2)
            else:
                ax_row[0].set_ylim(lo, hi + 0.2 * (hi - lo))
    panels.log_ticks(row["grad_norm"][0])
    _af_axis(row["coherence"], series)
    handles, labels = panels.collect_legend(axes.ravel())
    if any(l.get_gid() == "lead" for ax in axes.ravel() for l in ax.lines):
        handles.append(Line2D([], [], linestyle="none", marker="v", markersize=5, color=NEUTRAL,
                              markeredgecolor="#333333", markeredgewidth=0.4))
        labels.append("signal left its baseline (lead)")
    if handles:
        per_row = 4 if fig.get_figwidth() > 5 else 2
        fig.legend(handles, labels, loc="outside upper center", ncols=min(len(labels), per_row),
                   handlelength=1.8)


def _share_limits(ax_row: np.ndarray) -> None:
    lo, hi = 0.0, 1.0
    for ax in ax_row:
        for coll in ax.collections:
            for path in coll.get_paths():
                v = path.vertices[:, 1]
                v = v[np.isfinite(v)]
                if len(v):
                    lo, hi = min(lo, float(v.min())), max(hi, float(v.max()))
    ax_row[0].set_ylim(lo - 0.05 * (hi - lo), hi + 0.05 * (hi - lo))


def _af_axis(ax_row: np.ndarray, series: list) -> None:
    """A right axis in amplification-factor units, on the rightmost coherence panel with data, when
    every run's multi-agent roles have one n."""
    ns = {int(n) for s in series for n in s.n_agents if n >= 2}
    drawn = [ax for ax in ax_row if not is_no_data(ax)]
    if len(ns) != 1 or not drawn:
        return
    n, ax = ns.pop(), drawn[-1]
    sec = ax.secondary_yaxis("right", functions=(lambda c: c * n, lambda a: a / n))
    sec.set_label("coherence-af")
    sec.set_ylabel(f"AF (n = {n})")

