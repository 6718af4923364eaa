"""Paper-style figures and tables from gradscope run files.

Every figure is a function returning a :class:`matplotlib.figure.Figure` (built without pyplot, so
it displays in a notebook and never touches global state); :func:`save` writes it as PNG/PDF/SVG.
Inputs are :class:`analyses.series.RunSeries` objects or run-file paths. See docs/figures.md.

    from gradscope.figures import cliff_figure, save
    fig = cliff_figure(["ip.h5", "sp.h5"])
    save(fig, "out/cliffs", "png,pdf")
"""
from gradscope.figures.alignment import alignment_figure
from gradscope.figures.cliffs import cliff_figure
from gradscope.figures.demo import demo_figures
from gradscope.figures.ipsp import ip_vs_sp_figure
from gradscope.figures.shares import shares_figure
from gradscope.figures.style import POLICY_COLORS, ROLE_COLORS, WIDTHS, role_color, save, theme
from gradscope.figures.sweep import sweep_figure
from gradscope.figures.table import format_table, summary_table
from gradscope.figures.updates import updates_figure

__all__ = ["POLICY_COLORS", "ROLE_COLORS", "WIDTHS", "alignment_figure", "cliff_figure", "demo_figures",
           "format_table", "ip_vs_sp_figure", "role_color", "save", "shares_figure", "summary_table",
           "sweep_figure", "theme", "updates_figure"]
