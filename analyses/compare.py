"""``gradscope compare``: runs side by side — the IP-vs-SP table a researcher wants."""
from __future__ import annotations

from collections.abc import Sequence

from gradscope.analyses.findings import Report

COLUMNS = ("run", "workflow", "task", "policy", "base", "peak", "final", "Δ vs base", "cliff (onset)",
           "max coherence", "dominant share")


def row(report: Report) -> list[str]:
    s = report.summary
    cliffs = [f for f in report.findings if f.kind == "cliff"]
    num = lambda key: f"{s[key]:.3f}" if key in s else "–"  # noqa: E731
    return [report.run, str(s.get("workflow")), str(s.get("task")), str(s.get("policy")),
            num("base"), num("peak"), num("final"), f"{s['delta']:+.3f}" if "delta" in s else "–",
            f"yes ({cliffs[0].onset})" if cliffs else ("no" if "peak" in s else "–"),
            ", ".join(f"{r} {v:.2f}" for r, v in s.get("max_coherence", {}).items()) or "–",
            ", ".join(f"{d['role']} {d['mean_share']:.2f}" for d in s.get("dominant_share", {}).values()) or "–"]


def compare_table(reports: Sequence[Report], fmt: str = "text") -> str:
    rows = [list(COLUMNS)] + [row(r) for r in reports]
    if fmt == "md":
        return "\n".join(["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(COLUMNS)] +
                         ["| " + " | ".join(r) + " |" for r in rows[1:]])
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)
