"""The command line itself: defaults in every ``--help``, ``--version``, and parsing without heavy imports.

Timing is not asserted (the machine is shared); what makes ``--help`` and a bad flag fast is that
nothing heavy is imported before the arguments are parsed, and that is checked in a fresh
interpreter through ``sys.modules``.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import gradscope
from gradscope.cli import ArgumentParser, build_parser, main

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "peft", "transformers", "matplotlib", "h5py", "pandas", "scipy", "numpy")


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    top = build_parser()
    sub = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


SUBCOMMANDS = tuple(name for name in _subcommands() if name != "train")  # train parses its own flags


def _parsers() -> dict[str, argparse.ArgumentParser]:
    """Every parser of the command line: the top level, each subcommand, and ``train``'s own."""
    from gradscope.trainers.config import add_arguments

    train = ArgumentParser(prog="gradscope train")
    add_arguments(train)
    return {"gradscope": build_parser(), **{name: p for name, p in _subcommands().items() if name != "train"},
            "train": train}


def _flat(text: str) -> str:
    return " ".join(text.split())


@pytest.mark.parametrize("name", ["gradscope", *SUBCOMMANDS, "train"])
def test_every_help_shows_every_default(name: str) -> None:
    """Each option with a value to show (not None, "", [] or a bare switch) has ``(default: X)``."""
    parser = _parsers()[name]
    text = _flat(parser.format_help())
    checked = 0
    for action in parser._actions:
        if not action.option_strings or action.help == argparse.SUPPRESS:
            continue
        if action.default in (None, "", [], argparse.SUPPRESS) or isinstance(action, argparse._StoreTrueAction):
            continue
        assert f"(default: {action.default})" in text, f"{name} {action.option_strings[0]}: {text}"
        checked += 1
    assert not re.search(r"\(default [^:]", text), f"{name}: a default not written as (default: X): {text}"
    assert checked or name in ("gradscope", "info", "export"), f"{name}: no flag with a default checked"


def test_train_help_names_the_defaults() -> None:
    text = _flat(_parsers()["train"].format_help())
    for flag, default in (("--steps", 200), ("--tasks-per-step", 8), ("--group-size", 8), ("--policy", "ip"),
                          ("--temperature", 0.7), ("--default-alerts", True)):
        assert re.search(rf"{flag}\b.*?\(default: {re.escape(str(default))}\)", text), flag


def test_version(capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"gradscope {gradscope.__version__}"
    assert importlib.metadata.version("gradscope") == gradscope.__version__  # pyproject reads the constant


def test_help_and_bad_flags_import_nothing_heavy() -> None:
    """``--help`` of every command, ``train --help`` and bad flags, in one fresh interpreter: each
    exits as argparse does (0 for help, 2 with one line for a bad flag) and none of them imports
    torch, peft, transformers, matplotlib, h5py, pandas, scipy or numpy."""
    calls = [["--help"], ["--version"], ["train", "--help"], ["train", "--bogus"], ["train", "--steps", "x"],
             ["analyze", "r.h5", "--bogus"], ["plot", "nope", "r.h5"]] + [[name, "--help"] for name in SUBCOMMANDS]
    code = f"""
import contextlib, io, json, sys
from gradscope.cli import main
codes, errors = [], []
for argv in {calls!r}:
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        try:
            codes.append(main(argv))
        except SystemExit as exc:
            codes.append(exc.code)
    errors.append(err.getvalue())
print(json.dumps({{"codes": codes, "errors": errors, "heavy": sorted(m for m in {HEAVY!r} if m in sys.modules)}}))
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["heavy"] == [], f"imported before parsing: {got['heavy']}"
    for argv, code_, err in zip(calls, got["codes"], got["errors"]):
        help_like = "--help" in argv or "--version" in argv
        assert code_ == (0 if help_like else 2), (argv, code_, err)
        if not help_like:
            assert err.startswith("gradscope: error: ") and err.count("\n") == 1, (argv, err)


def test_an_error_naming_a_path_with_a_line_break_stays_one_line(tmp_path, capsys):
    assert main(["info", str(tmp_path / "bad\nname.h5")]) == 2
    err = capsys.readouterr().err
    assert err == f"gradscope: error: {tmp_path}/bad\\nname.h5: no such file\n", err


def test_gradscopes_own_warnings_print_as_one_line(tmp_path):
    """A sweep of the code task warns that toy level 1 repeats its training prompts: one line, prefixed like
    the errors (not Python's file:line and source line)."""
    config = tmp_path / "code.yaml"
    config.write_text("train:\n  steps: 2\ngrid:\n  workflow: voting\n  task: code\n  policy: ip\n")
    out = subprocess.run([sys.executable, "-m", "gradscope.cli", "sweep", str(config), "--dry-run",
                          "--out", str(tmp_path / "out")], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stderr.splitlines() == ["gradscope: warning: code:toy:L1: the level has 179 distinct prompts: the 128 "
                                       "held-out tasks are distinct, the 2000 training tasks repeat the other 51"]


def test_other_warnings_keep_pythons_format_and_main_restores_it():
    import warnings

    from gradscope.cli import _one_line_warning
    from gradscope.errors import GradscopeWarning

    assert _one_line_warning("x", GradscopeWarning, "/any/where.py", 3) == "gradscope: warning: x\n"
    other = _one_line_warning("y", UserWarning, "/site-packages/numpy/__init__.py", 7)
    assert other.startswith("/site-packages/numpy/__init__.py:7: UserWarning: y")
    before = warnings.formatwarning
    assert main(["table", "/nonexistent/run.h5"]) == 2  # an error: the format is put back all the same
    assert warnings.formatwarning is before
