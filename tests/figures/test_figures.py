"""The figure functions on synthetic run files: structure, not only that something was drawn.

Panels are found by their Axes label (``figures.panels``), role lines by their label and colour,
the cliff shading by gid ``cliff``, "no data" panels by a text with gid ``no-data``.
"""
from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

from dataclasses import replace  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from matplotlib.colors import to_hex  # noqa: E402

from gradscope.figures import (alignment_figure, cliff_figure, format_table, ip_vs_sp_figure, role_color, save,  # noqa: E402
                     shares_figure, summary_table, sweep_figure)
from gradscope.figures import data  # noqa: E402
from gradscope.figures.cliffs import ROWS  # noqa: E402
from gradscope.figures.style import is_no_data  # noqa: E402
from gradscope.errors import ConfigError  # noqa: E402

ROLES = ["voter", "aggregator"]


def panels(fig, name: str) -> list:
    return [ax for ax in fig.axes if ax.get_label() == name]


def role_lines(ax) -> dict[str, str]:
    return {ln.get_label(): to_hex(ln.get_color()) for ln in ax.lines if ln.get_label() in ROLES}


def has_gid(ax, gid: str) -> bool:
    return any(a.get_gid() == gid for a in [*ax.patches, *ax.lines, *ax.collections, *ax.texts])


def xspan(ax, gid: str) -> tuple[float, float]:
    p = next(a for a in ax.patches if a.get_gid() == gid)
    if hasattr(p, "get_width"):  # a Rectangle (matplotlib >= 3.9)
        return float(p.get_x()), float(p.get_x() + p.get_width())
    xs = np.asarray(p.get_xy())[:, 0]
    return float(np.min(xs)), float(np.max(xs))


def render(fig):
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    return canvas.get_renderer()


# ------------------------------------------------------------------ cliffs
def test_cliffs_sp_with_cliff(runs):
    s = data.as_series(runs["sp_cliff"])
    cliff = data.cliff_of(s)
    assert cliff is not None, "the fixture's cliff must be found by the detector"
    fig = cliff_figure(s)
    main = [ax for ax in fig.axes if ax.get_label() in ROWS]
    assert [ax.get_label() for ax in main] == list(ROWS)            # 5 panels, top to bottom
    for ax in main:
        assert ax.get_ylabel(), f"panel {ax.get_label()} has no y label"
        assert not is_no_data(ax)
    assert main[-1].get_xlabel() == "training step"
    assert all(ax.get_shared_x_axes().joined(main[0], ax) for ax in main)
    norm = panels(fig, "grad_norm")[0]
    assert norm.get_yscale() == "log"
    assert role_lines(norm) == {r: role_color(r) for r in ROLES}   # one line per role, in its colour
    assert [ln.get_label() for ln in norm.lines].count("voter") == 1
    coh = panels(fig, "coherence")[0]
    assert set(role_lines(coh)) == {"voter"}                        # only roles with >= 2 agents
    shares = panels(fig, "shares")[0]
    assert {c.get_label() for c in shares.collections} >= set(ROLES)
    acc = panels(fig, "accuracy")[0]
    lo, hi = xspan(acc, "cliff")
    assert lo == cliff.onset and hi == data.last_step(s)            # shaded from onset to the end
    onset = [ln for ln in acc.lines if ln.get_gid() == "cliff-onset"]
    assert onset and onset[0].get_xdata()[0] == cliff.onset
    assert any(ln.get_gid() == "peak" for ln in acc.lines)
    assert all(has_gid(ax, "cliff-onset") for ax in main)           # the onset runs through every panel
    assert any(ln.get_gid() == "lead" for ax in main for ln in ax.lines)  # lead indicators marked
    legend_labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert {"voter", "aggregator", "cliff onset", "peak"} <= set(legend_labels)


def test_cliffs_ip_without_cliff(runs):
    fig = cliff_figure(runs["ip_ok"])
    assert not any(has_gid(ax, "cliff") or has_gid(ax, "cliff-onset") for ax in fig.axes)
    shares = panels(fig, "shares")[0]
    assert is_no_data(shares)                                        # IP: no shared set
    assert "IP" in next(t.get_text() for t in shares.texts if t.get_gid() == "no-data")
    assert role_lines(panels(fig, "grad_norm")[0]) == {r: role_color(r) for r in ROLES}
    assert not is_no_data(panels(fig, "alignment")[0])               # voter pairs are measured


