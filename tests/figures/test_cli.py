"""``gradscope plot`` / ``gradscope table`` / ``figures.demo_figures`` on synthetic run files.

Commands run in-process through ``gradscope.cli.main`` (the machine is small); only the check
that building the parser does not import matplotlib needs a fresh interpreter.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from gradscope.cli import main

ROOT = Path(__file__).resolve().parents[2]


def run(capsys, *argv: str) -> tuple[int, list[str], list[str]]:
    try:
        code = main([str(a) for a in argv])
    except SystemExit as exc:  # a flag refused by the parser (argparse exits)
        code = exc.code
    out, err = capsys.readouterr()
    return code, out.splitlines(), err.splitlines()


def test_parser_does_not_import_matplotlib():
    code = ("import sys; from gradscope.cli import build_parser; build_parser().parse_args(['plot', 'cliffs', "
            "'x.h5']); print(sorted(m for m in ('matplotlib', 'seaborn', 'figures') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("kind, names", [
    ("cliffs", ["ip_cliff", "sp_cliff"]),
    ("ip-vs-sp", ["ip_ok", "sp_cliff"]),
    ("shares", ["sp_cliff"]),
    ("alignment", ["sp_ok"]),
    ("sweep", ["ip_ok", "sp_ok", "big_sp"]),
])
def test_plot_every_kind(capsys, runs, tmp_path, kind, names):
    code, out, err = run(capsys, "plot", kind, *[runs[n] for n in names], "--out", tmp_path / kind, "--dpi", "200")
    assert code == 0, err
    assert out == [str(tmp_path / f"{kind}.png")]
    assert Path(out[0]).stat().st_size > 5000


def test_plot_default_output_next_to_first_run_and_formats(capsys, runs, tmp_path):
    import shutil

    src = tmp_path / "one.h5"
    shutil.copy(runs["single"], src)
    code, out, err = run(capsys, "plot", "cliffs", src, "--format", "png,svg", "--size", "one")
    assert code == 0, err
    assert out == [str(tmp_path / "one_cliffs.png"), str(tmp_path / "one_cliffs.svg")]
    assert all(Path(p).exists() for p in out)
    code, out, err = run(capsys, "plot", "alignment", src, "--steps", "1")
    assert code == 0, err
    assert out == [str(tmp_path / "one_alignment.png")]


def test_plot_panels_without_data_still_draw(capsys, runs, tmp_path):
    """A run without evaluations or without gradient records: the cliffs figure is drawn, the
    panels that lack data say so (tested in test_figures); the command succeeds."""
    for name in ("sp_noevals", "evals_only"):
        code, out, err = run(capsys, "plot", "cliffs", runs[name], "--out", tmp_path / name)
        assert code == 0 and len(out) == 1, err


@pytest.mark.parametrize("argv, message", [
    (["plot", "cliffs", "{tmp}/missing.h5"], "missing.h5: no such file"),
    (["plot", "cliffs", "{empty}"], "no accuracy evaluations and no gradient records: nothing to draw"),
    (["plot", "cliffs", "{sp_ok}", "{empty}"], "empty.h5: no accuracy evaluations and no gradient records"),
    (["plot", "shares", "{ip_ok}"], "no parameter set shared by two or more roles"),
    (["plot", "shares", "{evals_only}"], "no gradient records"),
    (["plot", "alignment", "{evals_only}"], "no gradient records"),
    (["plot", "ip-vs-sp", "{ip_ok}", "{sp_ok}", "{evalopt_ip}"], "different workflow"),
    (["plot", "ip-vs-sp", "{ip_ok}", "{sp_noevals}"], "no accuracy evaluations"),
    (["plot", "shares", "{sp_ok}", "{sp_cliff}"], "takes one run file, got 2"),
    (["plot", "cliffs", "{sp_ok}", "--format", "png,jpg"], "format must be"),
    (["plot", "cliffs", "{sp_ok}", "--dpi", "72"], "--dpi: must be a whole number in [200, 1200]"),
    (["plot", "cliffs", "{sp_ok}", "--dpi", "100000"], "--dpi: must be a whole number in [200, 1200]"),
    (["plot", "cliffs", "{sp_ok}", "--steps", "3"], "--steps applies to plot alignment only"),
    (["plot", "alignment", "{sp_ok}", "--steps", "a,b"], "--steps must be"),
    (["plot", "alignment", "{sp_ok}", "--steps", "45", "--window", "10"],  # its window held steps 36-40 only
     "no gradient records at step 45 (the run has steps 1–40)"),
    (["plot", "sweep", "{sp_noevals}"], "none of the runs has accuracy evaluations"),
    (["table", "{sp_ok}", "{tmp}/missing.h5"], "missing.h5: no such file"),
    (["plot", "cliffs", "{sp_ok}", "--metric", "peak"], "--metric applies to plot sweep only"),
    (["plot", "ip-vs-sp", "{ip_ok}", "{sp_ok}", "--smooth", "3"], "--smooth applies to plot cliffs, shares, updates"),
    (["plot", "sweep", "{ip_ok}", "--smooth", "3"], "--smooth applies to plot cliffs, shares, updates only"),
    (["plot", "alignment", "{sp_ok}", "--smooth", "3"], "only (alignment: --window)"),
    (["table", "{sp_ok}", "{sp_cliff}", "--over", "sede"], "--over sede: no run has a setting of that name"),
])
def test_bad_input_is_one_line_and_exit_2(capsys, runs, tmp_path, argv, message):
    names = {k: str(v) for k, v in runs.items()}
    code, out, err = run(capsys, *[a.format(tmp=tmp_path, **names) for a in argv])
    assert code == 2
    assert len(err) == 1 and err[0].startswith("gradscope: error: ") and message in err[0], err
    assert not list(tmp_path.glob("*.png"))


@pytest.mark.parametrize("kind", ["shares", "alignment", "updates"])
def test_single_run_figure_refuses_a_folder_of_several_runs(capsys, runs, tmp_path, kind):
    """A sweep folder stands for its finished runs; a single-run figure must not silently plot the
    first of several."""
    import shutil

    folder = tmp_path / "sweep"
    folder.mkdir()
    for name in ("sp_ok", "sp_cliff"):
        shutil.copy(runs[name], folder / f"{name}.h5")
    code, out, err = run(capsys, "plot", kind, folder)
    assert code == 2 and out == []
    assert len(err) == 1 and err[0].startswith("gradscope: error: "), err
    assert f"folder {folder} holds 2 finished runs" in err[0]
    assert "pass one run file" in err[0] and f"gradscope plot sweep {folder}" in err[0]
    assert not list(tmp_path.glob("*.png"))


def test_a_folder_names_every_run_file_it_leaves_out(capsys, runs, tmp_path):
    """A closed run whose loop logged gradient records but no metrics rows is finished at its last
    record's step; a run closed early and an unreadable *.h5 are left out with a note each."""
    import shutil

    import numpy as np

    from gradscope.runfile import RunMeta, RunWriter

    folder = tmp_path / "sweep"
    folder.mkdir()
    shutil.copy(runs["sp_ok"], folder / "a_done.h5")
    for name, steps in (("b_records_only", 5), ("c_early", 3)):
        meta = RunMeta(agents=["v0", "v1"], agent_roles=["voter", "voter"], policies=["shared"],
                       config={"workflow": "voting", "task": "math", "model": "testbed", "policy": "sp", "steps": 5})
        with RunWriter(folder / f"{name}.h5", meta) as w:
            for step in range(1, steps + 1):
                w.log_step(step, np.eye(2), [5, 5], policy="shared")
            w.log_eval(steps, {"accuracy": 0.5})
    (folder / "d_bad.h5").write_bytes(b"not hdf5")
    code, out, err = run(capsys, "table", folder, "--format", "csv")
    assert code == 0
    assert [line.split(",")[0] for line in out[1:]] == ["a_done.h5", "b_records_only.h5"]
    assert err[0] == f"gradscope: note: {folder / 'c_early.h5'} skipped: closed at step 3 of 5"
    assert err[1].startswith(f"gradscope: note: {folder / 'd_bad.h5'} skipped: unreadable (") and len(err) == 2


