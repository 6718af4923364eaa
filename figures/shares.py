"""Who drives a shared update: contribution, token and per-token shares of one run (SP).

One column per shared parameter set (a set trained by two or more roles), three panels:

1. signed contribution share ``s_r = ⟨g_r, g⟩/‖g‖²`` as a stacked area (positive shares stack up
   from 0, negative ones — a role pulling against the step — down from 0), with the capture
   threshold (0.7);
2. token share ``T_r / ΣT`` per role;
3. per-token share ``(‖g_r‖/T_r) / Σ_s ‖g_s‖/T_s`` per role.

Reading 2 against 3 tells *why* a role dominates: more tokens, or a bigger gradient per token
(the role-capture detector's ``explained_by``). The capture finding's onset (when
``analyses.capture.detect_capture`` found one) and the cliff onset are drawn as vertical lines.

A run without a shared set (IP, or no record where two roles of one set have a finite, non-zero
gradient) or without gradient records raises ConfigError: there is nothing
to split.
"""
from __future__ import annotations

import numpy as np
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from gradscope.analyses.capture import detect_capture
from gradscope.figures import data, panels
from gradscope.figures.data import RunLike
from gradscope.figures.style import new_figure, role_color, theme
from gradscope.errors import ConfigError

ROWS = ("shares", "token_share", "per_token_share")
YLABELS = {"shares": "contribution\nshare", "token_share": "token\nshare", "per_token_share": "per-token\nshare"}


def shares_figure(run: RunLike, *, size: str = "two", smooth: int = 1, height: float = 3.6) -> Figure:
    """Shares of the roles of each shared parameter set of one run (RunSeries or path)."""
    s = data.as_series(run)
    name = s.name or "run"
    if not len(s.gram):
        raise ConfigError(f"shares: {name} has no gradient records")
    if not s.shared_sets:
        why = ("an IP run: each role's update is its own" if data.policy_of(s) == "ip" else
               "no record in which two or more roles of one parameter set have a finite, non-zero gradient")
        raise ConfigError(f"shares: {name} has no parameter set shared by two or more roles ({why}); "
                          "plot cliffs shows its per-role norms")
    sets = list(s.shared_sets)
    cliff = data.cliff_of(s)
    captures = detect_capture(s) if len(s.steps) >= 10 else []
    with theme(s.roles):
        fig, axes = new_figure(size, height, len(ROWS), len(sets), sharex=True, sharey="row")
        for c, policy in enumerate(sets):
            col = {name: axes[i, c] for i, name in enumerate(ROWS)}
            col["shares"].set_label("shares")
            panels.stack_signed(col["shares"], s.steps, data.smooth(panels.set_shares(s, policy), smooth),
                                s.role_sets[policy])
            col["shares"].axhline(panels.CAPTURE_THRESHOLD, color="#7F7F7F", linestyle=":", linewidth=0.9,
                                  label=f"capture threshold {panels.CAPTURE_THRESHOLD}", zorder=4)
            for key in ("token_share", "per_token_share"):
                ax = col[key]
                ax.set_label(key)
                values = data.smooth(panels.set_shares(s, policy, key), smooth)
                mk = panels.markers_for(len(s.steps))
                for j, role in enumerate(s.role_sets[policy]):
                    panels.line(ax, s.steps, values[:, j], color=role_color(role), label=role, **mk)
                ax.set_ylim(-0.03, 1.03)
            for f in captures:
                if f.policy == policy:
                    for ax in col.values():
                        ax.axvline(f.onset, color=role_color(f.role), linestyle=(0, (1, 1)), linewidth=1.2,
                                   gid="capture-onset",
                                   label=f"capture by {f.role} (step {f.onset}; {f.evidence.get('explained_by')})")
            for ax in col.values():
                panels.mark_cliff(ax, cliff, data.last_step(s), shade=False)
            title = data.title(s) + data.smoothed(smooth)
            if len(sets) > 1:
                title += f"\nparameter set '{policy}'"
            col["shares"].set_title(title, fontsize=7)
            axes[-1, c].set_xlabel("training step")
        for i, name in enumerate(ROWS):
            axes[i, 0].set_ylabel(YLABELS[name])
        lo, hi = 0.0, 1.0
        for p in sets:
            v = np.nan_to_num(panels.set_shares(s, p))
            lo = min(lo, float(np.where(v < 0, v, 0).sum(axis=1).min()))
            hi = max(hi, float(np.where(v > 0, v, 0).sum(axis=1).max()))
        pad = 0.04 * (hi - lo)
        axes[0, 0].set_ylim(lo - pad, hi + pad)
        end = data.last_step(s)
        axes[0, 0].set_xlim(min(0, int(s.steps[0])) - max(0.6, 0.02 * end), end + max(0.6, 0.02 * end))
        axes[0, 0].xaxis.set_major_locator(MaxNLocator(nbins=8, integer=True, steps=[1, 2, 2.5, 5, 10]))
        handles, labels = panels.collect_legend(axes.ravel())
        fig.legend(handles, labels, loc="outside upper center", ncols=min(len(labels), 4 if size == "two" else 2))
    return fig
