"""Running every detector on a run, and rendering the report as text, JSON or Markdown."""
from __future__ import annotations

import io
import json
import numpy as np

from gradscope.analyses.amplification import detect_amplification, detect_update_amplification
from gradscope.analyses.capture import detect_capture
from gradscope.analyses.cliff import detect_cliff
from gradscope.analyses.findings import Finding, Report
from gradscope.analyses.series import RunSeries
from gradscope.analyses.thresholds import AnalysisConfig
from gradscope.labels import MISSING, describe, is_missing, number, text
from gradscope.stats import norm_shares

KINDS = ("amplification", "capture", "cliff")


def analyze_series(series: RunSeries, cfg: AnalysisConfig = AnalysisConfig(), *, closed: bool = True) -> Report:
    """Every detector on ``series``; ``notes`` say what could not be analysed."""
    notes = []
    if not closed:
        notes.append(f"the run file was not closed (a live or killed writer): analysed its {len(series.gram)} "
                     "complete records")
    bad = int((~series.finite).sum())
    if bad:
        notes.append(f"{bad} record(s) with non-finite Gram entries were left out of every statistic")
    findings: list[Finding] = []
    if len(series.gram) == 0:
        notes.append("no gradient records: amplification and capture not analysed")
    elif len(series.steps) < max(cfg.amplification.window, cfg.capture.window):
        notes.append(f"only {len(series.steps)} step(s) with gradient records: amplification and capture need "
                     f"at least {max(cfg.amplification.window, cfg.capture.window)}")
    else:
        findings += detect_amplification(series, cfg.amplification)
        findings += detect_update_amplification(series, cfg.amplification)
        findings += detect_capture(series, cfg.capture)
        if not series.finite.any():
            notes.append("every gradient record is non-finite: no gradient statistic could be computed")
        else:
            if not any(series.n_agents >= 2):
                notes.append("no role has two or more agents: amplification does not apply")
            if not series.shared_sets:
                notes.append("no parameter set is shared by two or more roles: capture does not apply")
    checked = len(series.accuracy) >= 3
    if not checked:
        notes.append(f"{len(series.accuracy)} accuracy evaluation(s): cliff detection needs at least 3")
    else:
        findings += detect_cliff(series, cfg.cliff)
    return Report(run=series.name, summary=summarize(series), findings=findings, notes=notes, cliff_checked=checked)


def summarize(series: RunSeries) -> dict:
    acc = series.accuracy
    out = {"workflow": series.config.get("workflow"), "policy": series.config.get("policy"),
           "model": series.config.get("model"), "task": series.config.get("task"),
           "scale": series.config.get("scale"),  # (the testbed's size: its label is testbed-<scale>, as in tables)
           "agents": series.agents, "roles": series.roles, "steps": int(len(series.steps)),
           "records": int(len(series.gram))}
    if len(acc):
        out.update(base=float(acc.iloc[0]), peak=float(acc.max()), peak_step=int(acc.idxmax()),
                   final=float(acc.iloc[-1]), delta=float(acc.iloc[-1] - acc.iloc[0]))
    if len(series.gram):
        coh = {role: float(np.nanmax(series.coherence[:, r])) for r, role in enumerate(series.roles)
               if series.n_agents[r] >= 2 and np.isfinite(series.coherence[:, r]).any()}
        out["max_coherence"] = coh
        shares = {}
        for policy in series.shared_sets:
            st = series.set_stats(policy)
            mean = np.nanmean(st["share"], axis=0) if np.isfinite(st["share"]).any() else None
            if mean is not None:
                j = int(np.nanargmax(mean))
                shares[policy] = {"role": str(st["roles"][j]), "mean_share": float(mean[j])}
        out["dominant_share"] = shares
    if series.has_updates and len(series.gram):
        out["updates"] = update_summary(series)
    return out


def update_summary(series: RunSeries) -> dict:
    """Gradient against update, per role (means over the training steps): mass shares of the per-step role
    norms (every run), and for each shared parameter set the signed gradient and update shares."""
    grad_mass, update_mass = norm_shares(series.role_norm), norm_shares(series.role_update_norm)
    roles = {role: {"gradient_norm": _nanmean(series.role_norm[:, r]),
                    "update_norm": _nanmean(series.role_update_norm[:, r]),
                    "gradient_mass_share": _nanmean(grad_mass[:, r]),
                    "update_mass_share": _nanmean(update_mass[:, r])} for r, role in enumerate(series.roles)}
    sets = {}
    for policy, members in series.shared_sets.items():
        st = series.set_stats(policy)
        sets[policy] = {role: {"gradient_share": _nanmean(st["share"][:, j]),
                               "update_share": _nanmean(st["update_share"][:, j])} for j, role in enumerate(members)}
    return {"roles": roles, "shared_sets": sets}


def _nanmean(x: np.ndarray) -> float:
    return float(np.nanmean(x)) if np.isfinite(x).any() else float("nan")


def _update_lines(s: dict) -> list[str]:
    """The summary's gradient-vs-update comparison as readable lines (none without update attribution)."""
    if "updates" not in s:
        return []
    u = s["updates"]
    lines = ["gradient → update mass share: " + ", ".join(
        f"{role} {number(v['gradient_mass_share'], '.2f')} → {number(v['update_mass_share'], '.2f')}"
        for role, v in u["roles"].items())]
    for policy, roles in u["shared_sets"].items():
        lines.append(f"gradient → update share in '{policy}': " + ", ".join(
            f"{role} {number(v['gradient_share'], '.2f')} → {number(v['update_share'], '.2f')}"
            for role, v in roles.items()))
    return lines


