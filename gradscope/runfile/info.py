"""``gradscope info``: a plain-text summary of what a run file holds.

Every measured number goes through :func:`gradscope.labels.number`, so a missing, NaN or infinite value reads
``—`` wherever it appears (as in every command's text output).
"""
from __future__ import annotations

import json
import os
import time
from collections import Counter
from collections.abc import Sequence

from gradscope.labels import MISSING, number, text
from gradscope.runfile.reader import RunReader, open_run
from gradscope.runfile.schema import RunMeta
from gradscope.runfile.writer import flush_every_problem

_MAX_NAMES = 8  # list at most this many scalar names / groups before abbreviating
_LABEL = 14


def _names(items: Sequence[str], limit: int = _MAX_NAMES) -> str:
    if not items:
        return "(none)"
    shown = ", ".join(items[:limit])
    return shown + (f", ... (+{len(items) - limit} more)" if len(items) > limit else "")


def _clip(text: str, width: int = 100) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def _age(path: str) -> str:
    try:
        seconds = max(0.0, time.time() - os.path.getmtime(path))
    except OSError:
        return MISSING
    if seconds < 120:
        return f"{seconds:.0f} s ago"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min ago"
    return f"{seconds / 3600:.1f} h ago"


def _flush_every(meta: RunMeta) -> str:
    """The writer's records per flush: ``—`` where the file records none (0 or absent), and a value no writer
    could have used marked invalid (reading ignores it; a resume would take it: :meth:`RunWriter.resume`)."""
    if not meta.flush_every:
        return MISSING
    problem = flush_every_problem(meta)
    if problem is not None:
        return f"{meta.flush_every} (invalid: {problem}; a resume refuses it)"
    return f"{meta.flush_every} records"


def _last_record_summary(run: RunReader) -> str:
    """Total norm and per-role contribution shares of the last record, via gradscope.stats."""
    try:
        from gradscope.stats import UPDATE_EXTRAS, derive, derive_updates
    except ImportError:
        return "(statistics unavailable: gradscope.stats not importable)"
    meta = run.meta
    try:
        cols = derive(run.read("gram", -1)[0], run.read("tokens", -1)[0], meta.agents, meta.agent_roles)
    except Exception as exc:  # noqa: BLE001 - a summary line must never break `info`
        return f"(statistics unavailable: {exc})"
    shares = ", ".join(f"{role} {number(float(cols[f'share/{role}']), '.2f')}"
                       for role in meta.roles if f"share/{role}" in cols)
    line = f"total norm {number(float(cols['total_norm']), '.4g')}; shares: {shares or '(none)'}"
    if meta.update_unit:
        units = meta.roles if meta.update_unit == "role" else meta.agent_roles
        upd = derive_updates(run.read("update_gram", -1)[0], run.read("update_interference", -1)[0], units,
                             meta.agent_roles, meta.roles)
        line += "; update shares: " + ", ".join(f"{c} {number(float(upd[f'update_share/{c}']), '.2f')}"
                                                for c in [*meta.roles, *UPDATE_EXTRAS])
    return line


def render_info(path: str | os.PathLike[str]) -> str:
    """Summarise a run file in a few readable lines.

    Raises:
        RunFileError: the file cannot be read as a run file (one line, naming the file).
    """
    path = os.fspath(path)
    lines: list[tuple[str, str]] = []
    with open_run(path) as run:
        meta = run.meta
        add = lambda label, text: lines.append((label, text))  # noqa: E731
        add("run file", f"{path} (schema {run.schema_version})")
        add("created", meta.created or MISSING)
        if run.closed:
            add("writer", "closed cleanly")
        else:
            add("writer", f"not closed: live or killed (file last modified {_age(path)}; "
                          f"only committed records are shown)")
        add("versions", _names([f"{k} {v}" for k, v in meta.versions.items()], limit=20))
        add("seed", text(meta.seed if meta.seed is not None else (meta.config or {}).get("seed")))
        add("probe method", meta.probe_method or MISSING)
        add("updates", f"split by {meta.update_unit} into {', '.join(meta.update_components)}"
            if meta.update_unit else "(no update attribution)")
        add("agents", ", ".join(f"{a} ({r})" for a, r in zip(meta.agents, meta.agent_roles)))
        count = Counter(meta.agent_roles)
        add("roles", ", ".join(f"{r} x{count.get(r, 0)}" for r in meta.roles))
        add("policies", _names(meta.policies))
        add("groups", _names([f"{g} ({n:,} params)" for g, n in zip(meta.groups, meta.group_sizes)]))
        if meta.config:
            add("config", _clip(json.dumps(meta.config, sort_keys=True)))
        add("flush every", _flush_every(meta))

        n = run.n_steps
        add("records", f"{n} complete")
        if n:
            step, opt = run.step, run.opt_step
            add("steps", f"{int(step.min())} .. {int(step.max())} "
                         f"(optimizer steps {int(opt.min())} .. {int(opt.max())})")
        add("scalars", f"{len(meta.scalar_names)}: {_names(meta.scalar_names)}"
            if meta.scalar_names else "(none)")

        evals_text = f"{run.n_evals} rows"
        if run.n_evals:
            evals = run.evals
            evals_text += f" at {evals['step'].nunique()} steps"
            acc = evals[evals["name"] == "accuracy"]
            if len(acc):
                last = acc.iloc[-1]
                evals_text += f"; last accuracy {number(float(last['value']), '.4g')} at step {int(last['step'])}"
        add("evals", evals_text)
        metrics_text = f"{run.n_metrics} rows"
        if run.n_metrics:
            metrics = run.metrics
            names = list(dict.fromkeys(metrics["name"]))  # in order of first appearance
            metrics_text += f" at {metrics['step'].nunique()} steps; {len(names)} names: {_names(names)}"
        add("metrics", metrics_text)
        events_text = str(run.n_events)
        if run.n_events:
            last_event = run.events.iloc[-1]
            events_text += (f" (last: {last_event['severity']} {last_event['kind']} at step "
                            f"{int(last_event['step'])}: {_clip(last_event['message'], 60)})")
        add("events", events_text)
        if n:
            last_step = int(run.read("step", -1)[0])
            p = int(run.read("policy", -1)[0])
            where = f"step {last_step}" + (f", policy {meta.policies[p]}" if 0 <= p < len(meta.policies) else "")
            add("last record", f"{where}: {_last_record_summary(run)}")
    return "\n".join(f"{label:<{_LABEL}} {text}" for label, text in lines)


__all__ = ["render_info"]
