"""``gradscope plot`` and ``gradscope table``: load the runs, draw, save, print the paths.

Imported only by the command handlers in ``gradscope/cli.py`` (the parser never imports
matplotlib). Bad input raises a GradscopeError, which the command line prints as one line with
exit code 2: a missing or unreadable run file, an unknown format, a single-run figure given
several runs (or a sweep folder holding several), a figure that needs data the run lacks entirely
(shares of an IP run or a run without gradient records, ip-vs-sp without evaluations or across
workflows, updates of a run without update attribution). A *panel* of the cliffs figure whose data
a run lacks is drawn and marked "no data" instead (docs/figures.md).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: never open a window, never need a display

from gradscope.figures import data  # noqa: E402
from gradscope.figures.style import parse_formats, save  # noqa: E402
from gradscope.figures.sweepdir import expand_paths  # noqa: E402
from gradscope.errors import ConfigError  # noqa: E402
from gradscope.paths import atomic_output  # noqa: E402

KINDS = ("cliffs", "ip-vs-sp", "shares", "alignment", "sweep", "updates")
SINGLE = ("shares", "alignment", "updates")
SMOOTHED = ("cliffs", "shares", "updates")  # the kinds with gradient curves that --smooth smooths


def _load(run_files: list[str]) -> list:
    """The runs of run files (a sweep folder given on the command line: ``expand_paths``' list of its runs)."""
    out = []
    for path in run_files:
        series, closed = data.load(path)
        if not closed:
            print(f"gradscope: note: {path}: the writer did not close the file (live or killed); "
                  f"reading its {len(series.gram)} committed records", file=sys.stderr)
        out.append(series)
    return out


def _one_run_in(folder: str, run_files: list[str], kind: str) -> None:
    """A single-run figure given a sweep folder: refused unless the folder holds one finished run
    (it would otherwise plot only the first of them)."""
    if len(run_files) > 1:
        raise ConfigError(f"plot {kind} takes one run file, but folder {folder} holds {len(run_files)} finished "
                          f"runs; pass one run file (or use gradscope plot sweep {folder})")


def _steps(text: str | None) -> list[int] | None:
    if not text:
        return None
    try:
        return [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise ConfigError(f"--steps must be comma-separated step numbers, got {text!r}") from None


def default_stem(first_run: str, kind: str) -> Path:
    """Next to the first run file (or folder): ``<dir>/<run stem>_<kind>``; a folder by its whole name
    (``sweep.v2`` keeps its dot), ``.`` or ``..`` by its absolute name."""
    p = Path(first_run)
    if p.name in ("", ".."):
        p = p.resolve()
    if not p.name:
        raise ConfigError(f"cannot name the figure after {first_run!r}: pass --out")
    return p.with_name(f"{p.name if p.is_dir() else p.stem}_{kind.replace('-', '_')}")


def make_figure(kind: str, series: list, args: argparse.Namespace):
    from gradscope.figures.alignment import alignment_figure
    from gradscope.figures.cliffs import cliff_figure
    from gradscope.figures.ipsp import ip_vs_sp_figure
    from gradscope.figures.shares import shares_figure
    from gradscope.figures.sweep import sweep_figure
    from gradscope.figures.updates import updates_figure

    if kind == "cliffs":
        return cliff_figure(series, size=args.size, smooth=args.smooth or 1)
    if kind == "ip-vs-sp":
        return ip_vs_sp_figure(series, size=args.size)
    if kind == "shares":
        return shares_figure(series[0], size=args.size, smooth=args.smooth or 1)
    if kind == "alignment":
        return alignment_figure(series[0], steps=_steps(args.steps), window=args.window or 1, size=args.size)
    if kind == "updates":
        return updates_figure(series[0], size=args.size, smooth=args.smooth or 1)
    return sweep_figure(series, metric=args.metric or "final", size=args.size)


def plot_main(args: argparse.Namespace) -> int:
    kind = args.kind
    formats = parse_formats(args.format)
    if kind in SINGLE and len(args.runs) != 1:
        raise ConfigError(f"plot {kind} takes one run file, got {len(args.runs)}")
    if args.steps and kind != "alignment":
        raise ConfigError("--steps applies to plot alignment only")
    if args.metric and kind != "sweep":
        raise ConfigError("--metric applies to plot sweep only")
    if args.window is not None and kind != "alignment":
        raise ConfigError("--window applies to plot alignment only")
    if args.smooth is not None and kind not in SMOOTHED:
        raise ConfigError(f"--smooth applies to plot {', '.join(SMOOTHED)} only"
                          + (" (alignment: --window)" if kind == "alignment" else ""))
    run_files = expand_paths(args.runs)
    if kind in SINGLE and Path(args.runs[0]).is_dir():
        _one_run_in(args.runs[0], run_files, kind)
    series = _load(run_files)
    fig = make_figure(kind, series, args)
    stem = Path(args.out) if args.out else default_stem(args.runs[0], kind)
    if args.out and (stem.is_dir() or args.out.endswith("/")):  # a folder: the default name inside it
        stem = stem / default_stem(args.runs[0], kind).name
    for path in save(fig, stem, formats, dpi=args.dpi):
        print(path)
    return 0


def table_main(args: argparse.Namespace) -> int:
    from gradscope.figures.table import format_table, seed_table, summary_table

    series = _load(expand_paths(args.runs))
    text = seed_table(series, args.over, args.format) if args.over else format_table(summary_table(series), args.format)
    if args.out:
        out = Path(args.out)
        with atomic_output(out) as tmp:  # only ever replaces a regular file
            tmp.write_text(text)
        print(out)
    else:
        print(text, end="")
    return 0
