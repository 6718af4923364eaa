"""Run untrusted, model-written Python programs in a separate, locked-down process.

Nothing here executes a program in the calling process. Each run starts ``launcher.py``, which
puts the program into fresh namespaces (user - or, for root callers, a uid of its own -, mount,
PID, network, IPC) with a private read-only root, rlimits and a seccomp filter, and maps how it
ended to one of four verdicts. ``check_program`` runs the candidate and the tests in two such
processes so that the verdict is out of the candidate's reach. See ``docs/sandbox.md``.

Modules: ``limits`` (records), ``spawn`` (starting a launcher, cleaning up), ``launcher`` (the
set-up, run as a script), ``seccomp`` (the filter), ``supervise`` (watching running programs),
``verdict`` (how a program ended -> verdict), ``run`` (``run_program``), ``check``
(``check_program``), ``uids`` (root callers' per-run uids), ``child/`` (what runs inside).
"""
from .check import check_program
from .limits import VERDICTS, Limits, SandboxError, SandboxResult, SandboxUnavailable
from .run import run_program, sandbox_info, unavailable_reason

__all__ = [
    "Limits",
    "SandboxResult",
    "SandboxError",
    "SandboxUnavailable",
    "run_program",
    "check_program",
    "sandbox_info",
    "unavailable_reason",
    "VERDICTS",
]
