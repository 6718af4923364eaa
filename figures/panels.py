"""Panel drawers shared by several figures. Each draws on one Axes and labels its artists:

* an Axes' label (``ax.get_label()``) names its panel: ``accuracy``, ``grad_norm``, ``coherence``,
  ``shares``, ``token_share``, ``per_token_share``, ``alignment``;
* a role's line (or stacked area) has the role's name as its label and the role's colour;
* the cliff's shaded collapsed region has gid ``cliff``, its onset line gid ``cliff-onset``;
* a panel without data carries a text with gid ``no-data`` (:func:`figures.style.mark_no_data`).
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from matplotlib.axes import Axes
from matplotlib.lines import Line2D
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

from gradscope.analyses.findings import Finding
from gradscope.analyses.series import RunSeries
from gradscope.figures import data
from gradscope.figures.style import ACCURACY_COLOR, CLIFF_COLOR, NEUTRAL, mark_no_data, role_color

AMPLIFICATION_THRESHOLD = 0.75   # analyses.amplification default coherence
CAPTURE_THRESHOLD = 0.7          # analyses.capture default share


def markers_for(n: int) -> dict:
    """Point markers when a series is short (a one-step line is otherwise invisible)."""
    return {"marker": "o", "markersize": 2.5} if n <= 30 else {}


def widen(x: np.ndarray, *ys: np.ndarray) -> tuple[np.ndarray, ...]:
    """A single step becomes a one-step-wide band, so areas of one-step runs stay visible."""
    if len(x) != 1:
        return (x, *ys)
    return (np.array([x[0] - 0.5, x[0] + 0.5]), *(np.repeat(y, 2, axis=0) for y in ys))


def line(ax: Axes, x: np.ndarray, y: np.ndarray, **kw) -> Line2D:
    """``ax.plot`` that also shows isolated finite points (a value between two gaps draws no line
    segment) as dots of the same colour."""
    (ln,) = ax.plot(x, y, **kw)
    y = np.asarray(y, dtype=float)
    ok = np.isfinite(y)
    if "marker" not in kw and ok.any():
        prev = np.concatenate([[False], ok[:-1]])
        nxt = np.concatenate([ok[1:], [False]])
        alone = ok & ~prev & ~nxt
        if alone.any():
            ax.plot(np.asarray(x)[alone], y[alone], linestyle="none", marker="o", markersize=1.8,
                    color=kw.get("color"), label="_isolated", zorder=ln.get_zorder())
    return ln


def log_ticks(ax: Axes) -> None:
    """Readable ticks on a log axis after its limits are known: 1-2-5 steps within a decade or two,
    plain powers of ten beyond; numbers written plainly (0.05, not 5×10⁻²) down to 1e-3."""
    lo, hi = ax.get_ylim()
    if not (lo > 0 and hi > lo):
        return
    decades = np.log10(hi / lo)
    subs = (1.0, 2.0, 5.0) if decades <= 1.6 else (1.0,) if decades <= 4 else None
    if subs is None:
        ax.yaxis.set_major_locator(LogLocator(base=10, numticks=5))
    else:
        ax.yaxis.set_major_locator(LogLocator(base=10, subs=subs))
    if lo >= 1e-3 and hi <= 1e4:
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(NullFormatter())


# ------------------------------------------------------------------ accuracy
def accuracy(ax: Axes, series: RunSeries, cliff: Finding | None, *, show_final: bool = False) -> bool:
    """Held-out accuracy, the base level, the peak (the detector's when it found a cliff)."""
    ax.set_label("accuracy")
    acc = series.accuracy
    if not len(acc):
        mark_no_data(ax, "no accuracy evaluations")
        return False
    x, y = acc.index.to_numpy(), acc.to_numpy(dtype=float)
    ax.plot(x, y, color=ACCURACY_COLOR, marker="o", markersize=2.2, linewidth=1.0, label="accuracy",
            zorder=3)
    ax.axhline(y[0], color=NEUTRAL, linestyle="--", linewidth=0.8, label="base model (step %d)" % x[0]
               if x[0] else "base model", zorder=1)
    peak_step = cliff.evidence["peak_step"] if cliff else int(x[int(np.nanargmax(y))])
    peak = float(acc.loc[peak_step])
    ax.plot([peak_step], [peak], linestyle="none", marker="*", markersize=7, color="#E69F00",
            markeredgecolor=ACCURACY_COLOR, markeredgewidth=0.4, label="peak", zorder=5, gid="peak")
    if show_final:
        ax.plot([x[-1]], [y[-1]], linestyle="none", marker="o", markersize=4, markerfacecolor="white",
                markeredgecolor=ACCURACY_COLOR, label="final", zorder=5, gid="final")
    return True


def mark_cliff(ax: Axes, cliff: Finding | None, end: float, *, shade: bool = True) -> None:
    """The onset line and the collapsed region [onset, end of run], in every panel of a column."""
    if cliff is None:
        return
    if shade:
        ax.axvspan(cliff.onset, max(end, cliff.onset + 0.5), color=CLIFF_COLOR, alpha=0.09, linewidth=0,
                   label="after cliff onset", gid="cliff", zorder=0)
    ax.axvline(cliff.onset, color=CLIFF_COLOR, linestyle=(0, (4, 2)), linewidth=0.9,
               label="cliff onset", gid="cliff-onset", zorder=2)


# ------------------------------------------------------------------ gradients
def grad_norms(ax: Axes, series: RunSeries, window: int = 1) -> bool:
    """One line per role: ‖g_r‖ per step (log scale); hatched where the whole step had no gradient."""
    ax.set_label("grad_norm")
    ax.set_yscale("log")
    if not len(series.gram):
        mark_no_data(ax, "no gradient records")
        return False
    norms = np.where(series.role_norm > 0, series.role_norm, np.nan)
    norms = data.smooth(norms, window)
    mk = markers_for(len(series.steps))
    for r, role in enumerate(series.roles):
        line(ax, series.steps, norms[:, r], color=role_color(role), label=role, **mk)
    for a, b in data.spans(data.zero_gradient_steps(series), series.steps):
        ax.axvspan(a, b, facecolor="none", edgecolor=NEUTRAL, hatch="/////", linewidth=0, alpha=0.6,
                   label="zero gradient", gid="zero-gradient", zorder=0)
    return True


def coherence(ax: Axes, series: RunSeries, window: int = 1) -> bool:
    """Coherence AF_r/n_r of each role with ≥ 2 agents, with the detector's threshold and the
    level of independent agents (1/√n)."""
    ax.set_label("coherence")
    multi = [r for r in range(len(series.roles)) if series.n_agents[r] >= 2]
    if not len(series.gram):
        mark_no_data(ax, "no gradient records")
        return False
    if not multi:
        mark_no_data(ax, "no role has two or more agents")
        return False
    coh = data.smooth(series.coherence, window)
    mk = markers_for(len(series.steps))
    for r in multi:
        line(ax, series.steps, coh[:, r], color=role_color(series.roles[r]), label=series.roles[r], **mk)
    ax.axhline(AMPLIFICATION_THRESHOLD, color=NEUTRAL, linestyle=":", linewidth=0.9,
               label=f"coherence threshold {AMPLIFICATION_THRESHOLD}")
    for n in sorted({int(series.n_agents[r]) for r in multi}):
        ax.axhline(1 / np.sqrt(n), color=NEUTRAL, linestyle="-.", linewidth=0.7,
                   label=r"independent agents $1/\sqrt{n}$")
    return True


def shares(ax: Axes, series: RunSeries, policy: str | None = None, window: int = 1) -> bool:
    """Signed contribution shares of the roles of a shared parameter set as a stacked area:
    positive shares stack up from 0, negative ones (roles pulling against the step) down from 0."""
    ax.set_label("shares")
    if not len(series.gram):
        mark_no_data(ax, "no gradient records")
        return False
    if not series.shared_sets:
        mark_no_data(ax, "no parameter set shared by two roles (IP):\neach role has its own update")
        return False
    policy = policy or max(series.shared_sets, key=lambda p: len(series.shared_sets[p]))
    stack_signed(ax, series.steps, data.smooth(set_shares(series, policy), window),
                 [str(r) for r in series.role_sets[policy]])
    ax.axhline(CAPTURE_THRESHOLD, color=NEUTRAL, linestyle=":", linewidth=0.9,
               label=f"capture threshold {CAPTURE_THRESHOLD}", zorder=4)
    return True


def set_shares(series: RunSeries, policy: str, key: str = "share") -> np.ndarray:
    """(T, R_p) per-step shares of a parameter set's roles; NaN at steps where the set had no
    gradient at all (the statistics define shares of a zero gradient as 0: not a measurement)."""
    values = np.array(series.set_stats(policy)[key], dtype=float)
    values[np.nansum(np.abs(values), axis=1) == 0] = np.nan
    return values


def stack_signed(ax: Axes, steps: np.ndarray, values: np.ndarray, roles: Sequence[str]) -> None:
    x, values = widen(np.asarray(steps, dtype=float), np.asarray(values, dtype=float))
    up = np.zeros(len(x))
    down = np.zeros(len(x))
    for j, role in enumerate(roles):
        v = values[:, j]
        pos, neg = np.where(v > 0, v, 0.0), np.where(v < 0, v, 0.0)
        pos[~np.isfinite(v)] = np.nan
        neg[~np.isfinite(v)] = np.nan
        ax.fill_between(x, up, up + pos, color=role_color(role), alpha=0.85, linewidth=0, label=role, zorder=2)
        if (neg < 0).any():
            ax.fill_between(x, down + neg, down, color=role_color(role), alpha=0.85, linewidth=0,
                            label=f"_{role} (negative)", zorder=2)
        up, down = up + np.nan_to_num(pos), down + np.nan_to_num(neg)
    ax.axhline(0, color="#333333", linewidth=0.5, zorder=3)


def alignment(ax: Axes, series: RunSeries, window: int = 1) -> bool:
    """Mean cosine of agent pairs within each role (role colour) and across roles that share
    parameters (grey, dashed)."""
    ax.set_label("alignment")
    if not len(series.gram):
        mark_no_data(ax, "no gradient records")
        return False
    groups = data.pair_alignment(series)
    if not groups:
        mark_no_data(ax, "no two agents with gradients in one record")
        return False
    mk = markers_for(len(series.steps))
    dashes = [(0, (3, 1.5)), (0, (1, 1)), (0, (5, 1, 1, 1))]
    cross = 0
    for group, values in groups.items():
        values = data.smooth(values, window)
        if "–" in group:
            line(ax, series.steps, values, color=NEUTRAL, linestyle=dashes[cross % len(dashes)], linewidth=0.9,
                    label=f"{group} pairs", **mk)
            cross += 1
        else:
            line(ax, series.steps, values, color=role_color(group), label=f"{group} pairs", **mk)
    ax.axhline(0, color="#333333", linewidth=0.5, zorder=1)
    return True


# ------------------------------------------------------------------ legends
def collect_legend(axes: Sequence[Axes]) -> tuple[list, list[str]]:
    """Handles and labels of all panels, deduplicated by label, in a fixed order: roles first."""
    seen: dict[str, object] = {}
    for ax in axes:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            if lab and not lab.startswith("_") and lab not in seen:
                seen[lab] = h
    return list(seen.values()), list(seen.keys())
