"""Shared-policy role capture: one role's gradient dominates a shared parameter set.

Default: in a parameter set trained by ≥ 2 roles, one role's contribution share ``s_r ≥ 0.7`` on at
least 80% of a 10-step window; qualifying windows of one role and set at most ``gap`` (20) steps
apart are one finding. The finding says whether the role's per-token
gradient or only its token count explains the dominance, and reports the text-side signature from
the evaluation records: other roles' output lengths drifting toward the dominant role's, and their
format validity falling.

With update attribution (``--probe-updates``) the same window rule runs on the role's **update share**
``<Δθ_r, Δθ>/‖Δθ‖²`` too — what AdamW actually applied, which can differ from the gradient share
because every role's part of the step is divided by the same ``√v``. Every finding reports both means
and their difference (``measured_by`` says which share crossed the threshold); the steps of an
update-share episode outside every gradient-share episode (a window of them at least) are a finding of
their own.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from gradscope.analyses.findings import Finding
from gradscope.analyses.series import RunSeries
from gradscope.analyses.thresholds import CaptureConfig
from gradscope.analyses.windows import episodes, merge_close, sustained

__all__ = ["CaptureConfig", "detect_capture", "text_signature"]


def detect_capture(series: RunSeries, cfg: CaptureConfig = CaptureConfig()) -> list[Finding]:
    out: list[Finding] = []
    if len(series.steps) < cfg.window:
        return out
    for policy, roles in series.shared_sets.items():
        st = series.set_stats(policy)
        measures = {"gradient share": st["share"]}
        if "update_share" in st:
            measures["update share"] = st["update_share"]
        for j, role in enumerate(roles):
            by_gradient: list[tuple[int, int]] = []
            for measure, values in measures.items():
                share = values[:, j]
                qualifies = sustained(share >= cfg.share, cfg.window, cfg.fraction)
                found = merge_close(episodes(qualifies, cfg.window), series.steps, cfg.gap)
                if measure == "gradient share":
                    by_gradient = found
                else:  # the gradient share's findings report the update share of their own steps
                    found = [p for a, b in found for p in _uncovered(a, b, by_gradient, cfg.window)]
                for a, b in found:
                    onset = a + int(np.argmax(share[a:b + 1] >= cfg.share))
                    out.append(_finding(series, st, policy, roles, j, measure, a, b, onset, cfg))
    return out


def _uncovered(a: int, b: int, covered: list[tuple[int, int]], min_len: int) -> list[tuple[int, int]]:
    """The parts of indices ``a..b`` outside every ``covered`` range, each at least ``min_len`` long."""
    parts, start = [], a
    for c, d in sorted(covered):
        if d >= start and c <= b:
            if c > start:
                parts.append((start, c - 1))
            start = max(start, d + 1)
    if start <= b:
        parts.append((start, b))
    return [(x, y) for x, y in parts if y - x + 1 >= min_len]


def _finding(series: RunSeries, st: dict, policy: str, roles: list[str], j: int, measure: str, a: int, b: int,
             onset: int, cfg: CaptureConfig) -> Finding:
    """Role ``roles[j]`` dominating ``policy``'s update over steps ``a..b`` (indices), by ``measure``."""
    role, seg, steps = roles[j], slice(a, b + 1), series.steps
    fair = 1.0 / len(roles)
    tok, per_tok = float(np.nanmean(st["token_share"][seg, j])), float(np.nanmean(st["per_token_share"][seg, j]))
    by_tokens, by_grad = tok >= fair + cfg.excess - 1e-9, per_tok >= fair + cfg.excess - 1e-9  # as `sustained`
    explained = {(True, True): "both", (True, False): "token count",
                 (False, True): "per-token gradient", (False, False): "neither"}[(by_tokens, by_grad)]
    mean_share = float(np.nanmean(st["share"][seg, j]))
    evidence = {"measured_by": measure, "mean_share": mean_share}
    if "update_share" in st:
        mean_update = float(np.nanmean(st["update_share"][seg, j]))
        evidence.update(mean_update_share=mean_update, update_minus_gradient_share=mean_update - mean_share)
    dominant = evidence["mean_update_share"] if measure == "update share" else mean_share
    # Dominance by token count alone is the workflow's shape (3 voters write 3× the
    # tokens), not a change in per-token dynamics: report it, at low severity.
    severity = "info" if explained == "token count" else "critical" if dominant >= 0.9 else "warning"
    what = (f"the shared parameters '{policy}' (share {mean_share:.2f}" if measure == "gradient share" else
            f"the update of the shared parameters '{policy}' (update share {dominant:.2f}, gradient share "
            f"{mean_share:.2f}")
    if measure == "gradient share" and "mean_update_share" in evidence:
        what += f", update share {evidence['mean_update_share']:.2f}"
    evidence.update(token_share=tok, per_token_share=per_tok, explained_by=explained, roles_in_set=list(roles),
                    text_signature=text_signature(series.evals, role, roles, int(steps[onset])))
    return Finding(kind="capture", severity=severity,
                   summary=f"'{role}' dominates {what}) from step {steps[onset]}; explained by {explained}",
                   onset=int(steps[onset]), start=int(steps[a]), end=int(steps[b]), role=role, policy=policy,
                   evidence=evidence)


def text_signature(evals: pd.DataFrame, dominant: str, roles: list[str], onset: int) -> dict[str, dict[str, float]]:
    """Per other role: mean |length − dominant's length| and format validity, before vs after onset."""
    out: dict[str, dict[str, float]] = {}
    if evals.empty or f"length/{dominant}" not in evals:
        return out
    before, after = evals[evals.index < onset], evals[evals.index >= onset]
    if before.empty or after.empty:
        return out
    for other in roles:
        if other == dominant or f"length/{other}" not in evals:
            continue
        gap = (evals[f"length/{other}"] - evals[f"length/{dominant}"]).abs()
        row = {"length_gap_before": float(gap[before.index].mean()), "length_gap_after": float(gap[after.index].mean())}
        if f"format_valid/{other}" in evals:
            row["format_valid_before"] = float(before[f"format_valid/{other}"].mean())
            row["format_valid_after"] = float(after[f"format_valid/{other}"].mean())
        out[other] = row
    return out
