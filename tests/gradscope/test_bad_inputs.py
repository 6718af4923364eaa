"""Bad input, one case at a time (issues 15 and 20): each is refused with one line and exit 2, names
what is wrong, and touches nothing — numeric flags of every command and of ``train``, output paths
that are not run files or not regular files, the inputs the fuzz corpus found hanging or crashing,
alert rules and files, and the read limits themselves."""
from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import math
import os
import signal
import stat
import time
from pathlib import Path

import h5py
import numpy as np
import pytest

from gradscope.alerts.rules import load_rules, parse_rule
from gradscope.cli import main
from gradscope.errors import ConfigError, RunFileError
from gradscope.paths import atomic_output
from gradscope.ranges import Range
from gradscope.runfile import RunWriter, open_run
from gradscope.runfile.limits import MAX_COMPRESSION, check_read, deadline
from tests.gradscope.fuzz_corpus import structural, write_base


def cli(*argv: object) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main([str(a) for a in argv])
        except SystemExit as exc:  # argparse's usage errors
            code = exc.code
    return code, out.getvalue(), err.getvalue()


def refused(argv: list[object], *words: str) -> str:
    """Run ``gradscope ARGV``; assert exit 2 with one error line containing ``words``; return it."""
    code, _, err = cli(*argv)
    lines = err.splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("gradscope: error: "), (code, err)
    assert all(w in lines[0] for w in words), lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_base(tmp_path_factory.mktemp("run") / "run.h5")


# ------------------------------------------------------------------ numeric flags of the reading commands
@pytest.mark.parametrize("argv, words", [
    (["analyze", "{run}", "--window", "0"], "argument --window: must be a whole number >= 1, got '0'"),
    (["analyze", "{run}", "--window", "-3"], "argument --window: must be a whole number >= 1, got '-3'"),
    (["analyze", "{run}", "--coherence", "nan"], "argument --coherence: must be a finite number in [0, 1]"),
    (["analyze", "{run}", "--fraction", "0"], "argument --fraction: must be a finite number in (0, 1]"),
    (["analyze", "{run}", "--min-drop=-inf"], "argument --min-drop: must be a finite number >= 0"),
    (["compare", "{run}", "--within", "0"], "argument --within: must be a whole number >= 1"),
    (["plot", "cliffs", "{run}", "--dpi", "100000"], "argument --dpi: must be a whole number in [200, 1200]"),
    (["plot", "cliffs", "{run}", "--smooth", "0"], "argument --smooth: must be a whole number >= 1"),
    (["plot", "alignment", "{run}", "--window", "1.5"], "argument --window: must be a whole number >= 1"),
    (["watch", "{run}", "--poll", "nan"], "argument --poll: must be a finite number in (0, 86400]"),
    (["watch", "{run}", "--idle", "-1"], "argument --idle: must be a finite number >= 0"),
    (["demo", "--steps", "0"], "argument --steps: must be a whole number >= 1"),
    (["demo", "--jobs", "0"], "argument --jobs: must be a whole number >= 1"),
])
def test_reading_flags_are_checked_by_the_parser(run: Path, argv: list[str], words: str) -> None:
    refused([a.format(run=run) for a in argv], words)


def test_range_checks_values_from_python_too() -> None:
    unit = Range(0, 1, hi_open=True)
    assert unit.accepts(0) and unit.accepts(np.float32(0.5)) and not unit.accepts(1)
    assert not unit.accepts(math.nan) and not unit.accepts(True) and not unit.accepts("0.5")
    whole = Range(1, whole=True)
    assert whole.accepts(10**400) and whole.accepts(np.int64(3)) and not whole.accepts(2.0)
    with pytest.raises(ConfigError, match=r"^--x must be a whole number >= 1, got 0$"):
        whole.check("--x", 0)


# ------------------------------------------------------------------ train: every numeric flag, before any model
class ModelBuilt(Exception):
    pass


