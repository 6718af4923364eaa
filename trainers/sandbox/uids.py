"""Which processes belong to a run: the per-run uids of root callers, and killing what is left.

A root caller runs each program as its own unprivileged uid ``SANDBOX_UID_BASE + slot``, reserved
by an ``flock`` on ``/run/gradscope-sandbox/<slot>.lock``: root does not obey ``RLIMIT_NPROC``, and
a uid per run keeps one run's thread count from eating another's. These uids have no passwd entry
and need none. A non-root caller needs no slot: its program runs in a user namespace of its own,
where ``RLIMIT_NPROC`` counts that namespace's tasks only.
"""
from __future__ import annotations

import fcntl
import os
import secrets
import signal
import threading
import time

from .limits import SandboxError

#: 1_900_000_000 lies in the range systemd leaves unused (above container uids, below 2**31).
SANDBOX_UID_BASE = 1_900_000_000
SANDBOX_UID_SLOTS = 512
LOCK_DIR = "/run/gradscope-sandbox"  # root only; per-slot flock files

_slot_mutex = threading.Lock()
_next_slot = secrets.randbelow(SANDBOX_UID_SLOTS)


def _lock_dir() -> str:
    try:
        os.mkdir(LOCK_DIR, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(LOCK_DIR)
    if not os.path.isdir(LOCK_DIR) or os.path.islink(LOCK_DIR) or st.st_uid != 0 or st.st_mode & 0o022:
        raise SandboxError(f"{LOCK_DIR} must be a root-owned directory not writable by others")
    return LOCK_DIR


def proc_tasks() -> list[tuple[int, int, str, int]]:
    """(pid, real uid, state letter, session id) of every process, from /proc/<pid>/status."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status", "rb") as f:
                status = f.read()
            i = status.index(b"\nState:") + 7
            state = status[i:i + 3].strip()[:1].decode()
            i = status.index(b"\nUid:") + 5
            uid = int(status[i:status.index(b"\n", i)].split()[0])
            i = status.find(b"\nNSsid:")
            sid = int(status[i + 7:status.index(b"\n", i + 1)].split()[0]) if i >= 0 else -1
        except (OSError, ValueError, IndexError):
            continue
        out.append((int(name), uid, state, sid))
    return out


def _kill_pid(pid: int, uid: int | None) -> None:
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:
        return
    try:
        if uid is not None:  # re-check ownership through the pidfd: no pid-reuse race
            with open(f"/proc/{pid}/status", "rb") as f:
                status = f.read()
            i = status.index(b"\nUid:")
            if int(status[i + 5:status.index(b"\n", i + 1)].split()[0]) != uid:
                return
        signal.pidfd_send_signal(pidfd, signal.SIGKILL)
    except (OSError, ValueError):
        pass
    finally:
        os.close(pidfd)


def kill_all(uid: int | None, sid: int | None, rounds: int = 200) -> bool:
    """SIGKILL every live process of a run - by uid (root callers) or by session - until none is
    left. True if none is."""
    for i in range(rounds):
        live = [pid for pid, puid, state, psid in proc_tasks()
                if state not in ("Z", "X") and ((uid is not None and puid == uid)
                                                or (uid is None and psid == sid))]
        if not live:
            return True
        for pid in live:
            _kill_pid(pid, uid)
        time.sleep(min(0.0005 * (i + 1), 0.02))
    return False


def acquire_uid() -> tuple[int, int]:
    """An exclusive sandbox uid and the descriptor whose ``flock`` reserves it (close it to
    release the slot). A free slot that still has processes (zombies not yet reaped, or leftovers
    of a caller that died) is cleaned and skipped."""
    global _next_slot
    lock_dir = _lock_dir()
    busy = {puid for _, puid, _, _ in proc_tasks()
            if SANDBOX_UID_BASE <= puid < SANDBOX_UID_BASE + SANDBOX_UID_SLOTS}
    for _ in range(2 * SANDBOX_UID_SLOTS):
        with _slot_mutex:
            slot = _next_slot
            _next_slot = (slot + 1) % SANDBOX_UID_SLOTS
        fd = os.open(f"{lock_dir}/{slot}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # in use by a run in this or another process
            os.close(fd)
            continue
        uid = SANDBOX_UID_BASE + slot
        if uid in busy:
            kill_all(uid, None, rounds=20)
            busy.discard(uid)
            os.close(fd)
            continue
        return uid, fd
    raise SandboxError("no free sandbox uid")
