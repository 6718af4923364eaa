"""The run file under a writer that is killed (SIGKILL), still writing (SWMR live reading), or
resumed after it was killed.

The writer runs in a subprocess (``runfile_child.py``) whose record ``i`` is a pure function of
``i``, so every row a reader sees can be checked exactly.
"""
from __future__ import annotations

import functools
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

from gradscope.runfile import RunReader, RunWriter, open_run
from gradscope.runfile.writer import RESUME_SUFFIX

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


def _start(path: Path, n: int, flush_every: int, sleep_s: float,
           resume_below: int | None = None) -> subprocess.Popen[str]:
    extra = [] if resume_below is None else [str(resume_below)]
    return subprocess.Popen([sys.executable, str(CHILD), str(path), str(n), str(flush_every), str(sleep_s),
                             *extra],
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


@functools.lru_cache(maxsize=None)
def _rows_after(i: int) -> dict[str, list[tuple[object, ...]]]:
    """The eval, metric and event rows the child logs after record ``i`` (cached: a live reader
    checks them at every poll)."""
    step = child.record(i)["step"]
    return {"evals": [(step, name, value) for name, value in (child.eval_of(i) or {}).items()],
            "metrics": [(step, name, value) for name, value in (child.metrics_of(i) or {}).items()],
            "events": [child.event_of(i)] if child.event_of(i) else []}


def assert_tables_match(run: RunReader, complete: bool = False) -> None:
    """Evaluation, metric and event rows are the child's, in order, and none is ahead of the
    records ("resume" events, which the child does not log itself, are left out). ``complete``:
    every row logged with the committed records is there."""
    # Rows logged after record i are committed no earlier than record i: only i < n_steps count.
    logged = {what: [row for i in range(run.n_steps) for row in _rows_after(i)[what]]
              for what in ("evals", "metrics", "events")}
    for what in ("evals", "metrics"):
        table = getattr(run, what)
        got = list(zip(table["step"], table["name"], table["value"]))
        assert got == logged[what][: len(got)], what
        if complete:
            assert len(got) == len(logged[what]), what
    events = run.events
    events = events[events["kind"] != "resume"]
    got_events = list(zip(events["kind"], events["message"], events["severity"]))
    assert got_events == logged["events"][: len(got_events)]
    if complete:
        assert len(got_events) == len(logged["events"])


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
            assert_tables_match(run)
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
            assert_tables_match(run)
            if run.closed:
                break
            assert time.monotonic() < deadline, "writer never closed the file"
            time.sleep(0.005)
        assert run.n_steps == n_total
        assert_records_match(run)  # and everything once more from the start
        assert_tables_match(run, complete=True)
    assert proc.wait(timeout=30) == 0
    assert "done" in proc.stdout.read()
    distinct = sorted(set(seen))
    assert len(distinct) >= 5, f"reader saw too few intermediate states: {distinct}"


# --- resuming after a kill ----------------------------------------------------------------------


def _snapshot(path: Path) -> dict[str, np.ndarray]:
    """Every committed row of every dataset, as stored."""
    with open_run(path) as run:
        out = {name: run.read(name) for name in ("step", "opt_step", "policy", "time", "gram", "tokens",
                                                  "scalars", "group_gram")}
        out.update({f"/{t}": run.read_table(t) for t in ("evals", "metrics", "events")})
    return out


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    """Bitwise equality, for plain and structured arrays alike."""
    a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def _info(path: Path) -> str:
    res = subprocess.run([sys.executable, "-m", "gradscope.cli", "info", str(path)], capture_output=True,
                         text=True, cwd=ROOT, env=_env(), timeout=60)
    assert res.returncode == 0, res.stderr
    return res.stdout


def _run_and_kill(path: Path, n: int, F: int, at_least: int, delay_s: float,
                  resume_below: int | None = None) -> list[str]:
    proc = _start(path, n, F, 0.002, resume_below)
    log: list[str] = []
    _kill_when(proc, at_least, delay_s, log)
    assert proc.returncode == -signal.SIGKILL, (log[-3:], proc.stderr.read() if proc.stderr else "")
    assert "done" not in log, log[-3:]
    return log


def test_resume_a_killed_run_in_process(tmp_path: Path) -> None:
    """Resume a SIGKILLed file: kept rows bit-exact, later rows dropped, new rows appended."""
    seed = random.randrange(2**31)
    rnd = random.Random(seed)
    path, F = tmp_path / "killed.h5", 10
    _run_and_kill(path, 10_000, F, 10 * F, rnd.uniform(0.0, 0.05))
    old = _snapshot(path)
    n = len(old["step"])
    k = rnd.randint(1, (n - F) // 2)  # every row below step k is committed
    ctx = f"seed {seed}, {n} records, keep below step {k}"

    w = RunWriter.resume(path, keep_below_step=k)
    assert (w.n_steps, w.n_committed, w.flush_every) == (2 * k, 2 * k, F), ctx
    assert not (tmp_path / ("killed.h5" + RESUME_SUFFIX)).exists()
    with open_run(path) as run:  # the resumed file is live, and readable as such
        assert not run.closed and run.n_steps == 2 * k, ctx
    with w:
        for i in range(2 * k, 2 * k + 25):
            rec = child.record(i)
            w.log_step(rec["step"], rec["gram"], rec["tokens"], policy=rec["policy"],
                       group_gram=rec["group_gram"], scalars=rec["scalars"])
            if child.metrics_of(i):
                w.log_metrics(rec["step"], child.metrics_of(i))
    new = _snapshot(path)
    kept = old["step"] < k
    assert kept.sum() == 2 * k and not kept[2 * k:].any(), ctx
    for name in ("step", "opt_step", "policy", "time", "gram", "tokens", "scalars", "group_gram"):
        assert _same(new[name][: 2 * k], old[name][kept]), f"{name}: {ctx}"
    for t in ("/evals", "/metrics"):
        rows = old[t][old[t]["step"] < k]
        assert _same(new[t][: len(rows)], rows), f"{t}: {ctx}"
        assert (new[t]["step"][len(rows):] >= k).all(), f"{t}: {ctx}"
    events = old["/events"][old["/events"]["step"] < k]
    assert _same(new["/events"][: len(events)], events), ctx
    resume_event = new["/events"][len(events)]
    assert resume_event["kind"] == b"resume" and resume_event["step"] == k, ctx
    assert f"kept {2 * k} records, dropped {n - 2 * k}".encode() in resume_event["message"], ctx
    assert np.array_equal(new["opt_step"], np.arange(2 * k + 25)), ctx  # continuous
    assert (np.diff(new["time"]) >= 0).all() and resume_event["time"] >= old["time"][2 * k - 1], ctx
    with open_run(path) as run:
        assert run.closed and run.n_steps == 2 * k + 25, ctx
        assert_records_match(run)
        assert_tables_match(run)
    out = _info(path)
    assert "closed cleanly" in out and f"{2 * k + 25} complete" in out and "update_norm/voter_lora" in out
    assert "resume at step" in out, out


def test_resume_killed_twice_then_finish(tmp_path: Path) -> None:
    """Kill, resume in a new process, kill that one, resume again, finish: the final file holds
    exactly what one uninterrupted run would have written, plus the two "resume" events."""
    seed = random.randrange(2**31)
    rnd = random.Random(seed)
    path, F, N = tmp_path / "run.h5", 10, 400
    log1 = _run_and_kill(path, N, F, 10 * F, rnd.uniform(0.0, 0.05))
    with open_run(path) as run:
        n1 = run.n_steps
    k1 = rnd.randint(1, (n1 - F) // 2)
    log2 = _run_and_kill(path, N, F, 2 * k1 + 5 * F, rnd.uniform(0.0, 0.05), resume_below=k1)
    with open_run(path) as run:
        n2 = run.n_steps
        assert_records_match(run)
        assert_tables_match(run)
    k2 = rnd.randint(k1 + 1, (n2 - F) // 2)
    ctx = f"seed {seed}, killed at {n1} and {n2}, resumed below {k1} and {k2}; {log1[-1:]}, {log2[-1:]}"
    proc = _start(path, N, F, 0.0, resume_below=k2)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0 and "done" in out, f"{ctx}\n{err}"

    with open_run(path) as run:
        assert run.closed and run.n_steps == N, ctx
        assert_records_match(run)  # opt_step == record index: continuous across both resumes
        assert_tables_match(run, complete=True)
        assert (np.diff(run.time) >= 0).all(), ctx
        events = run.events
        resumes = events[events["kind"] == "resume"]
        assert list(resumes["step"]) == [k1, k2], ctx
        assert f"kept {2 * k2} records" in resumes["message"].iloc[1], ctx
    text = _info(path)
    assert "closed cleanly" in text and f"{N} complete" in text, text
    assert f"0 .. {(N - 1) // 2}" in text and f"optimizer steps 0 .. {N - 1}" in text, text
