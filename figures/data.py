"""What the figures read off a run, beyond ``analyses.series.RunSeries``.

* :func:`as_series` — accept a RunSeries or a path (notebooks pass paths).
* ``RunSeries.agent_cosine`` — per-step agent cosine alignment: the mean over a training step's records
  of ``gradscope.stats.cosine(M)``, counting a pair only in records where **both** agents have a
  non-zero gradient (under IP a voter record holds no aggregator gradient, so cross-role pairs of
  different parameter sets never count: their cosine is 0 by construction, not a measurement).
* :func:`pair_alignment` — those cosines averaged per pair group: within a role (its agents'
  pairs) and across two roles.
* :func:`policy_of`, :func:`describe`, :func:`cliff_of`, :func:`zero_gradient_steps`.
"""
from __future__ import annotations

import os
import re
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from gradscope import labels
from gradscope.analyses.cliff import detect_cliff
from gradscope.analyses.findings import Finding
from gradscope.analyses.series import RunSeries
from gradscope.errors import ConfigError

RunLike = RunSeries | str | os.PathLike


def load(path: str | os.PathLike) -> tuple[RunSeries, bool]:
    """(series, closed) of a run file; RunFileError (one line) if it cannot be read."""
    from gradscope.analyses.cli import load as _load

    return _load(os.fspath(path))


def as_series(run: RunLike) -> RunSeries:
    return run if isinstance(run, RunSeries) else load(run)[0]


def as_series_list(runs: RunLike | Iterable[RunLike]) -> list[RunSeries]:
    if isinstance(runs, (RunSeries, str, os.PathLike)):
        runs = [runs]
    out = [as_series(r) for r in runs]
    if not out:
        raise ConfigError("no runs given")
    return out


# ------------------------------------------------------------------ metadata
def policy_of(series: RunSeries) -> str:
    """``"ip"`` / ``"sp"`` / a sharing map as written, from the run's config; ``"unknown"`` without
    one (never guessed from the records: gradscope.labels)."""
    return labels.describe(series.config)["policy"]


#: Config keys that say nothing about what was trained (where it was written, how it was run).
RUN_KEYS = ("out", "run", "overwrite", "resume", "threads", "world_size", "dist_timeout", "checkpoint_every")


def flat_config(series: RunSeries) -> dict[str, object]:
    """The run's config with nested sections (``grpo``) flattened into one level of flag names."""
    out: dict[str, object] = {}
    for key, value in series.config.items():
        if isinstance(value, dict):
            out.update(value)
        else:
            out[key] = value
    return out


def group_by_config(series: Sequence[RunSeries], ignore: Sequence[str] = ()) -> dict[str, list[RunSeries]]:
    """Runs grouped by their whole config (flattened, without :data:`RUN_KEYS` and ``ignore``), in order."""
    import json

    out: dict[str, list[RunSeries]] = {}
    for s in series:
        config = {k: v for k, v in flat_config(s).items() if k not in RUN_KEYS and k not in ignore}
        out.setdefault(json.dumps(config, sort_keys=True, default=str), []).append(s)
    return out


def varying_keys(series: Sequence[RunSeries], exclude: Sequence[str] = ()) -> list[str]:
    """Flag names whose values differ between the runs that have them (beyond :data:`RUN_KEYS`, ``exclude``
    and what :func:`describe` already shows), in config order. A flag some runs lack (written by a
    gradscope that did not have it yet) varies only if the runs that have it disagree."""
    import json

    shown = ("workflow", "task", "model", "scale", "policy")
    configs = [flat_config(s) for s in series]
    keys = list(dict.fromkeys(k for c in configs for k in c))
    return [k for k in keys if k not in RUN_KEYS and k not in shown and k not in exclude
            and len({json.dumps(c[k], sort_keys=True) for c in configs if k in c}) > 1]


def describe(series: RunSeries) -> dict[str, str]:
    """workflow, task, model, policy of a run (gradscope.labels.describe)."""
    return labels.describe(series.config)


def stem(series: RunSeries) -> str:
    return Path(series.name).stem if series.name else "run"


def title(series: RunSeries, width: int | None = None) -> str:
    """``IP · voting/math · testbed`` (``unknown`` for what the config lacks) plus the file name, broken
    after ``_`` / ``.`` into lines of at most ``width`` characters where given (narrow columns)."""
    d = describe(series)
    head = f"{labels.policy_label(d['policy'])} · {d['workflow']}/{d['task']} · {d['model']}"
    if not width:
        return f"{head}\n{Path(series.name).name}" if series.name else head
    out = []
    for text, breaks in ((head, r"[^·]*(?:· )?"), (Path(series.name).name if series.name else "", r"[^_.]*[_.]?")):
        lines = [""]
        for piece in re.findall(breaks, text):
            if lines[-1] and len(lines[-1]) + len(piece) > width:
                lines.append("")
            lines[-1] += piece
        out += [line.strip() for line in lines if line.strip()]
    return "\n".join(out)


