"""Fuzz (issue 15): every bad input is read or refused in one line with exit 2 — no traceback, no hang.

A seeded corpus (``fuzz_corpus.py``: truncations, byte flips, wrong schemas, huge declared shapes,
NaN/inf, FIFOs, devices, directories, external links and storage) goes through the command line's
own entry point in this process, and rule strings and YAML files through the rule parser. A case that
blocks inside a system call cannot be interrupted from Python: ``faulthandler`` then ends the test
process after ``BACKSTOP`` seconds, printing where it hung, so a hang fails loudly instead of
stalling CI.
"""
from __future__ import annotations

import contextlib
import faulthandler
import io
import os
import time
import traceback
from collections.abc import Iterator
from pathlib import Path

import pytest

from gradscope.alerts.rules import Rule, load_rules, parse_rule
from gradscope.cli import main
from gradscope.errors import ConfigError
from tests.gradscope.fuzz_corpus import build_cases, rule_texts, yaml_files

SEED = 15
#: A case slower than this counts as a hang (the slowest legitimate case, a plot, takes ~1 s).
CASE_SECONDS = 15.0
BACKSTOP = 120


@contextlib.contextmanager
def backstop() -> Iterator[None]:
    faulthandler.dump_traceback_later(BACKSTOP, exit=True)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


def run_cli(argv: list[str]) -> tuple[object, str, str, float]:
    """(exit code, stdout, stderr, seconds) of ``gradscope ARGV``; an exception escaping ``main``
    is returned as its traceback in place of the code."""
    out, err = io.StringIO(), io.StringIO()
    t0 = time.monotonic()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code: object = main(argv)
        except SystemExit as exc:
            code = exc.code
        except BaseException:  # noqa: BLE001 - exactly what the test looks for
            code = "escaped: " + traceback.format_exc()
    return code, out.getvalue(), err.getvalue(), time.monotonic() - t0


def problem(code: object, allowed: frozenset[int], out: str, err: str, seconds: float) -> str | None:
    """What is wrong with one command's outcome, or None."""
    if not isinstance(code, int):
        return str(code)[-600:]
    if code not in allowed:
        return f"exit {code}, expected {sorted(allowed)}; stderr {err[-300:]!r}"
    if "Traceback" in err or "Traceback" in out:
        return f"traceback on exit {code}: {err[-600:]!r}"
    lines = err.splitlines()
    if code == 2 and (len(lines) != 1 or not lines[0].startswith("gradscope: error: ")):
        return f"exit 2 must print one line 'gradscope: error: ...', got {err[-400:]!r}"
    if code == 0 and any(not ln.startswith("gradscope: note: ") for ln in lines):
        return f"exit 0 with stderr other than notes (warnings?): {err[-400:]!r}"
    if seconds > CASE_SECONDS:
        return f"took {seconds:.1f} s"
    return None


@pytest.fixture
def limits(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same limits on every machine: a 256 MiB read budget and a 60 s read timeout."""
    monkeypatch.setenv("GRADSCOPE_READ_BUDGET", str(256 << 20))
    monkeypatch.setenv("GRADSCOPE_READ_TIMEOUT", "60")


def test_readers_survive_the_corpus(tmp_path: Path, limits: None) -> None:
    cases = build_cases(tmp_path / "corpus", seed=SEED)
    assert len(cases) > 300
    failures, outcomes = [], {0: 0, 2: 0}
    with backstop():
        for case in cases:
            faulthandler.dump_traceback_later(BACKSTOP, exit=True)  # per case
            code, out, err, seconds = run_cli(case.argv)
            why = problem(code, case.codes, out, err, seconds)
            if why:
                failures.append(f"{case.name}: {' '.join(case.argv)}\n    {why}")
            elif isinstance(code, int):
                outcomes[code] += 1
    assert not failures, f"{len(failures)} of {len(cases)} cases failed:\n" + "\n".join(failures[:40])
    # Both outcomes occur: damaged files are refused, and valid or harmlessly damaged ones are read.
    assert outcomes[0] >= 20 and outcomes[2] >= 200, outcomes


def test_nothing_blocks_on_a_fifo_or_a_device(tmp_path: Path, limits: None) -> None:
    """The inputs that used to hang or never end, one by one, with the reason in the error line."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    (tmp_path / "link").symlink_to(fifo)
    for path, words in ((fifo, "is a named pipe (FIFO), not a run file"),
                        (tmp_path / "link", "is a named pipe (FIFO), not a run file"),
                        (Path("/dev/urandom"), "is a character device, not a run file"),
                        (tmp_path, "is a directory, not a run file")):
        with backstop():
            code, _, err, _ = run_cli(["info", str(path)])
        assert code == 2 and err == f"gradscope: error: {path}: {words}\n", err


def test_rule_parser_survives_random_rules() -> None:
    texts = rule_texts(seed=SEED, n=300)
    parsed = refused = 0
    for text in texts:
        t0 = time.monotonic()
        try:
            assert isinstance(parse_rule(text), Rule)
            parsed += 1
        except ConfigError as exc:
            message = str(exc)
            assert "\n" not in message and len(message) < 600, message[:300]
            assert message.startswith("bad alert rule ") and "column" in message or "empty" in message, message
            refused += 1
        # linear-time tokenizer: a rule of 5,000 digits once took 1.8 s of regex backtracking
        assert time.monotonic() - t0 < 0.5, text[:80]
    assert parsed >= 5 and refused >= 200, (parsed, refused)


def test_rule_files_survive_malformed_yaml(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    loaded = refused = 0
    with backstop():
        for path in yaml_files(tmp_path / "yaml", fifo, seed=SEED):
            try:
                rules = load_rules(path)
                assert all(isinstance(r, Rule) for r in rules)
                loaded += 1
            except ConfigError as exc:
                message = str(exc)
                assert "\n" not in message and len(message) < 600 and str(path) in message, message[:300]
                refused += 1
    assert loaded >= 3 and refused >= 35, (loaded, refused)


def test_rules_on_the_command_line_are_one_line_errors(tmp_path: Path, limits: None) -> None:
    """A sample of the random rules through ``gradscope watch --alert``: exit 2 in one line, or, for
    the rules that parse, a normal watch of a finished run (exit 0) unless the rule names a role,
    agent or policy the run lacks (exit 2)."""
    from tests.gradscope.fuzz_corpus import write_base

    run = write_base(tmp_path / "run.h5")
    failures = []
    for text in rule_texts(seed=SEED + 1, n=60):
        argv = ["watch", str(run), "--no-default-alerts", "--poll", "0.01", "--alert", text]
        code, out, err, seconds = run_cli(argv)
        why = problem(code, frozenset({0, 2}), out, err, seconds)
        if why:
            failures.append(f"{text[:80]!r}: {why}")
    assert not failures, "\n".join(failures)
