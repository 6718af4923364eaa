"""A sweep folder's tables and figures: ``summary.csv``, ``table.md`` (Table 1) and ``figures/``.

A folder written by ``gradscope sweep`` lists its cells in ``cells.json`` (name, run file, axis
values); :func:`folder_runs` returns the run files of those cells that finished (closed by their
writer at the steps they were asked for, or stopped by an alert:
:class:`gradscope.runfile.progress.RunProgress`), so every table and figure holds exactly the cells
run — not stale files, not runs still in progress, not runs a SIGTERM closed early (each file left
out, an unreadable one included, is named in a note with the reason). A folder without
``cells.json`` counts every ``*.h5`` in it and in ``runs/``.

:func:`write_report` writes, from those runs:

* ``summary.csv`` — one row per run (:func:`figures.table.summary_table`, with every setting that
  varies between the runs as a column, seed included);
* ``table.md`` — the paper's Table 1: per cell, mean ± sd over seeds of base / peak / final / Δ and the
  cliff rate (:func:`figures.table.seed_table`);
* ``figures/delta[_<setting>].png`` — Fig 2: Δ over base by workflow × task × scale, IP and SP panels
  (one figure per value of any other varying setting, e.g. ``_lr=0.003``);
* ``figures/ipsp_<workflow>_<task>_<model>[...].png`` — Fig 3: IP vs SP accuracy, mean and band over seeds,
  for every cell group that has both policies;
* ``figures/cliffs.png`` — Fig 6: gradient dynamics around the terminal cliffs of up to four runs
  (the deepest; none drawn when no run fell off a cliff).

A figure of these names in ``figures/`` that the report does not draw (an earlier report's) is removed.
"""
from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable
from pathlib import Path

from gradscope.errors import ConfigError
from gradscope.figures import data
from gradscope.runfile.progress import run_progress

MANIFEST = "cells.json"
MAX_CLIFF_COLUMNS = 4


def folder_runs(folder: str | Path, *, finished_only: bool = True,
                on_skip: Callable[[str], None] | None = None) -> list[Path]:
    """The run files of a sweep folder (see the module doc), in the sweep's cell order; ``on_skip``
    (if given) is told of each run file left out and why, one line each (unreadable, not closed,
    closed before its steps), and of the cells without a run file yet, in one line."""
    folder = Path(folder)
    manifest = folder / MANIFEST
    if manifest.is_file():
        try:
            cells = json.loads(manifest.read_text())["cells"]
            paths = [folder / c["run"] for c in cells]
        except (ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"{manifest}: not a sweep manifest ({exc})") from None
    else:
        paths = sorted(folder.glob("*.h5")) + sorted((folder / "runs").glob("*.h5"))
    out = []
    missing = [p for p in paths if not p.is_file()]
    for p in (p for p in paths if p.is_file()):
        why = run_progress(p).unfinished() if finished_only else None
        if why is None:
            out.append(p)
        elif on_skip is not None:
            on_skip(f"{p} skipped: {why}")
    if missing and on_skip is not None:
        on_skip(f"{folder}: {len(missing)} of the {len(paths)} cells of {MANIFEST} have no run file yet")
    return out


def expand_paths(paths: list[str]) -> list[str]:
    """Run-file arguments with every folder replaced by its runs (ConfigError for a folder without any)."""
    out: list[str] = []
    for p in paths:
        if Path(p).is_dir():
            runs = folder_runs(p, on_skip=_note)
            if not runs:
                raise ConfigError(f"{p}: a folder without finished run files")
            out += [str(r) for r in runs]
        else:
            out.append(p)
    return out


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9.=+-]+", "-", text).strip("-")


def _note(message: str) -> None:
    print(f"gradscope: note: {message}", file=sys.stderr)


#: The names of the report's figures in ``figures/``: any of them this report does not draw is removed.
REPORT_FIGURES = ("delta*.png", "ipsp_*.png", "cliffs.png")


def write_report(folder: str | Path, on_skip: Callable[[str], None] = _note) -> list[Path]:
    """Write the folder's tables and figures (module doc); returns the paths written."""
    from gradscope.figures.cliffs import cliff_figure
    from gradscope.figures.ipsp import ip_vs_sp_figure
    from gradscope.figures.style import save_or_skip
    from gradscope.figures.sweep import sweep_figure
    from gradscope.figures.table import format_table, seed_table, summary_table

    folder = Path(folder)
    paths = folder_runs(folder, on_skip=on_skip)
    if not paths:
        raise ConfigError(f"{folder}: no finished runs to report on")
    series = [data.load(p)[0] for p in paths]
    extra = data.varying_keys(series)
    written = []
    (folder / "summary.csv").write_text(format_table(summary_table(series, extra), "csv"))
    (folder / "table.md").write_text(seed_table(series))
    written += [folder / "summary.csv", folder / "table.md"]
    figs = folder / "figures"
    others = [k for k in extra if k != "seed"]

    def attempt(stem: str, make: Callable[[], object]) -> None:
        written.extend(save_or_skip(make, figs / stem, on_skip))

    by_other = _group(series, others)
    for key, group in by_other.items():
        suffix = "".join(f"_{k}={_slug(str(v))}" for k, v in key)
        attempt(f"delta{suffix}", lambda g=group: sweep_figure(g))
        cells = _group(group, ["workflow", "task", "model"], describe=True)
        for (wf, task, model), runs in cells.items():
            if {data.policy_of(s) for s in runs} >= {"ip", "sp"}:
                attempt(f"ipsp_{_slug(wf[1])}_{_slug(task[1])}_{_slug(model[1])}{suffix}",
                        lambda r=runs: ip_vs_sp_figure(r))
    cliffs = sorted(((c, s) for s in series if (c := data.cliff_of(s)) is not None),
                    key=lambda cs: -cs[0].evidence["depth"])[:MAX_CLIFF_COLUMNS]
    if cliffs:
        attempt("cliffs", lambda: cliff_figure([s for _, s in cliffs]))
    else:
        on_skip("cliffs not drawn: no run of the sweep fell off a terminal cliff")
    for stale in (p for pattern in REPORT_FIGURES for p in figs.glob(pattern) if p not in written and p.is_file()):
        stale.unlink()  # an earlier report's figure of cells (or a cliff) this one no longer has
    return written


def _group(series: list, keys: list[str], describe: bool = False) -> dict[tuple, list]:
    """Runs grouped by the values of ``keys`` (config flags, or :func:`data.describe` fields)."""
    out: dict[tuple, list] = {}
    for s in series:
        values = data.describe(s) if describe else data.flat_config(s)
        key = tuple((k, json.dumps(values.get(k)) if isinstance(values.get(k), (list, dict)) else values.get(k))
                    for k in keys)
        out.setdefault(key, []).append(s)
    return out