# ------------------------------------------------------------------ accuracy
def cliff_of(series: RunSeries) -> Finding | None:
    """The detector's terminal cliff (``analyses.cliff.detect_cliff``, default thresholds), if any."""
    if len(series.accuracy) < 3:
        return None
    found = [f for f in detect_cliff(series) if f.kind == "cliff"]
    return found[0] if found else None


def last_step(series: RunSeries) -> int:
    ends = [int(series.steps[-1])] if len(series.steps) else []
    if len(series.accuracy):
        ends.append(int(series.accuracy.index[-1]))
    return max(ends) if ends else 0


# ------------------------------------------------------------------ gradients
def pair_groups(series: RunSeries) -> dict[str, list[tuple[int, int]]]:
    """Agent pairs (k < l) by group: ``"<role>"`` for pairs within a role, ``"<r>–<s>"`` across."""
    groups: dict[str, list[tuple[int, int]]] = {}
    roles = series.agent_roles
    order = {r: i for i, r in enumerate(series.roles)}
    for k in range(len(roles)):
        for l in range(k + 1, len(roles)):
            a, b = sorted((roles[k], roles[l]), key=order.get)
            groups.setdefault(a if a == b else f"{a}–{b}", []).append((k, l))
    within = {g: p for g, p in groups.items() if "–" not in g}
    across = {g: p for g, p in groups.items() if "–" in g}
    return {**within, **across}


def pair_alignment(series: RunSeries, cos: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """Group → (T,) mean cosine over the group's pairs present at each step; groups that are never
    measured (e.g. across IP parameter sets, or one-agent roles) are left out."""
    cos = series.agent_cosine if cos is None else cos
    out = {}
    for group, pairs in pair_groups(series).items():
        vals = np.stack([cos[:, k, l] for k, l in pairs], axis=1) if len(cos) else np.zeros((0, len(pairs)))
        ok = np.isfinite(vals)
        if not ok.any():
            continue
        count = ok.sum(axis=1)
        total = np.where(ok, vals, 0.0).sum(axis=1)
        out[group] = np.divide(total, count, out=np.full(len(vals), np.nan), where=count > 0)
    return out


def zero_gradient_steps(series: RunSeries) -> np.ndarray:
    """Training steps whose finite records all have an all-zero Gram (e.g. every reward equal, so
    every GRPO advantage is 0: nothing is learned)."""
    if not len(series.gram):
        return np.zeros(0, dtype=int)
    zero = np.where(series.finite, np.abs(np.nan_to_num(series.gram)).sum(axis=(1, 2)) == 0, np.nan)
    frac = series.per_step(zero)
    return series.steps[frac == 1]


def spans(steps: np.ndarray, all_steps: np.ndarray) -> list[tuple[float, float]]:
    """Contiguous runs of ``steps`` within ``all_steps`` as (start − ½, end + ½) intervals."""
    if not len(steps):
        return []
    idx = np.searchsorted(all_steps, steps)
    out, start = [], idx[0]
    for a, b in zip(idx[:-1], idx[1:]):
        if b != a + 1:
            out.append((all_steps[start] - 0.5, all_steps[a] + 0.5))
            start = b
    out.append((all_steps[start] - 0.5, all_steps[idx[-1]] + 0.5))
    return out


def smooth(values: np.ndarray, window: int) -> np.ndarray:
    """Centred rolling mean along axis 0 over ``window`` consecutive rows — a run's logged training
    steps — of the finite values among them (1 = unchanged); a NaN value stays NaN, so a gap (e.g. a
    zero-gradient span) stays a gap."""
    if window <= 1 or len(values) == 0:
        return values
    import pandas as pd

    flat = np.asarray(values, dtype=float).reshape(len(values), -1)
    rolled = pd.DataFrame(flat).rolling(window, center=True, min_periods=1).mean().to_numpy()
    return np.where(np.isnan(flat), np.nan, rolled).reshape(values.shape)


def smoothed(window: int, of: str = "") -> str:
    """What :func:`smooth` did, for a title: ``" · <of>mean of 5 logged steps"`` ("" at 1)."""
    return f" · {of}mean of {window} logged steps" if window > 1 else ""


def check_same(series: Sequence[RunSeries], keys: Sequence[str], what: str, hint: str) -> None:
    """ConfigError when the runs differ in any of ``keys`` (workflow, task, model...)."""
    for key in keys:
        by: dict[str, list[str]] = {}
        for s in series:
            by.setdefault(describe(s)[key], []).append(Path(s.name).name or "run")
        if len(by) > 1:
            listed = "; ".join(f"{v}: {', '.join(names)}" for v, names in by.items())
            raise ConfigError(f"{what}: the runs are of different {key} ({listed}); {hint}")
