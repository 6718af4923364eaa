"""Helpers shared by the sandbox tests: finding leftover sandbox processes, and the autouse check
that a test left the test process and the machine as they were."""
from __future__ import annotations

import os

import pytest

from gradscope.trainers.sandbox.limits import Limits, SandboxResult
from gradscope.trainers.sandbox.run import execute, result
from gradscope.trainers.sandbox.verdict import verdict

IS_ROOT = os.geteuid() == 0


def _status(pid: str) -> tuple[int, str] | None:
    """(parent pid, state letter) of a process, None if it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            text = f.read()
    except OSError:
        return None
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    return int(fields["PPid"]), fields["State"].strip()[0]


def sandbox_processes() -> list[int]:
    """Live (non-zombie) descendants of this test process: launchers, and programs while their
    launcher lives (a program whose launcher dies is killed with it). Runs of other test processes
    on the same machine are not counted."""
    me = os.getpid()
    procs = {}
    for pid in os.listdir("/proc"):
        st = _status(pid) if pid.isdigit() else None
        if st is not None:
            procs[int(pid)] = st
    found = []
    for pid, (ppid, state) in procs.items():
        seen = set()
        while ppid > 1 and ppid != me and ppid not in seen:
            seen.add(ppid)
            ppid = procs.get(ppid, (0, ""))[0]
        if ppid == me and state not in "ZX":
            found.append(pid)
    return found


def _environ() -> dict:
    return {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}


@pytest.fixture(autouse=True)
def parent_unharmed():
    env_before = _environ()
    pid = os.getpid()
    # children an earlier test left running on purpose (a dashboard's service process) are not this test's
    earlier = set(sandbox_processes())
    yield
    assert os.getpid() == pid
    assert _environ() == env_before, "the parent's environment changed"
    assert [p for p in sandbox_processes() if p not in earlier] == [], "sandboxed processes left behind"


def kernel_only(src: str, limits: Limits = Limits()) -> SandboxResult:
    """Run ``src`` with the audit hook off: only the kernel's layers stand in its way."""
    raw = execute(src, limits, hook=False)
    return result(raw, verdict(raw, limits))
