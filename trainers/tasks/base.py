"""Task records, task sets and the seeded train / held-out split.

A :class:`Task` is one verifiable problem: the text shown to the agents (``prompt``), the reference
(``answer``) and whatever the checker needs (``meta``: difficulty, fixed answer width, entry point,
unit tests, ...). Tasks are plain data; nothing here executes code.
"""
from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass, field
from typing import Any, Sequence

from gradscope.errors import ConfigError, TaskFileError

__all__ = ["Task", "TaskSet", "TaskError", "TaskFileError", "split", "rng_for", "same_tasks"]

KINDS = ("math", "code")


class TaskError(ConfigError, ValueError):
    """A task request that cannot be met (unknown task, more tasks than the source holds, ...)."""


@dataclass(frozen=True)
class Task:
    """One verifiable problem.

    ``kind`` is ``"math"`` or ``"code"``. For math, ``answer`` is the normalised reference answer
    (zero-padded when ``meta["width"]`` is set); for code it is the canonical completion (or ``""``).
    """

    id: str
    kind: str
    prompt: str
    answer: str
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"Task.kind must be one of {KINDS}, got {self.kind!r}")

    def __hash__(self) -> int:  # meta is a dict: hash the identifying fields only
        return hash((self.id, self.kind, self.prompt, self.answer))


@dataclass
class TaskSet:
    """A named pair of task lists: ``train`` for rollouts, ``held_out`` for evaluation."""

    name: str
    train: list[Task]
    held_out: list[Task]

    def __len__(self) -> int:
        return len(self.train) + len(self.held_out)

    def fingerprint(self) -> str:
        """``"NAME TRAIN+HELD_OUT v1:DIGEST"``: the name, the sizes and the first 16 hex digits of the
        sha256 of both lists (every task's id, kind, prompt, answer and meta but the task file's path, in
        order), after the scheme tag :data:`FINGERPRINT_SCHEME`. Equal fingerprints: the same tasks in
        the same order; a run file keeps it (``versions["tasks"]``) so that a resume or a sweep can tell
        when the same settings now give other tasks (a changed generator or split, an edited task
        file): :func:`same_tasks`."""
        doc = [[[t.id, t.kind, t.prompt, t.answer, {k: v for k, v in t.meta.items() if k != "file"}]
                for t in part] for part in (self.train, self.held_out)]
        # no default=: a meta value JSON cannot hold fails here rather than hash by its repr (an address)
        digest = hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:16]
        return f"{self.name} {len(self.train)}+{len(self.held_out)} {FINGERPRINT_SCHEME}:{digest}"


#: What :meth:`TaskSet.fingerprint` hashes, by version: a fingerprint of another scheme says nothing.
FINGERPRINT_SCHEME = "v1"


def same_tasks(stored: str | None, now: str) -> bool | None:
    """Whether a recorded fingerprint ``stored`` names the same tasks as ``now`` (both
    :meth:`TaskSet.fingerprint`); None when it cannot tell: nothing recorded, or another scheme."""
    def scheme(fingerprint: str) -> str:
        return fingerprint.rpartition(" ")[2].partition(":")[0]

    if stored is None or scheme(stored) != scheme(now):
        return None
    return stored == now


def rng_for(seed: int, *salt: object) -> random.Random:
    """A ``random.Random`` fixed by ``seed`` and ``salt``.

    Seeded from a string, which Python hashes with SHA-512 (not ``hash()``), so the stream does not
    depend on ``PYTHONHASHSEED``; the salt keeps different generators on one seed independent.
    """
    return random.Random(":".join([str(int(seed)), *map(str, salt)]))


def split(
    tasks: Sequence[Task],
    held_out_fraction: float | None = None,
    *,
    n_held_out: int | None = None,
    n_train: int | None = None,
    seed: int = 0,
    name: str = "tasks",
) -> TaskSet:
    """Split ``tasks`` into train and held-out parts, fixed by ``seed``.

    Give exactly one of ``held_out_fraction`` (rounded to the nearest count) or ``n_held_out``.
    ``n_train`` caps the train part (default: every task not held out). Both parts keep the input
    order; the same seed and input give the same split in every process.
    """
    tasks = list(tasks)
    if (held_out_fraction is None) == (n_held_out is None):
        raise TaskError("split: give exactly one of held_out_fraction and n_held_out")
    if held_out_fraction is not None:
        if not 0.0 <= held_out_fraction <= 1.0:
            raise TaskError(f"split: held_out_fraction must be in [0, 1], got {held_out_fraction}")
        n_held_out = int(round(held_out_fraction * len(tasks)))
    assert n_held_out is not None
    if n_held_out < 0 or n_held_out > len(tasks):
        raise TaskError(f"split: n_held_out={n_held_out} but only {len(tasks)} tasks")
    rest = len(tasks) - n_held_out
    if n_train is None:
        n_train = rest
    if n_train < 0 or n_train > rest:
        raise TaskError(
            f"split: asked for {n_train} train + {n_held_out} held-out tasks, only {len(tasks)} available")
    order = list(range(len(tasks)))
    rng_for(seed, "split").shuffle(order)
    held = set(order[:n_held_out])
    train = set(order[n_held_out:n_held_out + n_train])
    return TaskSet(name=name,
                   train=[t for i, t in enumerate(tasks) if i in train],
                   held_out=[t for i, t in enumerate(tasks) if i in held])


def unique_draws(rng: random.Random, n: int, draw) -> list:
    """Call ``draw(rng) -> (key, item)`` until ``n`` items with distinct keys are collected.

    When the space is exhausted — ``10 * (distinct keys so far) + 1000`` draws in a row bring no new
    key, which for a uniform draw over a finite space leaves it incomplete with negligible
    probability — the rest is filled with further draws, duplicates allowed, so ``n`` items always
    come back (the distinct ones first).
    """
    seen: set = set()
    out: list = []
    misses = 0
    while len(out) < n and misses <= 10 * len(seen) + 1000:
        key, item = draw(rng)
        if key in seen:
            misses += 1
            continue
        misses = 0
        seen.add(key)
        out.append(item)
    while len(out) < n:
        out.append(draw(rng)[1])
    return out