@pytest.fixture
def no_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """Building a model fails loudly: a flag that passes validation reaches it, a bad one must not."""
    from gradscope.trainers import train

    def refuse(*args: object, **kwargs: object) -> None:
        raise ModelBuilt
    monkeypatch.setattr(train, "load_base", refuse)


@pytest.mark.parametrize("flag, value, words", [
    ("--lr", "nan", "--lr must be a finite number >= 0, got nan"),
    ("--temperature", "nan", "--temperature must be a finite number > 0, got nan"),
    ("--temperature", "0", "--temperature must be a finite number > 0"),
    ("--mini-batch-size", "-4", "--mini-batch-size must be a whole number >= 0, got -4"),
    ("--max-new-tokens", "-1", "--max-new-tokens must be a whole number >= 0"),
    ("--lora-rank", "-8", "--lora-rank must be a whole number >= 0"),
    ("--lora-alpha", "inf", "--lora-alpha must be a finite number >= 0"),
    ("--group-size", "0", "--group-size must be a whole number >= 1"),
    ("--clip-low", "1.5", "--clip-low must be a finite number in [0, 1]"),
    ("--kl-coef", "-0.1", "--kl-coef must be a finite number >= 0"),
    ("--weight-decay", "nan", "--weight-decay must be a finite number >= 0"),
    ("--seed", "-1", "--seed must be a whole number in [0, 4294967295]"),
    ("--seed", str(2**32), "--seed must be a whole number in [0, 4294967295], got 4294967296"),
    ("--task-level", "4", "--task-level must be a whole number in [1, 3]"),
    ("--dist-timeout", "1e300", "--dist-timeout must be a finite number in (0, 1e+06]"),
    ("--eval-every", "-1", "--eval-every must be a whole number >= 0"),
    ("--steps", "0", "--steps must be a whole number >= 1"),
    ("--log-to", ",", "--log-to ',' names no dashboard"),
    ("--log-dir", "logs", "--log-dir is the folder of the --log-to dashboards, and --log-to names none"),
])
def test_train_flags_refused_before_any_model(tmp_path: Path, no_model: None, flag: str, value: str,
                                              words: str) -> None:
    refused(["train", flag, value, "--out", tmp_path / "run.h5"], words)
    assert not list(tmp_path.iterdir())


def test_train_refuses_a_task_file_that_would_block(tmp_path: Path, no_model: None) -> None:
    fifo = tmp_path / "tasks.jsonl"
    os.mkfifo(fifo)
    refused(["train", "--task-file", fifo, "--out", tmp_path / "run.h5"], "is a named pipe (FIFO), not a file")


def test_train_refuses_a_config_file_that_would_block_or_is_not_one(tmp_path: Path, no_model: None) -> None:
    fifo = tmp_path / "c.yaml"
    os.mkfifo(fifo)
    latin1 = tmp_path / "latin1.yaml"
    latin1.write_bytes("steps: 2 # café\n".encode("latin-1"))
    for path, words in ((fifo, "cannot read --config file"), (fifo, "it is a named pipe (FIFO), not a file"),
                        (tmp_path / "missing.yaml", "cannot read --config file"), (tmp_path, "it is a directory"),
                        (latin1, "--config file"), (latin1, "not UTF-8 text (byte 15)")):
        refused(["train", "--config", path, "--out", tmp_path / "run.h5"], words, str(path))
    assert not (tmp_path / "run.h5").exists()


def test_every_numeric_train_field_has_a_range_that_accepts_its_default() -> None:
    from gradscope.trainers.config import RANGES, TrainConfig
    from gradscope.trainers.grpo_config import GRPO_RANGES, GRPOConfig

    for cls, ranges in ((TrainConfig, RANGES), (GRPOConfig, GRPO_RANGES)):
        numeric = {f.name for f in dataclasses.fields(cls)
                   if isinstance(f.default, (int, float)) and not isinstance(f.default, bool)}
        assert numeric == set(ranges), (cls.__name__, numeric ^ set(ranges))
        for f in dataclasses.fields(cls):
            if f.name in ranges:
                assert ranges[f.name].accepts(f.default), (f.name, f.default)
                assert ranges[f.name].whole == isinstance(f.default, int), f.name


