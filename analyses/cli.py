"""``gradscope analyze`` and ``gradscope compare``: load, detect, render, choose the exit code."""
from __future__ import annotations

import argparse

from gradscope.analyses.amplification import AmplificationConfig
from gradscope.analyses.capture import CaptureConfig
from gradscope.analyses.cliff import CliffConfig
from gradscope.analyses.compare import compare_table
from gradscope.analyses.findings import Report
from gradscope.analyses.report import KINDS, AnalysisConfig, analyze_series, to_json, to_markdown, to_text
from gradscope.analyses.series import RunSeries
from gradscope.errors import ConfigError
from gradscope.ranges import COUNT, Range
from gradscope.runfile import open_run


def load(path: str) -> tuple[RunSeries, bool]:
    """The run's series and whether its writer closed it (RunFileError on unreadable files)."""
    with open_run(path) as run:
        return RunSeries.from_reader(run, name=str(path)), run.closed


def config_from(args: argparse.Namespace) -> AnalysisConfig:
    return AnalysisConfig(
        amplification=AmplificationConfig(args.coherence, args.window, args.fraction, args.norm_ratio),
        capture=CaptureConfig(args.share, args.window, args.fraction),
        cliff=CliffConfig(args.min_drop, args.min_rel_drop, args.within))


def analyze_main(args: argparse.Namespace) -> int:
    fail_on = {k.strip() for k in args.fail_on.split(",") if k.strip()} if args.fail_on else set()
    unknown = fail_on - set(KINDS)
    if unknown:
        raise ConfigError(f"--fail-on: unknown kind(s) {sorted(unknown)}; use {', '.join(KINDS)}")
    report = _report(args.run, config_from(args))
    print(to_json(report) if args.json else to_markdown(report) if args.md else to_text(report), end="")
    return 1 if fail_on & report.kinds() else 0


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


#: Allowed values of the detector thresholds (coherence AF/n lies in [0, 1]; a signed contribution
#: share can be any finite number).
UNIT, NONNEG, SHARE = Range(0, 1), Range(0), Range()


def add_threshold_arguments(p: argparse.ArgumentParser) -> None:
    a, c, k = AmplificationConfig(), CaptureConfig(), CliffConfig()
    p.add_argument("--coherence", type=UNIT.arg, default=a.coherence, help="amplification: coherence threshold")
    p.add_argument("--norm-ratio", type=NONNEG.arg, default=a.norm_ratio, help="amplification: norm vs other roles")
    p.add_argument("--share", type=SHARE.arg, default=c.share, help="capture: contribution-share threshold")
    p.add_argument("--window", type=COUNT.arg, default=a.window, help="steps per detection window")
    p.add_argument("--fraction", type=Range(0, 1, lo_open=True).arg, default=a.fraction,
                   help="share of a window above threshold")
    p.add_argument("--min-drop", type=NONNEG.arg, default=k.min_drop, help="cliff: absolute accuracy drop")
    p.add_argument("--min-rel-drop", type=UNIT.arg, default=k.min_rel_drop, help="cliff: relative drop")
    p.add_argument("--within", type=COUNT.arg, default=k.within, help="cliff: evaluations from onset to threshold")