def test_cliffs_several_runs_share_scales(runs):
    fig = cliff_figure([runs["ip_cliff"], runs["sp_cliff"], runs["sp_ok"]])
    for name in ROWS:
        row = panels(fig, name)
        assert len(row) == 3, name
        assert all(row[0].get_shared_y_axes().joined(row[0], ax) for ax in row[1:])
        assert len({ax.get_xlim() for ax in row}) == 1
    acc = panels(fig, "accuracy")
    assert [has_gid(ax, "cliff") for ax in acc] == [True, True, False]
    titles = [ax.get_title() for ax in acc]
    assert titles[0].startswith("IP") and titles[1].startswith("SP")


def test_cliffs_column_titles_of_long_run_names_do_not_overlap(runs, tmp_path):
    """Four columns of runs with long file names (a sweep's cells): each title is broken into lines that fit
    its column, so neighbouring titles never overlap."""
    import shutil

    long = []
    for i, name in enumerate(["ip_cliff", "sp_cliff", "ip_ok", "sp_ok"]):
        long.append(tmp_path / f"voting_math_0.3M_{name}_coherence_reg=0.5_seed{i}.h5")
        shutil.copyfile(runs[name], long[-1])
    fig = cliff_figure(long)
    fig.canvas.draw()
    boxes = [ax.title.get_window_extent() for ax in panels(fig, "accuracy")]
    assert all("\n" in ax.get_title() for ax in panels(fig, "accuracy"))
    assert all(a.x1 < b.x0 for a, b in zip(boxes, boxes[1:]))


def test_cliffs_run_without_evaluations(runs):
    fig = cliff_figure(runs["sp_noevals"])
    assert is_no_data(panels(fig, "accuracy")[0])
    for name in ROWS[1:]:
        assert not is_no_data(panels(fig, name)[0]), name


def test_cliffs_run_without_gradients(runs):
    fig = cliff_figure(runs["evals_only"])
    assert not is_no_data(panels(fig, "accuracy")[0])
    for name in ROWS[1:]:
        assert is_no_data(panels(fig, name)[0]), name


def test_cliffs_single_step_run(runs):
    fig = cliff_figure(runs["single"], size="one")
    assert fig.get_figwidth() == pytest.approx(3.4)
    norm = panels(fig, "grad_norm")[0]
    lines = [ln for ln in norm.lines if ln.get_label() in ROLES]
    assert len(lines) == 2 and all(ln.get_marker() == "o" for ln in lines)   # a point, not an invisible line
    shares = panels(fig, "shares")[0]
    width = np.ptp(shares.collections[0].get_paths()[0].vertices[:, 0])
    assert width > 0                                                 # a one-step band, visible
    lo, hi = norm.get_xlim()
    assert lo < 0 and hi > 1                                         # the step is inside the axes


def test_cliffs_roles_without_peers(runs):
    fig = cliff_figure(runs["evalopt_ip"])
    coh = panels(fig, "coherence")[0]
    assert is_no_data(coh)
    assert "two or more agents" in next(t.get_text() for t in coh.texts if t.get_gid() == "no-data")
    norm = panels(fig, "grad_norm")[0]
    assert {ln.get_label() for ln in norm.lines} >= {"generator", "evaluator"}


def test_af_axis_does_not_depend_on_column_order(runs):
    """The AF right axis is drawn whenever every run's multi-agent roles have one n (3 voters here;
    Eval-Opt has none), on the rightmost coherence panel with data, whichever column comes last."""
    for order in (["sp_ok", "evalopt_ip"], ["evalopt_ip", "sp_ok"]):
        fig = cliff_figure([runs[n] for n in order])
        coh = panels(fig, "coherence")
        af = [(i, c) for i, ax in enumerate(coh) for c in ax.child_axes if c.get_label() == "coherence-af"]
        assert [(i, c.get_ylabel()) for i, c in af] == [(order.index("sp_ok"), "AF (n = 3)")], order


