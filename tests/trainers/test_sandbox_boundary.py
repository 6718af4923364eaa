"""The boundary as an ordinary user sees it: attacks, memory routes, and refusing where it is missing.

Most users train as an ordinary user, so the attacks run as one: when the tests run as root, a
driver process drops to ``nobody`` (uid 65534) and runs the sandbox from a world-readable copy of
the package; otherwise the driver runs as the current user. Each attack runs with the audit hook
on and off (the hook is a convenience; the kernel's layers are the wall), and the host checks that
nothing changed: no file in the host's /tmp or in a folder the user owns, no secret read, no
connection to a loopback or Unix-socket listener, the user's other process alive.
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from gradscope.errors import ConfigError
from gradscope.trainers import train
from gradscope.trainers.config import TrainConfig
from gradscope.trainers.sandbox import spawn

from .sandbox_util import IS_ROOT, parent_unharmed  # noqa: F401

NOBODY = 65534
PACKAGE = Path(spawn.__file__).parent

DRIVER = r'''
import importlib.util, json, os, sys
root = sys.argv[1]
spec = importlib.util.spec_from_file_location("sbx", root + "/sbx/__init__.py",
                                              submodule_search_locations=[root + "/sbx"])
sbx = importlib.util.module_from_spec(spec)
sys.modules["sbx"] = sbx
spec.loader.exec_module(sbx)
from sbx import seccomp
from sbx.limits import Limits
from sbx.run import execute, result
from sbx.verdict import verdict

job = json.load(sys.stdin)
if job.get("deny_unshare"):  # a machine where unprivileged user namespaces are disabled
    seccomp.install(seccomp.build({seccomp.NR["unshare"]: seccomp.RET_ERRNO | 1}))
out = []
for case in job["cases"]:
    lim = Limits(**case.get("limits", {}))
    try:
        raw = execute(case["src"], lim, hook=case["hook"], unsafe=case.get("unsafe", False))
    except sbx.SandboxError as e:
        out.append({"error": type(e).__name__, "message": str(e)})
        continue
    r = result(raw, verdict(raw, lim))
    out.append({"verdict": r.verdict, "reason": r.reason, "stdout": r.stdout, "stderr": r.stderr,
                "layers": raw.layers})
print(json.dumps({"uid": os.getuid(), "cases": out}))
'''


#: How the test starts a process as the ordinary user: as root, drop to nobody; else as itself.
AS_USER = {"user": NOBODY, "group": NOBODY, "extra_groups": []} if IS_ROOT else {}


def _runs(py: str) -> bool:
    try:
        return subprocess.run([py, "-I", "-c", "import sys"], cwd="/", capture_output=True, timeout=30,
                              **AS_USER).returncode == 0
    except OSError:
        return False


@pytest.fixture(scope="module")
def user():
    """(uid, run(job) -> driver output): the driver as an ordinary user."""
    uid = NOBODY if IS_ROOT else os.getuid()
    py = next((p for p in (spawn.layout().exe, "/usr/bin/python3") if _runs(p)), None)
    if py is None:
        pytest.skip("no Python interpreter that uid 65534 may run (the tests' own is in a private folder)")
    home = tempfile.mkdtemp(prefix="gradscope-sbx-test-")
    os.chmod(home, 0o755)
    shutil.copytree(PACKAGE, os.path.join(home, "sbx"), ignore=shutil.ignore_patterns("__pycache__"))
    for d, _, files in os.walk(home):
        os.chmod(d, 0o755)
        for f in files:
            os.chmod(os.path.join(d, f), 0o644)

    def run(job: dict) -> dict:
        p = subprocess.run([py, "-I", "-B", "-c", DRIVER, home], input=json.dumps(job), text=True,
                           capture_output=True, cwd=home, env={"PATH": "/usr/bin:/bin"}, timeout=300,
                           **AS_USER)
        assert p.returncode == 0, p.stderr
        return json.loads(p.stdout)

    yield uid, run
    shutil.rmtree(home)


@pytest.fixture
def targets(user):
    """What an escape would touch: a folder the user owns (with a secret in it), loopback and
    Unix-socket listeners, and another process of the same user."""
    uid, _ = user
    token = "gradscope-sbx-evil-" + secrets.token_hex(6)
    folder = tempfile.mkdtemp(prefix="gradscope-sbx-victim-")
    secret = "s3cr3t-" + secrets.token_hex(8)
    Path(folder, "secret").write_text(secret)
    tcp = socket.socket()
    tcp.bind(("127.0.0.1", 0))
    unix = socket.socket(socket.AF_UNIX)
    unix.bind(os.path.join(folder, "sock"))
    for srv in (tcp, unix):
        srv.listen(4)
        srv.settimeout(0.2)
    for path in (folder, os.path.join(folder, "secret"), os.path.join(folder, "sock")):
        os.chown(path, uid, uid)
    os.chmod(os.path.join(folder, "secret"), 0o600)
    victim = subprocess.Popen(["sleep", "600"], **AS_USER)
    yield {"token": token, "folder": folder, "secret": secret, "port": tcp.getsockname()[1],
           "victim": victim, "listeners": (tcp, unix)}
    victim.kill()
    victim.wait()
    tcp.close()
    unix.close()
    for path in (f"/tmp/{token}-a", f"/tmp/{token}-d", f"/tmp/{token}-e"):
        if os.path.exists(path):
            os.unlink(path)
    shutil.rmtree(folder)


def posixsubprocess_exploit(shell: str) -> str:
    """A fresh ``_posixsubprocess`` restores ``fork_exec``: an extension module loaded again under
    a dotted name (its init function is found by the last part; the audit event names the whole,
    which the hook does not know), or, in builds where it is built in, a new built-in instance.
    ``sys.audit`` is replaced so that ``subprocess`` does not raise its own event."""
    return ("import _imp, importlib.machinery, subprocess, sys\n"
            "origin = getattr(sys.modules['_posixsubprocess'], '__file__', None)\n"
            "name = 'bypass._posixsubprocess' if origin else '_posixsubprocess'\n"
            "spec = importlib.machinery.ModuleSpec(name, None, origin=origin)\n"
            "fresh = _imp.create_dynamic(spec) if origin else _imp.create_builtin(spec)\n"
            "subprocess._posixsubprocess, subprocess._fork_exec = fresh, fresh.fork_exec\n"
            "sys.audit = lambda *a: None\n"
            f"print(subprocess.run(['/bin/sh', '-c', {shell!r}]).returncode)\n")


def dir_fd_exploit(targets: list[str]) -> str:
    """From a deep working directory, a path relative to a dir_fd: the audit hook resolves it
    against the cwd (inside the working directory), the kernel against the dir_fd (outside)."""
    return ("import os\ntop = os.getcwd()\nfd = os.open(top, os.O_RDONLY)\n"
            "os.makedirs('a/b/c/d/e/f')\nos.chdir('a/b/c/d/e/f')\n"
            f"for target in {targets!r}:\n"
            "    try:\n"
            "        os.close(os.open('../../' + target, os.O_CREAT | os.O_WRONLY, 0o644, dir_fd=fd))\n"
            "        print('created', target)\n"
            "    except OSError as e:\n"
            "        print('refused', target, e)\n")


def attacks(t: dict) -> dict[str, str]:
    token, folder, port, victim = t["token"], t["folder"], t["port"], t["victim"].pid
    escape = f"echo pwned > /tmp/{token}-e; kill -9 {victim}"
    return {
        "write /tmp": f"open('/tmp/{token}-a', 'w').write('x')\n",
        "write the user's folder": f"open('{folder}/{token}-b', 'w').write('x')\n",
        "read the user's secret": f"print(open('{folder}/secret').read())\n",
        "dir_fd": dir_fd_exploit([f"tmp/{token}-d", f"{folder[1:]}/{token}-d"]),
        "_posixsubprocess": posixsubprocess_exploit(escape),
        "connect to loopback": f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)\n",
        "connect to a Unix socket": (f"import socket\ns = socket.socket(socket.AF_UNIX)\n"
                                     f"s.connect('{folder}/sock')\n"),
        "kill the user's process": f"import os\nos.kill({victim}, 9)\n",
        "kill everything": "import os\nos.kill(-1, 9)\n",
        # ctypes: fork, unshare(CLONE_NEWUSER), socket, ptrace(ATTACH), prctl(PR_SET_PDEATHSIG, 0)
        "raw system calls": (
            "import ctypes\nlibc = ctypes.CDLL(None)\n"
            f"print([libc.syscall(57), libc.syscall(272, 0x10000000), libc.syscall(41, 1, 1, 0), "
            f"libc.syscall(101, 16, {victim}, 0, 0), libc.syscall(157, 1, 0)])\n"),
    }


def assert_untouched(t: dict) -> None:
    token, folder = t["token"], t["folder"]
    assert t["victim"].poll() is None, "the user's other process was killed"
    for path in (f"/tmp/{token}-a", f"/tmp/{token}-d", f"/tmp/{token}-e"):
        assert not os.path.exists(path), path
    assert sorted(os.listdir(folder)) == ["secret", "sock"]
    for srv in t["listeners"]:
        with pytest.raises(socket.timeout):
            srv.accept()[0].close()


def test_attacks_as_an_ordinary_user_change_nothing(user, targets):
    uid, run = user
    cases = attacks(targets)
    out = run({"cases": [{"src": src, "hook": hook} for src in cases.values() for hook in (True, False)]})
    assert out["uid"] == uid and uid != 0
    for (name, hook), case in zip([(n, h) for n in cases for h in (True, False)], out["cases"]):
        assert "error" not in case, (name, case)
        assert {"userns", "namespaces", "rootfs", "seccomp"} <= set(case["layers"]), case
        assert targets["secret"] not in case["stdout"] + case["stderr"], name
        if name == "raw system calls" and not hook:
            assert case["stdout"] == "[-1, -1, -1, -1, -1]\n", case
        if name == "dir_fd":  # it gets past the hook, into the sandbox's own /tmp only
            assert f"refused {targets['folder'][1:]}" in case["stdout"], case
        if name == "_posixsubprocess":  # it gets past the hook; seccomp refuses the fork
            assert case["reason"] == "exit code 1: PermissionError: [Errno 1] Operation not permitted", case
    assert_untouched(targets)


def _sandboxed_programs(uid: int) -> list[int]:
    """Pids of the processes of ``uid`` that run a sandboxed program (``/.gradscope`` in argv)."""
    pids = []
    for p in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{p}/cmdline").read_bytes()
            status = Path(f"/proc/{p}/status").read_text()
        except OSError:
            continue
        uids = status.split("\nUid:")[1].split()
        state = status.split("\nState:")[1].split()[0]
        if b"/.gradscope" in cmd and int(uids[0]) == uid and state not in "ZX":
            pids.append(int(p))
    return pids


def test_a_program_does_not_outlive_its_run(user):
    """A program that clears its parent-death signal (native code: here ctypes without the hook)
    would survive the launcher, and an ordinary user's run has no uid sweep: the filter refuses
    the call, and nothing of the run is left once it returns."""
    uid, run = user
    src = ("import ctypes, time\nprint(ctypes.CDLL(None).prctl(1, 0, 0, 0, 0), flush=True)\n"
           "time.sleep(60)\n")
    before = set(_sandboxed_programs(uid))
    out = run({"cases": [{"src": src, "hook": False, "limits": {"wall_s": 1.0}}]})
    left = set(_sandboxed_programs(uid)) - before
    for pid in left:
        os.kill(pid, 9)
    case, = out["cases"]
    assert not left, case
    assert case["verdict"] == "timeout" and case["stdout"] == "-1\n", case


def test_the_audit_hook_alone_does_not_hold(tmp_path):
    """Control for the two hook bypasses above: under the hook alone (no kernel layers) both
    escape, so the attack test would see it if the kernel's layers did not stop them."""
    wd = tempfile.mkdtemp(dir="/tmp")  # two levels deep: ../../tmp from it is the host's /tmp
    token = "gradscope-sbx-control-" + secrets.token_hex(6)
    hooked = (f"import sys, os\nsys.path.insert(0, {spawn.LIB_DIR!r})\nimport guard\n"
              f"os.chdir({wd!r})\nguard.install({wd!r})\n")
    escaped = []
    try:
        for exploit, path in ((dir_fd_exploit([f"tmp/{token}-d"]), f"/tmp/{token}-d"),
                              (posixsubprocess_exploit(f"echo x > /tmp/{token}-e"), f"/tmp/{token}-e")):
            refused = subprocess.run([sys.executable, "-I", "-c", hooked + "open('/tmp/x', 'w')\n"],
                                     capture_output=True, text=True)
            assert "writing outside the working directory is blocked" in refused.stderr  # hook is on
            subprocess.run([sys.executable, "-I", "-c", hooked + exploit], capture_output=True, timeout=60)
            escaped.append(os.path.exists(path))
    finally:
        shutil.rmtree(wd)
        for suffix in ("d", "e"):
            if os.path.exists(f"/tmp/{token}-{suffix}"):
                os.unlink(f"/tmp/{token}-{suffix}")
    assert escaped == [True, True]