# ------------------------------------------------------------------ rendering
#: Findings per kind that text and Markdown show by default (``analyze --max-findings``; JSON: all).
MAX_PER_KIND = 5
_RANK = {"critical": 0, "warning": 1, "info": 2}


def shown(findings: list[Finding], max_per_kind: int | None = MAX_PER_KIND) -> tuple[list[Finding], dict[str, int]]:
    """The findings a text report lists — per kind the ``max_per_kind`` most severe (ties: the
    earliest onset), in report order — and how many of each kind it leaves out."""
    if max_per_kind is None:
        return list(findings), {}
    keep: set[int] = set()
    hidden: dict[str, int] = {}
    for kind in dict.fromkeys(f.kind for f in findings):
        mine = [i for i, f in enumerate(findings) if f.kind == kind]
        ranked = sorted(mine, key=lambda i: (_RANK.get(findings[i].severity, 3), findings[i].onset))
        keep.update(ranked[:max_per_kind])
        if len(mine) > max_per_kind:
            hidden[kind] = len(mine) - max_per_kind
    return [f for i, f in enumerate(findings) if i in keep], hidden


def _hidden_lines(hidden: dict[str, int]) -> list[str]:
    return [f"{n} more {kind} finding(s) not shown (--max-findings; --json lists all)" for kind, n in hidden.items()]


def _header(s: dict) -> tuple[str, str | None]:
    """The run line (workflow / task / policy / model, steps, records) and the accuracy line (None without
    evaluations), missing values as gradscope.labels renders them."""
    d = describe(s)
    run = (f"{d['workflow']} / {d['task']} / policy {d['policy']} / model {d['model']} · {s['steps']} steps, "
           f"{s['records']} records")
    if "peak" not in s:
        return run, None
    return run, (f"accuracy: base {number(s['base'])}, peak {number(s['peak'])} (step {s['peak_step']}), "
                 f"final {number(s['final'])} (Δ {number(s['delta'], '+.3f')})")


def to_json(report: Report) -> str:
    """Stable JSON (docs/detectors.md): every finding; non-finite numbers become null."""
    return json.dumps(_finite(report.to_dict()), indent=2, default=_plain, allow_nan=False)


def to_markdown(report: Report, max_per_kind: int | None = MAX_PER_KIND) -> str:
    run, accuracy = _header(report.summary)
    findings, hidden = shown(report.findings, max_per_kind)
    lines = [f"## gradscope analysis: `{report.run}`", "", run]
    if accuracy:
        lines.append(accuracy)
    lines += [f"{line}  " for line in _update_lines(report.summary)]
    lines += ["", "| kind | severity | role | steps | finding |", "|---|---|---|---|---|"]
    for f in findings:
        lines.append(f"| {f.kind} | {f.severity} | {text(f.role)} | {f.start}–{f.end} (onset {f.onset}) | "
                     f"{_cell(f.summary)} |")
    if not report.findings:
        lines.append(f"| {MISSING} | {MISSING} | {MISSING} | {MISSING} | no pathology found |")
    if hidden:
        lines += [""] + _hidden_lines(hidden)
    for f in findings:
        lines += ["", f"**{f.kind}** ({f.role or 'run'}) evidence:", ""]
        lines += [f"- {k}: {_fmt(v)}" for k, v in f.evidence.items()]
    if report.notes:
        lines += ["", "Not analysed:", ""] + [f"- {n}" for n in report.notes]
    return "\n".join(lines) + "\n"


def to_text(report: Report, max_per_kind: int | None = MAX_PER_KIND) -> str:
    """Readable console report (rich), returned as a string."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    buf = io.StringIO()
    console = Console(file=buf, width=110, force_terminal=False, color_system=None)
    run, accuracy = _header(report.summary)
    findings, hidden = shown(report.findings, max_per_kind)
    console.print(escape(f"gradscope analysis of {report.run}"))
    console.print(escape(f"  {run}"))
    if accuracy:
        console.print(escape(f"  {accuracy}"))
    for line in _update_lines(report.summary):
        console.print(escape(f"  {line}"))
    if not report.findings:
        console.print("  no pathology found")
    for f in findings:
        console.print(escape(f"[{f.severity}] {f.kind}: {f.summary}"))
        table = Table(show_header=False)
        table.add_column("evidence", style="bold")
        table.add_column("value")
        table.add_row("steps", f"{f.start}–{f.end} (onset {f.onset})")
        for k, v in f.evidence.items():
            table.add_row(k, escape(_fmt(v)))
        console.print(table)
    for line in _hidden_lines(hidden):
        console.print(escape(f"  {line}"))
    for n in report.notes:
        console.print(escape(f"  note: {n}"))
    return buf.getvalue()


def _cell(value: str) -> str:
    """Text for a Markdown table cell (a ``|`` would end the cell)."""
    return value.replace("|", "\\|")


def _fmt(v) -> str:
    if is_missing(v):
        return MISSING
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, list) and v and isinstance(v[0], dict):
        return "; ".join(", ".join(f"{k}={_fmt(x)}" for k, x in d.items()) for d in v[:5]) + \
               (f"; … ({len(v) - 5} more)" if len(v) > 5 else "")
    if isinstance(v, dict):
        return "; ".join(f"{k}: {_fmt(x)}" for k, x in v.items()) or MISSING
    return str(v)


def _finite(v):
    if isinstance(v, dict):
        return {k: _finite(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_finite(x) for x in v]
    if isinstance(v, (float, np.floating)):
        return float(v) if np.isfinite(v) else None
    return v


def _plain(v):
    if isinstance(v, np.generic):
        return v.item()
    if isinstance(v, np.ndarray):
        return v.tolist()
    raise TypeError(f"not JSON-serialisable: {type(v)}")
