"""The seccomp filter of a sandboxed program: a classic-BPF program installed with ``prctl``.

Written out by hand (a few dozen instructions) and installed through ``ctypes`` rather than with
libseccomp/pyseccomp: those are not on PyPI as wheels for every platform and would add a system
library to a training install, while a fixed deny-list needs nothing beyond ``prctl(2)``.

What the filter does (x86-64 only; another architecture, or the 32-bit and x32 system-call ABIs
on x86-64, cannot be filtered by this table, so the launcher reports seccomp as unavailable on
another architecture, and on x86-64 a 32-bit system call kills the program while an x32 one gets
EPERM):

* **Killed** (``SECCOMP_RET_KILL_PROCESS``, the program dies of SIGSYS): the routes to memory that
  ``RLIMIT_AS`` does not count - ``memfd_create``, ``memfd_secret``, System V shared memory and
  message queues (``shmget``, ``msgget``) and POSIX message queues (``mq_open``).
* **Refused with EPERM**: new processes (``fork``, ``vfork``, ``clone`` without ``CLONE_THREAD``
  or with any namespace flag), sockets, ptrace and cross-process memory access, namespaces and
  mounts, io_uring, bpf, perf events, userfaultfd, the kernel keyring, ``syslog``, file handles.
  ``clone3`` gets ENOSYS, so that glibc falls back to ``clone``, whose flags the filter can read
  (``clone3`` passes them in memory). Threads stay possible. ``prctl(PR_SET_PDEATHSIG, ...)``:
  the program must not clear the signal that ends it with its launcher (the launcher sets it
  before installing the filter).
* Everything else is allowed.

Used by the launcher (installs it) and by the tests (which also build filters of their own).
Standard library only: the launcher imports this file by path.
"""
from __future__ import annotations

import ctypes
import errno
import os
import struct

AUDIT_ARCH_X86_64 = 0xC000003E
X32_SYSCALL_BIT = 0x40000000

RET_KILL_PROCESS = 0x80000000
RET_ERRNO = 0x00050000
RET_ALLOW = 0x7FFF0000

CLONE_THREAD = 0x00010000
# NEWNS CGROUP UTS IPC USER PID NET (CLONE_NEWTIME shares its bit with clone's exit signal)
CLONE_NAMESPACES = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000

#: x86-64 system-call numbers (asm/unistd_64.h).
NR = {
    "memfd_create": 319, "memfd_secret": 447, "shmget": 29, "msgget": 68, "mq_open": 240,
    "fork": 57, "vfork": 58, "clone": 56, "clone3": 435,
    "socket": 41, "socketpair": 53,
    "ptrace": 101, "process_vm_readv": 310, "process_vm_writev": 311, "kcmp": 312,
    "pidfd_getfd": 438,
    "unshare": 272, "setns": 308, "mount": 165, "umount2": 166, "pivot_root": 155, "chroot": 161,
    "open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432,
    "fspick": 433, "mount_setattr": 442,
    "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427,
    "bpf": 321, "perf_event_open": 298, "userfaultfd": 323,
    "keyctl": 250, "add_key": 248, "request_key": 249, "syslog": 103,
    "name_to_handle_at": 303, "open_by_handle_at": 304, "prctl": 157,
}
PR_SET_PDEATHSIG = 1

KILLED = ("memfd_create", "memfd_secret", "shmget", "msgget", "mq_open")
REFUSED = ("fork", "vfork", "socket", "socketpair", "ptrace", "process_vm_readv",
           "process_vm_writev", "kcmp", "pidfd_getfd", "unshare", "setns", "mount", "umount2",
           "pivot_root", "chroot", "open_tree", "move_mount", "fsopen", "fsconfig", "fsmount",
           "fspick", "mount_setattr", "io_uring_setup", "io_uring_enter", "io_uring_register",
           "bpf", "perf_event_open", "userfaultfd", "keyctl", "add_key", "request_key", "syslog",
           "name_to_handle_at", "open_by_handle_at")

