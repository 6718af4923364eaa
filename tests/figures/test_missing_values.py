"""One rendering of missing values (gradscope.labels) in every command and figure title.

A run without evaluations has no base / peak / final; a run whose file holds no config has no
workflow, task, policy or model. Text and Markdown show ``—`` and ``unknown`` (never ``?``, ``None``,
``nan`` or a policy guessed from the records); JSON shows ``null``.
"""
from __future__ import annotations

import json
import re

import pytest

from gradscope.cli import main
from gradscope.figures import data
from gradscope.figures.table import format_table, summary_table
from gradscope.labels import MISSING, UNKNOWN, describe, is_missing, number

# What missing values used to read as (an en dash between numbers is a range, not a missing value).
NEVER = (r"\?", r"\bNone\b", r"\bnan\b", r"(?<!\d)–(?!\d)")


def _out(capsys, *argv) -> str:
    assert main([str(a) for a in argv]) == 0
    return capsys.readouterr().out


def _clean(text: str) -> None:
    for bad in NEVER:
        assert not re.search(bad, text), f"{bad!r} in {text!r}"


def test_labels_rules() -> None:
    pd = pytest.importorskip("pandas")
    assert all(is_missing(v) for v in (None, float("nan"), float("inf"), pd.NA))
    assert not any(is_missing(v) for v in (0, 0.0, "", "x", False))
    assert number(None) == MISSING and number(float("nan"), "+.3f") == MISSING and number(0.5) == "0.500"
    assert describe(None) == {"workflow": UNKNOWN, "task": UNKNOWN, "policy": UNKNOWN, "model": UNKNOWN}
    assert describe({"policy": "SP", "model": "/models/Qwen3-1.7B/", "workflow": "", "task": None}) == \
        {"workflow": UNKNOWN, "task": UNKNOWN, "policy": "sp", "model": "Qwen3-1.7B"}


def test_table_and_titles(runs) -> None:
    df = summary_table([runs["sp_noconfig"], runs["sp_noevals"]])
    assert list(df["policy"]) == [UNKNOWN, "sp"] and list(df["workflow"]) == [UNKNOWN, "voting"]
    md = format_table(df, "md").splitlines()
    assert "| unknown | unknown | unknown | unknown |" in md[2] and "SP" not in md[2]
    assert md[3].count(MISSING) == 5
    _clean("\n".join(md[2:]))
    assert f"{UNKNOWN} · {UNKNOWN}/{UNKNOWN} · {UNKNOWN}" in data.title(data.load(runs["sp_noconfig"])[0])
    csv = format_table(df, "csv").splitlines()
    assert csv[2].split(",")[5:] == [""] * 7                 # CSV: a missing value is an empty cell
    assert "---" in format_table(df, "latex")                 # LaTeX's em dash


def test_compare_says_no_cliff_only_where_the_detector_ran(capsys, runs) -> None:
    """A run with fewer than 3 evaluations: `table` says "—", and `compare` said "no" (a cliff ruled out)."""
    df = summary_table([runs["single"], runs["sp_ok"]])
    assert df["cliff"].tolist() == [None, False]
    rows = [re.split(r"\s{2,}", row) for row in _out(capsys, "compare", runs["single"], runs["sp_ok"]).splitlines()]
    column = rows[0].index("cliff (onset)")
    assert rows[1][column] == MISSING and rows[2][column] == "no", rows


def test_compare_analyze_info(capsys, runs) -> None:
    text = _out(capsys, "compare", runs["sp_noconfig"], runs["sp_noevals"])
    rows = text.splitlines()
    assert rows[1].split()[1:4] == [UNKNOWN] * 3 and MISSING in rows[2]
    _clean(text)
    md = _out(capsys, "compare", "--md", runs["sp_noconfig"], runs["sp_noevals"])
    assert "| unknown | unknown | unknown |" in md and f"| {MISSING} |" in md
    out = _out(capsys, "analyze", runs["sp_noconfig"])
    assert "unknown / unknown / policy unknown / model unknown" in out
    _clean(out)
    report = json.loads(_out(capsys, "analyze", "--json", runs["sp_noconfig"]))
    assert [report["summary"][k] for k in ("workflow", "task", "policy", "model")] == [None] * 4
    md = _out(capsys, "analyze", "--md", runs["sp_noevals"])
    assert "voting / math / policy sp / model testbed" in md
    _clean(md)
    info = _out(capsys, "info", runs["sp_noconfig"])
    assert "(unknown)" not in info and "seed" in info
    seed_line = next(line for line in info.splitlines() if line.startswith("seed"))
    assert seed_line.split()[-1] == MISSING
