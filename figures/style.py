"""One look for every gradscope figure: theme, colours, sizes, saving.

* Theme: seaborn's ``whitegrid`` axes style and ``paper`` context, tuned for print (8 pt text,
  thin lines, light grid, no top/right spines), applied with :func:`theme` around figure creation
  only, so a notebook's own rcParams are never changed.
* Colours: Okabe & Ito's colour-blind-safe palette. Every role has **one colour in every figure**
  (:func:`role_color`): the roles of the built-in workflows have fixed colours, any other role gets a
  colour from its name (stable across runs and figures). IP and SP have their own two colours
  (:data:`POLICY_COLORS`, from Paul Tol's colour-blind-safe set), accuracy is near-black.
* Sizes: :data:`WIDTHS` — ``one`` column (3.4 in) and ``two`` columns / full width (7.0 in) of a
  two-column paper; heights are chosen per figure.
* Formats: PNG (``dpi`` 200–1200, default 300), PDF and SVG, all with text kept as text (TrueType in
  PDF, ``<text>`` in SVG) and no timestamps, so re-running a script gives the same files.

Figures are built as :class:`matplotlib.figure.Figure` objects without pyplot: nothing is
registered globally, nothing leaks, and a notebook displays the returned Figure as usual.
"""
from __future__ import annotations

import contextlib
import zlib
from contextvars import ContextVar
from collections.abc import Callable, Iterable, Iterator, Sequence
from functools import lru_cache
from pathlib import Path

import matplotlib as mpl
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from gradscope.errors import ConfigError, GradscopeError
from gradscope.paths import atomic_output, check_derived_output
from gradscope.ranges import DPI

#: Okabe & Ito (2008), "Color Universal Design": distinguishable under the common colour-vision
#: deficiencies and in greyscale by lightness for the first few.
OKABE_ITO = {
    "blue": "#0072B2", "vermillion": "#D55E00", "green": "#009E73", "purple": "#CC79A7",
    "orange": "#E69F00", "sky": "#56B4E9", "yellow": "#F0E442", "black": "#000000",
}
#: The roles of the built-in workflows (docs/training.md); the same colour in every figure.
ROLE_COLORS = {
    "voter": OKABE_ITO["blue"], "aggregator": OKABE_ITO["vermillion"],
    "generator": OKABE_ITO["green"], "evaluator": OKABE_ITO["purple"],
    "orchestrator": OKABE_ITO["orange"], "worker": OKABE_ITO["sky"], "synthesizer": OKABE_ITO["vermillion"],
}
#: Colours for roles not listed above, chosen by a hash of the role name (yellow is left out: too
#: light for lines on white).
_SPARE = ["#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9", "#882255", "#44AA99"]
#: Isolated vs shared policy (Paul Tol's "muted" wine and teal; distinct from the role colours
#: that appear next to them).
POLICY_COLORS = {"ip": "#882255", "sp": "#117733"}
ACCURACY_COLOR = "#222222"
CLIFF_COLOR = "#C0392B"      # onset line; the collapsed region is the same colour, very light
NEUTRAL = "#7F7F7F"          # reference lines, cross-role pairs, zero-gradient hatching
DIVERGING = "RdBu"           # ColorBrewer diverging map: colour-blind safe (red = worse / negative)

#: Figure widths in inches: one column and the full text width of a two-column paper.
WIDTHS = {"one": 3.4, "two": 7.0}
FORMATS = ("png", "pdf", "svg")


#: The colours of the figure being built (:func:`theme`'s ``roles``): role → colour.
_FIGURE_COLORS: ContextVar[dict[str, str]] = ContextVar("gradscope_role_colors", default={})


def role_color(role: str) -> str:
    """The colour of ``role`` (lower-case hex, as ``matplotlib.colors.to_hex``): a workflow role's is
    fixed; any other role's comes from its name, moved on to the next spare colour that no other role
    of the figure being built has (:func:`theme`)."""
    if role in ROLE_COLORS:
        return ROLE_COLORS[role].lower()
    return _FIGURE_COLORS.get().get(role) or _spare(role, 0)


def _spare(role: str, k: int) -> str:
    return _SPARE[(zlib.crc32(role.encode("utf-8")) + k) % len(_SPARE)].lower()


def _figure_colors(roles: Iterable[str]) -> dict[str, str]:
    """Distinct colours for ``roles`` where the palette allows (more roles than colours repeat some)."""
    roles = set(roles)
    used = {ROLE_COLORS[r].lower() for r in roles if r in ROLE_COLORS}
    out = {}
    for role in sorted(roles - set(ROLE_COLORS)):
        free = [c for c in (_spare(role, k) for k in range(len(_SPARE))) if c not in used]
        out[role] = free[0] if free else _spare(role, 0)
        used.add(out[role])
    return out


def policy_color(policy: str) -> str:
    return POLICY_COLORS.get(policy.lower(), NEUTRAL)


def width(size: str) -> float:
    if size not in WIDTHS:
        raise ConfigError(f"size must be one of {', '.join(WIDTHS)}, got {size!r}")
    return WIDTHS[size]


