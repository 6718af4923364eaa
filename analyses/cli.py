"""``gradscope analyze`` and ``gradscope compare``: load, detect, render, choose the exit code."""
from __future__ import annotations

import argparse

from gradscope.analyses.compare import compare_table
from gradscope.analyses.findings import Report
from gradscope.analyses.report import KINDS, analyze_series, to_json, to_markdown, to_text
from gradscope.analyses.series import RunSeries
from gradscope.analyses.thresholds import AnalysisConfig, config_from
from gradscope.errors import ConfigError
from gradscope.runfile import open_run


def load(path: str) -> tuple[RunSeries, bool]:
    """The run's series and whether its writer closed it (RunFileError on unreadable files)."""
    with open_run(path) as run:
        return RunSeries.from_reader(run, name=str(path)), run.closed


def analyze_main(args: argparse.Namespace) -> int:
    fail_on = {k.strip() for k in args.fail_on.split(",") if k.strip()} if args.fail_on else set()
    unknown = fail_on - set(KINDS)
    if unknown:
        raise ConfigError(f"--fail-on: unknown kind(s) {sorted(unknown)}; use {', '.join(KINDS)}")
    if args.max_findings < 0:
        raise ConfigError(f"--max-findings must be >= 0, got {args.max_findings}")
    report = _report(args.run, config_from(args))
    if args.json:
        text = to_json(report)
    elif args.md:
        text = to_markdown(report, max_per_kind=args.max_findings)
    else:
        text = to_text(report, max_per_kind=args.max_findings)
    print(text, end="")
    # info findings (a capture by token count alone, a decline, a mild update channel) are the workflow's
    # shape, present in healthy runs: a gate on them would fail every run
    alarming = {f.kind for f in report.findings if f.severity != "info"}
    return 1 if fail_on & alarming else 0


def compare_main(args: argparse.Namespace) -> int:
    cfg = config_from(args)
    reports = [_report(path, cfg) for path in args.runs]
    print(compare_table(reports, fmt="md" if args.md else "text"))
    return 0


def analyze_runs(paths: list[str]) -> str:
    """Each run's report at default thresholds, then the side-by-side table (the demo's ending)."""
    reports = [_report(path, AnalysisConfig()) for path in paths]
    return "".join(to_text(r) + "\n" for r in reports) + compare_table(reports)


def _report(path: str, cfg: AnalysisConfig) -> Report:
    series, closed = load(path)
    return analyze_series(series, cfg, closed=closed)
