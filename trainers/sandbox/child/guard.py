"""The audit hook: a convenience inside the sandbox, not its boundary.

The boundary is the kernel (namespaces, a read-only root, the uid, rlimits and the seccomp filter
set up by the launcher). Audit hooks can be bypassed - ``os.open(relative, dir_fd=...)``, or a
fresh copy of ``_posixsubprocess`` made with ``_imp.create_dynamic`` - so this hook only turns the
common hostile operations into a clear ``PermissionError`` ("sandbox: ... is blocked") instead of
an errno from the kernel, and the tests check that every bypass still changes nothing outside.

Runs inside the sandbox (copied in by the launcher, imported as ``guard``).
"""
import posix
import sys


def _blocked(*args, **kwargs):
    raise PermissionError("sandbox: this operation is blocked")


def install(wd: str) -> None:
    """Add the hook for a program whose working directory is ``wd``. It holds its state in default
    arguments (immutable values and C functions) and reads no globals or builtins when called, so
    a program that patches modules or builtins does not change what it decides; audit hooks cannot
    be removed."""
    import _posixsubprocess
    import _signal

    for mod, names in ((posix, ("mkfifo", "mknod", "pidfd_open")),
                       (_posixsubprocess, ("fork_exec",)),
                       (_signal, ("pidfd_send_signal",))):
        for n in names:  # operations without an audit event: replace them
            if hasattr(mod, n):
                setattr(mod, n, _blocked)
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
             _W=O.O_WRONLY | O.O_RDWR | O.O_CREAT | O.O_TRUNC | O.O_APPEND,
             _devw=frozenset(("/dev/null", "/dev/stdout", "/dev/stderr")),
             _pathev=path_events,
             _exec=frozenset(("os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork",
                              "os.forkpty", "subprocess.Popen", "os.startfile", "pty.spawn")),
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
            pid = args[0]
            if pid == _getpid() or pid == 0 or (pid < -1 and -pid == _getpgrp()):
                return
            raise _PE("sandbox: signalling other processes is blocked")
        elif event == "os.killpg":
            if args[0] == _getpgrp():
                return
            raise _PE("sandbox: signalling other processes is blocked")
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
            # reading outside the working directory: no directory descriptors (they could serve
            # as dir_fd, which the "open" event does not show) and no other processes' memory
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