@lru_cache(maxsize=1)
def _rc() -> dict:
    import seaborn as sns  # imported here: only figure-making code pays for it

    rc = dict(sns.axes_style("whitegrid"))
    rc.update(sns.plotting_context("paper", font_scale=0.9))
    rc.update({
        "font.size": 7.5, "axes.labelsize": 7.5, "axes.titlesize": 8, "xtick.labelsize": 6.5,
        "ytick.labelsize": 6.5, "legend.fontsize": 6.5, "legend.title_fontsize": 7,
        "figure.titlesize": 9,
        "axes.edgecolor": "#333333", "axes.linewidth": 0.6, "axes.spines.top": False,
        "axes.spines.right": False, "axes.titlepad": 4.0, "axes.labelpad": 2.0,
        "grid.color": "#E5E5E5", "grid.linewidth": 0.5,
        "lines.linewidth": 1.1, "lines.markersize": 3.0, "patch.linewidth": 0.4,
        "xtick.bottom": True, "ytick.left": True, "xtick.major.size": 2.5, "ytick.major.size": 2.5,
        "xtick.major.width": 0.5, "ytick.major.width": 0.5, "xtick.major.pad": 1.5, "ytick.major.pad": 1.5,
        "legend.frameon": False, "legend.handlelength": 1.6, "legend.columnspacing": 1.2,
        "legend.borderaxespad": 0.2,
        "figure.dpi": 100, "savefig.dpi": 300, "savefig.bbox": None, "savefig.facecolor": "white",
        "pdf.fonttype": 42, "ps.fonttype": 42, "svg.fonttype": "none",
        "svg.hashsalt": "gradscope",  # fixed clip-path / marker ids: a regenerated SVG is the same file
        "figure.constrained_layout.h_pad": 0.03, "figure.constrained_layout.w_pad": 0.03,
        "image.cmap": DIVERGING,
    })
    return rc


@contextlib.contextmanager
def theme(roles: Iterable[str] = ()) -> Iterator[None]:
    """Temporarily apply the gradscope theme (rcParams are restored on exit); ``roles``: every role the
    figure draws, so that no two of them share a colour (:func:`role_color`)."""
    token = _FIGURE_COLORS.set(_figure_colors(roles))
    try:
        with mpl.rc_context(_rc()):
            yield
    finally:
        _FIGURE_COLORS.reset(token)


def new_figure(size: str, height: float, nrows: int = 1, ncols: int = 1, **subplot_kw) -> tuple[Figure, object]:
    """A constrained-layout Figure of the paper width ``size`` and ``height`` inches, with axes.

    Call inside :func:`theme`. Returns ``(fig, axes)`` where ``axes`` is a 2-D array (squeeze=False).
    """
    fig = Figure(figsize=(width(size), height), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False, **subplot_kw)
    return fig, axes


def mark_no_data(ax: Axes, reason: str) -> None:
    """Mark a panel that has nothing to show: a grey "no data" with the reason, in the middle.

    The text artist has gid ``"no-data"`` (tests and callers can find it); the panel keeps its
    axes so that shared scales stay intact.
    """
    ax.text(0.5, 0.5, f"no data\n{reason}", transform=ax.transAxes, ha="center", va="center",
            fontsize=6.5, color=NEUTRAL, gid="no-data", wrap=True,
            bbox={"boxstyle": "round,pad=0.3", "facecolor": "white", "edgecolor": "#DDDDDD", "linewidth": 0.5})


def is_no_data(ax: Axes) -> bool:
    return any(t.get_gid() == "no-data" for t in ax.texts)


def parse_formats(formats: str | Iterable[str]) -> list[str]:
    """``"png,pdf"`` or ``["png", "pdf"]`` → validated list (ConfigError on unknown ones)."""
    items = [f.strip().lower().lstrip(".") for f in (formats.split(",") if isinstance(formats, str) else formats)]
    items = [f for f in dict.fromkeys(items) if f]
    bad = [f for f in items if f not in FORMATS]
    if bad or not items:
        raise ConfigError(f"format must be a comma-separated subset of {','.join(FORMATS)}, got {formats!r}")
    return items


def save(fig: Figure, path_stem: str | Path, formats: str | Sequence[str] = ("png",), dpi: int = 300) -> list[Path]:
    """Write ``fig`` as ``<path_stem>.<fmt>`` for each format; returns the paths written.

    A suffix of ``path_stem`` that is one of the formats is dropped (``out/fig.png`` → ``out/fig``).
    PNGs get ``dpi`` (200–1200, ``gradscope.ranges.DPI``); PDF and SVG are vector. Folders are created as needed.
    Only regular files are replaced, each at once (``gradscope.paths.atomic_output``): ConfigError, and
    nothing written, if any of the paths is a directory, link, device, FIFO or HDF5 file (a run file).
    """
    fmts = parse_formats(formats)
    DPI.check("dpi", dpi)
    stem = Path(path_stem)
    if stem.suffix.lower().lstrip(".") in FORMATS:
        stem = stem.with_suffix("")
    paths = [stem.parent / f"{stem.name}.{fmt}" for fmt in fmts]
    for path in paths:  # all refused before any is written
        check_derived_output(path)
    metadata = {"png": {"Software": None}, "pdf": {"CreationDate": None, "Producer": None},
                "svg": {"Date": None}}
    with theme():
        for fmt, path in zip(fmts, paths):
            with atomic_output(path) as tmp:
                fig.savefig(tmp, format=fmt, dpi=dpi, metadata=metadata[fmt], facecolor="white")
    return paths


def save_or_skip(make: Callable[[], Figure], path_stem: str | Path, on_skip: Callable[[str], None],
                 formats: str | Sequence[str] = ("png",)) -> list[Path]:
    """Draw ``make()`` and :func:`save` it; a figure that cannot be drawn (GradscopeError: no data for
    it) is reported to ``on_skip`` as one line and nothing is written. Returns the paths written."""
    try:
        fig = make()
    except GradscopeError as exc:
        on_skip(f"{Path(path_stem).name} not drawn: {exc}")
        return []
    return save(fig, path_stem, formats)
