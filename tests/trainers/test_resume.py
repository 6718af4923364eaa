"""``--resume`` and ``--config``: exact continuation, the checks against the run's stored config and its
checkpoint, checkpoint folders that are never replaced unless they are gradscope's, YAML config files."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
from pathlib import Path

import h5py
import numpy as np
import pytest

from gradscope.cli import main
from gradscope.errors import GradscopeWarning
from gradscope.runfile import open_run, schema
from gradscope.trainers import train as train_mod
from gradscope.trainers.checkpoint import find_checkpoint
from gradscope.trainers.train import Trainer

from .conftest import crash_at
from .test_train import small

#: A tiny run on the command line (a few seconds).
TINY = ["--tasks-per-step", "2", "--group-size", "2", "--n-held-out", "4", "--n-train", "40", "--max-new-tokens", "8",
        "--eval-every", "2", "--checkpoint-every", "1", "--no-default-alerts"]


def assert_same_run(expected: str | Path, actual: str | Path) -> None:
    """Every dataset of two finished run files equal, row for row, except wall-clock fields
    (``/steps/time``, the events' ``time``, ``time/*`` metric values) and ``resume`` events."""
    with h5py.File(expected, "r", libver="latest", swmr=True) as f, \
            h5py.File(actual, "r", libver="latest", swmr=True) as g:
        names = set(f[schema.STEPS])
        assert set(g[schema.STEPS]) == names
    with open_run(expected) as a, open_run(actual) as b:
        assert a.closed and b.closed
        for name in names - {"time"}:  # wall clock
            np.testing.assert_array_equal(a.read(name), b.read(name), err_msg=f"/steps/{name}")
        for name in schema.TABLES:
            x, y = a.read_table(name), b.read_table(name)
            if name == schema.EVENTS:
                x, y = (t[t["kind"] != b"resume"][["step", "kind", "severity", "message"]] for t in (x, y))
            if name == schema.METRICS:
                assert np.array_equal(x[["step", "name"]], y[["step", "name"]]), f"/{name}"
                clock = np.char.startswith(x["name"], b"time/")
                x, y = x[~clock], y[~clock]
            assert np.array_equal(x, y), f"/{name}: {x} != {y}"
        invocation = ("resume", "overwrite", "out")
        assert {k: v for k, v in a.meta.config.items() if k not in invocation} == \
               {k: v for k, v in b.meta.config.items() if k not in invocation}


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def train(*args: str) -> int:
    return main(["train", *TINY, *args])


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert err and err[-1].startswith("gradscope: error:") and "Traceback" not in "\n".join(err), err
    return err[-1]


@pytest.fixture
def forbid_model(monkeypatch):
    """Call it to fail the test if a model is built from then on: the checks must come before."""
    def forbid() -> None:
        monkeypatch.setattr(train_mod, "load_base", lambda *a, **k: pytest.fail("a model was built"))

    return forbid


# ---------------------------------------------------------------- exact continuation
def test_resume_after_a_crash_past_the_checkpoint_equals_an_uninterrupted_run(tmp_path):
    """A crash after step 3 whose rows were flushed (the writer closes on the exception), checkpoint
    of step 2: resume drops step 3 and redoes it."""
    full = small(tmp_path, steps=5, checkpoint_every=2, out=str(tmp_path / "full.h5"))
    Trainer(full).run()
    cut = dataclasses.replace(full, out=str(tmp_path / "cut.h5"))

    with pytest.raises(RuntimeError):
        Trainer(cut).run(on_step=crash_at(3))
    with open_run(cut.out) as run:
        assert run.step.max() == 3
    assert find_checkpoint(Path(cut.out + ".ckpt")).step == 2
    Trainer(dataclasses.replace(cut, resume=True)).run()
    assert_same_run(full.out, cut.out)
    with open_run(cut.out) as run:
        assert run.events["kind"].tolist().count("resume") == 1


def test_checkpoint_records_the_committed_rows(tmp_path):
    """checkpoint.json: the step, and the run file's committed counters, which equal its rows up to that step."""
    cfg = small(tmp_path, steps=2, checkpoint_every=1)
    Trainer(cfg).run()
    info = json.loads((Path(cfg.out + ".ckpt") / "latest" / "checkpoint.json").read_text())
    with open_run(cfg.out) as run:
        assert info["step"] == 2 and info["run_created"] == run.meta.created
        assert info["committed"] == {"n_steps": run.n_steps, "n_evals": run.n_evals, "n_events": run.n_events,
                                     "n_metrics": run.n_metrics}
        assert run.n_steps > 0 and run.n_evals > 0


# ---------------------------------------------------------------- --resume reads the stored config
def test_resume_reads_the_stored_config(tmp_path, capsys):
    out = tmp_path / "run.h5"
    assert train("--steps", "1", "--seed", "3", "--out", str(out)) == 0
    assert main(["train", "--out", str(out), "--resume", "--steps", "2", "--eval-every", "1"]) == 0
    with open_run(out) as run:
        config = run.meta.config
        assert sorted(set(run.step)) == [1, 2] and sorted(set(run.evals["step"])) == [0, 1, 2]
    assert config["steps"] == 2 and config["eval_every"] == 1  # the file stores what the resumed run used
    assert config["seed"] == 3 and config["tasks_per_step"] == 2 and config["grpo"]["group_size"] == 2
    assert config["default_alerts"] is False


@pytest.mark.parametrize("flag, value, stored", [("--group-size", "8", "2"), ("--policy", "sp", '"ip"'),
                                                 ("--no-shuffle", None, "true")])
def test_resume_refuses_a_setting_that_may_not_change(tmp_path, capsys, forbid_model, flag, value, stored):
    out = tmp_path / "run.h5"
    assert train("--steps", "1", "--out", str(out)) == 0
    before = digest(out)
    forbid_model()
    assert main(["train", "--out", str(out), "--resume", flag, *([value] if value else [])]) == 2
    line = one_error_line(capsys)
    name = flag.replace("--no-", "--")
    assert f"{name} is " in line and f"the run was made with {stored}" in line and "--steps" in line, line
    assert digest(out) == before


def test_resume_with_the_same_settings_repeated(tmp_path, capsys):
    out = tmp_path / "run.h5"
    assert train("--steps", "1", "--out", str(out)) == 0
    assert train("--steps", "2", "--lora-rank", "0", "--out", str(out), "--resume") == 0  # 0: the resolved default
    with open_run(out) as run:
        assert sorted(set(run.step)) == [1, 2]


# ---------------------------------------------------------------- --resume checks the checkpoint
def test_resume_refuses_a_run_file_older_than_its_checkpoint(tmp_path, capsys, forbid_model):
    """The commit counter check: a run file restored from a copy taken before the checkpoint."""
    out = tmp_path / "run.h5"
    assert train("--steps", "1", "--out", str(out)) == 0
    shutil.copy(out, tmp_path / "copy.h5")
    assert main(["train", "--out", str(out), "--resume", "--steps", "2"]) == 0  # checkpoint of step 2
    shutil.copy(tmp_path / "copy.h5", out)  # the run file as it was after step 1
    forbid_model()
    assert main(["train", "--out", str(out), "--resume", "--steps", "3"]) == 2
    line = one_error_line(capsys)
    assert "covers" in line and "up to step 2" in line and "not the one" in line, line
    assert digest(out) == digest(tmp_path / "copy.h5")


def test_resume_below_the_checkpoints_step_is_refused(tmp_path, capsys, forbid_model):
    """--steps below the checkpoint's step wrote a config of 2 steps into a file of 3 (and a resume event)."""
    out = tmp_path / "run.h5"
    assert train("--steps", "3", "--out", str(out)) == 0
    before = digest(out)
    forbid_model()
    assert main(["train", "--out", str(out), "--resume", "--steps", "2"]) == 2
    assert one_error_line(capsys) == "gradscope: error: --resume: the checkpoint is at step 3; --steps must be at least 3, got 2"
    assert digest(out) == before


def test_resume_without_a_checkpoint_but_with_trained_steps_is_refused(tmp_path, capsys, forbid_model):
    out = tmp_path / "run.h5"
    assert train("--steps", "2", "--out", str(out)) == 0
    shutil.rmtree(str(out) + ".ckpt")
    before = digest(out)
    forbid_model()
    assert main(["train", "--out", str(out), "--resume"]) == 2
    assert "no checkpoint in" in one_error_line(capsys)
    assert digest(out) == before


def test_resume_refuses_a_run_trained_on_other_tasks(tmp_path, capsys, forbid_model, monkeypatch):
    """The same settings giving other tasks (a changed generator or split): refused, nothing touched."""
    out = tmp_path / "run.h5"
    assert train("--steps", "1", "--out", str(out)) == 0
    with open_run(out) as run:
        stored = run.meta.versions["tasks"]
    assert re.fullmatch(r"math:L1 40\+4 v1:[0-9a-f]{16}", stored), stored
    before = digest(out)
    real = train_mod.tasks_for

    def reordered(cfg):  # the same tasks, held out in another order
        tasks = real(cfg)
        return dataclasses.replace(tasks, held_out=tasks.held_out[::-1])

    monkeypatch.setattr(train_mod, "tasks_for", reordered)
    forbid_model()
    assert main(["train", "--out", str(out), "--resume", "--steps", "2"]) == 2
    line = one_error_line(capsys)
    assert "trained on other tasks" in line and f"({stored})" in line and "--overwrite" in line, line
    assert digest(out) == before


@pytest.mark.parametrize("stored", [-5, 10**12])
def test_resume_refuses_a_run_file_with_a_damaged_flush_every(tmp_path, capsys, stored):
    """The resumed writer would take the file's flush_every as its records per flush: a negative one was taken
    silently as 10, a huge one was a MemoryError traceback. One line, exit 2, the file unchanged; the file
    still reads."""
    out = tmp_path / "run.h5"
    assert train("--steps", "1", "--out", str(out)) == 0
    with h5py.File(out, "r+", libver="latest") as f:
        f.attrs["flush_every"] = np.int64(stored)
    before = digest(out)
    capsys.readouterr()
    assert main(["train", "--out", str(out), "--resume", "--steps", "2"]) == 2
    line = one_error_line(capsys)
    assert line.startswith(f"gradscope: error: {out}: cannot resume: its flush_every attribute is {stored}: ") \
        and line.endswith("; the run file is unchanged (set the attribute to a record count, e.g. 10, to resume it)"), line
    assert digest(out) == before
    assert main(["info", str(out)]) == 0
    assert f"flush every    {stored} (invalid: " in capsys.readouterr().out


def test_resume_of_a_run_file_that_does_not_record_its_tasks_warns(tmp_path, capsys):
    out = tmp_path / "run.h5"
    assert train("--steps", "1", "--out", str(out)) == 0
    with h5py.File(out, "r+", libver="latest") as f:  # as written before run files recorded their tasks
        versions = json.loads(f.attrs["versions"])
        del versions["tasks"]
        f.attrs["versions"] = json.dumps(versions)
    with pytest.warns(GradscopeWarning, match=r"^--resume: .*run.h5 does not record its tasks in this form .* cannot check"):
        assert main(["train", "--out", str(out), "--resume", "--steps", "2"]) == 0
    with open_run(out) as run:
        assert sorted(set(run.step)) == [1, 2]


def test_find_checkpoint_takes_the_newest_complete_one(tmp_path):
    def make(name: str, step: int, complete: bool = True) -> None:
        folder = tmp_path / name
        (folder / "adapters").mkdir(parents=True)
        (folder / "checkpoint.json").write_text(json.dumps({"step": step}))
        if complete:
            (folder / "state.pt").write_bytes(b"")

    assert find_checkpoint(tmp_path) is None
    make("old", 4)
    assert find_checkpoint(tmp_path).path.name == "old"  # a kill inside the swap: only old/ is left
    make("latest", 6, complete=False)
    assert find_checkpoint(tmp_path).path.name == "old"  # latest/ being written
    shutil.rmtree(tmp_path / "latest")
    make("latest", 6)
    assert find_checkpoint(tmp_path).step == 6
    shutil.rmtree(tmp_path / "old")
    make("old", 6)
    assert find_checkpoint(tmp_path).path.name == "latest"


# ---------------------------------------------------------------- checkpoint folders
def _symlink(folder: Path, victim: Path) -> None:
    os.symlink(victim, folder / "latest")


def _foreign(folder: Path, victim: Path) -> None:
    shutil.copytree(victim, folder / "latest")


def _fifo(folder: Path, victim: Path) -> None:
    os.mkfifo(folder / "latest")


@pytest.mark.parametrize("make", [_symlink, _foreign, _fifo])
@pytest.mark.parametrize("mode", ["--overwrite", "--resume"])
def test_a_foreign_entry_in_the_checkpoint_folder_is_never_touched(tmp_path, capsys, forbid_model, make, mode):
    """``latest`` as a link to the user's folder, a copy of it, a FIFO: exit 2, nothing touched."""
    out, folder, victim = tmp_path / "run.h5", tmp_path / "run.h5.ckpt", tmp_path / "mine"
    victim.mkdir()
    (victim / "notes.txt").write_text("precious")
    assert train("--steps", "1", "--out", str(out)) == 0
    shutil.rmtree(folder / "latest")
    make(folder, victim)
    before = {p: os.lstat(p).st_mtime_ns for p in [folder / "latest", *folder.rglob("*"), *victim.rglob("*")]}
    run_before = digest(out)
    forbid_model()
    assert train("--steps", "2", "--out", str(out), mode) == 2
    assert "not a gradscope checkpoint folder" in one_error_line(capsys)
    assert {p: os.lstat(p).st_mtime_ns for p in before} == before and digest(out) == run_before
    assert (victim / "notes.txt").read_text() == "precious"


@pytest.mark.parametrize("kind", ["file", "symlink"])
def test_a_checkpoint_folder_that_is_not_a_folder_is_refused(tmp_path, capsys, forbid_model, kind):
    out, folder = tmp_path / "run.h5", tmp_path / "run.h5.ckpt"
    target = tmp_path / "elsewhere"
    target.mkdir()
    if kind == "file":
        folder.write_text("precious")
    else:
        folder.symlink_to(target)
    forbid_model()
    assert train("--steps", "1", "--out", str(out)) == 2
    assert f"is a {'file' if kind == 'file' else 'symbolic link'}, not a folder" in one_error_line(capsys)
    assert not out.exists() and not any(target.iterdir())
    assert kind != "file" or folder.read_text() == "precious"


def test_a_new_run_replaces_an_earlier_runs_checkpoint_only_with_overwrite(tmp_path, capsys):
    out, latest = tmp_path / "run.h5", tmp_path / "run.h5.ckpt" / "latest"
    assert train("--steps", "1", "--out", str(out)) == 0
    out.unlink()  # the run file is gone; its checkpoint stays
    old = (latest / "checkpoint.json").read_text()
    assert train("--steps", "1", "--out", str(out)) == 2
    assert "holds the checkpoint of an earlier run" in one_error_line(capsys)
    assert (latest / "checkpoint.json").read_text() == old and not out.exists()
    assert train("--steps", "1", "--out", str(out), "--overwrite") == 0
    with open_run(out) as run:
        assert json.loads((latest / "checkpoint.json").read_text())["run_created"] == run.meta.created


# ---------------------------------------------------------------- --config FILE.yaml
def test_config_file_with_flags_over_it(tmp_path, capsys):
    """Flat settings (dashes or underscores) and a ``grpo:`` section; a flag overrides the file; the run
    file stores the merged config."""
    cfg = tmp_path / "run.yaml"
    cfg.write_text("tasks-per-step: 2\nsteps: 5\nn_held_out: 4\nn_train: 40\nmax_new_tokens: 8\n"
                   "default_alerts: false\nalert: 'acc_drop > 0.9'\ngrpo:\n  group_size: 2\n  lr: 2e-3\n")
    out = tmp_path / "run.h5"
    assert main(["train", "--config", str(cfg), "--steps", "1", "--eval-every", "0", "--out", str(out)]) == 0
    with open_run(out) as run:
        config = run.meta.config
        assert sorted(set(run.step)) == [1]
    assert config["steps"] == 1 and config["tasks_per_step"] == 2 and config["n_held_out"] == 4
    assert config["grpo"]["group_size"] == 2 and config["grpo"]["lr"] == 2e-3 and config["eval_every"] == 0
    assert config["alert"] == ["acc_drop > 0.9"] and config["default_alerts"] is False


@pytest.mark.parametrize("text, message", [
    ("steps: 3\ntasks_per_stp: 2\n", "run.yaml:2: unknown setting 'tasks_per_stp' (did you mean 'tasks_per_step'?)"),
    ("steps: two\n", 'run.yaml:1: steps: expected a whole number, got "two"'),
    ("lr: true\n", "run.yaml:1: lr: expected a number, got true"),
    ("grpo:\n  steps: 3\n", "run.yaml:2: unknown setting 'steps' under grpo"),
    ("steps: 3\nsteps: 4\n", "run.yaml:2: steps is set twice (first at"),
    ("- steps\n", "run.yaml:1: expected a mapping of settings"),
    ("steps: [3\n", "not valid YAML"),
    ("seed: 1\nsteps: 0\n", "--steps must be a whole number >= 1, got 0 (", ),
    ("workflow: debate\n", "unknown workflow 'debate'"),
    ("steps: 2\nalert: ['acc_drop > nan']\n", "--alert: bad alert rule 'acc_drop > nan': at column 12"),
])
def test_bad_config_file_is_one_line_with_its_location(tmp_path, capsys, forbid_model, text, message):
    cfg = tmp_path / "run.yaml"
    cfg.write_text(text)
    forbid_model()
    assert main(["train", "--config", str(cfg), "--out", str(tmp_path / "run.h5")]) == 2
    line = one_error_line(capsys)
    assert message in line, line
    if "must be" in message or "alert" in message:
        assert line.endswith("run.yaml:2)"), line
    assert not (tmp_path / "run.h5").exists()


def test_a_flag_fixes_a_bad_value_of_the_config_file(tmp_path, capsys, forbid_model):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("steps: 0\n")
    forbid_model()
    assert main(["train", "--config", str(cfg), "--steps", "-1", "--out", str(tmp_path / "run.h5")]) == 2
    line = one_error_line(capsys)
    assert "--steps must be a whole number >= 1, got -1" in line, line  # the flag's value ...
    assert "run.yaml" not in line, line  # ... not the file's
