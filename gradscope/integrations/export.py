"""``gradscope export RUN.h5 --to tensorboard|wandb|mlflow DEST``: a finished (or live) run into a dashboard.

Per training step: every gradient statistic (:func:`~gradscope.integrations.scalars.step_scalars`),
the run's per-step metrics as ``gradscope/<name>`` and its evaluations as ``gradscope/eval/<name>``;
alert and other events as text under ``gradscope/events`` at their step; the analysis' findings
as text under ``gradscope/findings`` at the last step.
"""
from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

from gradscope.errors import GradscopeError
from gradscope.integrations.scalars import DashboardNames, finite_items, step_scalars
from gradscope.integrations.sinks import EVENTS_TAG, FINDINGS_TAG, check_sink, event_line, open_sink, parse_sinks
from gradscope.runfile import open_run


def export_run(path: str | os.PathLike[str], to: str, dest: str | os.PathLike[str],
               findings: Sequence[str] = ()) -> str:
    """Write run file ``path`` to the sink ``to`` at ``dest``; returns a one-line summary.

    Raises:
        RunFileError: the run file cannot be read; ConfigError: unknown sink or missing library;
        GradscopeError: ``dest`` cannot be written.
    """
    (to,) = parse_sinks([to])
    check_sink(to, dest)
    scalars: dict[int, dict[str, float]] = defaultdict(dict)
    texts: dict[int, list[str]] = defaultdict(list)
    with open_run(path) as run:
        meta = run.meta
        names = DashboardNames(meta.agents, meta.agent_roles)
        if run.n_steps:
            uniq, cols = step_scalars(run.gram, run.tokens, run.step, meta.agents, meta.agent_roles)
            for t, step in enumerate(uniq.tolist()):
                scalars[step].update({name: values[t] for name, values in cols.items()})
        for table, prefix in ((run.metrics, ""), (run.evals, "eval/")):
            for step, name, value in zip(table["step"], table["name"], table["value"]):
                scalars[int(step)][names.metric(name, prefix)] = value
        events = run.events
        for step, kind, severity, message in zip(events["step"], events["kind"], events["severity"], events["message"]):
            texts[int(step)].append(event_line(kind, severity, message))
    all_steps = sorted(set(scalars) | set(texts))
    try:
        sink = open_sink(to, dest, run_name=Path(path).stem, config=meta.config or {})
        try:
            n = 0
            for step in all_steps:
                values = finite_items(scalars.get(step, {}))
                n += len(values)
                if values:
                    sink.scalars(step, values)
                if texts.get(step):
                    sink.text(step, EVENTS_TAG, texts[step])
            if findings:
                sink.text(all_steps[-1] if all_steps else 0, FINDINGS_TAG, list(findings))
        finally:
            sink.close()
    except OSError as exc:
        raise GradscopeError(f"cannot write {to} output to {dest}: {exc.strerror or exc}") from None
    return (f"exported {path} to {to} at {dest}: {n} values over {len(all_steps)} steps, "
            f"{sum(map(len, texts.values()))} events, {len(findings)} findings")
