"""The summary table: one row per run — workflow, task, model, policy, base, peak, final, Δ, cliff —
and the paper's Table 1 over seeds: one row per cell, mean ± sd of each and the cliff rate.

:func:`summary_table` returns a DataFrame of raw values (NaN / None where a run has no
evaluations; ``unknown`` for what the run's config does not say); :func:`format_table` renders it
as Markdown, CSV (raw numbers, for analysis; a missing value is an empty cell) or LaTeX (a
``booktabs`` tabular to ``\\input`` into a paper). Missing values read ``—`` (gradscope.labels).
:func:`cell_table` groups the runs into cells — the same workflow, task, model, policy and every
other setting that varies between the runs, except the one averaged over (``seed``) — and
:func:`format_cell_table` renders it.
"""
from __future__ import annotations

import csv
import io
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from gradscope.figures import data
from gradscope.labels import MISSING, is_missing, number, policy_label
from gradscope.figures.data import RunLike
from gradscope.errors import ConfigError

FORMATS = ("md", "csv", "latex")
COLUMNS = ("run", "workflow", "task", "model", "policy", "base", "peak", "peak_step", "final", "delta",
           "cliff", "cliff_onset")
MEASURES = ("base", "peak", "final", "delta")
#: Columns of the two tables: a setting of the same name becomes column ``<name> (setting)``.
RESERVED = frozenset({*COLUMNS, "n", "cliffs", "judged", "cliff_rate",
                      *(f"{m}_{x}" for m in MEASURES for x in ("mean", "sd"))})


def setting_column(key: str) -> str:
    """The column of config key ``key`` in the tables (renamed where it would clash with one of theirs)."""
    return f"{key} (setting)" if key in RESERVED else key


def summary_table(runs: Iterable[RunLike], extra: Sequence[str] = ()) -> pd.DataFrame:
    """One row per run (RunSeries or paths). ``cliff`` is True/False, or None with fewer than 3
    evaluations (the detector needs 3); ``cliff_onset`` is the onset step or None. ``extra``: config
    keys (flag names) to add as columns after ``policy`` (named by :func:`setting_column`)."""
    columns = [setting_column(k) for k in extra]
    rows = []
    for s in data.as_series_list(runs):
        acc = s.accuracy
        config = data.flat_config(s)
        row = {"run": Path(s.name).name if s.name else "run", **data.describe(s),
               **{c: _scalar(config.get(k)) for c, k in zip(columns, extra)}}
        if len(acc):
            base, final = float(acc.iloc[0]), float(acc.iloc[-1])
            row.update(base=base, peak=float(acc.max()), peak_step=int(acc.idxmax()), final=final,
                       delta=final - base)
        else:
            row.update(base=np.nan, peak=np.nan, peak_step=None, final=np.nan, delta=np.nan)
        cliff = data.cliff_of(s)
        row["cliff"] = None if len(acc) < 3 else cliff is not None
        row["cliff_onset"] = cliff.onset if cliff else None
        rows.append(row)
    df = pd.DataFrame(rows, columns=[*COLUMNS[:5], *columns, *COLUMNS[5:]])
    for col in ("peak_step", "cliff_onset"):
        df[col] = df[col].astype("Int64")
    df["cliff"] = df["cliff"].astype(object)
    return df


def _scalar(v):
    """A config value as a table cell: lists and mappings as compact JSON."""
    import json

    return json.dumps(v, sort_keys=True) if isinstance(v, (list, dict)) else v


def _cells(r) -> list[str]:
    cliff = MISSING if is_missing(r["cliff"]) else (f"yes (step {int(r['cliff_onset'])})" if r["cliff"] else "no")
    peak = number(r["peak"]) + ("" if is_missing(r["peak_step"]) else f" @{int(r['peak_step'])}")
    return [str(r["run"]), str(r["workflow"]), str(r["task"]), str(r["model"]), policy_label(str(r["policy"])),
            number(r["base"]), peak, number(r["final"]), number(r["delta"], "+.3f"), cliff]


HEAD = ["run", "workflow", "task", "model", "policy", "base", "peak @step", "final", "Δ", "cliff (onset)"]


def _check_format(fmt: str) -> None:
    if fmt not in FORMATS:
        raise ConfigError(f"table format must be one of {', '.join(FORMATS)}, got {fmt!r}")


def _csv(df: pd.DataFrame) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(df.columns)
    for _, r in df.iterrows():
        w.writerow(["" if is_missing(v) else f"{v:.6g}" if isinstance(v, float) else v for v in r])
    return buf.getvalue()


def format_table(df: pd.DataFrame, fmt: str = "md") -> str:
    _check_format(fmt)
    if fmt == "csv":
        return _csv(df)
    rows = [_cells(r) for _, r in df.iterrows()]
    if fmt == "md":
        lines = ["| " + " | ".join(HEAD) + " |", "|" + "|".join("---:" if i >= 5 and i < 9 else "---"
                                                           for i in range(len(HEAD))) + "|"]
        lines += ["| " + " | ".join(c.replace("|", "\\|") for c in r) + " |" for r in rows]
        return "\n".join(lines) + "\n"
    head = [_tex(h) for h in HEAD]
    head[8] = r"$\Delta$"
    lines = [r"\begin{tabular}{lllll" + "r" * 4 + "l}", r"\toprule", " & ".join(head) + r" \\", r"\midrule"]
    lines += [" & ".join(_tex(c) for c in r) + r" \\" for r in rows]
    lines += [r"\bottomrule", r"\end{tabular}"]
    return "\n".join(lines) + "\n"