# ------------------------------------------------------------------ output paths (issue 20 item 3)
def _targets(tmp_path: Path, run: Path) -> dict[str, tuple[Path, str]]:
    """Paths that must never be replaced, and the words their refusal says. ``/dev/null`` itself is
    never touched: a symbolic link to it stands in for a device, and a FIFO is a device-like target."""
    fifo = tmp_path / "fifo.h5"
    os.mkfifo(fifo)
    (tmp_path / "folder.h5").mkdir()
    (tmp_path / "foreign.h5").write_text("precious notes")
    (tmp_path / "link_to_run.h5").symlink_to(run)
    (tmp_path / "link_to_null.h5").symlink_to("/dev/null")
    (tmp_path / "plain.h5").write_bytes(b"")
    with h5py.File(tmp_path / "other_hdf5.h5", "w") as f:
        f["x"] = 1
    return {"fifo": (fifo, "is a named pipe (FIFO)"), "folder": (tmp_path / "folder.h5", "is a directory"),
            "foreign": (tmp_path / "foreign.h5", "not a gradscope run file"),
            "other_hdf5": (tmp_path / "other_hdf5.h5", "not a gradscope run file"),
            "empty": (tmp_path / "plain.h5", "not a gradscope run file"),
            "link_to_run": (tmp_path / "link_to_run.h5", "is a symbolic link"),
            "link_to_null": (tmp_path / "link_to_null.h5", "is a symbolic link")}


def _snapshot(path: Path) -> tuple:
    st = os.lstat(path)
    content = path.read_bytes() if stat.S_ISREG(st.st_mode) else None
    return st.st_mode, st.st_ino, content, os.readlink(path) if stat.S_ISLNK(st.st_mode) else None


def test_train_overwrite_replaces_only_a_run_file(tmp_path: Path, run: Path, no_model: None) -> None:
    null_before = os.stat("/dev/null")
    run_before = run.read_bytes()
    for name, (path, words) in _targets(tmp_path, run).items():
        before = _snapshot(path)
        for extra in (["--overwrite"], ["--resume"]):
            line = refused(["train", "--out", path, *extra], words, str(path))
            assert _snapshot(path) == before, (name, extra, line)
    assert run.read_bytes() == run_before
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode) and os.stat("/dev/null").st_ino == null_before.st_ino
    assert not list(tmp_path.glob(".*")), "no probe or temporary file left behind"
    # A run file is replaceable: validation passes and the trainer goes on to build the model.
    own = tmp_path / "own.h5"
    own.write_bytes(run_before)
    with pytest.raises(ModelBuilt):
        cli("train", "--out", own, "--overwrite", "--steps", "1")
    assert own.read_bytes() == run_before  # nothing replaced before the model exists


def test_run_writer_overwrite_guard(tmp_path: Path, run: Path) -> None:
    with open_run(run) as r:
        meta = r.meta
    for name, (path, words) in _targets(tmp_path, run).items():
        before = _snapshot(path)
        with pytest.raises(RunFileError, match=words.replace("(", r"\(").replace(")", r"\)")):
            RunWriter(path, meta, overwrite=True)
        assert _snapshot(path) == before, name
    own = tmp_path / "own.h5"
    own.write_bytes(run.read_bytes())
    RunWriter(own, meta, overwrite=True).close()
    with open_run(own) as r:
        assert r.n_steps == 0 and r.closed
    with pytest.raises(RunFileError, match="is a symbolic link"):
        RunWriter.resume(tmp_path / "link_to_run.h5", keep_below_step=3)


