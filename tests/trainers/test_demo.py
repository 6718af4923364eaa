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