MEMORY_ROUTES = {  # each tries to take 200 MB, reporting every MB it got on stdout
    "memfd": "import os\nfd = os.memfd_create('x')\nos.posix_fallocate(fd, 0, 200 * 2**20)\nprint('MB ' * 200)\n",
    "/dev/shm": "for i in range(200):\n    open(f'/dev/shm/f{i}', 'wb').write(b'x' * 2**20)\n    print('MB', flush=True)\n",
    "/tmp": "for i in range(200):\n    open(f'/tmp/f{i}', 'wb').write(b'x' * 2**20)\n    print('MB', flush=True)\n",
    "working directory": "for i in range(200):\n    open(f'f{i}', 'wb').write(b'x' * 2**20)\n    print('MB', flush=True)\n",
    "anonymous shared mappings": ("import mmap\nmaps = []\nfor i in range(200):\n"
                                  "    m = mmap.mmap(-1, 2**20, flags=mmap.MAP_SHARED)\n    m.write(b'x' * 2**20)\n"
                                  "    maps.append(m)\n    print('MB', flush=True)\n"),
    "private memory": "x = []\nfor i in range(200):\n    x.append(bytearray(2**20))\n    print('MB', flush=True)\n",
    "System V shared memory": ("import ctypes\nlibc = ctypes.CDLL(None)\n"
                               "print(libc.shmget(0, 200 * 2**20, 0o1000 | 0o600))\n"),
    "POSIX message queue": "import ctypes\nprint(ctypes.CDLL(None).syscall(240, b'/q', 0o100 | 2, 0o600, 0))\n",
    "a second process": "import os\nprint(os.fork())\n",
}


