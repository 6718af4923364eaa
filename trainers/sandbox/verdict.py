"""How a program ended -> one of four verdicts and a one-line reason (docs/sandbox.md, Verdicts)."""
from __future__ import annotations

import math
import re
import signal

from .limits import Limits
from .supervise import Raw

_EXC_LINE = re.compile(r"^([A-Za-z_][\w.]*)(:|$)")


def exception_line(tail: bytes) -> str | None:
    """The final "ExcType: message" line of a Python traceback at the end of stderr."""
    text = tail.decode("utf-8", "replace")
    has_tb = "Traceback (most recent call last)" in text
    for ln in reversed([ln.rstrip() for ln in text.splitlines() if ln.strip()]):
        if ln.startswith((" ", "\t")):
            continue
        m = _EXC_LINE.match(ln)
        if m and (has_tb or m.group(1).endswith(("Error", "Exception", "Warning"))):
            return ln
        return None
    return None


def one_line(s: str, n: int = 300) -> str:
    s = " ".join(s.split())
    return s if len(s) <= n else s[: n - 3] + "..."


def last_line(raw: Raw) -> str:
    lines = [ln for ln in raw.stderr_tail.decode("utf-8", "replace").splitlines() if ln.strip()]
    return lines[-1].strip() if lines else ""


def verdict(raw: Raw, limits: Limits) -> tuple[str, str]:
    """``(verdict, reason)`` of one program; "pass" needs exit code 0."""
    rc = raw.returncode
    cpu_soft = max(1, math.ceil(limits.cpu_s))
    if raw.timed_out:
        return "timeout", f"wall time {limits.wall_s:g} s exceeded"
    if raw.flooded:
        return "crash", f"output limit exceeded: more than {limits.flood_bytes} bytes on {raw.flooded}"
    if rc is None:
        return "crash", "did not run to the end"
    if rc < 0:
        sig = -rc
        # The program is pid 1 of its PID namespace, which ignores SIGXCPU: the kernel's SIGKILL
        # at the hard limit (soft + 1 s) ends it.
        if sig == signal.SIGXCPU or (sig == signal.SIGKILL and raw.cpu_s >= cpu_soft - 0.05):
            return "timeout", f"cpu time {cpu_soft} s exceeded"
        if sig == signal.SIGXFSZ:
            return "crash", f"file size limit {limits.max_file_mb} MB exceeded"
        if sig == signal.SIGSYS:
            return "crash", "killed by the seccomp filter (a forbidden system call, e.g. memfd_create)"
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = "?"
        return "crash", f"killed by signal {sig} ({name})"
    if rc == 0:
        return "pass", "exit code 0"
    exc = exception_line(raw.stderr_tail)
    if exc is not None:
        if exc == "MemoryError" or exc.startswith(("MemoryError:", "OSError: [Errno 12]")):
            return "crash", f"memory limit {limits.memory_mb} MB exceeded"
        if exc.startswith("OSError: [Errno 27]"):  # EFBIG (Python ignores SIGXFSZ)
            return "crash", f"file size limit {limits.max_file_mb} MB exceeded"
        if exc.startswith("OSError: [Errno 28]"):  # ENOSPC: a tmpfs of the sandbox is full
            return "crash", f"disk limit exceeded ({limits.disk_mb} MB in the working directory, " \
                            f"{limits.max_file_mb} MB in /tmp and /dev/shm)"
        if exc == "AssertionError":
            return "fail", "assertion failed"
        if exc.startswith("AssertionError:"):
            return "fail", one_line("assertion failed: " + exc[len("AssertionError:"):].strip())
        return "fail", one_line(f"exit code {rc}: {exc}")
    last = last_line(raw)
    return "fail", one_line(f"exit code {rc}" + (f": {last}" if last else ""))
