"""Sets up one sandboxed program, then becomes it. Never imported by the caller: ``spawn.py``
compiles this file once and runs it in a fresh interpreter as
``python -I -S -B -c <stub> <fd>``, where the descriptor holds the *job* - ``marshal``-ed data from
the caller: the spec, the program's files, the compiled child modules and this code.

As the caller's user (root or not), single-threaded, before the program exists::

    unshare(user* | mount | pid | net | ipc | uts)     * not as root; then map the own uid/gid
    fork ── pid 1 of the new PID namespace
            setsid; mount namespace private; a fresh tmpfs becomes the root (pivot_root):
              read-only binds of /usr, /lib*, /bin, /sbin, ld.so.cache and the interpreter prefix,
              empty read-only tmpfs over every site-/dist-packages folder inside them
              /dev: null zero full random urandom, and /dev/shm (tmpfs, size cap)
              /tmp (tmpfs, size cap), /sandbox (tmpfs, size cap, the working directory)
              /.gradscope (boot.pyc, guard.pyc, plain.pyc); then / itself read-only
            root only: setgroups([]), setresgid/setresuid(the run's sandbox uid)
            rlimits (AS, CPU, FSIZE, NPROC, NOFILE, CORE=0, MSGQUEUE=0)
            PR_SET_PDEATHSIG(SIGKILL); no_new_privs + seccomp filter (seccomp.py)
            execve(python -I -S -B -c <boot stub> /.gradscope <mode> <wd> <hook> <entry> <fds>, env={})
    the launcher waits, kills pid 1 at the backstop deadline, reports the exit status + CPU time.

Status lines on the status descriptor: ``READY <layers>`` (just before execve), ``EXIT <wait
status> <cpu seconds>``, ``UNAVAILABLE <why>`` (a required layer cannot be had and the spec is
strict), ``TOOLARGE <why>`` (the program's files do not fit in its working directory) or ``ERR
<why>`` (a set-up failure). In a non-strict ("unsafe") spec a missing layer is
skipped and listed as ``!<layer>``; without namespaces the program then runs in the host's file
system, in the caller's temporary directory.
"""
import codecs
import ctypes
import errno
import os
import select
import signal
import sys

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC, MS_PRIVATE, MS_RELATIME = 1024, 2048, 4096, 16384, 1 << 18, 1 << 21
MNT_DETACH = 2
SYS_PIVOT_ROOT = 155
WD, LIB = "/sandbox", "/.gradscope"
#: What the program's interpreter runs: the child modules from a folder (``/.gradscope``, or the
#: package's ``child/`` folder in unsafe mode without namespaces).
BOOT = "import sys; sys.path.insert(0, sys.argv[1]); import boot; boot.main(*sys.argv[2:])"
DEVICES = ("null", "zero", "full", "random", "urandom")

seccomp = None  # the sibling module seccomp.py, imported by main() from the package's folder
libc = ctypes.CDLL(None, use_errno=True)
libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong,
                       ctypes.c_char_p]
libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
libc.unshare.argtypes = [ctypes.c_int]
libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]


class Unavailable(Exception):
    """A layer the strict sandbox requires cannot be set up on this machine."""


class TooLarge(Exception):
    """The program's files do not fit in its working directory (``disk_mb``): the program's
    own doing, reported as ``TOOLARGE`` and judged like a full disk, not a set-up failure."""


def _enc(s):
    return None if s is None else s.encode()


def _check(rc, what):
    if rc != 0:
        e = ctypes.get_errno()
        raise OSError(e, "%s: %s" % (what, os.strerror(e)))


def mount(src, dst, fstype, flags, data=None):
    _check(libc.mount(_enc(src), _enc(dst), _enc(fstype), flags, _enc(data)),
           "mount %s on %s" % (fstype or src, dst))


def remount_readonly(path):
    """Make the bind mount at ``path`` read-only. Flags the mount already has must be kept (in
    a user namespace the kernel refuses to clear them), so they are read back with statvfs."""
    f = os.statvfs(path).f_flag
    keep = 0
    for st_flag, ms_flag in ((os.ST_NOSUID, MS_NOSUID), (os.ST_NODEV, MS_NODEV),
                             (os.ST_NOEXEC, MS_NOEXEC), (os.ST_NOATIME, MS_NOATIME),
                             (os.ST_NODIRATIME, MS_NODIRATIME), (os.ST_RELATIME, MS_RELATIME)):
        if f & st_flag:
            keep |= ms_flag
    mount(None, path, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV | keep)


def _mount_points_under(path):
    with open("/proc/self/mountinfo", "rb") as f:  # field 5: the mount point, \ooo-escaped
        points = [os.fsdecode(codecs.escape_decode(line.split()[4])[0]) for line in f]
    return [p for p in points if p == path or p.startswith(path + "/")]