@pytest.mark.parametrize("name", ["sweep", "sweep.v2"])
def test_single_run_figure_of_a_folder_with_one_run(capsys, runs, tmp_path, name):
    """A folder holding one finished run is that run; the default output is next to the folder, named
    after its whole name (a folder has no suffix to drop)."""
    import shutil

    folder = tmp_path / name
    folder.mkdir()
    shutil.copy(runs["sp_cliff"], folder / "sp_cliff.h5")
    code, out, err = run(capsys, "plot", "shares", folder)
    assert code == 0, err
    assert out == [str(tmp_path / f"{name}_shares.png")]


def test_an_out_folder_gets_the_default_name_inside_it(capsys, runs, tmp_path):
    (tmp_path / "figs").mkdir()
    for out, want in ((tmp_path / "figs", tmp_path / "figs" / "sp_cliff_cliffs.png"),
                      (f"{tmp_path}/new/", tmp_path / "new" / "sp_cliff_cliffs.png")):
        code, printed, err = run(capsys, "plot", "cliffs", runs["sp_cliff"], "--out", out)
        assert code == 0 and printed == [str(want)] and want.is_file(), err
    assert not (tmp_path / "figs.png").exists() and not (tmp_path / "new.png").exists()


def test_a_figure_of_the_current_folder_is_named_after_it(capsys, runs, tmp_path, monkeypatch):
    """``plot shares .`` inside a sweep folder: the figure goes next to the folder, named after it."""
    import shutil

    folder = tmp_path / "sweep"
    folder.mkdir()
    shutil.copy(runs["sp_cliff"], folder / "sp_cliff.h5")
    monkeypatch.chdir(folder)
    code, out, err = run(capsys, "plot", "shares", ".")
    assert code == 0, err
    assert Path(out[0]).resolve() == tmp_path / "sweep_shares.png"


