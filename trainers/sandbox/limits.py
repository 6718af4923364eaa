"""The sandbox's records: per-program limits, the result of a run, and its errors."""
from __future__ import annotations

from dataclasses import dataclass

VERDICTS = ("pass", "fail", "timeout", "crash")

#: Output beyond ``max_output_bytes`` is dropped; a program that writes more than
#: ``OUTPUT_FLOOD_FACTOR * max_output_bytes`` bytes to stdout or stderr is killed
#: ("crash", "output limit exceeded ...").
OUTPUT_FLOOD_FACTOR = 16

#: RLIMIT_NOFILE of a program: with at most this many descriptors, pipe buffers (at most 1 MiB
#: each for an unprivileged user) stay below 32 MiB.
MAX_OPEN_FILES = 64


class SandboxError(RuntimeError):
    """The sandbox itself could not be set up (never raised for program behaviour)."""


class SandboxUnavailable(SandboxError):
    """A layer of the boundary (namespaces, the private root, seccomp) cannot be had on this
    machine, and the call did not pass ``unsafe=True``. The message says which and why."""


@dataclass(frozen=True)
class Limits:
    """Per-program limits. Defaults are the documented ones (docs/sandbox.md)."""

    wall_s: float = 5.0  # wall clock from process start, enforced by the caller (SIGKILL)
    cpu_s: float = 5.0  # RLIMIT_CPU, rounded up to whole seconds (kernel granularity)
    memory_mb: int = 512  # RLIMIT_AS (address space, not RSS); the program is one process
    max_procs: int = 16  # RLIMIT_NPROC: threads of the program, the main one included
    max_file_mb: int = 8  # RLIMIT_FSIZE (largest file); also the size of /tmp and /dev/shm
    max_output_bytes: int = 64_000  # kept per stream (stdout, stderr)

    def __post_init__(self):
        if not self.wall_s > 0 or not self.cpu_s > 0:
            raise ValueError("wall_s and cpu_s must be > 0")
        if self.memory_mb < 1 or self.max_procs < 1:
            raise ValueError("memory_mb and max_procs must be >= 1")
        if self.max_file_mb < 0 or self.max_output_bytes < 0:
            raise ValueError("max_file_mb and max_output_bytes must be >= 0")

    @property
    def disk_mb(self) -> int:
        """Size of the working directory's tmpfs (all its files together), MB."""
        return max(16, 4 * self.max_file_mb)

    @property
    def flood_bytes(self) -> int:
        """Output on one stream past which the program is killed."""
        return max(OUTPUT_FLOOD_FACTOR * self.max_output_bytes, 4096)


@dataclass(frozen=True)
class SandboxResult:
    verdict: str  # "pass" | "fail" | "timeout" | "crash"
    reason: str  # one line
    returncode: int | None  # exit code, or -signal; None if it never ran (check_program: the tests')
    stdout: str  # first max_output_bytes bytes, decoded as UTF-8 (errors replaced)
    stderr: str
    wall_s: float
    harness: str = "program"  # "program" | "split" (two processes) | "in-process" (check_program)

    @property
    def passed(self) -> bool:
        return self.verdict == "pass"

    @property
    def wall_timeout(self) -> bool:
        """Stopped at the wall-clock limit: a verdict that depends on how busy the machine was."""
        return self.verdict == "timeout" and self.reason.startswith("wall time")