_TEX = {"\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_", "{": r"\{",
        "}": r"\}", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}", "–": "--", MISSING: "---",
        "@": "@"}


def _tex(text: str) -> str:
    return "".join(_TEX.get(ch, ch) for ch in text)


# ------------------------------------------------------------------ over seeds (Table 1)


def cell_table(df: pd.DataFrame, keys: Sequence[str]) -> pd.DataFrame:
    """Rows of :func:`summary_table` grouped by ``keys`` (in order of first appearance): ``n`` runs,
    ``<m>_mean`` and ``<m>_sd`` (sample SD, NaN for one run) of base, peak, final and delta,
    ``cliffs`` (runs with a terminal cliff) out of ``judged`` (runs with ≥ 3 evaluations) and
    ``cliff_rate`` = cliffs / judged."""
    rows = []
    for values, group in df.groupby(list(keys), sort=False, dropna=False):
        row = dict(zip(keys, values if isinstance(values, tuple) else (values,)))
        row["n"] = len(group)
        for m in MEASURES:
            v = group[m].astype(float)
            row[f"{m}_mean"], row[f"{m}_sd"] = float(v.mean()), float(v.std(ddof=1)) if v.count() > 1 else np.nan
        judged = group["cliff"].dropna()
        row["cliffs"], row["judged"] = int(sum(bool(c) for c in judged)), len(judged)
        row["cliff_rate"] = row["cliffs"] / row["judged"] if row["judged"] else np.nan
        rows.append(row)
    cols = [*keys, "n", *(f"{m}_{x}" for m in MEASURES for x in ("mean", "sd")), "cliffs", "judged", "cliff_rate"]
    return pd.DataFrame(rows, columns=cols)


def _pm(r, m: str, tex: bool = False) -> str:
    mean, sd = r[f"{m}_mean"], r[f"{m}_sd"]
    fmt = "{:+.3f}" if m == "delta" else "{:.3f}"
    if is_missing(mean):
        return MISSING
    if is_missing(sd):
        return fmt.format(mean)
    return fmt.format(mean) + (r" $\pm$ " if tex else " ± ") + f"{sd:.3f}"


def format_cell_table(df: pd.DataFrame, keys: Sequence[str], fmt: str = "md") -> str:
    """Markdown / CSV (raw columns) / LaTeX of :func:`cell_table`: the cell's keys, n, mean ± sd of
    base, peak, final, Δ, and the cliff rate as ``cliffs/judged``."""
    _check_format(fmt)
    if fmt == "csv":
        return _csv(df)
    head = [*keys, "n", "base", "peak", "final", "Δ", "cliffs"]
    tex = fmt == "latex"
    rows = [[policy_label(str(r[k])) if k == "policy" else MISSING if is_missing(r[k]) else str(r[k])
             for k in keys] + [str(int(r["n"]))]
            + [_pm(r, m, tex) for m in MEASURES]
            + [MISSING if not r["judged"] else f"{int(r['cliffs'])}/{int(r['judged'])}"] for _, r in df.iterrows()]
    if fmt == "md":
        lines = ["| " + " | ".join(head) + " |",
                 "|" + "|".join("---:" if i >= len(keys) else "---" for i in range(len(head))) + "|"]
        lines += ["| " + " | ".join(c.replace("|", "\\|") for c in r) + " |" for r in rows]
        return "\n".join(lines) + "\n"
    head = [_tex(h) for h in head]
    head[len(keys) + 4] = r"$\Delta$"
    lines = [r"\begin{tabular}{" + "l" * len(keys) + "r" * 6 + "}", r"\toprule", " & ".join(head) + r" \\",
             r"\midrule"]
    lines += [" & ".join(c if "$" in c else _tex(c) for c in r) + r" \\" for r in rows]
    lines += [r"\bottomrule", r"\end{tabular}"]
    return "\n".join(lines) + "\n"


def seed_table(runs: Iterable[RunLike], over: str = "seed", fmt: str = "md") -> str:
    """The Table-1 analogue of some runs: cells = workflow, task, model, policy and every other
    setting that differs between the runs except ``over``; mean ± sd over ``over``. ConfigError when
    no run has a setting ``over`` (a typo would otherwise give one row per run, averaged over nothing)."""
    series = data.as_series_list(runs)
    if series and not any(over in data.flat_config(s) for s in series):
        raise ConfigError(f"--over {over}: no run has a setting of that name (the train flags' names, "
                          f"e.g. seed, lr, kl_coef)")
    extra = data.varying_keys(series, exclude=(over,))
    keys = ["workflow", "task", "model", "policy", *map(setting_column, extra)]
    return format_cell_table(cell_table(summary_table(series, extra), keys), keys, fmt)
