"""Every command works from a folder whose own figures.py / analyses.py / trainers.py would shadow ours."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.figures.conftest import write_run

SHADOWS = ("figures", "analyses", "trainers")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("user")
    for name in SHADOWS:
        (d / f"{name}.py").write_text("raise SystemExit('shadowed')\n")
    write_run(d / "a.h5", policy="sp")
    write_run(d / "b.h5", policy="ip", seed=1)
    return d


COMMANDS = [["info", "a.h5"], ["analyze", "a.h5"], ["compare", "a.h5", "b.h5"],
            ["plot", "shares", "a.h5", "--out", "fig", "--dpi", "200"], ["table", "a.h5", "b.h5"],
            ["watch", "a.h5", "--poll", "0.1"], ["train", "--help"], ["export", "a.h5", "--to", "tensorboard", "tb"]]


@pytest.mark.parametrize("args", COMMANDS, ids=lambda a: a[0])
def test_python_m_gradscope_cli_ignores_shadowing_modules(workdir, args):
    # python -m puts the working directory first on sys.path: a bare `import figures` would run ours.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-m", "gradscope.cli", *args], cwd=workdir, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "shadowed" not in done.stdout + done.stderr
