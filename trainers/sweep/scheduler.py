"""Runs a sweep's cells, each as its own ``gradscope train`` process, at most ``jobs`` at a time.

Every child gets one torch thread unless the sweep sets ``threads`` (``OMP_NUM_THREADS`` and
``MKL_NUM_THREADS`` follow it), writes ``runs/<cell>.h5`` and logs to ``logs/<cell>.log``. Finished
runs are skipped, killed ones resumed from their checkpoint (:mod:`.runs`). The folder is locked
while a sweep runs in it. Ctrl-C or SIGTERM interrupts every child (each closes its run file),
waits for them and re-raises; on Linux a child also ends if the sweep process is killed outright.
"""
from __future__ import annotations

import ctypes
import dataclasses
import fcntl
import json
import os
import shlex
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from gradscope.errors import ConfigError, GradscopeWarning
from gradscope.paths import kind_of
from gradscope.trainers.sweep.config import SweepError
from gradscope.trainers.sweep.grid import Cell, cell_config, train_parser
from gradscope.trainers.sweep.progress import Progress
from gradscope.runfile.progress import run_progress
from gradscope.trainers.sweep.runs import DONE, RESUME, check_same_config, check_same_tasks, run_state

if TYPE_CHECKING:
    from gradscope.trainers.config import TrainConfig

MANIFEST = "cells.json"
#: ``gradscope`` in a child interpreter, whatever the working directory holds (``-m`` would put the
#: folder first on sys.path, where a checkout's ``gradscope/`` folder would shadow the installed package).
CHILD = [sys.executable, "-c", "import sys; del sys.path[0]; from gradscope.cli import main; sys.exit(main())"]


@dataclass
class Outcome:
    done: list[str] = field(default_factory=list)       # cells finished (now or before)
    skipped: list[str] = field(default_factory=list)    # ... of them, finished before this invocation
    failed: dict[str, str] = field(default_factory=dict)  # cell → log file


@dataclass
class _Job:
    cell: Cell
    steps: int
    proc: subprocess.Popen
    log: object
    done_steps: int = 0


def write_manifest(folder: Path, cells: list[Cell], config: Path) -> None:
    """``cells.json``: the sweep's cells (name, run file relative to the folder, axis values), which
    ``gradscope table`` and ``gradscope plot`` read to know exactly which runs a folder holds."""
    doc = {"config": str(config), "cells": [
        {"name": c.name, "run": str(c.run_path(Path("."))), "axes": c.axes} for c in cells]}
    (folder / MANIFEST).write_text(json.dumps(doc, indent=1) + "\n")


#: What a sweep writes in its folder: files (replaced or appended to) and folders.
FILES = (".sweep.lock", MANIFEST, "sweep.yaml", "summary.csv", "table.md")
FOLDERS = ("runs", "logs", "figures")


def check_folder(folder: Path, cells: list[Cell], files: Sequence[str] = FILES,
                 folders: Sequence[str] = FOLDERS) -> None:
    """ConfigError (one line, nothing written) unless ``folder`` is absent or a folder whose entries a
    sweep writes are absent or of their kind: ``folders`` folders, ``files`` and every cell's
    ``logs/<cell>.log`` regular files (a FIFO would block the sweep, a folder crash it)."""
    def kind(path: Path) -> str | None:
        try:
            return kind_of(os.stat(path).st_mode) or "a file"
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise ConfigError(f"--out {folder}: cannot check {path.relative_to(folder)} ({exc.strerror or exc})") \
                from None

    got = kind(folder)
    if got not in (None, "a directory"):
        raise ConfigError(f"--out {folder}: is {got}, not a folder")
    if got is None:
        return
    wanted = [(folder / name, "a directory") for name in folders]  # first: logs/ before the logs in it
    wanted += [(folder / name, "a file") for name in files]
    wanted += [(folder / "logs" / f"{c.name}.log", "a file") for c in cells]
    for path, want in wanted:
        got = kind(path)
        if got not in (None, want):
            raise ConfigError(f"--out {folder}: {path.relative_to(folder)} is {got}, not {want}; move it away")


def make_folder(folder: Path) -> None:
    """Create ``folder`` (and its parents) if absent; ConfigError, one line, when it cannot be."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"--out {folder}: cannot create ({exc.strerror or exc})") from None


@contextmanager
def folder_lock(folder: Path) -> Iterator[None]:
    with open(folder / ".sweep.lock", "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise SweepError(f"{folder}: another sweep is running in this folder") from None
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def plan(cells: list[Cell], folder: Path) -> list[tuple[Cell, int, str, int]]:
    """(cell, steps, state, steps already done) of every cell; ConfigError if a run file in the
    folder was trained with other settings than its cell's, or (one to be kept: finished or resumed)
    on other tasks than they give now. One GradscopeWarning for kept run files whose tasks cannot be
    checked (written before run files recorded them)."""
    parser = train_parser()
    out, unchecked = [], 0
    fingerprints: dict[tuple, str] = {}  # cells differing only in workflow, policy, lr, ... share their tasks
    for cell in cells:
        path = cell.run_path(folder)
        cfg = cell_config(cell, parser, path)
        st = run_state(path, cfg.steps)
        if st.config is not None:
            wanted = json.loads(json.dumps(dataclasses.asdict(cfg.resolved())))
            check_same_config(path, st.config, wanted, _defaults())
        if st.state in (DONE, RESUME):
            key = (cfg.task, cfg.task_file, cfg.task_level, cfg.n_train, cfg.n_held_out, cfg.seed)
            if key not in fingerprints:
                fingerprints[key] = _fingerprint(cfg)
            unchecked += not check_same_tasks(path, st.tasks, fingerprints[key])
        out.append((cell, cfg.steps, st.state, st.steps_done))
    if unchecked:
        warnings.warn(f"{folder}: {unchecked} run file(s) to keep do not record their tasks (written before run files "
                      "did): not checked against the tasks their settings give now", GradscopeWarning, stacklevel=2)
    return out


def _fingerprint(cfg: TrainConfig) -> str:
    """The fingerprint of the tasks a cell's config gives (:meth:`TaskSet.fingerprint`)."""
    from gradscope.trainers.tasks import tasks_for

    with warnings.catch_warnings():  # the trainer warns about a repeating level, once per run
        warnings.simplefilter("ignore", GradscopeWarning)
        return tasks_for(cfg).fingerprint()