def test_smoothing_keeps_gaps(tmp_path):
    """``--smooth``: zero-gradient steps (hatched, NaN) stay gaps in the smoothed curves, and the
    title says what the window counts."""
    from gradscope.runfile import RunMeta, RunWriter

    rng = np.random.default_rng(0)
    meta = RunMeta(agents=["v0", "v1", "a"], agent_roles=["voter", "voter", "aggregator"], policies=["shared"],
                   config={"workflow": "voting", "task": "math", "model": "testbed", "policy": "sp"})
    with RunWriter(tmp_path / "gap.h5", meta) as w:
        for step in range(1, 21):
            G = np.zeros((3, 4)) if 8 <= step <= 12 else rng.normal(size=(3, 4))
            w.log_step(step, G @ G.T, [5, 5, 5], policy="shared")
    fig = cliff_figure(tmp_path / "gap.h5", smooth=5)
    gap = np.arange(8, 13)
    for name in ("grad_norm", "coherence", "alignment"):
        for ln in panels(fig, name)[0].lines:
            x, y = np.asarray(ln.get_xdata(), float), np.asarray(ln.get_ydata(), float)
            if len(x) == 20:
                assert np.isnan(y[np.isin(x, gap)]).all() and np.isfinite(y[~np.isin(x, gap)]).any(), (name, ln)
    assert "gradients: mean of 5 logged steps" in panels(fig, "accuracy")[0].get_title()
    np.testing.assert_allclose(data.smooth(np.array([1.0, 3.0, np.nan, np.nan, 4.0, 6.0]), 3),
                               [2.0, 2.0, np.nan, np.nan, 5.0, 5.0])


def test_refusals_say_what_the_run_lacks(tmp_path):
    """An SP run whose records are all zero is not called an IP run by ``shares``; a run with update
    attribution but no record holding an update is pointed at ``--probe-updates`` by ``updates``."""
    from gradscope.figures.updates import updates_figure
    from gradscope.runfile import RunMeta, RunWriter

    meta = RunMeta(agents=["v0", "v1", "a"], agent_roles=["voter", "voter", "aggregator"], policies=["shared"],
                   config={"workflow": "voting", "task": "math", "model": "testbed", "policy": "sp"},
                   update_unit="role")
    with RunWriter(tmp_path / "zero.h5", meta) as w:
        for step in (1, 2):
            w.log_step(step, np.zeros((3, 3)), [5, 5, 5], policy="shared")
    with pytest.raises(ConfigError, match="no record in which two or more roles") as info:
        shares_figure(tmp_path / "zero.h5")
    assert "IP" not in str(info.value)
    with pytest.raises(ConfigError, match="no record with an update .*--probe-updates"):
        updates_figure(tmp_path / "zero.h5")


# ------------------------------------------------------------------ ip vs sp
def test_ip_vs_sp_with_seeds(runs):
    fig = ip_vs_sp_figure([runs["ip_ok"], runs["ip_ok2"], runs["sp_ok"], runs["sp_ok2"], runs["sp_ok3"]])
    ip, sp = panels(fig, "accuracy:ip")[0], panels(fig, "accuracy:sp")[0]
    assert ip.get_shared_y_axes().joined(ip, sp)
    assert ip.get_ylabel() == "held-out accuracy" and ip.get_xlabel() == "training step"
    assert sum(ln.get_gid() == "seed" for ln in ip.lines) == 2
    assert sum(ln.get_gid() == "seed" for ln in sp.lines) == 3
    bands = {ax.get_label(): [c.get_label() for c in ax.collections if c.get_gid() == "band"] for ax in (ip, sp)}
    assert bands == {"accuracy:ip": ["range (2 runs)"], "accuracy:sp": ["±1 SD (3 runs)"]}
    for ax in (ip, sp):
        gids = {ln.get_gid() for ln in ax.lines}
        assert {"mean", "peak", "final", "base"} <= gids
        base = next(ln for ln in ax.lines if ln.get_gid() == "base")
        assert base.get_linestyle() == "--"
        labels = [t.get_text() for t in ax.get_legend().get_texts()]
        assert any(t.startswith("peak ") for t in labels) and any(t.startswith("final ") for t in labels)


def test_ip_vs_sp_marks_cliffs(runs):
    fig = ip_vs_sp_figure([runs["ip_cliff"], runs["sp_ok"]])
    ip, sp = panels(fig, "accuracy:ip")[0], panels(fig, "accuracy:sp")[0]
    onset = next(ln for ln in ip.lines if ln.get_gid() == "cliff-onset")
    assert onset.get_xdata()[0] == data.cliff_of(data.as_series(runs["ip_cliff"])).onset
    assert not any(ln.get_gid() == "cliff-onset" for ln in sp.lines)