def test_bad_kind_is_a_usage_error(capsys, runs):
    with pytest.raises(SystemExit) as exc:
        main(["plot", "heatmap", str(runs["sp_ok"])])
    assert exc.value.code == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "invalid choice" in err[0]


def test_table_formats(capsys, runs, tmp_path):
    code, out, _ = run(capsys, "table", runs["ip_cliff"], runs["sp_ok"])
    assert code == 0 and out[0].startswith("| run |") and len(out) == 4
    assert "yes (step 26)" in out[2]
    code, out, _ = run(capsys, "table", runs["ip_cliff"], "--format", "csv")
    assert out[0].startswith("run,workflow,task,model,policy,base,peak") and out[1].endswith("True,26")
    code, out, _ = run(capsys, "table", runs["ip_cliff"], "--format", "latex", "--out", tmp_path / "t.tex")
    assert out == [str(tmp_path / "t.tex")] and r"\bottomrule" in (tmp_path / "t.tex").read_text()


def test_demo_figures(runs, tmp_path, capsys):
    from gradscope.figures import demo_figures

    paths = demo_figures([runs["ip_cliff"], runs["sp_cliff"]], tmp_path)
    names = sorted(p.name for p in paths)
    assert names == ["cliffs.png", "ip_cliff_alignment.png", "ip_vs_sp.png", "sp_cliff_alignment.png",
                     "sp_cliff_shares.png", "summary.md"]
    assert all(p.exists() and p.parent == tmp_path for p in paths)
    skipped = []
    paths = demo_figures([runs["evals_only"]], tmp_path / "x", on_skip=skipped.append)
    assert sorted(p.name for p in paths) == ["cliffs.png", "summary.md"]
    assert any("evals_only_alignment not drawn" in s for s in skipped)


def test_demo_figures_note_every_figure_they_skip(runs, tmp_path):
    """Shares of an IP run and updates of a run without update attribution: a note each, not silence."""
    from gradscope.figures import demo_figures

    skipped: list[str] = []
    demo_figures([runs["ip_ok"], runs["sp_ok"]], tmp_path, on_skip=skipped.append)
    assert [s.split(":")[0] for s in skipped] == ["ip_ok_shares not drawn", "ip_ok_updates not drawn",
                                                  "sp_ok_updates not drawn"]
    assert "an IP run" in skipped[0] and all("--probe-updates" in s for s in skipped[1:])
