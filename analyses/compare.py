"""``gradscope compare``: runs side by side — the IP-vs-SP table a researcher wants.

Missing values read ``—``; workflow, task and policy come from each run's config (``unknown`` where
it has none): gradscope.labels.
"""
from __future__ import annotations

from collections.abc import Sequence

from gradscope.analyses.findings import Report
from gradscope.labels import MISSING, describe, number

COLUMNS = ("run", "workflow", "task", "policy", "base", "peak", "final", "Δ vs base", "cliff (onset)",
           "max coherence", "dominant share")


def row(report: Report) -> list[str]:
    s = report.summary
    d = describe(s)
    cliffs = [f for f in report.findings if f.kind == "cliff"]
    cliff = f"yes ({cliffs[0].onset})" if cliffs else ("no" if report.cliff_checked else MISSING)
    return [report.run, d["workflow"], d["task"], d["policy"],
            number(s.get("base")), number(s.get("peak")), number(s.get("final")), number(s.get("delta"), "+.3f"),
            cliff,
            ", ".join(f"{r} {number(v, '.2f')}" for r, v in s.get("max_coherence", {}).items()) or MISSING,
            ", ".join(f"{dom['role']} {number(dom['mean_share'], '.2f')}"
                      for dom in s.get("dominant_share", {}).values()) or MISSING]


def compare_table(reports: Sequence[Report], fmt: str = "text") -> str:
    rows = [list(COLUMNS)] + [row(r) for r in reports]
    if fmt == "md":
        return "\n".join(["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(COLUMNS)] +
                         ["| " + " | ".join(c.replace("|", "\\|") for c in r) + " |" for r in rows[1:]])
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)
