"""The run file under a writer that is killed (SIGKILL) or still writing (SWMR live reading).

The writer runs in a subprocess (``runfile_child.py``) whose record ``i`` is a pure function of
``i``, so every row a reader sees can be checked exactly.
"""
from __future__ import annotations

import importlib.util
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from gradscope.runfile import RunReader, open_run

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="SIGKILL and SWMR semantics are POSIX")

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
CHILD = HERE / "runfile_child.py"


def _load_child():
    # Loaded by path: works whether or not tests/gradscope is a package.
    spec = importlib.util.spec_from_file_location("_runfile_child", CHILD)
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    return module


child = _load_child()


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def _start(path: Path, n: int, flush_every: int, sleep_s: float) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, str(CHILD), str(path), str(n), str(flush_every), str(sleep_s)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=_env())


def _bits(a: np.ndarray) -> np.ndarray:
    """float64 as uint64: equality of these is bitwise equality (NaN == NaN, 0.0 != -0.0)."""
    return np.ascontiguousarray(a, dtype=np.float64).view(np.uint64)


def assert_records_match(run: RunReader, start: int = 0) -> None:
    """Every committed record from ``start`` on, in every dataset, equals what the child wrote."""
    n = run.n_steps
    step, opt, pol = run.read("step", start), run.read("opt_step", start), run.read("policy", start)
    gram, tokens = run.read("gram", start), run.read("tokens", start)
    scalars, group = run.read("scalars", start), run.read("group_gram", start)
    assert len(step) == len(opt) == len(pol) == len(gram) == len(tokens) == len(scalars) == len(group) \
        == n - start
    names = run.meta.scalar_names
    for row, i in enumerate(range(start, n)):
        rec = child.record(i)
        assert step[row] == rec["step"] and opt[row] == rec["opt_step"], f"record {i}"
        assert run.meta.policies[pol[row]] == rec["policy"], f"record {i}"
        assert np.array_equal(_bits(gram[row]), _bits(rec["gram"])), f"gram of record {i}"
        assert np.array_equal(tokens[row], rec["tokens"]), f"tokens of record {i}"
        assert np.array_equal(_bits(group[row]), _bits(rec["group_gram"])), f"group_gram of record {i}"
        want = np.array([rec["scalars"].get(s, np.nan) for s in names])
        assert np.array_equal(_bits(scalars[row]), _bits(want)), f"scalars of record {i}"


def assert_evals_events_match(run: RunReader) -> None:
    """Evaluation and event rows are the child's, in order, and none is ahead of the records."""
    logged_evals = [(child.record(i)["step"], name, value)
                    for i in range(0, run.n_steps + 1000) if child.eval_of(i)
                    for name, value in child.eval_of(i).items()]
    evals = run.evals
    got = list(zip(evals["step"], evals["name"], evals["value"]))
    assert got == logged_evals[: len(got)]
    # Evals logged after record i are committed no earlier than record i.
    if got:
        assert got[-1][0] <= child.record(max(run.n_steps - 1, 0))["step"]
    events = run.events
    logged_events = [child.event_of(i) for i in range(run.n_steps + 1000) if child.event_of(i)]
    got_events = list(zip(events["kind"], events["message"], events["severity"]))
    assert got_events == logged_events[: len(got_events)]


def _kill_when(proc: subprocess.Popen[str], at_least: int, delay_s: float, log: list[str]) -> None:
    """Read the child's lines; once it reports >= ``at_least`` committed, wait, then SIGKILL it."""
    assert proc.stdout is not None
    for line in proc.stdout:
        log.append(line.strip())
        if (line.startswith("ready") and at_least == 0) or \
                (line.startswith("committed") and int(line.split()[1]) >= at_least):
            break
    time.sleep(delay_s)
    proc.send_signal(signal.SIGKILL)
    log.extend(line.strip() for line in proc.stdout)  # everything it printed before dying
    proc.wait()


def test_killed_writer_leaves_a_readable_file(tmp_path: Path) -> None:
    seed = random.randrange(2**31)
    rnd = random.Random(seed)
    F = 10
    # (records, sleep per record, kill once this many are committed, extra delay before the kill)
    plans = [
        (10_000, 0.002, 0, 0.0),                              # right after start: maybe nothing flushed
        (10_000, 0.002, 2 * F, F * 0.002 / 2),                # mid-way between two flushes
        (10_000, 0.002, 3 * F, rnd.uniform(0, F * 0.002)),    # a random point of a flush interval
        (10_000, 0.001, 5 * F, rnd.uniform(0.05, 0.3)),       # a random point further on
        (100_000, 0.0, 20 * F, rnd.uniform(0.0, 0.05)),       # full speed: likely inside a flush
        (100_000, 0.0, 50 * F, rnd.uniform(0.0, 0.02)),
    ]
    paths = [tmp_path / f"killed{j}.h5" for j in range(len(plans))]
    logs: list[list[str]] = [[] for _ in plans]
    procs = [_start(p, n, F, s) for p, (n, s, _, _) in zip(paths, plans)]
    threads = [threading.Thread(target=_kill_when, args=(proc, at, delay, log))
               for proc, (_, _, at, delay), log in zip(procs, plans, logs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    for proc in procs:
        assert proc.returncode == -signal.SIGKILL, proc.stderr.read() if proc.stderr else ""

    info = [subprocess.Popen([sys.executable, "-m", "gradscope.cli", "info", str(p)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, cwd=ROOT, env=_env()) for p in paths]
    for j, (path, log) in enumerate(zip(paths, logs)):
        ctx = f"plan {j} {plans[j]}, seed {seed}, log tail {log[-3:]}"
        assert "done" not in log, ctx
        reported = max([int(x.split()[1]) for x in log if x.startswith("committed")], default=0)
        with open_run(path) as run:
            assert not run.closed, ctx
            # The child prints a count right after each flush, so at most one further flush may
            # have completed unreported: never fewer than reported, never more than one flush on.
            assert reported <= run.n_steps <= reported + F, ctx
            assert run.n_steps % F == 0, ctx
            assert_records_match(run)
            assert_evals_events_match(run)
            run.stats()  # derived statistics work on a killed file
        out, err = info[j].communicate(timeout=30)
        assert info[j].returncode == 0, f"{ctx}\n{err}"
        assert "not closed" in out and f"{run.n_steps} complete" in out, out
    assert any(max([int(x.split()[1]) for x in log if x.startswith("committed")], default=0) >= 20 * F
               for log in logs)


def test_live_reader_sees_only_complete_records(tmp_path: Path) -> None:
    path = tmp_path / "live.h5"
    n_total, F = 240, 7
    proc = _start(path, n_total, F, 0.002)
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready", proc.stderr.read() if proc.stderr else ""
    seen: list[int] = []
    checked = 0
    deadline = time.monotonic() + 30
    with open_run(path) as run:
        assert run.swmr
        while True:
            run.refresh()
            n = run.n_steps
            assert not seen or n >= seen[-1], f"count went down: {seen[-1]} -> {n}"
            seen.append(n)
            assert n % F == 0 or run.closed
            assert_records_match(run, start=checked)  # new rows, every dataset
            checked = n
            assert_evals_events_match(run)
            if run.closed:
                break
            assert time.monotonic() < deadline, "writer never closed the file"
            time.sleep(0.005)
        assert run.n_steps == n_total
        assert_records_match(run)  # and everything once more from the start
    assert proc.wait(timeout=30) == 0
    assert "done" in proc.stdout.read()
    distinct = sorted(set(seen))
    assert len(distinct) >= 5, f"reader saw too few intermediate states: {distinct}"