@pytest.mark.parametrize("command", ["table", "plot"])
def test_figure_and_table_outputs_never_replace_a_non_regular_file(tmp_path: Path, run: Path,
                                                                    command: str) -> None:
    ext = ".png" if command == "plot" else ".csv"
    elsewhere = tmp_path / f"elsewhere{ext}"
    elsewhere.write_text("keep me")
    os.mkfifo(tmp_path / f"fifo{ext}")
    (tmp_path / f"dir{ext}").mkdir()
    (tmp_path / f"link{ext}").symlink_to(elsewhere)

    def argv(out: Path) -> list[object]:  # a figure's --out is its stem: <stem>.png is written
        return (["table", run, "--format", "csv", "--out", out] if command == "table"
                else ["plot", "cliffs", run, "--out", out.with_suffix(""), "--dpi", "200"])

    for name, words in (("fifo", "is a named pipe (FIFO)"), ("dir", "is a directory"), ("link", "is a symbolic link")):
        out = tmp_path / f"{name}{ext}"
        before = _snapshot(out)
        refused(argv(out), words, str(out))
        assert _snapshot(out) == before
    assert elsewhere.read_text() == "keep me"
    # a run file (HDF5) is never replaced: a copy of the input under the output's name, the input itself,
    # and an HDF5 file with a 512-byte user block before its signature
    copy = tmp_path / f"copy{ext}"
    copy.write_bytes(run.read_bytes())
    blocked = tmp_path / f"blocked{ext}"
    blocked.write_bytes(b"\0" * 512 + run.read_bytes()[:4096])
    inputs = [copy, blocked] + ([run] if command == "table" else [])
    for out in inputs:
        before = _snapshot(out)
        refused(argv(out), "is an HDF5 file (a run file?); refusing to write over it", str(out))
        assert _snapshot(out) == before
    # a regular file is replaced, at once, with nothing left beside it
    regular = tmp_path / f"fresh{ext}"
    regular.write_text("old")
    code, _, err = cli(*argv(regular))
    assert code == 0 and regular.read_bytes() != b"old", err
    assert not list(tmp_path.glob(".*"))


def test_atomic_output_leaves_nothing_on_failure(tmp_path: Path) -> None:
    target = tmp_path / "t.txt"
    target.write_text("old")
    with pytest.raises(ZeroDivisionError), atomic_output(target) as tmp:
        tmp.write_text("half")
        1 / 0  # noqa: B018
    assert target.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["t.txt"]


# ------------------------------------------------------------------ the inputs that used to hang or crash
@pytest.fixture(scope="module")
def damaged(tmp_path_factory: pytest.TempPathFactory, run: Path) -> dict[str, Path]:
    import shutil

    d = tmp_path_factory.mktemp("damaged")
    fifo = d / "fifo"
    os.mkfifo(fifo)
    fns = structural(str(fifo), str(run))
    out = {}
    for name in ("agents_20000", "rows_1e12", "external_link_fifo", "external_group_fifo", "external_storage_fifo",
                 "virtual_fifo", "soft_link_loop", "gzip_zeros_1e7", "gram_strings", "evals_2d", "seed_inf",
                 "policies_many", "committed_huge"):
        shutil.copyfile(run, d / f"{name}.h5")
        with h5py.File(d / f"{name}.h5", "r+") as f:
            fns[name](f)
        out[name] = d / f"{name}.h5"
    return out


