"""The summary table: one row per run — workflow, task, model, policy, base, peak, final, Δ, cliff.

:func:`summary_table` returns a DataFrame of raw values (NaN / None where a run has no
evaluations; ``unknown`` for what the run's config does not say); :func:`format_table` renders it
as Markdown, CSV (raw numbers, for analysis; a missing value is an empty cell) or LaTeX (a
``booktabs`` tabular to ``\\input`` into a paper). Missing values read ``—`` (gradscope.labels).
"""
from __future__ import annotations

import csv
import io
from collections.abc import Iterable
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


def summary_table(runs: Iterable[RunLike]) -> pd.DataFrame:
    """One row per run (RunSeries or paths). ``cliff`` is True/False, or None with fewer than 3
    evaluations (the detector needs 3); ``cliff_onset`` is the onset step or None."""
    rows = []
    for s in data.as_series_list(runs):
        acc = s.accuracy
        row = {"run": Path(s.name).name if s.name else "run", **data.describe(s)}
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
    df = pd.DataFrame(rows, columns=list(COLUMNS))
    for col in ("peak_step", "cliff_onset"):
        df[col] = df[col].astype("Int64")
    df["cliff"] = df["cliff"].astype(object)
    return df


def _cells(r) -> list[str]:
    cliff = MISSING if is_missing(r["cliff"]) else (f"yes (step {int(r['cliff_onset'])})" if r["cliff"] else "no")
    peak = number(r["peak"]) + ("" if is_missing(r["peak_step"]) else f" @{int(r['peak_step'])}")
    return [str(r["run"]), str(r["workflow"]), str(r["task"]), str(r["model"]), policy_label(str(r["policy"])),
            number(r["base"]), peak, number(r["final"]), number(r["delta"], "+.3f"), cliff]


HEAD = ["run", "workflow", "task", "model", "policy", "base", "peak @step", "final", "Δ", "cliff (onset)"]


def format_table(df: pd.DataFrame, fmt: str = "md") -> str:
    if fmt not in FORMATS:
        raise ConfigError(f"table format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    if fmt == "csv":
        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        w.writerow(COLUMNS)
        for _, r in df.iterrows():
            w.writerow(["" if is_missing(v) else f"{v:.6g}" if isinstance(v, float) else v
                        for v in (r[c] for c in COLUMNS)])
        return buf.getvalue()
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
