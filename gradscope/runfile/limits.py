"""Bounds on what reading a run file may cost: memory per array, and wall-clock time per command.

A damaged or hostile file can declare anything (20,000 agents, 10¹² records); these checks run on
the *declared* sizes, before anything is allocated, so such a file is refused with one line rather
than exhausting the machine. Limits and their environment variables: docs/format.md, "Reading
untrusted files".
"""
from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator

from gradscope.errors import RunFileError

#: Environment variable: the most bytes one array read from a run file may take (default: an
#: eighth of the physical memory, at least 256 MiB).
BUDGET_ENV = "GRADSCOPE_READ_BUDGET"
#: Environment variable: seconds a reading command (info, analyze, compare, plot, table) may take
#: in all (default 600; 0 turns the limit off).
TIMEOUT_ENV = "GRADSCOPE_READ_TIMEOUT"
DEFAULT_TIMEOUT = 600.0
#: A filtered (compressed) dataset holds at most this many times its share of the file: deflate,
#: the strongest filter HDF5 ships, cannot exceed ~1032:1.
MAX_COMPRESSION = 1100


def _env_number(name: str, default: float) -> float:
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        raise RunFileError(f"{name}={text!r} is not a number") from None
    if not value >= 0 or value == float("inf"):
        raise RunFileError(f"{name}={text!r} must be a finite number >= 0")
    return value


def read_budget() -> int:
    """Bytes one array read may take: ``$GRADSCOPE_READ_BUDGET`` or an eighth of physical memory."""
    try:
        physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        physical = 16 << 30
    return int(_env_number(BUDGET_ENV, max(physical // 8, 256 << 20)))


def size_text(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if n < 1024 or unit == "PiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} EiB"  # unreachable


def check_read(path: str, what: str, nbytes: int, *, file_size: int | None = None, filtered: bool = False) -> None:
    """Refuse to read ``nbytes`` of ``what`` unless it fits the budget and (given ``file_size``)
    the file could hold it.

    Unfiltered data lies in the file byte for byte; filtered data at most ``MAX_COMPRESSION``
    times smaller. More than that means the declared shape is not what the file stores.
    """
    budget = read_budget()
    if nbytes > budget:
        raise RunFileError(f"{path}: {what} would take {size_text(nbytes)} in memory, over the read budget of "
                           f"{size_text(budget)} (set {BUDGET_ENV} in bytes to raise it)")
    if file_size is None:
        return
    room = file_size * (MAX_COMPRESSION if filtered else 1)
    if nbytes > room:
        raise RunFileError(f"{path}: {what} declares {size_text(nbytes)} of data, more than a "
                           f"{size_text(file_size)} file can hold (a damaged file)")


def read_timeout() -> float:
    """Seconds a reading command may take: ``$GRADSCOPE_READ_TIMEOUT``, default 600 (0: no limit)."""
    return _env_number(TIMEOUT_ENV, DEFAULT_TIMEOUT)


class _Expired(BaseException):
    """Raised by the timer of :func:`deadline`; never escapes it."""


@contextlib.contextmanager
def deadline(seconds: float, what: str) -> Iterator[None]:
    """Raise :class:`RunFileError` in the block once ``seconds`` have passed (0: no limit).

    The handler raises a ``BaseException`` (turned into the RunFileError as it leaves the block), so
    no ``except Exception`` on the way can swallow it.

    A real-time interval timer (SIGALRM), so it works only in the main thread (elsewhere the block
    runs unlimited). A timer armed before (e.g. a test runner's) is put back afterwards with the
    time it had left, and still fires if it falls due first. Python runs the handler between
    bytecodes, so it cannot cut a blocking system call short: the reader therefore refuses every
    input that could block (pipes, devices, links and storage outside the file) before opening it.
    """
    if seconds <= 0 or threading.current_thread() is not threading.main_thread():
        yield
        return
    start = time.monotonic()
    outer_delay, _ = signal.getitimer(signal.ITIMER_REAL)
    outer_handler = signal.getsignal(signal.SIGALRM)

    def expire(signum: int, frame: object) -> None:
        nonlocal outer_delay
        elapsed = time.monotonic() - start
        if outer_delay and elapsed < seconds:  # the outer timer fell due first: it behaves as without us
            outer_delay = 0.0
            signal.setitimer(signal.ITIMER_REAL, seconds - elapsed)
            if callable(outer_handler):
                outer_handler(signum, frame)
            elif outer_handler == signal.SIG_DFL:
                signal.signal(signal.SIGALRM, signal.SIG_DFL)
                signal.raise_signal(signal.SIGALRM)
            return
        raise _Expired

    signal.signal(signal.SIGALRM, expire)
    try:  # armed inside: a limit so short that it falls due at once is the same one-line error
        signal.setitimer(signal.ITIMER_REAL, min(seconds, outer_delay) if outer_delay else seconds)
        yield
    except _Expired:
        raise RunFileError(f"{what}: gave up after {seconds:g} s (set {TIMEOUT_ENV} to allow longer, 0 for "
                           f"no limit)") from None
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, outer_handler)
        if outer_delay:
            signal.setitimer(signal.ITIMER_REAL, max(outer_delay - (time.monotonic() - start), 1e-3))