@pytest.mark.parametrize("name, words", [
    ("agents_20000", ("one record of /steps/gram would take 3.0 GiB in memory, over the read budget of 256.0 MiB",)),
    ("rows_1e12", ("1,000,000,000,000 rows of /steps/", "iB in memory, over the read budget of 256.0 MiB")),
    ("rows_1e12@1P", ("1,000,000,000,000 rows of /steps/", "iB of data, more than a", "file can hold")),
    ("external_link_fifo", ("/steps/gram is an external link; a run file's datasets must be inside it",)),
    ("external_group_fifo", ("/steps is an external link",)),
    ("external_storage_fifo", ("/steps/gram keeps its data in external files",)),
    ("virtual_fifo", ("/steps/gram is a virtual dataset",)),
    ("soft_link_loop", ("/steps/gram is a soft link",)),
    ("gzip_zeros_1e7@1P", ("10,000,000 rows of /steps/", "of data, more than a", "file can hold")),
    ("gram_strings", ("/steps/gram holds values of type |S8, expected numbers",)),
    ("evals_2d", ("/evals holds values of type float64, expected one-dimensional rows of (step, name, value)",)),
    ("seed_inf", ("invalid run metadata (cannot convert float infinity to integer)",)),
])
def test_damaged_files_are_refused_in_one_line(damaged: dict[str, Path], monkeypatch: pytest.MonkeyPatch,
                                               name: str, words: list[str]) -> None:
    """``name@1P``: with a read budget of a petabyte, so that the file-size check speaks."""
    name, _, budget = name.partition("@")
    monkeypatch.setenv("GRADSCOPE_READ_BUDGET", str(2**50 if budget else 256 << 20))
    for command in ("info", "analyze", "watch"):
        t0 = time.monotonic()
        refused([command, damaged[name]], *words, str(damaged[name]))
        assert time.monotonic() - t0 < 10


def test_a_filtered_dataset_may_be_compressed_up_to_deflates_ratio() -> None:
    check_read("f.h5", "x", 1000 * MAX_COMPRESSION, file_size=1000, filtered=True)
    with pytest.raises(RunFileError, match="more than a 1000 B file can hold"):
        check_read("f.h5", "x", 1000 * MAX_COMPRESSION + 1, file_size=1000, filtered=True)
    with pytest.raises(RunFileError, match="more than a 1000 B file can hold"):
        check_read("f.h5", "x", 1001, file_size=1000, filtered=False)


def test_many_policies_and_huge_counters_read_quickly(damaged: dict[str, Path]) -> None:
    """40,000 declared policies once meant an O(n²) uniqueness check (a hang); counters of 2⁶² are
    capped by the datasets' lengths."""
    for name in ("policies_many", "committed_huge"):
        t0 = time.monotonic()
        code, out, err = cli("info", damaged[name])
        assert code == 0 and time.monotonic() - t0 < 10, err
    with open_run(damaged["committed_huge"]) as r:
        assert r.n_steps == 48 and len(r.gram) == 48


