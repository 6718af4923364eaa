"""Make the figures of docs/figures.md from run files.

    python -m gradscope.figures.make_docs --ip out/demo/ip.h5 --sp out/demo/sp.h5 \\
        --cliff out/hot/ip.h5 out/hot/sp.h5 --out docs/img

``--ip``/``--sp``: a healthy IP and SP pair (e.g. the demo's runs); ``--cliff``: runs that fell off
a cliff (optional; e.g. the demo's setting with a 10× learning rate). Writes PNGs at 200 dpi and
``summary.md`` (the table) into ``--out`` and prints their paths.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

from gradscope.figures import data  # noqa: E402
from gradscope.figures.alignment import alignment_figure  # noqa: E402
from gradscope.figures.cliffs import cliff_figure  # noqa: E402
from gradscope.figures.ipsp import ip_vs_sp_figure  # noqa: E402
from gradscope.figures.shares import shares_figure  # noqa: E402
from gradscope.figures.style import save  # noqa: E402
from gradscope.figures.sweep import sweep_figure  # noqa: E402
from gradscope.figures.table import format_table, summary_table  # noqa: E402
from gradscope.figures.updates import updates_figure  # noqa: E402

DPI = 200


def make(ip: list[str], sp: list[str], cliff: list[str], out: Path) -> list[Path]:
    ips = [data.load(p)[0] for p in ip]
    sps = [data.load(p)[0] for p in sp]
    hot = [data.load(p)[0] for p in cliff]
    written: list[Path] = []

    def put(fig, name: str) -> None:
        written.extend(save(fig, out / name, "png", dpi=DPI))

    put(cliff_figure(hot or [*ips[:1], *sps[:1]]), "cliffs")
    put(cliff_figure(sps[:1], size="one", smooth=5), "cliffs_one_column")
    put(ip_vs_sp_figure([*ips, *sps]), "ip_vs_sp")
    put(shares_figure(sps[0], smooth=5), "shares")
    put(alignment_figure(sps[0]), "alignment")
    last = int(sps[0].steps[-1])
    put(alignment_figure(sps[0], steps=[10, last // 2, last], window=10), "alignment_steps")
    put(sweep_figure([*ips, *sps]), "sweep")
    for name, runs in (("updates", sps), ("updates_ip", ips)):  # runs trained with --probe-updates
        if runs[0].has_updates:
            put(updates_figure(runs[0], smooth=5), name)
    table = out / "summary.md"
    table.write_text(format_table(summary_table([*ips, *sps, *hot]), "md"))
    written.append(table)
    return written


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gradscope.figures.make_docs", description=__doc__.split("\n\n")[0])
    p.add_argument("--ip", nargs="+", required=True, help="IP run file(s)")
    p.add_argument("--sp", nargs="+", required=True, help="SP run file(s)")
    p.add_argument("--cliff", nargs="*", default=[], help="run files with an accuracy cliff")
    p.add_argument("--out", default="docs/img", help="output folder (default docs/img)")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for path in make(args.ip, args.sp, args.cliff, out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
