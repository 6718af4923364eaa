"""Who actually moves the policy: gradient share against update share, and the interference matrix.

For one run with update attribution (``gradscope train --probe-updates role``, or ``Probe.attach``):

1. mass shares over time, per role: the gradient's ``‖g_r‖ / Σ_s ‖g_s‖`` (solid) and the update's
   ``‖Δθ_r‖ / Σ_s ‖Δθ_s‖`` (dashed), from per-step mean norms — any run, IP included (under IP Adam
   normalises each adapter's step, so a role with small gradients can still take full-size steps);
2. for each parameter set shared by two or more roles: the signed gradient share ``<g_r, g>/‖g‖²``
   (solid) and update share ``<Δθ_r, Δθ>/‖Δθ‖²`` (dashed), with the capture threshold (0.7);
3. the interference matrix ``<Δθ_a, g_s>``, mean over the run's records (a role's row over the
   records where the role has a gradient; a step weighs by its number of records): row a is a
   component of the step (a role's part, the unattributed part, weight decay), column s a role's
   loss gradient; negative (blue) = a's part of the update lowers s's loss to first order, positive
   (red) = raises it.

A run without update attribution raises ConfigError.
"""
from __future__ import annotations

import numpy as np
from matplotlib.colors import Normalize
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from gradscope.errors import ConfigError
from gradscope.figures import data, panels
from gradscope.figures.data import RunLike
from gradscope.figures.style import DIVERGING, NEUTRAL, role_color, theme, width
from gradscope.stats import UPDATE_EXTRAS, norm_shares

GRADIENT, UPDATE = "-", (0, (3, 1.5))


def updates_figure(run: RunLike, *, size: str = "two", smooth: int = 1) -> Figure:
    """Gradient vs update shares over time and the interference heatmap of one run (RunSeries or path)."""
    s = data.as_series(run)
    name = s.name or "run"
    if not s.has_updates:
        raise ConfigError(f"updates: {name} has no update attribution (train with --probe-updates role, or attach "
                          "the optimizer to the probe: docs/probe.md)")
    if not len(s.gram) or not np.isfinite(s.role_update_norm).any():
        raise ConfigError(f"updates: {name} has no record with an update (every record was logged without one; "
                          "train with --probe-updates role, or attach the optimizer to the probe: docs/probe.md)")
    sets = list(s.shared_sets)
    rows = 1 + len(sets)
    mk = panels.markers_for(len(s.steps))
    with theme(s.roles):
        fig = Figure(figsize=(width(size), 1.9 + 1.5 * rows), layout="constrained")
        grid = fig.add_gridspec(rows, 2, width_ratios=(2.2, 1))
        series_axes = [fig.add_subplot(grid[0, 0])]
        series_axes += [fig.add_subplot(grid[i, 0], sharex=series_axes[0]) for i in range(1, rows)]
        ax = series_axes[0]
        ax.set_label("mass-shares")
        grad, upd = (data.smooth(norm_shares(x), smooth) for x in (s.role_norm, s.role_update_norm))
        for r, role in enumerate(s.roles):
            panels.line(ax, s.steps, grad[:, r], color=role_color(role), linestyle=GRADIENT, label=f"{role} gradient", **mk)
            panels.line(ax, s.steps, upd[:, r], color=role_color(role), linestyle=UPDATE, label=f"{role} update", **mk)
        ax.set_ylim(-0.03, 1.03)
        ax.set_ylabel("mass share")
        ax.set_title(data.title(s).replace("\n", " · ") + data.smoothed(smooth),
                     fontsize=7)
        for ax, policy in zip(series_axes[1:], sets):
            ax.set_label(f"shares:{policy}")
            roles = s.set_stats(policy)["roles"]
            for key, style, what in (("share", GRADIENT, "gradient"), ("update_share", UPDATE, "update")):
                shares = panels.set_shares(s, policy, key)  # a gap where the set had nothing to share
                for j, role in enumerate(roles):
                    panels.line(ax, s.steps, data.smooth(shares[:, j], smooth), color=role_color(str(role)),
                                linestyle=style, label=f"{role} {what}", **mk)
            ax.axhline(panels.CAPTURE_THRESHOLD, color=NEUTRAL, linestyle=":", linewidth=0.9,
                       label=f"capture threshold {panels.CAPTURE_THRESHOLD}")
            ax.set_ylabel(f"signed share\n'{policy}'" if len(sets) > 1 else "signed share")
        for ax in series_axes[:-1]:
            ax.tick_params(labelbottom=False)
        series_axes[-1].set_xlabel("training step")
        series_axes[-1].xaxis.set_major_locator(MaxNLocator(nbins=8, integer=True, steps=[1, 2, 2.5, 5, 10]))
        _interference(fig.add_subplot(grid[:, 1]), s)
        handles, labels = panels.collect_legend(series_axes)
        fig.legend(handles, labels, loc="outside upper center", ncols=min(len(labels), 4 if size == "two" else 2))
    return fig


def _interference(ax, s) -> None:
    """The run's interference matrix, components × roles, mean over records (each row over the
    records where its component counts: ``RunSeries.record_interference``), annotated."""
    ax.set_label("interference")
    matrix = s.record_interference
    ok = np.isfinite(matrix)
    count = ok.sum(axis=0)
    mean = np.divide(np.where(ok, matrix, 0.0).sum(axis=0), count, out=np.full(matrix.shape[1:], np.nan),
                     where=count > 0)
    rows = [*s.roles, *UPDATE_EXTRAS]
    lim = float(np.nanmax(np.abs(mean))) if np.isfinite(mean).any() else 1.0
    im = ax.imshow(np.ma.masked_invalid(mean), cmap=DIVERGING + "_r", norm=Normalize(-lim or -1, lim or 1),
                   interpolation="nearest", aspect="auto")
    ax.set_facecolor("#DDDDDD")
    ax.grid(False)
    ax.set_xticks(range(len(s.roles)), [f"{r}\nloss" for r in s.roles])
    ax.set_yticks(range(len(rows)), [f"Δθ {r}" for r in rows])
    for lab, r in zip(ax.get_xticklabels(), s.roles):
        lab.set_color(role_color(r))
    for lab, r in zip(ax.get_yticklabels(), rows):
        lab.set_color(role_color(r) if r in s.roles else NEUTRAL)
    for i in range(len(rows)):
        for j in range(len(s.roles)):
            if np.isfinite(mean[i, j]):
                ax.text(j, i, f"{mean[i, j]:.2g}", ha="center", va="center", fontsize=5.5,
                        color="white" if abs(mean[i, j]) > 0.6 * lim else "#222222")
    ax.set_title("interference ⟨Δθ_a, g_s⟩\n< 0: a lowers s's loss", fontsize=7)
    cb = ax.figure.colorbar(im, ax=ax, location="bottom", fraction=0.06, pad=0.02)
    cb.ax.xaxis.set_major_locator(MaxNLocator(nbins=3, symmetric=True))
    cb.ax.ticklabel_format(style="sci", scilimits=(-2, 3))
    cb.ax.set_label("<colorbar>")