def test_read_budget_and_timeout_come_from_the_environment(run: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GRADSCOPE_READ_BUDGET", "1000")
    refused(["analyze", run], "over the read budget of 1000 B", "GRADSCOPE_READ_BUDGET")
    monkeypatch.setenv("GRADSCOPE_READ_BUDGET", "lots")
    refused(["info", run], "GRADSCOPE_READ_BUDGET='lots' is not a number")
    monkeypatch.delenv("GRADSCOPE_READ_BUDGET")
    monkeypatch.setenv("GRADSCOPE_READ_TIMEOUT", "0.001")
    from gradscope.analyses import cli as analyses_cli
    load = analyses_cli.load

    def slow_load(path):  # a read that outlasts the limit whatever the machine's speed
        end = time.monotonic() + 2.0
        while time.monotonic() < end:
            pass
        return load(path)
    monkeypatch.setattr(analyses_cli, "load", slow_load)
    refused(["analyze", run], "reading run files: gave up after 0.001 s", "GRADSCOPE_READ_TIMEOUT")
    monkeypatch.setattr(analyses_cli, "load", load)
    monkeypatch.setenv("GRADSCOPE_READ_TIMEOUT", "0")  # no limit
    assert cli("analyze", run)[0] == 0


def test_a_limit_that_falls_due_while_it_is_armed_is_the_same_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """GRADSCOPE_READ_TIMEOUT=0.000001: the timer fires inside the call that arms it."""
    from gradscope.runfile import limits

    real = limits.signal.setitimer

    def arm_slowly(which, delay, *rest):  # the signal arrives before the call returns
        previous = real(which, delay, *rest)
        end = time.monotonic() + (0.2 if delay > 0 else 0)
        while time.monotonic() < end:
            pass
        return previous

    monkeypatch.setattr(limits.signal, "setitimer", arm_slowly)
    with pytest.raises(RunFileError, match="gave up after 1e-06 s"):
        with limits.deadline(1e-6, "reading"):
            pass


def test_deadline_fires_through_except_exception_and_keeps_an_outer_timer() -> None:
    def busy(seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            try:
                sum(range(1000))
            except Exception:  # noqa: BLE001 - a catch-all must not swallow the deadline
                pass

    t0 = time.monotonic()
    with pytest.raises(RunFileError, match="x: gave up after 0.2 s"), deadline(0.2, "x"):
        busy(5)
    assert time.monotonic() - t0 < 2
    # an outer timer due first still fires (its handler runs, the block goes on) ...
    fired: list[float] = []
    old = signal.signal(signal.SIGALRM, lambda s, f: fired.append(time.monotonic()))
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.2)
        with deadline(5, "y"):
            busy(0.5)
        assert len(fired) == 1
        # ... and one due later is put back with the time it had left
        signal.setitimer(signal.ITIMER_REAL, 0.6)
        with deadline(5, "z"):
            busy(0.1)
        remaining, _ = signal.getitimer(signal.ITIMER_REAL)
        assert 0.2 < remaining < 0.55, remaining
        busy(0.7)
        assert len(fired) == 2
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


# ------------------------------------------------------------------ alert rules and files
@pytest.mark.parametrize("text, words", [
    ("coherence[voter] > 1e999", "at column 20, '1e999': expected a finite number"),
    ("grad_norm[*] > 1e999x median(5)", "expected a finite number"),
    ("acc_drop > 0.1 for 99999999999999999999", "expected a whole number of observations after 'for' "
                                                "(at most 1,000,000,000)"),
    ("acc_drop > 0.1 for ٣", "at column 20, '٣': expected a name, number"),  # ASCII digits only
    ("acc_drop > " + "9" * 50_000 + " for " + "9" * 50_000, "(100,"),
])
def test_bad_numbers_in_rules(text: str, words: str) -> None:
    t0 = time.monotonic()
    with pytest.raises(ConfigError) as err:
        parse_rule(text)
    message = str(err.value)
    assert words in message and "\n" not in message and len(message) < 600, message[:300]
    assert time.monotonic() - t0 < 0.5  # the tokenizer is linear in the rule's length


def test_bad_alert_files(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text("- - &l1 [x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"  - &l{i} [" + ", ".join([f"*l{i - 1}"] * 9) + "]\n" for i in range(2, 10)))
    latin1 = tmp_path / "latin1.yaml"
    latin1.write_bytes("- acc_drop > 0.1 # café\n".encode("latin-1"))
    huge = tmp_path / "huge.yaml"
    huge.write_text("- acc_drop > 0.1\n" * 100_000)
    deep = tmp_path / "deep.yaml"
    deep.write_text("- " + "[" * 500 + "]" * 500)
    cases = [(fifo, "it is a named pipe (FIFO), not a file"), (Path("/dev/urandom"), "it is a character device"),
             (bomb, "entry 1 must be a rule string or {rule: ..., name: ...}, got [['x', 'x', 'x', ...]"),
             (latin1, "not UTF-8 text (byte 23)"), (huge, "1,700,000 bytes; at most 1,048,576 are read"),
             (deep, "not valid YAML: nested too deeply"), (tmp_path, "it is a directory")]
    for path, words in cases:
        t0 = time.monotonic()
        with pytest.raises(ConfigError) as err:
            load_rules(path)
        message = str(err.value)
        assert words in message and str(path) in message and "\n" not in message and len(message) < 600, message
        assert time.monotonic() - t0 < 5
    named = tmp_path / "named.yaml"
    named.write_text(json.dumps([{"rule": "acc_drop > 0.1", "name": {"a": 1}}]))
    with pytest.raises(ConfigError, match="entry 1 must be"):
        load_rules(named)
