"""The ``gradscope`` command line.

Subcommands dispatch lazily: building the parser imports nothing heavy (no torch, peft,
transformers, matplotlib, h5py, pandas), so ``--help`` and a bad flag are answered at once, and
``gradscope info`` never imports torch or the trainer stack. Every ``--help`` shows each flag's
default. Every user error (bad file, bad flag) prints one line ``gradscope: error: ...`` and exits 2.
"""
from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path
from collections.abc import Sequence

from gradscope import __version__
from gradscope.errors import GradscopeError, GradscopeWarning
from gradscope.ranges import COUNT, DPI, POLL, WAIT, WHOLE

EXIT_USAGE = 2
#: Commands that read run files: a damaged file's inf/NaN values print as values, without numpy's
#: floating-point warnings; all but ``UNTIMED`` are bounded in time as a whole ($GRADSCOPE_READ_TIMEOUT,
#: docs/cli.md): ``watch`` follows a live run for as long as it lasts, ``export`` waits on a dashboard.
READ_COMMANDS = ("info", "analyze", "compare", "plot", "table", "watch", "export")
UNTIMED = ("watch", "export")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends ``(default: X)`` to a flag's help, except where there is nothing to show: no
    default (None, "", an empty list), a bare switch, or a help text that already says ``%(default)s``."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default in (None, "", [], argparse.SUPPRESS) or isinstance(action, argparse._StoreTrueAction):
            return action.help
        return super()._get_help_string(action)