def test_ip_vs_sp_mean_is_over_every_seed(runs, tmp_path):
    """A seed ending at step 20 (of 40) ends the mean there, and seeds evaluated every 2 and every 3
    steps meet only at multiples of 6: 'mean of 2' is never one seed's value."""
    from tests.figures.conftest import write_run

    short = write_run(tmp_path / "ip_short.h5", policy="ip", steps=20, seed=3)
    odd = write_run(tmp_path / "ip_odd.h5", policy="ip", steps=40, seed=4, eval_every=3)
    for other, steps in ((short, list(range(0, 21, 2))), (odd, list(range(0, 37, 6)))):
        fig = ip_vs_sp_figure([runs["ip_ok"], other, runs["sp_ok"]])
        ip = panels(fig, "accuracy:ip")[0]
        a, b = (data.as_series(r).accuracy for r in (runs["ip_ok"], other))
        mean = next(ln for ln in ip.lines if ln.get_gid() == "mean")
        assert list(mean.get_xdata()) == steps
        np.testing.assert_allclose(mean.get_ydata(), [(a[t] + b[t]) / 2 for t in steps])
        final = next(ln for ln in ip.lines if ln.get_gid() == "final")
        assert final.get_xdata()[0] == steps[-1]
        band = next(c for c in ip.collections if c.get_gid() == "band")
        assert band.get_paths()[0].vertices[:, 0].max() == steps[-1]
    a, b = data.as_series(runs["ip_ok"]), data.as_series(odd)
    disjoint = [replace(a, evals=a.evals.loc[[2, 4]]), replace(b, evals=b.evals.loc[[3, 9]]), runs["sp_ok"]]
    with pytest.raises(ConfigError, match="no evaluation step in common"):
        ip_vs_sp_figure(disjoint)


@pytest.mark.parametrize("names, message", [
    (["ip_ok", "sp_ok", "evalopt_ip"], "different workflow"),
    (["ip_ok", "big_sp"], "different task"),
    (["ip_ok", "ip_ok2"], "no SP run"),
    (["ip_ok", "sp_noevals"], "no accuracy evaluations in sp_noevals.h5"),
])
def test_ip_vs_sp_refuses(runs, names, message):
    with pytest.raises(ConfigError, match=message):
        ip_vs_sp_figure([runs[n] for n in names])


# ------------------------------------------------------------------ shares, alignment
def test_shares(runs):
    fig = shares_figure(runs["sp_cliff"])
    assert [ax.get_label() for ax in fig.axes] == ["shares", "token_share", "per_token_share"]
    stack = panels(fig, "shares")[0]
    assert [c.get_label() for c in stack.collections if not c.get_label().startswith("_")] == ROLES
    assert [to_hex(c.get_facecolor()[0]) for c in stack.collections[:1]] == [role_color("voter")]
    for name in ("token_share", "per_token_share"):
        assert role_lines(panels(fig, name)[0]) == {r: role_color(r) for r in ROLES}
    capture = [ln for ln in stack.lines if ln.get_gid() == "capture-onset"]
    assert any("aggregator" in ln.get_label() for ln in capture)    # the planted capture at step 18
    assert all(ax.get_ylabel() for ax in fig.axes)


@pytest.mark.parametrize("name, message", [("ip_ok", "no parameter set shared"),
                                           ("evals_only", "no gradient records")])
def test_shares_refuses(runs, name, message):
    with pytest.raises(ConfigError, match=message):
        shares_figure(runs[name])


def test_alignment_over_time(runs):
    fig = alignment_figure(runs["sp_ok"])
    ax = panels(fig, "alignment-heatmap")[0]
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert len(labels) == 6 and labels[0] == "voter0 · voter1"      # SP: all 6 pairs, voters first
    assert ax.get_xlabel() == "training step"
    assert any(a.get_label() == "<colorbar>" for a in fig.axes)
    ip = alignment_figure(runs["ip_ok"])
    assert len(panels(ip, "alignment-heatmap")[0].get_yticklabels()) == 3  # IP: cross-role never measured


def test_alignment_at_steps(runs):
    fig = alignment_figure(runs["sp_cliff"], steps=[10, 30], window=5)
    mats = [ax for ax in fig.axes if ax.get_label().startswith("alignment:")]
    assert [ax.get_title() for ax in mats] == ["steps 6–10", "steps 26–30"]
    m = mats[1].images[0].get_array()
    assert m.mask[0, 0] and not m.mask[0, 1]                         # diagonal grey, pairs shown
    assert m[0, 1] > 0.8                                             # the planted voter coherence
    with pytest.raises(ConfigError, match="no gradient records at step 99"):
        alignment_figure(runs["sp_ok"], steps=[99])


