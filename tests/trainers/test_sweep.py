"""``gradscope sweep``: bad files exit 2 with their location before any run; a tiny grid finishes, is
killed and resumed without redoing finished runs; a killed run resumes from its checkpoint; the
folder's summary, table and figures hold exactly the cells run."""
from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from gradscope.cli import main
from gradscope.errors import GradscopeError
from gradscope.runfile import open_run
from gradscope.trainers.sweep.config import load_spec
from gradscope.trainers.sweep.grid import expand
from gradscope.trainers.sweep.runs import DONE, RESUME, run_state

GRADSCOPE = [sys.executable, "-m", "gradscope.cli"]
TINY = """\
train:
  steps: {steps}
  tasks_per_step: 2
  group_size: 2
  n_held_out: 4
  n_train: 20
  eval_every: 1
  checkpoint_every: 1
grid:
  policy: [ip, sp]
  seed: [0, 1]
  lr: [0.001, 0.002]
"""


def write(tmp_path: Path, text: str, name: str = "sweep.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


# ---------------------------------------------------------------- the file
@pytest.mark.parametrize("text, where, message", [
    ("train:\n  steps: abc\n", ":2:10:", "argument --steps: invalid int value: 'abc'"),
    ("train:\n  steps: [3\n", ":3:1:", "bad YAML"),
    ("grid:\n  lrr: [0.1]\n", ":2:3:", "unknown train flag 'lrr' (did you mean 'lr'?)"),
    ("grid:\n  policy: [ip, sp]\n  workflow: [voting, debate]\n", ":3:22:", "unknown workflow 'debate'"),
    ("grid:\n  policy: [ip, 'voter=a,critic=b']\n", ":2:16:", "unknown role 'critic'"),
    ("grid:\n  kl_coef: [0.1, 'critic=0.1']\n", ":2:18:", "--kl-coef names unknown role(s) ['critic']"),
    ("train:\n  out: x.h5\n", ":2:3:", "'out' is set by the sweep for every run (--out DIR chooses the folder)"),
    ("train:\n  resume: true\n", ":2:3:",
     "'resume' is set by the sweep for every run (running the same sweep again resumes its killed runs)"),
    ("grid:\n  overwrite: [true]\n", ":2:3:",
     "'overwrite' is set by the sweep for every run (a run it cannot resume starts afresh; --out DIR chooses "
     "another folder)"),
    ("grid:\n  default_alerts: [true, 3]\n", ":2:26:", "takes true or false"),
    ("grid:\n  seed: [0, 0]\n", ":2:13:", "two cells are both named 'seed0'"),
    ("grid:\n  seed: []\n", ":2:9:", "axis 'seed' has no values"),
    ("train:\n  seed: 1\ngrid:\n  seed: [0, 1]\n", ":4:10:", "'seed' is both a fixed train flag and in the grid axis"),
    ("runs: 3\n", ":1:1:", "unknown key 'runs'"),
    ("- a\n", ":1:1:", "a sweep file is a mapping"),
    ("grid:\n  scale: [0.3M, 2B]\n", ":2:17:", "unknown --scale '2B'"),
    ("grid:\n  variant: [a, b]\n", ":2:12:",
     "'variant' must be a mapping of name: {flag: value} (e.g. {none: {}, kl: {kl_coef: 0.05}})"),
    ("grid:\n  variant: {}\n", ":2:12:",
     "axis 'variant' has no values (name: {flag: value} each, e.g. {none: {}, kl: {kl_coef: 0.05}})"),
    ("grid:\n  variant:\n    kl: {kl_coef: x=}\n", ":3:19:", "bad per-role value"),
    ("grid:\n  variant:\n    a: {lr: 0.1}\n  lr: [0.2]\n", ":4:8:", "'lr' is both in the grid axis 'variant'"),
    ("grid:\n  variant:\n    a: {}\n    a: {lr: 1}\n", ":4:5:", "variant 'a' given twice"),
    # the trainer's range checks, located at the setting they name, fixed or on an axis
    ("train:\n  steps: 0\n", ":2:10:", "--steps must be a whole number >= 1, got 0"),
    ("train:\n  steps: 0\ngrid:\n  seed: [0, 1]\n", ":2:10:", "--steps must be a whole number >= 1"),
    ("train:\n  steps: 5\ngrid:\n  seed: [0, 1]\n  lr: [0.001, -1]\n", ":5:15:", "--lr must be a finite number"),
    # a bad seed or step count after a good one (those cells share every other check)
    ("grid:\n  workflow: [voting]\n  steps: [3, 0]\n", ":3:14:", "--steps must be a whole number >= 1, got 0"),
    ("grid:\n  seed: [0, -1]\n", ":2:13:", "--seed"),
    ("grid:\n  workflow: [voting]\ngrid:\n  seed: [0, 1]\n", ":3:1:", "'grid' given twice"),
    # a fixed setting's value the error quotes without naming its flag: located there, grid or none
    ("train:\n  steps: 1\n  workflow: bogus\ngrid:\n  seed: [0]\n", ":3:13:", "unknown workflow 'bogus'"),
    ("train:\n  steps: 1\n  workflow: bogus\n", ":3:13:", "unknown workflow 'bogus'"),
    ("train:\n  alert: ['garbage ((']\n", ":2:10:", "bad alert rule 'garbage (('"),
    ("train:\n  alert: [1]\n", ":2:10:", "bad alert rule '1'"),  # one character, quoted whole
    ("train:\n  task_file: nope.jsonl\ngrid:\n  seed: [0, 1]\n", ":2:14:", "nope.jsonl: cannot read task file"),
])
def test_bad_sweep_files_exit_2_with_their_location(tmp_path, capsys, text, where, message):
    path = write(tmp_path, text)
    out = tmp_path / "out"
    assert main(["sweep", str(path), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"gradscope: error: {path}{where}") and message in err and "\n" not in err, err
    assert not out.exists()  # nothing was started or written


SWEEPS = sorted((Path(__file__).resolve().parents[2] / "sweeps").glob("*.yaml"))


@pytest.mark.parametrize("config", SWEEPS, ids=[p.name for p in SWEEPS])
def test_committed_sweep_configs_pass_every_check(config):
    """Every config under sweeps/ passes the checks a sweep runs before its first run (gpu.yaml, never run
    until then, held out 256 code tasks of a level that has 179)."""
    cells = expand(load_spec(config))
    assert cells and len({c.name for c in cells}) == len(cells)


def test_bad_sweep_is_one_line_exit_2_as_a_command(tmp_path):
    path = write(tmp_path, "grid:\n  lr: [0.001, fast]\n")
    proc = subprocess.run(GRADSCOPE + ["sweep", str(path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert proc.stderr.strip() == (f"gradscope: error: {path}:2:15: argument --lr: invalid float value: 'fast'")


def test_variants_are_one_axis_of_named_flag_sets(tmp_path):
    spec = load_spec(write(tmp_path, "grid:\n  policy: [ip, sp]\n  variant:\n    none: {}\n"
                                     "    kl: {kl_coef: voter=0.05, coherence_beta: 0.5}\n"))
    cells = expand(spec)
    assert [c.name for c in cells] == ["ip_none", "ip_kl", "sp_none", "sp_kl"]
    assert cells[1].axes == {"policy": "ip", "variant": "kl"}
    assert cells[1].argv == ["--policy", "ip", "--kl-coef", "voter=0.05", "--coherence-beta", "0.5"]
    assert cells[2].argv == ["--policy", "sp"]


def test_the_documented_example_file_is_valid():
    """docs/sweep.md's example, as printed: 3 workflows × 2 tasks × 2 policies × 2 scales × 3 seeds × 2 lr
    × 3 variants (its coherence variant named the voter role, which eval-opt lacks: exit 2)."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "sweep.md").read_text()
    block = text.split("## The file", 1)[1].split("```yaml\n", 1)[1].split("```", 1)[0]
    cells = expand(load_spec(write(Path(tempfile.mkdtemp()), block)))
    assert len(cells) == 432 and cells[0].name == "voting_math_ip_0.3M_lr=0.001_none_seed0"


def test_cells_names_and_command_lines(tmp_path):
    spec = load_spec(write(tmp_path, "train:\n  steps: 5\n  default_alerts: false\n"
                                     "grid:\n  seed: [0, 1]\n  workflow: voting\n  kl_coef: ['voter=0.05', 0]\n"
                                     "  alert: ['acc_drop > 0.2', ['acc_drop > 0.3', 'nonfinite']]\n"))
    cells = expand(spec)
    assert [c.name for c in cells][:3] == ["voting_kl_coef=voter=0.05_alert=acc_drop-0.2_seed0",
                                           "voting_kl_coef=voter=0.05_alert=acc_drop-0.3-nonfinite_seed0",
                                           "voting_kl_coef=0_alert=acc_drop-0.2_seed0"]
    assert len(cells) == 8
    assert cells[1].argv == ["--seed", "0", "--workflow", "voting", "--kl-coef", "voter=0.05",
                             "--alert", "acc_drop > 0.3", "--alert", "nonfinite", "--steps", "5",
                             "--no-default-alerts"]


# ---------------------------------------------------------------- running
def _done(folder: Path, steps: int) -> list[str]:
    return [p.stem for p in sorted((folder / "runs").glob("*.h5")) if run_state(p, steps).state == DONE]


def _sweep(config: Path, out: Path, jobs: int = 2) -> subprocess.Popen:
    return subprocess.Popen(GRADSCOPE + ["sweep", str(config), "--out", str(out), "--jobs", str(jobs)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def _wait_for(condition, proc: subprocess.Popen, timeout: float = 600) -> None:
    deadline = time.time() + timeout
    while not condition():
        assert proc.poll() is None, proc.communicate()
        assert time.time() < deadline, "timed out"
        time.sleep(0.2)


@pytest.mark.slow
def test_tiny_sweep_killed_midway_resumes_without_redoing_finished_runs(tmp_path):
    config, out = write(tmp_path, TINY.format(steps=2)), tmp_path / "out"
    proc = _sweep(config, out)
    _wait_for(lambda: len(_done(out, 2)) >= 2, proc)
    os.kill(proc.pid, signal.SIGKILL)  # the sweep dies; its runs follow it (PR_SET_PDEATHSIG)
    proc.wait()
    first = {name: (out / "runs" / f"{name}.h5").stat() for name in _done(out, 2)}
    assert 2 <= len(first) < 8

    proc = _sweep(config, out)
    stdout, stderr = proc.communicate(timeout=900)
    assert proc.returncode == 0, stderr
    assert f"{len(first)} of 8 runs already finished, skipped" in stderr
    assert "sweep: 8 runs finished" in stdout
    for name, st in first.items():  # untouched: same file, never started again
        now = (out / "runs" / f"{name}.h5").stat()
        assert (now.st_ino, now.st_mtime_ns) == (st.st_ino, st.st_mtime_ns)
        assert (out / "logs" / f"{name}.log").read_text().count("$ gradscope train") == 1

    cells = json.loads((out / "cells.json").read_text())["cells"]
    names = {c["name"] for c in cells}
    assert len(names) == 8 and set(_done(out, 2)) == names
    with open(out / "summary.csv") as f:
        rows = list(csv.DictReader(f))
    assert sorted(r["run"] for r in rows) == sorted(f"{n}.h5" for n in names)
    assert {(r["policy"], r["seed"], r["lr"]) for r in rows} == {
        (p, s, lr) for p in ("ip", "sp") for s in ("0", "1") for lr in ("0.001", "0.002")}
    table = (out / "table.md").read_text().splitlines()
    assert table[0].startswith("| workflow | task | model | policy | lr | n |")
    body = [line for line in table[2:] if line.strip()]
    assert len(body) == 4 and all("| 2 |" in line for line in body)  # 2 policies × 2 lr, 2 seeds each
    figures = sorted(p.name for p in (out / "figures").iterdir())
    assert figures == ["delta_lr=0.001.png", "delta_lr=0.002.png", "ipsp_voting_math_testbed-0.3M_lr=0.001.png",
                       "ipsp_voting_math_testbed-0.3M_lr=0.002.png"]
    # the folder is a run list for table and plot
    proc = subprocess.run(GRADSCOPE + ["table", str(out), "--over", "seed", "--format", "csv"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and len(proc.stdout.strip().splitlines()) == 1 + 4
    # nothing left to run: the report is not written again
    written = (out / "summary.csv").stat().st_mtime_ns
    stdout, stderr = _sweep(config, out).communicate(timeout=300)
    assert stdout.strip() == "sweep: 8 runs finished (8 before this invocation), 0 failed", stderr
    assert (out / "summary.csv").stat().st_mtime_ns == written
    (out / "table.md").unlink()  # ... unless there is none (an invocation died before writing it)
    stdout, stderr = _sweep(config, out).communicate(timeout=300)
    assert str(out / "table.md") in stdout.splitlines() and (out / "table.md").exists(), stderr


def test_a_sweep_started_with_sigint_ignored_still_stops_on_it(tmp_path):
    """`&` in a script or nohup starts the sweep with SIGINT ignored: it re-arms it, as the trainer does, so
    SIGINT interrupts every run (each closes its file) and the sweep exits 130."""
    config, out = write(tmp_path, TINY.format(steps=50)), tmp_path / "out"
    proc = subprocess.Popen(GRADSCOPE + ["sweep", str(config), "--out", str(out), "--jobs", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    _wait_for(lambda: any(open_run_closed(p) is False for p in (out / "runs").glob("*.h5")), proc)
    os.kill(proc.pid, signal.SIGINT)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 130, stderr
    assert [open_run_closed(p) for p in (out / "runs").glob("*.h5")] == [True]


def open_run_closed(path: Path) -> bool | None:
    """Whether the run file's writer closed it (None while it cannot be read yet)."""
    try:
        with open_run(path) as run:
            return run.closed
    except (GradscopeError, OSError):
        return None


@pytest.mark.slow
def test_a_killed_run_resumes_from_its_checkpoint(tmp_path):
    out = tmp_path / "out"
    long = write(tmp_path, TINY.format(steps=300).replace("[ip, sp]", "ip").replace("[0, 1]", "0")
                 .replace("[0.001, 0.002]", "0.001"))
    proc = _sweep(long, out, jobs=1)
    run = out / "runs" / "ip_lr=0.001_seed0.h5"
    _wait_for(lambda: run_state(run, 300).state == RESUME and run_state(run, 300).steps_done >= 1, proc)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    time.sleep(1)
    state = run_state(run, 300)
    assert state.state == RESUME and 1 <= state.steps_done < 300  # the checkpoint's steps are committed
    steps = state.steps_done + 3
    short = write(tmp_path, long.read_text().replace("steps: 300", f"steps: {steps}"))
    proc = _sweep(short, out, jobs=1)
    _, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stderr
    assert "sweep: resuming ip_lr=0.001_seed0 at step" in stderr
    log = (out / "logs" / "ip_lr=0.001_seed0.log").read_text()
    commands = [line for line in log.splitlines() if line.startswith("$ gradscope train")]
    assert len(commands) == 2 and "--overwrite" in commands[0] and "--resume" in commands[1]
    with open_run(run) as r:
        assert r.closed and (r.events["kind"] == "resume").sum() == 1
        m = r.metrics
        assert m[m["name"] == "train/accuracy"]["step"].tolist() == list(range(1, steps + 1))  # each step once


def test_a_run_from_before_a_setting_existed_matches_the_setting_at_its_default(tmp_path):
    """A run file written before a setting existed (absent from its stored config) is the same run when the
    cell wants the setting's default, also inside a nested config; any other value, or a changed setting,
    is refused; steps may change."""
    from gradscope.errors import ConfigError
    from gradscope.trainers.sweep.runs import check_same_config

    defaults = {"lr": 1e-3, "dtype": "auto", "grpo": {"clip": 0.2, "beta": 0.0}, "steps": 100}
    stored = {"lr": 1e-3, "grpo": {"clip": 0.2}, "steps": 100}  # written before dtype and grpo.beta
    path = tmp_path / "run.h5"
    check_same_config(path, stored, {**defaults, "steps": 500}, defaults)
    for wanted, named in (({**defaults, "dtype": "bf16"}, "dtype"), ({**defaults, "grpo": {"clip": 0.2, "beta": 0.1}},
                          "grpo"), ({**defaults, "lr": 5e-3}, "lr")):
        with pytest.raises(ConfigError, match=f"{named}: "):
            check_same_config(path, stored, wanted, defaults)
    with pytest.raises(ConfigError, match="dtype: "):  # without defaults a missing setting is a difference
        check_same_config(path, stored, defaults)


def test_a_kept_run_trained_on_other_tasks_is_refused_before_any_run(tmp_path, capsys, monkeypatch):
    """A finished run whose recorded tasks are not what its cell's settings give now (a changed generator
    or split) is refused, exit 2, nothing started or touched; one that does not record them: a warning."""
    import h5py

    from gradscope.errors import GradscopeWarning
    from gradscope.trainers.sweep import scheduler

    config = write(tmp_path, TINY.format(steps=1).replace("[ip, sp]", "ip").replace("[0, 1]", "0")
                   .replace("[0.001, 0.002]", "0.001"))
    cells = expand(load_spec(config))
    folder = tmp_path / "out"
    (folder / "runs").mkdir(parents=True)
    run = cells[0].run_path(folder)
    assert main(["train", *cells[0].argv, "--out", str(run)]) == 0
    assert [p[2] for p in scheduler.plan(cells, folder)] == [DONE]  # the sweep's fingerprint is the trainer's
    before = run.read_bytes()
    monkeypatch.setattr(scheduler, "_fingerprint", lambda cfg: "math:L1 20+4 v1:0123456789abcdef")
    capsys.readouterr()
    assert main(["sweep", str(config), "--out", str(folder)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"gradscope: error: {run} was trained on other tasks (math:L1 20+4 ") and "\n" not in err
    assert "(math:L1 20+4 v1:0123456789abcdef: the task generator, split or file changed)" in err, err
    assert run.read_bytes() == before and not (folder / "logs").exists()
    monkeypatch.undo()
    with h5py.File(run, "r+", libver="latest") as f:  # as written before run files recorded their tasks
        versions = json.loads(f.attrs["versions"])
        del versions["tasks"]
        f.attrs["versions"] = json.dumps(versions)
    with pytest.warns(GradscopeWarning, match=r"1 run file\(s\) to keep do not record their tasks"):
        assert [p[2] for p in scheduler.plan(cells, folder)] == [DONE]
    # a fingerprint of another scheme (a later gradscope hashing other fields) says nothing either way
    with h5py.File(run, "r+", libver="latest") as f:
        f.attrs["versions"] = json.dumps({**versions, "tasks": "math:L1 20+4 v1:ffffffffffffffff"})
    monkeypatch.setattr(scheduler, "_fingerprint", lambda cfg: "math:L1 20+4 v2:0123456789abcdef")
    with pytest.warns(GradscopeWarning, match=r"1 run file\(s\) to keep do not record their tasks"):
        assert [p[2] for p in scheduler.plan(cells, folder)] == [DONE]


def test_a_sweep_file_or_folder_entry_of_the_wrong_kind_is_one_line_exit_2(tmp_path, capsys):
    """A FIFO would block the sweep for ever, a directory where a file goes crash it: both are refused
    before anything is written, as is a sweep file that is not UTF-8."""
    good = write(tmp_path, "train:\n  steps: 1\ngrid:\n  seed: [0]\n  alert: ['coherence[voter] > 2']\n")
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)
    latin1 = tmp_path / "latin1.yaml"
    latin1.write_bytes("train:\n  steps: 1 # café\n".encode("latin-1"))
    cases = [(fifo, tmp_path / "o1", "it is a named pipe (FIFO), not a file"),
             (latin1, tmp_path / "o2", "not UTF-8 text (byte 24)"),
             (tmp_path, tmp_path / "o3", "it is a directory, not a file"),
             (good, good, "is a file, not a folder")]
    for name, make, want in ((".sweep.lock", os.mkdir, "a directory, not a file"),
                             ("runs", lambda p: p.write_text(""), "a file, not a directory"),
                             ("cells.json", os.mkfifo, "a named pipe (FIFO), not a file")):
        folder = tmp_path / f"out_{name}"
        folder.mkdir()
        make(folder / name)
        cases.append((good, folder, f"{name} is {want}; move it away"))
    flat = tmp_path / "out_flat"  # logs/ a file: named before the logs it would hold
    flat.mkdir()
    (flat / "logs").write_text("")
    cases.append((good, flat, "logs is a file, not a directory; move it away"))
    logs, cell = tmp_path / "out_log", expand(load_spec(good))[0].name
    (logs / "logs" / f"{cell}.log").mkdir(parents=True)
    cases.append((good, logs, f"logs/{cell}.log is a directory, not a file"))
    for config, out, want in cases:
        before = sorted(p.name for p in out.iterdir()) if out.is_dir() else None
        for dry in ([], ["--dry-run"]):
            t0 = time.monotonic()
            assert main(["sweep", str(config), "--out", str(out), *dry]) == 2, (config, out)
            err = capsys.readouterr().err.strip()
            assert err.startswith("gradscope: error: ") and want in err and "\n" not in err, err
            assert time.monotonic() - t0 < 60
        assert (sorted(p.name for p in out.iterdir()) if out.is_dir() else None) == before


def test_dry_run_prints_command_lines_a_shell_reads_back(tmp_path, capsys):
    import shlex

    config = write(tmp_path, "train:\n  steps: 1\ngrid:\n  seed: [0]\n  alert: ['coherence[voter] > 2']\n")
    assert main(["sweep", str(config), "--out", str(tmp_path / "out"), "--dry-run"]) == 0
    name, command = capsys.readouterr().out.strip().split(": ", 1)
    assert shlex.split(command)[:2] == ["gradscope", "train"]
    assert shlex.split(command)[shlex.split(command).index("--alert") + 1] == "coherence[voter] > 2"


def test_a_run_whose_only_checkpoint_is_old_is_resumed(tmp_path):
    """A save killed between its two renames leaves old/ alone: the run resumes from it (was: started over
    with --overwrite, which deleted old/)."""
    run = tmp_path / "run.h5"
    assert main(["train", "--steps", "1", "--tasks-per-step", "2", "--group-size", "2", "--n-held-out", "4",
                 "--n-train", "16", "--eval-every", "0", "--out", str(run)]) == 0
    ckpt = tmp_path / "run.h5.ckpt"
    assert run_state(run, 2).state == RESUME
    (ckpt / "latest").rename(ckpt / "old")
    assert run_state(run, 2).state == RESUME
