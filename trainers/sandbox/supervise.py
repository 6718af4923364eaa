"""Watching running programs: output as it arrives, the wall clock, floods, exits.

One loop over ``selectors`` serves one or several programs (``check_program`` runs two): their
stdout and stderr, their launchers' status pipes, and a pidfd per launcher for its exit, so there
is no polling. Output is kept up to ``max_output_bytes`` per stream and read on (and dropped) past
it; past ``flood_bytes`` the program is killed. At the wall deadline every program still running is
killed; when the *primary* program ends, the others are stopped unless they end by themselves
within a second (a candidate ends as soon as the tests close its request pipe).
"""
from __future__ import annotations

import os
import selectors
import signal
import time
from dataclasses import dataclass, field

from .limits import Limits, SandboxError, SandboxUnavailable
from .spawn import Proc

_TAIL_BYTES = 4096  # kept from the end of stderr to find the exception line
_DRAIN_S = 1.0  # after a launcher exits, how long its pipes may still deliver
_GRACE_S = 1.0  # after the primary program ends, how long the others may take to end by themselves


@dataclass
class Raw:
    """How one program ended, before it is turned into a verdict."""

    returncode: int | None  # exit code or -signal of the program; None if it never finished
    stdout: bytes
    stderr: bytes
    stderr_tail: bytes
    wall_s: float
    cpu_s: float
    timed_out: bool  # killed at the wall deadline
    flooded: str | None  # killed for output past the flood limit: the stream's name
    layers: list[str] = field(default_factory=list)  # what the launcher set up (READY line)


@dataclass
class _Watch:
    proc: Proc
    out: dict = field(default_factory=lambda: {"stdout": bytearray(), "stderr": bytearray()})
    totals: dict = field(default_factory=lambda: {"stdout": 0, "stderr": 0})
    tail: bytearray = field(default_factory=bytearray)
    status: bytearray = field(default_factory=bytearray)
    ended: float | None = None
    killed: str | None = None  # "timeout" | "flood" | "stopped"
    flooded: str | None = None

    def kill(self, why: str) -> None:
        if self.ended is None and self.killed is None:
            self.killed = why
            try:
                os.killpg(self.proc.popen.pid, signal.SIGKILL)  # pid 1 follows (PDEATHSIG)
            except OSError:
                pass


def supervise(procs: list[Proc], limits: Limits, primary: int = 0) -> list[Raw]:
    """Run ``procs`` to their end (or the deadline ``limits.wall_s`` after the first start) and
    return how each ended. Raises :class:`SandboxUnavailable` or :class:`SandboxError` if a
    launcher could not set its program up."""
    watches = [_Watch(p) for p in procs]
    sel = selectors.DefaultSelector()
    pidfds = []
    try:
        for i, w in enumerate(watches):
            sel.register(w.proc.popen.stdout, selectors.EVENT_READ, (i, "stdout"))
            sel.register(w.proc.popen.stderr, selectors.EVENT_READ, (i, "stderr"))
            sel.register(w.proc.status_r, selectors.EVENT_READ, (i, "status"))
            pidfd = os.pidfd_open(w.proc.popen.pid)
            pidfds.append(pidfd)
            sel.register(pidfd, selectors.EVENT_READ, (i, "exit"))
        _loop(watches, sel, limits, primary)
    finally:
        sel.close()
        for fd in pidfds:
            os.close(fd)
    return [_raw(w) for w in watches]


def _loop(watches: list[_Watch], sel, limits: Limits, primary: int) -> None:
    deadline = min(w.proc.t0 for w in watches) + limits.wall_s
    while sel.get_map():
        now = time.monotonic()
        if now >= deadline:
            for w in watches:
                w.kill("timeout")
        waits = [deadline - now]
        primary_ended = watches[primary].ended
        if primary_ended is not None:
            if now >= primary_ended + _GRACE_S:
                for w in watches:
                    w.kill("stopped")
            else:
                waits.append(primary_ended + _GRACE_S - now)
        for key in list(sel.get_map().values()):
            i, _ = key.data
            ended = watches[i].ended
            if ended is not None:
                if now >= ended + _DRAIN_S:
                    sel.unregister(key.fileobj)  # its pipes are held by something else: stop
                else:
                    waits.append(ended + _DRAIN_S - now)
        if not sel.get_map():
            break
        if any(w.killed and w.ended is None for w in watches):
            waits.append(0.05)
        for key, _ in sel.select(max(0.0, min(waits))):
            i, name = key.data
            w = watches[i]
            if name == "exit":
                sel.unregister(key.fileobj)
                _, st = os.waitpid(w.proc.popen.pid, 0)
                w.proc.popen.returncode = os.waitstatus_to_exitcode(st)
                w.ended = time.monotonic()
                continue
            try:
                data = os.read(key.fd, 65536)
            except OSError:
                data = b""
            if not data:
                sel.unregister(key.fileobj)
            elif name == "status":
                if len(w.status) < 65536:
                    w.status += data
            else:
                _output(w, name, data, limits)


def _output(w: _Watch, name: str, data: bytes, limits: Limits) -> None:
    if w.flooded:
        return
    buf = w.out[name]
    if len(buf) < limits.max_output_bytes:
        buf += data[:limits.max_output_bytes - len(buf)]
    w.totals[name] += len(data)
    if name == "stderr":
        w.tail += data
        del w.tail[:-_TAIL_BYTES]
    if w.totals[name] > limits.flood_bytes and w.ended is None:
        w.flooded = name
        w.kill("flood")


def _raw(w: _Watch) -> Raw:
    lines = w.status.decode("utf-8", "replace").splitlines()
    tail = bytes(w.tail).decode("utf-8", "replace")[-500:]
    layers, returncode, cpu = [], None, 0.0
    for line in lines:
        key, _, rest = line.partition(" ")
        if key == "TOOLARGE":  # judged as the program filling its disk (verdict.py: ENOSPC)
            err = f"OSError: [Errno 28] the program's files do not fit in its working directory ({rest})\n"
            return Raw(returncode=1, stdout=b"", stderr=err.encode(), stderr_tail=err.encode(),
                       wall_s=time.monotonic() - w.proc.t0, cpu_s=0.0, timed_out=False, flooded=None)
        if key == "UNAVAILABLE":
            raise SandboxUnavailable("the sandbox is not available on this machine: " + rest)
        if key == "ERR":
            raise SandboxError("sandbox launcher failed: " + rest + (" | " + tail if tail else ""))
        if key == "READY":
            layers = rest.split()
        elif key == "EXIT":
            st, cpu_s = rest.split()
            returncode, cpu = os.waitstatus_to_exitcode(int(st)), float(cpu_s)
    if not lines and w.killed is None:
        raise SandboxError("sandbox launcher died: " + (tail or f"exit {w.proc.popen.returncode}"))
    end = w.ended if w.ended is not None else time.monotonic()
    return Raw(returncode=returncode, stdout=bytes(w.out["stdout"]), stderr=bytes(w.out["stderr"]),
               stderr_tail=bytes(w.tail), wall_s=end - w.proc.t0, cpu_s=cpu,
               timed_out=w.killed == "timeout", flooded=w.flooded,
               layers=layers)
