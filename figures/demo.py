"""The demo's figures: everything ``gradscope demo`` shows, written next to its run files."""
from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from gradscope.figures import data
from gradscope.figures.style import save_or_skip


def _note(message: str) -> None:
    print(f"gradscope: note: {message}", file=sys.stderr)


def demo_figures(paths: Sequence[str | Path], out_dir: str | Path | None = None, *,
                 formats: str | Sequence[str] = ("png",), on_skip: Callable[[str], None] = _note) -> list[Path]:
    """Write the figures of the demo's runs into ``out_dir`` (default: the first run's folder).

    Writes ``cliffs`` (every run, one column each), ``ip_vs_sp`` (for runs that differ only in their
    policy, when both policies are there; ``ip_vs_sp_2``... for further such groups),
    ``<run>_shares`` for each SP run, ``<run>_alignment`` for each run, ``<run>_updates`` for each run
    with update attribution, and the summary table ``summary.md``. A figure that does not apply
    (e.g. shares of an IP run, updates of a run without update attribution) is skipped and
    ``on_skip`` is told why, in one line per figure; unreadable run files raise RunFileError. Returns the paths written.
    """
    from gradscope.figures.alignment import alignment_figure
    from gradscope.figures.cliffs import cliff_figure
    from gradscope.figures.ipsp import ip_vs_sp_figure
    from gradscope.figures.shares import shares_figure
    from gradscope.figures.table import format_table, summary_table
    from gradscope.figures.updates import updates_figure

    series = [data.load(p)[0] for p in paths]
    if not series:
        return []
    out = Path(out_dir) if out_dir is not None else Path(paths[0]).resolve().parent
    written: list[Path] = []

    def attempt(name: str, make: Callable[[], object]) -> None:
        written.extend(save_or_skip(make, out / name, on_skip, formats))

    attempt("cliffs", lambda: cliff_figure(series))
    pairs = [g for g in data.group_by_config(series, ignore=("policy", "seed")).values()
             if {data.policy_of(s) for s in g} >= {"ip", "sp"}]
    for i, group in enumerate(pairs):
        attempt("ip_vs_sp" + (f"_{i + 1}" if i else ""), lambda g=group: ip_vs_sp_figure(g))
    for s in series:
        attempt(f"{data.stem(s)}_shares", lambda s=s: shares_figure(s))
        attempt(f"{data.stem(s)}_alignment", lambda s=s: alignment_figure(s))
        attempt(f"{data.stem(s)}_updates", lambda s=s: updates_figure(s))
    table = out / "summary.md"
    table.write_text(format_table(summary_table(series), "md"))
    written.append(table)
    return written