class ArgumentParser(argparse.ArgumentParser):
    """argparse that shows defaults in ``--help`` and reports a usage error as one line and exit code 2."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> None:  # argparse prints usage + message; we want one line
        print(f"gradscope: error: {one_line(message)}", file=sys.stderr)
        sys.exit(EXIT_USAGE)


def one_line(text: str) -> str:
    """``text`` with its line breaks escaped (a path may hold one): a message stays one line."""
    return text.replace("\r", "\\r").replace("\n", "\\n")


def _cmd_info(args: argparse.Namespace) -> int:
    from gradscope.runfile.info import render_info

    print(render_info(args.run))
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from gradscope.analyses.cli import analyze_runs
    from gradscope.figures.demo import demo_figures
    from gradscope.trainers.demo import run_demo

    paths = [str(p) for p in run_demo(args.out, steps=args.steps, threads=args.threads, jobs=args.jobs)]
    print("\n" + analyze_runs(paths))
    print("\nfigures:")
    for figure in demo_figures(paths, args.out):
        print(f"  {figure}")
    return 0


def _cmd_train(args: argparse.Namespace) -> int:
    from gradscope.trainers.cli import train_main  # torch and the trainer stack load only for this command

    return train_main(args.args)


def _cmd_analyze(args: argparse.Namespace) -> int:
    from gradscope.analyses.cli import analyze_main

    return analyze_main(args)


def _cmd_compare(args: argparse.Namespace) -> int:
    from gradscope.analyses.cli import compare_main

    return compare_main(args)


def _cmd_watch(args: argparse.Namespace) -> int:
    from gradscope.alerts.cli import watch_main

    return watch_main(args)


def _cmd_plot(args: argparse.Namespace) -> int:
    from gradscope.figures.cli import plot_main  # matplotlib loads only for this command

    return plot_main(args)


def _cmd_sweep(args: argparse.Namespace) -> int:
    from gradscope.figures.sweepdir import write_report
    from gradscope.trainers.sweep.cli import sweep_main

    folder, outcome = sweep_main(args.config, args.out, args.jobs, dry_run=args.dry_run)
    if outcome is None:
        return 0
    print(f"sweep: {len(outcome.done)} runs finished ({len(outcome.skipped)} before this invocation), "
          f"{len(outcome.failed)} failed")
    for name, log in outcome.failed.items():
        print(f"  failed: {name} (log: {log})")
    # a cell finished now, or no report yet (an earlier invocation died before writing it): else it stays as it was
    if len(outcome.done) > len(outcome.skipped) or (outcome.done and not (Path(folder) / "table.md").exists()):
        for path in write_report(folder):
            print(path)
    return 1 if outcome.failed else 0


def _cmd_table(args: argparse.Namespace) -> int:
    from gradscope.figures.cli import table_main

    return table_main(args)


def _cmd_export(args: argparse.Namespace) -> int:
    from gradscope.analyses.cli import load  # the findings go along with the statistics
    from gradscope.analyses.report import analyze_series
    from gradscope.integrations.export import export_run

    series, closed = load(args.run)
    findings = [f"[{f.severity}] {f.kind} (steps {f.start}-{f.end}): {f.summary}"
                for f in analyze_series(series, closed=closed).findings]
    print(export_run(args.run, args.to, args.dest, findings))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="gradscope", description="Gradient-dynamics diagnostics for multi-agent RL.")
    parser.add_argument("--version", action="version", version=f"gradscope {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=ArgumentParser)

    p = sub.add_parser("info", help="print what a run file holds")
    p.add_argument("run", help="path to a run file (.h5)")
    p.set_defaults(func=_cmd_info)

    p = sub.add_parser("demo", help="the main job: train Voting/math with IP and SP on the testbed")
    p.add_argument("--out", default="out/demo", help="folder for the demo's run files")
    p.add_argument("--steps", type=COUNT.arg, default=50, help="training steps of the IP and SP runs (the hot run: 30)")
    p.add_argument("--threads", type=WHOLE.arg, default=0,
                   help="torch intra-op threads per run (0: one, the fastest for the testbed on a shared machine)")
    p.add_argument("--jobs", type=COUNT.arg, default=3, help="runs at a time, each its own process")
    p.set_defaults(func=_cmd_demo)

    from gradscope.analyses.thresholds import add_threshold_arguments  # dataclasses only

    p = sub.add_parser("analyze", help="detect amplification, role capture and accuracy cliffs in a run")
    p.add_argument("run", help="run file (.h5)")
    fmt = p.add_mutually_exclusive_group()
    fmt.add_argument("--json", action="store_true", help="machine-readable report (docs/detectors.md); without --json or --md: text")
    fmt.add_argument("--md", action="store_true", help="Markdown report; without --json or --md: text")
    p.add_argument("--fail-on", default="", help="exit 1 if any of these kinds is found with severity warning or critical: amplification,capture,cliff (info findings never fail; without it: exit 0 whatever is found)")
    p.add_argument("--max-findings", type=int, default=5, metavar="N",
                   help="text and Markdown show at most N findings per kind (JSON: all)")
    add_threshold_arguments(p)
    p.set_defaults(func=_cmd_analyze)

    p = sub.add_parser("compare", help="runs side by side: accuracy, cliffs, coherence, dominant share")
    p.add_argument("runs", nargs="+", help="run files (.h5)")
    p.add_argument("--md", action="store_true", help="Markdown table (without it: text)")
    add_threshold_arguments(p)
    p.set_defaults(func=_cmd_compare)

    from gradscope.alerts.cli import add_alert_arguments

    p = sub.add_parser("watch", help="follow a live run file (any framework) and raise alerts",
                       description="Evaluate alert rules on a run file as it grows; exits when the writer "
                                   "closes it (docs/alerts.md).")
    p.add_argument("run", help="run file (.h5), live or finished")
    add_alert_arguments(p)
    p.add_argument("--poll", type=POLL.arg, default=1.0, help="seconds between looks at the file")
    p.add_argument("--wait", type=WAIT.arg, default=0.0,
                   help="wait up to this many seconds for the run file to appear (0: it must exist)")
    p.add_argument("--idle", type=WAIT.arg, default=0.0,
                   help="also exit after this many seconds without new data (0: wait for the writer)")
    p.set_defaults(func=_cmd_watch)

    p = sub.add_parser("plot", help="paper-style figures: cliffs, ip-vs-sp, shares, alignment, sweep, updates",
                       description="Draw a figure from run files and print the paths written (docs/figures.md).")
    p.add_argument("kind", choices=("cliffs", "ip-vs-sp", "shares", "alignment", "sweep", "updates"),
                   help="cliffs: dynamics around an accuracy cliff (one column per run); ip-vs-sp: accuracy of "
                        "IP and SP side by side; shares: who drives a shared update (one SP run); alignment: "
                        "agent cosine heatmap (one run); sweep: improvement over base by workflow x task x scale; "
                        "updates: gradient vs update share per role and the interference matrix (one run "
                        "with --probe-updates)")
    p.add_argument("runs", nargs="+", help="run files (.h5), or sweep folders (their finished runs)")
    p.add_argument("--out", default=None, help="output path stem (default: next to the first run, <run>_<kind>)")
    p.add_argument("--format", default="png", help="comma-separated: png,pdf,svg")
    p.add_argument("--size", choices=("one", "two"), default="two", help="paper width: one column or two")
    p.add_argument("--dpi", type=DPI.arg, default=300, help=f"PNG resolution, {DPI.lo:d} to {DPI.hi:d}")
    p.add_argument("--smooth", type=COUNT.arg, default=None,
                   help="cliffs, shares, updates: centred rolling mean over N logged steps of the gradient curves "
                        "(default: 1, raw)")
    p.add_argument("--steps", default=None,
                   help="alignment: cosine matrices at these steps, e.g. 10,50,100 (default: a heatmap over all steps)")
    p.add_argument("--window", type=COUNT.arg, default=None, help="alignment: average over this many steps (default: 1)")
    p.add_argument("--metric", choices=("final", "peak"), default=None,
                   help="sweep: improvement of the final or the peak accuracy over the base (default: final)")
    p.set_defaults(func=_cmd_plot)

    p = sub.add_parser("table", help="summary table of runs: base, peak, final, delta, cliff")
    p.add_argument("runs", nargs="+", help="run files (.h5), or sweep folders (their finished runs)")
    p.add_argument("--over", default=None, metavar="FLAG",
                   help="one row per cell, mean ± sd over this setting (e.g. seed: the paper's Table 1); without it: "
                        "one row per run")
    p.add_argument("--format", choices=("md", "csv", "latex"), default="md", help="table format")
    p.add_argument("--out", default=None, help="write to this file instead of standard output")
    p.set_defaults(func=_cmd_table)

    p = sub.add_parser("sweep", help="a YAML grid of training runs, one process each, resumable",
                       description="Run every cell of a YAML grid (docs/sweep.md) as its own gradscope train "
                                   "process; finished runs are skipped, killed ones resumed. Writes the run "
                                   "files, summary.csv, table.md and figures/ into the output folder.")
    p.add_argument("config", help="sweep file (.yaml)")
    p.add_argument("--jobs", type=int, default=1, help="runs at a time (one torch thread each)")
    p.add_argument("--out", default=None, help="output folder (default: sweeps/out/<config name>)")
    p.add_argument("--dry-run", action="store_true", help="check the file and list the cells' commands only (without it: run the cells)")
    p.set_defaults(func=_cmd_sweep)

    p = sub.add_parser("export", help="send a run's statistics, alerts and findings to TensorBoard, W&B or MLflow",
                       description="Write a run file into a dashboard under TRL-style names (gradscope/norm/<role>, "
                                   "...): W&B in offline mode, MLflow into a local store (docs/integrations.md).")
    p.add_argument("run", help="run file (.h5)")
    p.add_argument("--to", required=True, choices=("tensorboard", "wandb", "mlflow"), help="the dashboard")
    p.add_argument("dest", help="tensorboard: log directory; wandb: folder for the offline run; mlflow: folder "
                                "(SQLite store DEST/mlflow.db) or a tracking URI")
    p.set_defaults(func=_cmd_export)

    p = sub.add_parser("train", help="train a workflow with GRPO, probed (see gradscope train --help)",
                       add_help=False, prefix_chars="\0")
    p.add_argument("args", nargs=argparse.REMAINDER)
    p.set_defaults(func=_cmd_train)
    return parser


_format_warning = warnings.formatwarning  # Python's own, put back when main() returns


def _one_line_warning(message, category, filename, lineno, line=None) -> str:
    """gradscope's own warnings (GradscopeWarning) as one line, like its errors; others as Python prints them."""
    if issubclass(category, GradscopeWarning):
        return f"gradscope: warning: {one_line(str(message))}\n"
    return _format_warning(message, category, filename, lineno, line)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    warnings.formatwarning = _one_line_warning
    try:
        if args.command in READ_COMMANDS:
            return _reading(args)
        return args.func(args)
    except GradscopeError as exc:
        print(f"gradscope: error: {one_line(str(exc))}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("gradscope: interrupted", file=sys.stderr)
        return 130
    finally:
        warnings.formatwarning = _format_warning


def _reading(args: argparse.Namespace) -> int:
    import numpy as np

    from gradscope.runfile.limits import deadline, read_timeout

    seconds = 0.0 if args.command in UNTIMED else read_timeout()
    with deadline(seconds, "reading run files"), np.errstate(all="ignore"):
        return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
