"""How early do the default alert rules fire before a cliff, and how often on healthy runs?

For each run file: the cliff detector (``gradscope analyze``) gives the cliff onset; the default
rules are replayed over the file exactly as ``gradscope watch`` would (same order as inside
``gradscope train``). Prints one row per run — every default rule's first firing step, the lead
``onset − first firing`` of the earliest cliff rule (``cliff-early`` or ``cliff``), the number of
alerts — and a summary: lead on cliff runs, firings on runs without a cliff.

Run: ``.venv/bin/python benchmarks/alerts_early_warning.py RUN.h5 [RUN.h5 ...]``.
"""
from __future__ import annotations

import argparse
import os
import statistics

from gradscope.analyses.cli import load
from gradscope.analyses.report import AnalysisConfig, analyze_series
from gradscope.alerts import DEFAULT_RULES
from gradscope.alerts.watch import watch

CLIFF_RULES = ("cliff-early", "cliff")


def measure(path: str, rules=DEFAULT_RULES, report=None) -> dict:
    """The cliff onset (None without a cliff), each rule's first firing step (by rule name), the lead
    of the earliest cliff rule and the number of alerts, for one run file (``report``: its analysis,
    if already made)."""
    report = report or analyze_series(load(path)[0], AnalysisConfig())
    cliffs = [f for f in report.findings if f.kind == "cliff"]
    fired = watch(path, rules, poll=0.01, idle=0.05, echo=lambda line: None)
    first: dict[str, int] = {}
    for a in fired:
        first.setdefault(a.rule.name, a.step)
    onset = cliffs[0].onset if cliffs else None
    warn = min((first[n] for n in CLIFF_RULES if n in first), default=None)
    return {"run": path, "onset": onset, "first": first, "n_alerts": len(fired),
            "lead": onset - warn if onset is not None and warn is not None else None}


def main(paths: list[str]) -> list[dict]:
    rows = [measure(p) for p in paths]
    names = [r.name for r in DEFAULT_RULES]
    print(f"{'run':40s} {'cliff onset':>11s} " + " ".join(f"{n:>13s}" for n in names) + f" {'lead':>5s} {'alerts':>6s}")
    for r in rows:
        print(f"{os.path.basename(os.path.dirname(r['run']))[:14] + '/' + os.path.basename(r['run']):40s} "
              f"{str(r['onset'] or '-'):>11s} " + " ".join(f"{str(r['first'].get(n, '-')):>13s}" for n in names)
              + f" {str(r['lead'] if r['lead'] is not None else '-'):>5s} {r['n_alerts']:>6d}")
    cliff = [r for r in rows if r["onset"] is not None]
    healthy = [r for r in rows if r["onset"] is None]
    leads = [r["lead"] for r in cliff if r["lead"] is not None]
    if cliff:
        print(f"cliff runs: {len(cliff)}; a cliff rule fired before or at the onset in "
              f"{sum(lead >= 0 for lead in leads)}, after it in {sum(lead < 0 for lead in leads)}, never in "
              f"{len(cliff) - len(leads)}; lead median {statistics.median(leads) if leads else float('nan'):g} "
              f"steps (range {min(leads, default=0)}..{max(leads, default=0)})")
    if healthy:
        per_rule = {n: sum(n in r["first"] for r in healthy) for n in names}
        print(f"runs without a cliff: {len(healthy)}; runs where each rule fired: "
              + ", ".join(f"{n} {k}" for n, k in per_rule.items()))
    return rows


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+")
    main(parser.parse_args().runs)
