"""Running one whole program: ``run_program``, and what the sandbox can enforce here."""
from __future__ import annotations

import dataclasses
import functools
import os

from .limits import Limits, SandboxError, SandboxResult
from .spawn import IS_ROOT, Proc, layout, release, spawn
from .supervise import Raw, supervise
from .verdict import verdict

def run_procs(procs_args: list[tuple[dict, dict, dict]], limits: Limits, *, unsafe: bool,
              primary: int = 0, close: tuple[int, ...] = ()) -> list[Raw]:
    """Spawn one program per ``(files, boot, spawn keywords)``, supervise them together and clean
    up; the building block of ``run_program`` and ``check_program``. The caller's descriptors in
    ``close`` (its copies of those handed to the programs) are closed once all are started, so
    that each program sees end-of-file when its peer ends."""
    procs: list[Proc] = []
    raws = None
    try:
        try:
            for files, boot, kwargs in procs_args:
                procs.append(spawn(files, boot, limits, strict=not unsafe, **kwargs))
        finally:
            for fd in close:
                os.close(fd)
        raws = supervise(procs, limits, primary)
        return raws
    finally:
        errors = []
        for i, p in enumerate(procs):
            try:
                release(p, pid_namespace=raws is not None and "namespaces" in raws[i].layers)
            except SandboxError as e:
                errors.append(e)
        if errors and raws is not None:
            raise errors[0]


def execute(source: str, limits: Limits, stdin: str = "", *, hook: bool = True,
            unsafe: bool = False, keep_fds: tuple[int, ...] = ()) -> Raw:
    """Run one program as ``__main__``; ``keep_fds`` are handed to it (and closed here).
    ``hook=False`` exists only so that the tests can check the kernel's layers on their own; every
    public entry point runs with the audit hook."""
    boot = {"mode": "run", "hook": hook}
    return run_procs([({"main.py": source}, boot, {"stdin": stdin, "keep_fds": keep_fds})],
                     limits, unsafe=unsafe, close=keep_fds)[0]


def decode(b: bytes) -> str:
    return b.decode("utf-8", "replace")


def result(raw: Raw, verdict_reason: tuple[str, str], harness: str = "program") -> SandboxResult:
    v, reason = verdict_reason
    return SandboxResult(v, reason, raw.returncode, decode(raw.stdout), decode(raw.stderr),
                         raw.wall_s, harness)


def run_program(source: str, limits: Limits = Limits(), stdin: str = "", *,
                unsafe: bool = False) -> SandboxResult:
    """Run ``source`` (a complete Python program, standard library only) in the sandbox.

    Verdicts: "pass" exit 0; "fail" non-zero exit (an exception, sys.exit(n)); "timeout" wall or
    CPU limit; "crash" killed by a signal or the seccomp filter, memory exhaustion, output flood,
    file-size or disk limit. See docs/sandbox.md for the exact mapping. Raises
    ``SandboxUnavailable`` if a required layer cannot be had here (``unsafe=True``: run anyway,
    with what can be had).
    """
    raw = execute(source, limits, stdin, unsafe=unsafe)
    return result(raw, verdict(raw, limits))


@functools.lru_cache(maxsize=None)
def unavailable_reason() -> str | None:
    """None if the full sandbox can be set up on this machine, else why not (one line)."""
    try:
        execute("pass", Limits())
    except SandboxError as e:
        return str(e)
    return None


def sandbox_info() -> dict:
    """What the sandbox enforces on this machine, measured by running a probe program (in unsafe
    mode when the full sandbox is not available, so that the layers that are can be listed)."""
    reason = unavailable_reason()
    raw = execute("import sys, os\nprint(os.getuid(), os.getgid(), sorted(os.environ))\n"
                  "print(sys.version.split()[0])", Limits(), unsafe=reason is not None)
    lines = decode(raw.stdout).splitlines()
    return {
        "root": IS_ROOT,
        "available": reason is None,
        "reason": reason,
        "interpreter": layout().exe,
        "python": lines[1] if len(lines) > 1 else None,
        "ids_env": lines[0] if lines else None,
        "features": raw.layers,
        "probe": dataclasses.asdict(result(raw, verdict(raw, Limits()))),
    }