def write_file(path, data, mode=0o644):
    """Create ``path`` with ``data`` (str or bytes)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
    try:
        if isinstance(data, str):
            data = data.encode("utf-8", "surrogatepass")
        while data:
            data = data[os.write(fd, data):]
    finally:
        os.close(fd)


def build_root(spec, files, lib, uid, gid):
    """The program's whole file system, under spec["anchor"], then pivot_root into it."""
    lim = spec["limits"]
    root = spec["anchor"]
    mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing mounted here reaches the host
    mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=1m,nr_inodes=1024")
    for src in spec["binds"]:
        dst = root + src
        if os.path.isdir(src):
            os.makedirs(dst, 0o755, exist_ok=True)
        else:
            os.makedirs(os.path.dirname(dst), 0o755, exist_ok=True)
            write_file(dst, "")
        mount(src, dst, None, MS_BIND | MS_REC)
        for point in _mount_points_under(dst):
            remount_readonly(point)
    for name, target in spec["links"].items():
        os.symlink(target, root + name)
    for path in spec["masks"]:
        mount("tmpfs", root + path, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC,
              "mode=0755,size=4k,nr_inodes=16")
    dev = root + "/dev"
    os.mkdir(dev, 0o755)
    mount("tmpfs", dev, "tmpfs", MS_NOSUID | MS_NOEXEC, "mode=0755,size=64k,nr_inodes=64")
    for name in DEVICES:
        write_file(dev + "/" + name, "", 0o666)
        mount("/dev/" + name, dev + "/" + name, None, MS_BIND)
    small = "size=%dk,nr_inodes=1024" % lim["tmp_kb"]
    os.mkdir(dev + "/shm")
    mount("tmpfs", dev + "/shm", "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, "mode=1777," + small)
    remount_readonly(dev)
    os.mkdir(root + "/tmp")
    mount("tmpfs", root + "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777," + small)
    os.mkdir(root + WD)
    mount("tmpfs", root + WD, "tmpfs", MS_NOSUID | MS_NODEV,
          "mode=0700,uid=%d,gid=%d,size=%dk,nr_inodes=4096" % (uid, gid, lim["wd_kb"]))
    try:
        for name, text in files.items():
            write_file(root + WD + "/" + name, text)
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise TooLarge("%s: %s" % (name, e.strerror)) from None
        raise
    os.mkdir(root + LIB, 0o755)
    for name, data in lib.items():
        write_file(root + LIB + "/" + name, data)
    os.chdir(root)
    _check(libc.syscall(SYS_PIVOT_ROOT, b".", b"."), "pivot_root")
    _check(libc.umount2(b".", MNT_DETACH), "umount the old root")
    os.chdir("/")
    remount_readonly("/")
    os.chdir(WD)


def set_rlimits(lim, nproc):
    import resource

    for res, soft, hard in ((resource.RLIMIT_CORE, 0, 0),
                            (resource.RLIMIT_MSGQUEUE, 0, 0),
                            (resource.RLIMIT_CPU, lim["cpu"][0], lim["cpu"][1]),
                            (resource.RLIMIT_AS, lim["as"], lim["as"]),
                            (resource.RLIMIT_FSIZE, lim["fsize"], lim["fsize"]),
                            (resource.RLIMIT_NOFILE, lim["nofile"], lim["nofile"]),
                            (resource.RLIMIT_NPROC, nproc, nproc)):
        cur_hard = resource.getrlimit(res)[1]
        if cur_hard != resource.RLIM_INFINITY:  # a hard limit cannot be raised
            hard = min(hard, cur_hard)
            soft = min(soft, hard)
        resource.setrlimit(res, (soft, hard))


def _own_tasks():
    """Processes of this uid (RLIMIT_NPROC counts them all when there is no user namespace)."""
    uid, n = os.getuid(), 0
    for name in os.listdir("/proc"):
        try:
            n += name.isdigit() and os.stat("/proc/" + name).st_uid == uid
        except OSError:
            pass
    return n


def program(spec, ns, files, lib, alive_r, feats, lack):
    """In the forked child (pid 1 of the new PID namespace): finish the set-up and exec."""
    as_root = spec["uid"] >= 0
    uid, gid = (spec["uid"], spec["uid"]) if as_root else (os.getuid(), os.getgid())
    lim = spec["limits"]
    if ns:
        os.setsid()  # kill(0) / killpg(0) must not reach the launcher, which is outside the namespace
        try:
            build_root(spec, files, lib, uid, gid)
            feats.append("rootfs")
        except OSError as e:
            lack("rootfs", str(e))
            ns = False
    if not ns:  # unsafe mode only: the host's file system, the caller's temporary directory
        os.chdir(spec["anchor"])
        for name, text in files.items():
            write_file(name, text)
    if as_root:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
        if os.getresuid() != (uid, uid, uid) or os.getresgid() != (uid, uid, uid):
            raise OSError("privilege drop failed")
        feats.append("uid=%d" % uid)
        nproc = lim["procs"]
    else:
        # In a fresh user namespace RLIMIT_NPROC counts the namespace's tasks (the launcher and
        # the program); without one it counts every process of the user.
        nproc = lim["procs"] + (1 if ns else _own_tasks())
    set_rlimits(lim, nproc)
    feats.append("rlimits")
    # Die with the launcher. Set after the uid change (which clears it) and before the seccomp
    # filter (which refuses it, so that the program cannot clear it).
    _check(libc.prctl(seccomp.PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "PR_SET_PDEATHSIG")
    if select.select([alive_r], [], [], 0)[0]:  # the launcher died before the prctl
        os._exit(125)
    os.close(alive_r)
    why = seccomp.supported()
    if why is None:
        try:
            seccomp.install(spec["seccomp"])
            feats += ["no_new_privs", "seccomp"]
        except OSError as e:
            why = str(e)
    if why is not None:
        lack("seccomp", why)
        if libc.prctl(38, 1, 0, 0, 0) == 0:  # PR_SET_NO_NEW_PRIVS
            feats.append("no_new_privs")
    boot = spec["boot"]
    argv = [LIB if ns else spec["lib_dir"], boot["mode"], WD if ns else spec["anchor"],
            "1" if boot["hook"] else "0", boot.get("entry", ""),
            ",".join(str(fd) for fd in boot.get("fds", ()))]
    for fd in spec["keep_fds"]:
        os.set_inheritable(fd, True)
    status(spec, "READY " + " ".join(feats))
    exe = spec["exe"]
    os.execve(exe, [exe, "-I", "-S", "-B", "-c", BOOT, *argv], {})


def status(spec, line):
    os.write(spec["status"], (line.replace("\n", " ") + "\n").encode("utf-8", "replace"))


def launch(spec, files, lib):
    strict = spec["strict"]
    feats = []

    def lack(layer, why):
        if strict:
            raise Unavailable("%s: %s" % (layer, why))
        feats.append("!" + layer)

    as_root = spec["uid"] >= 0
    flags = CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS
    uid, gid = os.getuid(), os.getgid()
    hint = "" if as_root else " (unprivileged user namespaces are disabled or restricted here)"
    ns = libc.unshare(flags if as_root else flags | CLONE_NEWUSER) == 0
    if not ns:
        lack("namespaces", "unshare: %s%s" % (os.strerror(ctypes.get_errno()), hint))
    elif not as_root:
        try:
            for name, text in (("setgroups", "deny"), ("uid_map", "%d %d 1" % (uid, uid)),
                               ("gid_map", "%d %d 1" % (gid, gid))):
                with open("/proc/self/" + name, "w") as f:
                    f.write(text)
            feats.append("userns")
        except OSError as e:
            lack("namespaces", "user namespace: %s%s" % (e, hint))
            ns = False
    if ns:
        feats.append("namespaces")
    alive_r, alive_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            program(spec, ns, files, lib, alive_r, feats, lack)
        except Unavailable as e:
            status(spec, "UNAVAILABLE %s" % e)
        except TooLarge as e:
            status(spec, "TOOLARGE %s" % e)
        except BaseException as e:
            status(spec, "ERR %s: %s" % (type(e).__name__, e))
        os._exit(125)
    os.close(alive_r)
    for fd in spec["keep_fds"]:
        os.close(fd)  # only the program holds them now: the peer sees EOF when it ends
    pidfd = os.pidfd_open(pid)  # names this process even after it is reaped

    def backstop(*_):
        try:
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        except OSError:
            pass

    signal.signal(signal.SIGALRM, backstop)
    signal.setitimer(signal.ITIMER_REAL, spec["backstop_s"])  # if the caller is gone
    _, wait_status, usage = os.wait4(pid, 0)
    status(spec, "EXIT %d %.6f" % (wait_status, usage.ru_utime + usage.ru_stime))


def main(job):
    """Run by the stub in spawn.py with the job it read."""
    global seccomp
    spec = job["spec"]
    os.set_inheritable(spec["status"], False)
    try:
        sys.path.insert(0, spec["pkg_dir"])
        import seccomp  # a sibling file, outside any package here
        launch(spec, job["files"], job["lib"])
    except Unavailable as e:
        status(spec, "UNAVAILABLE %s" % e)
        os._exit(125)
    except BaseException as e:
        status(spec, "ERR %s: %s" % (type(e).__name__, e))
        os._exit(125)