# ------------------------------------------------------------------ sweep and table
def test_sweep(runs):
    names = ["ip_ok", "ip_ok2", "sp_ok", "sp_cliff", "big_sp", "big_ip_noevals", "evalopt_ip"]
    fig = sweep_figure([runs[n] for n in names])
    ip, sp = panels(fig, "sweep:ip")[0], panels(fig, "sweep:sp")[0]
    assert [t.get_text() for t in ip.get_xticklabels()] == ["testbed", "Qwen3-1.7B", "Qwen3-4B"]
    assert [t.get_text() for t in ip.get_yticklabels()] == ["evalopt / math", "voting / code", "voting / math"]
    cells = {(round(t.get_position()[1]), round(t.get_position()[0])): t.get_text() for t in ip.texts}
    assert cells[(2, 0)].endswith("n=2")                             # two IP seeds averaged
    assert cells[(2, 2)] == "no data"                                # a run without evaluations
    assert (1, 0) not in cells                                       # no IP run of voting/code
    s_cells = [t.get_text() for t in sp.texts]
    assert len(s_cells) == 2 and any("n=2" in t for t in s_cells)
    assert any(a.get_label() == "<colorbar>" for a in fig.axes)
    with pytest.raises(ConfigError, match="none of the runs"):
        sweep_figure([runs["sp_noevals"]])


def test_table(runs):
    df = summary_table([runs["ip_cliff"], runs["sp_ok"], runs["sp_noevals"], runs["single"]])
    assert list(df["policy"]) == ["ip", "sp", "sp", "sp"]
    assert list(df["cliff"]) == [True, False, None, None]
    assert df["cliff_onset"].iloc[0] == 26
    md = format_table(df, "md").splitlines()
    assert md[0].startswith("| run | workflow | task | model | policy | base | peak")
    assert "yes (step 26)" in md[2] and "| no |" in md[3] and md[4].count("—") >= 5
    csv = format_table(df, "csv").splitlines()
    assert csv[0].split(",")[:5] == ["run", "workflow", "task", "model", "policy"] and len(csv) == 5
    tex = format_table(df, "latex")
    assert r"\toprule" in tex and r"$\Delta$" in tex and r"ip\_cliff.h5" in tex
    with pytest.raises(ConfigError):
        format_table(df, "html")


def test_roles_outside_the_workflows_get_distinct_colours_in_a_figure(runs):
    """'actor' and 'critic' hash to the same spare colour (the aggregator's): one figure drew both in it."""
    assert role_color("actor") == role_color("critic") == role_color("aggregator")
    base = data.load(runs["sp_ok"])[0]
    s = replace(base, agent_roles=["actor", "actor", "actor", "critic"])
    ax = panels(cliff_figure(s), "grad_norm")[0]
    lines = {ln.get_label(): to_hex(ln.get_color()) for ln in ax.lines if ln.get_label() in ("actor", "critic")}
    assert set(lines) == {"actor", "critic"} and len(set(lines.values())) == 2
    assert lines["actor"] == role_color("actor")   # the name's own colour, the other moved on


def test_a_setting_named_like_a_table_column_keeps_its_values(runs):
    """A config key `n` (4, 4, 8) was overwritten by the run count in --over tables (CSV `n,n` with the
    count twice; Markdown raised TypeError); `run` (verl's run-file path) is where a run was written, no cell."""
    from gradscope.figures.table import seed_table

    base = data.load(runs["sp_ok"])[0]
    series = [replace(base, config={**base.config, "n": n, "seed": seed, "run": f"/runs/r{i}.h5"}, name=f"r{i}.h5")
              for i, (n, seed) in enumerate([(4, 0), (4, 1), (8, 0)])]
    csv = seed_table(series, fmt="csv").splitlines()
    assert csv[0].split(",")[:6] == ["workflow", "task", "model", "policy", "n (setting)", "n"]
    assert [line.split(",")[4:6] for line in csv[1:]] == [["4", "2"], ["8", "1"]]
    md = seed_table(series, fmt="md").splitlines()
    assert md[0].startswith("| workflow | task | model | policy | n (setting) | n | base") and len(md) == 4
    summary = summary_table(series, ["n"])
    assert list(summary["n (setting)"]) == [4, 4, 8]


def test_a_setting_some_cells_lack_reads_as_missing(runs):
    """Two runs disagree on `note`, a third lacks it: its cell read `nan`, not `—`."""
    from gradscope.figures.table import seed_table

    base = data.load(runs["sp_ok"])[0]
    series = [replace(base, config={**base.config, "seed": 0, **extra}, name=f"{i}.h5")
              for i, extra in enumerate([{"note": "x"}, {"note": "y"}, {}])]
    md = seed_table(series, fmt="md").splitlines()
    assert md[0].startswith("| workflow | task | model | policy | note | n |") and len(md) == 5, md
    assert [row.split("|")[5].strip() for row in md[2:]] == ["x", "y", "—"]