def _defaults() -> dict:
    """The trainer's default settings, as a run file stores its config."""
    from gradscope.trainers.config import TrainConfig

    return json.loads(json.dumps(dataclasses.asdict(TrainConfig())))


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the sweep process dies (Linux prctl PR_SET_PDEATHSIG)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)
    except OSError:
        pass


def _start(cell: Cell, folder: Path, state: str) -> tuple[subprocess.Popen, object]:
    run = cell.run_path(folder)
    argv = [*cell.argv, "--out", str(run), "--resume" if state == RESUME else "--overwrite"]
    threads = "1"
    if "--threads" in cell.argv:
        threads = cell.argv[cell.argv.index("--threads") + 1]
    else:
        argv += ["--threads", "1"]
    env = {**os.environ, "TQDM_MININTERVAL": "30"}
    if threads != "0":
        env.update(OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads)
    log = open(folder / "logs" / f"{cell.name}.log", "a")
    log.write(("\n" if log.tell() else "") + f"$ {shlex.join(['gradscope', 'train', *argv])}\n")  # after a killed run's last line
    log.flush()
    proc = subprocess.Popen([*CHILD, "train", *argv], stdout=log,
                            stderr=subprocess.STDOUT, env=env, start_new_session=True,
                            preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None)
    return proc, log


def run_cells(planned: list[tuple[Cell, int, str, int]], folder: Path, jobs: int, poll: float = 5.0) -> Outcome:
    """Run every unfinished cell of :func:`plan`'s list; returns what finished and what failed."""
    (folder / "runs").mkdir(parents=True, exist_ok=True)
    (folder / "logs").mkdir(exist_ok=True)
    cells = [p[0] for p in planned]
    outcome = Outcome()
    pending = []
    for cell, steps, state, done in planned:
        if state == DONE:
            outcome.done.append(cell.name)
            outcome.skipped.append(cell.name)
        else:
            pending.append((cell, steps, state, done))
    progress = Progress(len(cells), sum(p[1] for p in planned),
                        sum(p[1] if p[2] == DONE else p[3] for p in planned), len(outcome.done))
    if outcome.skipped:
        progress.event(f"sweep: {len(outcome.skipped)} of {len(cells)} runs already finished, skipped")
    running: list[_Job] = []
    base_steps = sum(p[1] for p in planned if p[2] == DONE)
    finished_steps = 0
    try:
        while pending or running:
            while pending and len(running) < jobs:
                cell, steps, state, done = pending.pop(0)
                proc, log = _start(cell, folder, state)
                running.append(_Job(cell, steps, proc, log, done))
                progress.event(f"sweep: {'resuming' if state == RESUME else 'started'} {cell.name}"
                               + (f" at step {done}" if state == RESUME else ""))
            time.sleep(poll)
            for job in list(running):
                job.done_steps = max(job.done_steps, run_progress(job.cell.run_path(folder)).last_step)
                if job.proc.poll() is None:
                    continue
                running.remove(job)
                job.log.close()
                if job.proc.returncode == 0 and run_state(job.cell.run_path(folder), job.steps).state == DONE:
                    outcome.done.append(job.cell.name)
                    finished_steps += job.steps
                    progress.event(f"sweep: finished {job.cell.name}")
                else:
                    log = folder / "logs" / f"{job.cell.name}.log"
                    outcome.failed[job.cell.name] = str(log)
                    finished_steps += job.done_steps
                    progress.event(f"sweep: FAILED {job.cell.name} (exit {job.proc.returncode}; see {log})")
            progress.counts(len(outcome.done), len(running), len(outcome.failed))
            progress.steps(base_steps + finished_steps + sum(j.done_steps for j in running)
                           + sum(p[3] for p in pending))
    except BaseException:
        _interrupt(running)
        raise
    finally:
        progress.close()
    return outcome


def _interrupt(running: list[_Job], grace: float = 30.0) -> None:
    """SIGINT every child (the trainer closes its run file on it), wait ``grace`` s, then kill."""
    for job in running:
        if job.proc.poll() is None:
            job.proc.send_signal(signal.SIGINT)
    deadline = time.monotonic() + grace
    for job in running:
        try:
            job.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            job.proc.kill()
            job.proc.wait()
        job.log.close()