def test_every_route_to_memory_is_bounded(user):
    """memfd, /dev/shm, /tmp, the working directory, shared and private mappings, System V and POSIX
    IPC, new processes: none lets the program hold more than its limits (64 MB of address space,
    4 MB in /tmp and in /dev/shm, 16 MB in the working directory)."""
    _, run = user
    limits = {"memory_mb": 64, "max_file_mb": 4}
    out = run({"cases": [{"src": src, "hook": False, "limits": limits} for src in MEMORY_ROUTES.values()]})
    bound = {"/dev/shm": 4, "/tmp": 4, "working directory": 16, "anonymous shared mappings": 64,
             "private memory": 64}
    for name, case in zip(MEMORY_ROUTES, out["cases"]):
        got = case["stdout"].count("MB")
        assert case["verdict"] in ("crash", "fail"), (name, case)
        assert got <= bound.get(name, 0), (name, got, case)
        if name in ("memfd", "System V shared memory", "POSIX message queue"):
            assert case["reason"].startswith("killed by the seccomp filter"), (name, case)
        elif name != "a second process":
            assert case["reason"].startswith(("memory limit", "disk limit", "file size limit")), (name, case)


def test_refuses_without_namespaces_unless_unsafe(user):
    """Where unprivileged user namespaces are disabled (here: unshare(2) refused by a filter on the
    driver), a run refuses with the reason; ``unsafe=True`` runs it with what is left, and then the
    hook bypass escapes - which is why the default refuses."""
    _, run = user
    token = "gradscope-sbx-unsafe-" + secrets.token_hex(6)
    try:
        out = run({"deny_unshare": True, "cases": [
            {"src": "print('hello')\n", "hook": True},
            {"src": "print('hello')\n", "hook": True, "unsafe": True},
            {"src": dir_fd_exploit([f"tmp/{token}"]), "hook": True, "unsafe": True}]})
        escaped = os.path.exists(f"/tmp/{token}")
    finally:
        if os.path.exists(f"/tmp/{token}"):
            os.unlink(f"/tmp/{token}")
    refused, unsafe, exploit = out["cases"]
    assert refused["error"] == "SandboxUnavailable", refused
    assert "namespaces: unshare: Operation not permitted" in refused["message"], refused
    assert unsafe["verdict"] == "pass" and unsafe["stdout"] == "hello\n", unsafe
    assert "!namespaces" in unsafe["layers"] and "seccomp" in unsafe["layers"], unsafe
    assert "created" in exploit["stdout"] and escaped, exploit


def test_train_refuses_code_tasks_without_the_sandbox(monkeypatch, tmp_path):
    reason = "the sandbox is not available on this machine: namespaces: unshare: Operation not permitted"
    monkeypatch.setattr(train, "unavailable_reason", lambda: reason)
    cfg = TrainConfig(task="code", out=str(tmp_path / "run.h5"), n_train=8, n_held_out=4)
    with pytest.raises(ConfigError, match="--unsafe-sandbox") as err:
        train.validate(cfg)
    assert reason in str(err.value) and "\n" not in str(err.value)
    train.validate(TrainConfig(task="code", out=str(tmp_path / "run.h5"), n_train=8, n_held_out=4,
                               unsafe_sandbox=True))
    train.validate(TrainConfig(task="math", out=str(tmp_path / "run.h5"), n_train=8, n_held_out=4))
    monkeypatch.undo()
    train.validate(cfg)  # here the sandbox is available