# classic BPF opcodes
_LD_ABS = 0x20   # BPF_LD | BPF_W | BPF_ABS
_JEQ = 0x15      # BPF_JMP | BPF_JEQ | BPF_K
_JGE = 0x35      # BPF_JMP | BPF_JGE | BPF_K
_JSET = 0x45     # BPF_JMP | BPF_JSET | BPF_K
_RET = 0x06      # BPF_RET | BPF_K
# offsets in struct seccomp_data
_NR, _ARCH, _ARG0 = 0, 4, 16


def _insn(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)


def supported() -> str | None:
    """None if this machine's architecture has a table here, else why not."""
    machine = os.uname().machine
    return None if machine == "x86_64" else f"no seccomp table for the {machine} architecture"


def build(rules: dict[int, int], *, threads_only: bool = False,
          by_arg0: dict[int, dict[int, int]] | None = None) -> bytes:
    """A filter program: ``rules`` maps system-call numbers to return actions (``RET_*``, or
    ``RET_ERRNO | errno``); ``by_arg0`` maps a system-call number to {first argument (its low
    32 bits): action}, its other calls allowed; with ``threads_only``, ``clone`` is allowed only
    for threads. Anything not named is allowed. Other architectures are killed, the x32 ABI
    refused."""
    prog = [_insn(_LD_ABS, _ARCH),
            _insn(_JEQ, AUDIT_ARCH_X86_64, jt=1),
            _insn(_RET, RET_KILL_PROCESS),
            _insn(_LD_ABS, _NR),
            _insn(_JGE, X32_SYSCALL_BIT, jf=1),
            _insn(_RET, RET_ERRNO | errno.EPERM)]
    for nr, action in rules.items():
        prog += [_insn(_JEQ, nr, jf=1), _insn(_RET, action)]
    for nr, actions in (by_arg0 or {}).items():
        body = [_insn(_LD_ABS, _ARG0)]
        for value, action in actions.items():
            body += [_insn(_JEQ, value, jf=1), _insn(_RET, action)]
        body.append(_insn(_RET, RET_ALLOW))
        prog += [_insn(_JEQ, nr, jf=len(body)), *body]
    if threads_only:
        prog += [_insn(_JEQ, NR["clone"], jf=5),
                 _insn(_LD_ABS, _ARG0),  # the flags (low 32 bits of the first argument)
                 _insn(_JSET, CLONE_NAMESPACES, jt=1),  # -> EPERM
                 _insn(_JSET, CLONE_THREAD, jt=1),  # -> ALLOW
                 _insn(_RET, RET_ERRNO | errno.EPERM),
                 _insn(_RET, RET_ALLOW)]
    prog.append(_insn(_RET, RET_ALLOW))
    return b"".join(prog)


def sandbox_filter() -> bytes:
    """The filter every sandboxed program runs under (module docstring)."""
    rules = {NR[name]: RET_KILL_PROCESS for name in KILLED}
    rules.update({NR[name]: RET_ERRNO | errno.EPERM for name in REFUSED})
    rules[NR["clone3"]] = RET_ERRNO | errno.ENOSYS
    pdeathsig = {PR_SET_PDEATHSIG: RET_ERRNO | errno.EPERM}
    return build(rules, threads_only=True, by_arg0={NR["prctl"]: pdeathsig})


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def install(prog: bytes) -> None:
    """Set no_new_privs and install ``prog`` on the calling thread (and what it starts); raises
    ``OSError`` if the kernel refuses."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong,
                           ctypes.c_ulong]
    buf = ctypes.create_string_buffer(prog, len(prog))
    fprog = _SockFprog(len(prog) // 8, ctypes.addressof(buf))
    for args in ((38, 1, 0, 0, 0),  # PR_SET_NO_NEW_PRIVS
                 (22, 2, ctypes.addressof(fprog), 0, 0)):  # PR_SET_SECCOMP, SECCOMP_MODE_FILTER
        if libc.prctl(*args) != 0:
            e = ctypes.get_errno()
            raise OSError(e, f"prctl({args[0]}): {os.strerror(e)}")
