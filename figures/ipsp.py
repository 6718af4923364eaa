"""IP vs SP: held-out accuracy of the two policies side by side.

One panel per policy (IP left, SP right, then any other sharing map), same y scale. With one run
per policy: its curve. With several (seeds): each seed as a thin line, their mean as a thick one
and a band — ±1 SD with three or more seeds, the min–max range with two — at the steps where every
seed has an evaluation (a seed that ends early ends the mean; runs of a policy without such a step
raise ConfigError). Marked on the mean: the peak (★) and the final value (○), both with their values
in the legend; the base model (each run's first evaluation, mean over the runs) as a dashed line;
where the cliff detector found a terminal cliff in a seed, its onset as a red ▼ on that seed's curve.

The runs must be of one workflow, task and model: anything else is not an IP-vs-SP comparison
(``gradscope plot sweep`` compares across them) and raises ConfigError, as does a run without
accuracy evaluations (it cannot be part of an accuracy figure) or a missing side.
"""
from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from gradscope import labels
from gradscope.figures import data
from gradscope.figures.data import RunLike
from gradscope.figures.style import ACCURACY_COLOR, CLIFF_COLOR, NEUTRAL, new_figure, policy_color, theme
from gradscope.errors import ConfigError

ORDER = {"ip": 0, "sp": 1}


def group_by_policy(series: list) -> dict[str, list]:
    groups: dict[str, list] = {}
    for s in series:
        groups.setdefault(data.policy_of(s), []).append(s)
    return dict(sorted(groups.items(), key=lambda kv: (ORDER.get(kv[0], 2), kv[0])))


def ip_vs_sp_figure(runs: Iterable[RunLike], *, size: str = "two", height: float | None = None) -> Figure:
    """Accuracy curves of IP and SP runs (RunSeries or paths), one panel per policy."""
    series = data.as_series_list(runs)
    data.check_same(series, ("workflow", "task", "model"), "ip-vs-sp",
                    "compare IP and SP of one workflow, task and model at a time (plot sweep compares across)")
    empty = [Path(s.name).name or "run" for s in series if not len(s.accuracy)]
    if empty:
        raise ConfigError(f"ip-vs-sp: no accuracy evaluations in {', '.join(empty)}; an accuracy figure "
                          "cannot show it")
    groups = group_by_policy(series)
    missing = [p.upper() for p in ("ip", "sp") if p not in groups]
    if missing:
        raise ConfigError(f"ip-vs-sp: no {' or '.join(missing)} run given (policies found: "
                          f"{', '.join(labels.policy_label(g) for g in groups)}); give at least one IP and one SP run")
    with theme():
        fig, axes = new_figure(size, height or (2.3 if size == "two" else 3.3), 1, len(groups), sharey=True,
                               sharex=True)
        top = 0.0
        for ax, (policy, runs_) in zip(axes[0], groups.items()):
            top = max(top, _panel(ax, policy, runs_, legend_cols=2 if size == "two" else 1))
        axes[0, 0].set_ylabel("held-out accuracy")
        axes[0, 0].set_ylim(-0.02, min(1.02, top + 0.08) if top <= 1 else 1.05 * top)  # accuracy in percent: all of it
        axes[0, 0].xaxis.set_major_locator(MaxNLocator(nbins=8, integer=True, steps=[1, 2, 2.5, 5, 10]))
        d = data.describe(series[0])
        fig.suptitle(f"{d['workflow']} / {d['task']} · {d['model']}", fontsize=8)
    return fig


def _panel(ax, policy: str, runs: list, legend_cols: int = 2) -> float:
    ax.set_label(f"accuracy:{policy}")
    color = policy_color(policy)
    curves = pd.concat({i: s.accuracy for i, s in enumerate(runs)}, axis=1).sort_index()
    common = curves.dropna()  # the steps where every run has an evaluation: a mean of all n, never of fewer
    n = len(runs)
    if common.empty:
        raise ConfigError(f"ip-vs-sp: the {labels.policy_label(policy)} runs "
                          f"({', '.join(Path(s.name).name or 'run' for s in runs)}) have no evaluation step in "
                          "common; their mean needs every run evaluated at the same steps")
    steps = common.index.to_numpy()
    mean = common.mean(axis=1).to_numpy(dtype=float)
    if n > 1:
        for i, s in enumerate(runs):
            ax.plot(s.accuracy.index, s.accuracy.to_numpy(dtype=float), color=color, alpha=0.35, linewidth=0.6,
                    label="seeds" if i == 0 else "_seed", gid="seed")
        if n >= 3:
            sd = common.std(axis=1, ddof=1).to_numpy(dtype=float)
            lo, hi, band = mean - sd, mean + sd, "±1 SD"
        else:
            lo, hi, band = common.min(axis=1).to_numpy(float), common.max(axis=1).to_numpy(float), "range"
        ax.fill_between(steps, lo, hi, color=color, alpha=0.18, linewidth=0, label=f"{band} ({n} runs)", gid="band")
    ax.plot(steps, mean, color=color, linewidth=1.5, marker="o", markersize=2.2,
            label=f"mean of {n}" if n > 1 else "accuracy", gid="mean")
    base = float(np.nanmean([s.accuracy.iloc[0] for s in runs]))
    ax.axhline(base, color=NEUTRAL, linestyle="--", linewidth=0.8, label=f"base model {base:.3f}", gid="base")
    k = int(np.nanargmax(mean))
    ax.plot([steps[k]], [mean[k]], linestyle="none", marker="*", markersize=8, color="#E69F00",
            markeredgecolor=ACCURACY_COLOR, markeredgewidth=0.4, zorder=5, gid="peak",
            label=f"peak {mean[k]:.3f} (step {steps[k]})")
    last = len(mean) - 1
    ax.plot([steps[last]], [mean[last]], linestyle="none", marker="o", markersize=4.5, markerfacecolor="white",
            markeredgecolor=ACCURACY_COLOR, markeredgewidth=0.8, zorder=5, gid="final",
            label=f"final {mean[last]:.3f} (Δ {mean[last] - base:+.3f})")
    onsets = [(c.onset, float(s.accuracy.get(c.onset, np.nan))) for s in runs if (c := data.cliff_of(s))]
    if onsets:
        ax.plot([o for o, _ in onsets], [v for _, v in onsets], linestyle="none", marker="v", markersize=5,
                color=CLIFF_COLOR, zorder=6, gid="cliff-onset", label=f"cliff onset ({len(onsets)} of {n})")
    ax.set_title(labels.policy_label(policy) + (f" · {n} runs" if n > 1 else ""), color=color, fontweight="bold")
    ax.set_xlabel("training step")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.2), ncols=legend_cols, borderaxespad=0,
              fontsize=6.3 if legend_cols == 2 else 5.8, handlelength=1.4)
    tops = [curves.to_numpy(dtype=float)] + ([hi] if n > 1 else [])  # the band's top too: never clipped
    return float(max(np.nanmax(t) for t in tops))
