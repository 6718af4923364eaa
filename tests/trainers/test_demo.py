"""``gradscope demo`` end to end, shortened: its runs train in parallel processes into a sweep folder,
and a second demo in the same folder starts afresh."""
import json

import pytest

from gradscope.runfile import open_run
from gradscope.runfile.progress import run_progress
from gradscope.trainers import demo


@pytest.mark.slow
def test_demo_trains_its_runs_in_parallel_into_a_sweep_folder(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(demo, "HOT", dict(demo.HOT, steps=3, eval_every=1))
    for _ in range(2):  # the second demo in the folder retrains (its runs are not skipped as finished)
        paths = demo.run_demo(tmp_path, steps=2, jobs=3)
        out = capsys.readouterr().out
        assert [p.name for p in paths] == ["ip.h5", "sp.h5", "hot.h5"]
        assert [run_progress(p).last_step for p in paths] == [2, 2, 3]
        assert out.count("accuracy  base") == 3 and "3 at a time" in out
        for name in ("ip", "sp", "hot"):  # each log holds this demo's run only
            assert (tmp_path / "logs" / f"{name}.log").read_text().count("$ gradscope train") == 1
    cells = json.loads((tmp_path / "cells.json").read_text())["cells"]
    assert [c["run"] for c in cells] == ["runs/ip.h5", "runs/sp.h5", "runs/hot.h5"]
    with open_run(paths[2]) as run:
        assert run.meta.config["grpo"]["lr"] == pytest.approx(1e-2) and run.meta.config["policy"] == "ip"


def test_a_failed_demo_run_names_its_log(tmp_path, monkeypatch):
    monkeypatch.setattr(demo, "HOT", dict(demo.HOT, steps=1, eval_every=1, policy="nope"))
    with pytest.raises(demo.GradscopeError, match=r"demo run 'hot' failed; its output is in .*hot\.log"):
        demo.run_demo(tmp_path, steps=1, jobs=3)


def test_a_demo_folder_that_is_a_file_or_holds_the_wrong_kind_is_one_line_exit_2(tmp_path, capsys):
    from gradscope.cli import main

    text = tmp_path / "text.h5"
    text.write_text("keep me")
    odd = tmp_path / "odd"
    (odd / "logs" / "ip.log").mkdir(parents=True)
    for out, want in ((text, f"--out {text}: is a file, not a folder"),
                      (odd, f"--out {odd}: logs/ip.log is a directory, not a file; move it away")):
        assert main(["demo", "--out", str(out), "--steps", "1"]) == 2
        captured = capsys.readouterr()
        err = captured.err.strip()
        assert err == f"gradscope: error: {want}", err
        assert "demo:" not in captured.out  # refused before the banner
    assert text.read_text() == "keep me" and sorted(p.name for p in odd.iterdir()) == ["logs"]
