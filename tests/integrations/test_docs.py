"""docs/integrations.md runs as written: its Python blocks in order in one process (a shared namespace),
and a block whose first line is ``# torchrun ... FILE.py`` saved as FILE.py and launched that way."""
from __future__ import annotations

import os
import re
import socket
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "integrations.md"
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def blocks() -> tuple[list[str], list[tuple[list[str], str]]]:
    """The in-order blocks, and the torchrun blocks with their command."""
    plain, launched = [], []
    for code in BLOCK.findall(DOC.read_text()):
        first = code.splitlines()[0]
        if first.startswith("# torchrun "):
            launched.append((shlex.split(first[2:]), code))
        else:
            plain.append(code)
    return plain, launched


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    return env


def test_the_doc_has_the_recipes():
    plain, launched = blocks()
    text = "\n".join(plain)
    for needle in ("backward_tokens", "class ProbedTrainer(Trainer)", "GradscopeGRPOTrainer", "rollout_func"):
        assert needle in text
    assert len(launched) == 1


@pytest.mark.slow
def test_python_blocks_run_as_written(tmp_path):
    plain, _ = blocks()
    script = tmp_path / "doc_blocks.py"
    script.write_text("\n\n".join(plain))
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=_env(), capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "gradscope/norm/voter" in done.stdout and "coherence/voter" in done.stdout


@pytest.mark.slow
def test_torchrun_block_runs_as_written(tmp_path):
    _, launched = blocks()
    (command, code), = launched
    (tmp_path / command[-1]).write_text(code)
    assert command[0] == "torchrun"
    port = f"--master_port={_free_port()}"
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--master_addr=127.0.0.1", port, *command[1:]],
                          cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "hooks+ranks(2)" in done.stdout