def test_a_flag_some_runs_lack_varies_only_where_they_disagree(runs):
    """A run written before a flag existed lacks it: the flag does not split cells unless runs that have it differ."""
    import dataclasses

    base = data.load(runs["sp_ok"])[0]
    old, new = (dataclasses.replace(base, config=dict(base.config)) for _ in range(2))
    new.config["dtype"] = "auto"
    assert "dtype" not in data.varying_keys([old, new])
    other = dataclasses.replace(base, config={**base.config, "dtype": "bf16"})
    assert "dtype" in data.varying_keys([old, new, other])


# ------------------------------------------------------------------ output
def test_save_formats_and_resolution(runs, tmp_path):
    from PIL import Image

    fig = ip_vs_sp_figure([runs["ip_ok"], runs["sp_ok"]], size="one")
    paths = save(fig, tmp_path / "sub" / "ipsp.png", "png,pdf,svg", dpi=200)
    assert [p.name for p in paths] == ["ipsp.png", "ipsp.pdf", "ipsp.svg"]
    with Image.open(paths[0]) as im:
        assert im.info["dpi"][0] == pytest.approx(200, abs=1)
        assert im.size[0] == pytest.approx(3.4 * 200, abs=2)
    assert paths[1].read_bytes().startswith(b"%PDF")
    assert "<text" in paths[2].read_text() or "held-out accuracy" in paths[2].read_text()
    with pytest.raises(ConfigError):
        save(fig, tmp_path / "x", "png", dpi=100)
    with pytest.raises(ConfigError):
        save(fig, tmp_path / "x", "jpg")


def test_regenerating_a_figure_gives_the_same_files(runs, tmp_path):
    """No timestamps, and fixed SVG ids (matplotlib draws random clip-path ids unless salted)."""
    files = []
    for n in range(2):
        fig = cliff_figure([runs["ip_cliff"]], size="one")
        files.append([p.read_bytes() for p in save(fig, tmp_path / str(n) / "cliffs", "png,pdf,svg", dpi=200)])
    assert files[0] == files[1]


def test_legends_do_not_cover_data(runs):
    """Rendered: the cliff figure's legend sits outside every panel; ip-vs-sp legends sit below
    their panels; nothing runs off the page."""
    fig = cliff_figure([runs["ip_cliff"], runs["sp_cliff"]])
    r = render(fig)
    leg = fig.legends[0].get_window_extent(r)
    page = fig.bbox
    assert leg.x0 >= page.x0 - 1 and leg.x1 <= page.x1 + 1 and leg.y1 <= page.y1 + 1
    for ax in fig.axes:
        assert not leg.overlaps(ax.get_window_extent(r)), ax.get_label()
    fig = ip_vs_sp_figure([runs["ip_ok"], runs["sp_ok"]])
    r = render(fig)
    for ax in fig.axes:
        box = ax.get_legend().get_window_extent(r)
        assert box.y1 <= ax.get_window_extent(r).y0 and box.y0 >= page.y0 - 1


def test_a_report_removes_the_figures_of_the_one_before_that_it_does_not_draw(tmp_path):
    """A sweep folder reported again with other runs (a rerun with fewer cells, no cliff any more): its
    figures/ holds this report's figures only, not the earlier IP-vs-SP and cliff figures; other files
    stay."""
    from gradscope.figures.sweepdir import write_report
    from tests.figures.conftest import write_run

    folder = tmp_path / "sweep"
    (folder / "runs").mkdir(parents=True)
    for name, kw in {"ip_cliff": dict(policy="ip", cliff=True), "sp": dict(policy="sp")}.items():
        write_run(folder / "runs" / f"{name}.h5", **kw)
    first = {p.name for p in write_report(folder, on_skip=lambda line: None) if p.parent.name == "figures"}
    assert {"cliffs.png", "ipsp_voting_math_testbed.png"} <= first
    (folder / "figures" / "notes.txt").write_text("mine")
    (folder / "runs" / "ip_cliff.h5").unlink()
    skipped: list[str] = []
    second = {p.name for p in write_report(folder, on_skip=skipped.append) if p.parent.name == "figures"}
    assert sorted(p.name for p in (folder / "figures").iterdir()) == sorted(second | {"notes.txt"})
    assert "cliffs.png" not in second and "ipsp_voting_math_testbed.png" not in second and skipped
