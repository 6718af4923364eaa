"""Agent cosine alignment of one run: which agents' gradients point the same way, and when.

Cosines are ``gradscope.stats.cosine(M)`` per record, averaged over a training step's records in
which both agents have a gradient (``RunSeries.agent_cosine``). Two views:

* over time (default): a heatmap, one row per agent pair that was ever measured (pairs within a
  role first, grouped by role; then pairs across roles that share parameters), one column per
  training step; diverging colours centred on 0 (blue = aligned, red = opposed). Under IP, pairs
  across roles are never measured (different parameters) and have no row.
* at chosen steps (``steps=[...]``): the K×K cosine matrix at each step, averaged over the
  ``window`` steps ending there; the diagonal (1 by definition) and cells never measured are grey.

No gradient records, or no two agents ever measured together, raise ConfigError.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from matplotlib.colors import Normalize
from matplotlib.figure import Figure

from gradscope.figures import data
from gradscope.figures.data import RunLike
from gradscope.figures.style import DIVERGING, new_figure, role_color, theme
from gradscope.errors import ConfigError


def alignment_figure(run: RunLike, *, steps: Sequence[int] | None = None, window: int = 1, size: str = "two",
                     vmax: float | None = None) -> Figure:
    """Agent cosine heatmap over time (``steps=None``) or the cosine matrices at ``steps``."""
    s = data.as_series(run)
    name = s.name or "run"
    if not len(s.gram):
        raise ConfigError(f"alignment: {name} has no gradient records")
    cos = s.agent_cosine
    pairs = [(g, k, l) for g, ps in data.pair_groups(s).items() for k, l in ps if np.isfinite(cos[:, k, l]).any()]
    if not pairs:
        raise ConfigError(f"alignment: {name} never has two agents with a gradient in one record")
    if window < 1:
        raise ConfigError(f"alignment: window must be at least 1, got {window}")
    if steps:
        return _at_steps(s, cos, list(steps), window, size, vmax)
    return _over_time(s, cos, pairs, window, size, vmax)


def _limit(values: np.ndarray, vmax: float | None) -> float:
    if vmax is not None:
        return float(vmax)
    v = np.abs(values[np.isfinite(values)])
    if not len(v):
        return 1.0
    return float(np.clip(np.ceil(np.quantile(v, 0.98) * 10) / 10, 0.2, 1.0))


def _edges(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=float)
    if len(x) == 1:
        return np.array([x[0] - 0.5, x[0] + 0.5])
    mid = (x[:-1] + x[1:]) / 2
    return np.concatenate([[x[0] - (mid[0] - x[0])], mid, [x[-1] + (x[-1] - mid[-1])]])


def _over_time(s, cos, pairs, window: int, size: str, vmax: float | None) -> Figure:
    rows = np.stack([cos[:, k, l] for _, k, l in pairs], axis=0)              # (P, T)
    rows = data.smooth(rows.T, window).T
    lim = _limit(rows, vmax)
    labels = [f"{s.agents[k]} · {s.agents[l]}" for _, k, l in pairs]
    with theme(s.roles):
        fig, axes = new_figure(size, max(1.5, 0.75 + 0.16 * len(pairs)), 1, 1)
        ax = axes[0, 0]
        ax.set_label("alignment-heatmap")
        mesh = ax.pcolormesh(_edges(s.steps), np.arange(len(pairs) + 1), np.ma.masked_invalid(rows),
                             cmap=DIVERGING, norm=Normalize(-lim, lim), shading="flat", rasterized=True)
        ax.set_facecolor("#EEEEEE")
        ax.grid(False)
        ax.set_yticks(np.arange(len(pairs)) + 0.5, labels)
        ax.invert_yaxis()
        groups = [g for g, _, _ in pairs]
        for i, g in enumerate(groups):
            ax.get_yticklabels()[i].set_color(role_color(g) if "–" not in g else "#333333")
            if i and g != groups[i - 1]:
                ax.axhline(i, color="white", linewidth=1.5)
        ax.set_xlabel("training step")
        ax.set_ylabel("agent pair")
        ax.set_title(data.title(s).replace("\n", " · ") + data.smoothed(window),
                     fontsize=7)
        cb = fig.colorbar(mesh, ax=ax, fraction=0.05, pad=0.01, aspect=12 if len(pairs) > 4 else 6)
        cb.set_label("cosine")
        cb.ax.set_label("<colorbar>")
    return fig


def _at_steps(s, cos, steps: list[int], window: int, size: str, vmax: float | None) -> Figure:
    have = s.steps
    mats, spans = [], []
    for step in steps:
        sel = (have <= step) & (have > step - window)
        if not sel.any() or step > have[-1]:  # past the run's end a window would hold only its end
            raise ConfigError(f"alignment: no gradient records at step {step}" +
                              (f" or the {window - 1} before it" if window > 1 and step <= have[-1] else "") +
                              f" (the run has steps {have[0]}–{have[-1]})")
        spans.append((int(have[sel][0]), int(have[sel][-1])))  # the steps with records the matrix averages
        chunk = cos[sel]
        ok = np.isfinite(chunk)
        count = ok.sum(axis=0)
        mats.append(np.divide(np.where(ok, chunk, 0).sum(axis=0), count, out=np.full(chunk.shape[1:], np.nan),
                              where=count > 0))
    K = len(s.agents)
    off = np.array([m[~np.eye(K, dtype=bool)] for m in mats])
    lim = _limit(off, vmax)
    n = len(steps)
    per = 7.0 if size == "two" else 3.4
    name_room = 0.35 + 0.06 * max(len(a) for a in s.agents)   # agent names left of / below the matrices
    cell = min(1.9, (per - name_room - 0.7 - 0.1 * n) / max(n, 1))
    with theme(s.roles):
        fig, axes = new_figure(size, min(5.0, cell + 0.2 + name_room), 1, n, sharey=True)
        for ax, step, m, (first, last) in zip(axes[0], steps, mats, spans):
            ax.set_label(f"alignment:{step}")
            m = np.where(np.eye(K, dtype=bool), np.nan, m)  # the diagonal is 1 by definition: grey
            im = ax.imshow(np.ma.masked_invalid(m), cmap=DIVERGING, norm=Normalize(-lim, lim), interpolation="nearest")
            ax.set_facecolor("#DDDDDD")
            ax.grid(False)
            ax.set_xticks(range(K), s.agents, rotation=90)
            ax.set_yticks(range(K), s.agents)
            for lab, r in zip(ax.get_xticklabels(), s.agent_roles):
                lab.set_color(role_color(r))
            for lab, r in zip(ax.get_yticklabels(), s.agent_roles):
                lab.set_color(role_color(r))
            if K <= 6:
                for i in range(K):
                    for j in range(K):
                        if np.isfinite(m[i, j]):
                            ax.text(j, i, f"{round(m[i, j], 2) + 0.0:.2f}", ha="center", va="center", fontsize=5.5,
                                    color="white" if abs(m[i, j]) > 0.6 * lim else "#222222")
            ax.set_title(f"step {step}" if first == last else f"steps {first}–{last}")
        fig.suptitle(data.title(s).replace("\n", " · "), fontsize=7)
        cb = fig.colorbar(im, ax=list(axes[0]), fraction=0.04, pad=0.02, shrink=0.9)
        cb.set_label("cosine")
        cb.ax.set_label("<colorbar>")
    return fig
