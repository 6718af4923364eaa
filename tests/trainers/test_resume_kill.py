"""SIGKILL at any moment, ``--resume``, again and again: the finished run file equals an uninterrupted
run's, record for record.

Each attempt is a forked child of the test process (torch and the warm start already loaded, so an
attempt costs its training steps, not a new interpreter) that trains until it is killed with SIGKILL:
by itself at a chosen point (right after a checkpoint, between the rows' flush and the checkpoint,
inside the checkpoint's swap, before ``state.pt`` is in place, inside ``RunWriter.resume``, and at
seeded random calls of the training loop's busiest functions), or by the test after a seeded delay.
The next attempt resumes; the last one runs to the end.
"""
from __future__ import annotations

import os
import random
import signal
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import pytest

from gradscope.runfile import RunWriter
from gradscope.runfile.writer import RESUME_SUFFIX
from gradscope.trainers import checkpoint
from gradscope.trainers import train as train_mod
from gradscope.trainers.checkpoint import find_checkpoint
from gradscope.trainers.config import TrainConfig
from gradscope.trainers.grpo import GRPOConfig, GRPOUpdater
from gradscope.trainers.train import Trainer

from .test_resume import assert_same_run

SEED = 2605


def config(out: Path, **kw) -> TrainConfig:
    """Six steps of the smallest batches, an evaluation every 3 and a checkpoint every 2 steps (so
    an evaluation falls between checkpoints), default alert rules on (their state is caught up)."""
    return TrainConfig(**{**dict(workflow="voting", task="math", steps=6, tasks_per_step=2, n_held_out=4, n_train=40,
                                 max_new_tokens=8, eval_every=3, checkpoint_every=2, out=str(out),
                                 grpo=GRPOConfig(group_size=2)), **kw})


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _kill_at(owner: object, name: str, *, after: bool, n: int = 1,
             when: Callable[..., bool] = lambda *a, **k: True) -> None:
    """Replace ``owner.name`` so that its ``n``-th call matching ``when`` kills the process, before
    the original runs or right after it returned."""
    original, calls = getattr(owner, name), [0]

    def wrapper(*args, **kwargs):
        hit = when(*args, **kwargs)
        calls[0] += hit
        if hit and calls[0] == n and not after:
            _die()
        result = original(*args, **kwargs)
        if hit and calls[0] == n and after:
            _die()
        return result

    setattr(owner, name, wrapper)


def _named(path: str) -> Callable[..., bool]:
    return lambda src, dst, *a, **k: Path(dst).name == path


#: Kill points by name: each is reached in any attempt that saves a checkpoint or resumes.
POINTS: dict[str, Callable[[Path], None]] = {
    # the run file's rows are flushed, the checkpoint not yet written
    "flushed, before the checkpoint": lambda out: _kill_at(checkpoint, "_write", after=False),
    "right after a checkpoint": lambda out: _kill_at(
        train_mod, "save_checkpoint", after=True, when=lambda *a, **k: k.get("name", "latest") == "latest"),
    # latest/ renamed to old/, tmp/ not yet renamed to latest/
    "inside the swap": lambda out: _kill_at(os, "rename", after=True, when=_named("old")),
    "before state.pt is in place": lambda out: _kill_at(os, "replace", after=False, when=_named("state.pt")),
    # the new run file is written beside the old one, not yet renamed over it
    "inside RunWriter.resume": lambda out: _kill_at(os, "replace", after=False, when=_named(out.name)),
}
#: Where seeded random kills land: the n-th call (n drawn from the range) of one of these, before or
#: after it. os.fsync: inside RunWriter.resume or a checkpoint's write.
BUSY = [(RunWriter, "_commit", 3), (RunWriter, "log_metrics", 3), (GRPOUpdater, "update", 3),
        (Trainer, "evaluate", 2), (os, "fsync", 12)]


def _attempt(cfg: TrainConfig, arm: Callable[[], None] | None, delay: float | None) -> str:
    """Train in a forked child; returns "killed" or "finished"."""
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 1
        try:
            if arm is not None:
                arm()
            Trainer(cfg).run()
            code = 0
        except BaseException:  # noqa: BLE001
            traceback.print_exc()
        finally:
            sys.stderr.flush()
            os._exit(code)
    deadline = None if delay is None else time.monotonic() + delay
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if deadline is not None and time.monotonic() >= deadline:
            os.kill(pid, signal.SIGKILL)
            _, status = os.waitpid(pid, 0)
            break
        time.sleep(0.01)
    if os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL:
        return "killed"
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, f"attempt failed with status {status}"
    return "finished"


@pytest.mark.slow
def test_kill_anywhere_and_resume_equals_an_uninterrupted_run(tmp_path):
    reference = config(tmp_path / "reference.h5")
    t0 = time.monotonic()
    Trainer(reference).run()
    duration = time.monotonic() - t0
    out = tmp_path / "killed.h5"
    folder = Path(str(out) + ".ckpt")
    rng = random.Random(SEED)
    # First the named points (each advances the run by at most one checkpoint, so all are reached),
    # the base evaluation's checkpoint never made first; then seeded delays (a fraction of an
    # uninterrupted run: most land before the end); then seeded random calls.
    first = "flushed, before the checkpoint"
    named = sorted(set(POINTS) - {first})
    rng.shuffle(named)
    plan: list[tuple[str, Callable[[], None] | None, float | None]] = [
        (name, (lambda name=name: POINTS[name](out)), None) for name in [first, *named]]
    plan += [(f"after {d:.2f} s", None, d) for d in (rng.uniform(0.1, 0.6) * duration for _ in range(2))]
    for _ in range(3):
        owner, name, most = rng.choice(BUSY)
        n, after = rng.randint(1, most), rng.random() < 0.5
        plan.append((f"call {n} of {name} ({'after' if after else 'before'})",
                     lambda owner=owner, name=name, n=n, after=after: _kill_at(owner, name, after=after, n=n), None))

    outcomes: list[tuple[str, str]] = []
    for i, (label, arm, delay) in enumerate(plan):
        outcomes.append((label, _attempt(config(out, resume=i > 0), arm, delay)))
        if label in POINTS:  # every named point is reached: the test covers what it says
            assert outcomes[-1][1] == "killed", outcomes
        if label == "inside the swap":  # the only complete checkpoint is in old/; resume must find it
            assert not (folder / "latest").exists() and find_checkpoint(folder).path.name == "old"
        if label == "inside RunWriter.resume":
            assert Path(str(out) + RESUME_SUFFIX).exists()
    assert _attempt(config(out, resume=True), None, None) == "finished"
    print(outcomes)  # shown with -s: which kills landed
    assert_same_run(reference.out, out)
