"""Tasks for the training stack: math (generated or from JSONL files) and code (toy or HumanEval).

``load_tasks("math", n_train=64, n_held_out=64, seed=0, level=1)`` is the entry point the trainer
uses; see ``docs/tasks.md`` for the formats, levels and the answer extractor's rules.
"""
from __future__ import annotations

import functools
import itertools
import warnings
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from gradscope.errors import GradscopeWarning

from .base import Task, TaskError, TaskFileError, TaskSet, split
from .code import (build_program, generate_toy_code, load_humaneval, sandbox_args, toy_body,
                   toy_program)
from .math import (answers_equivalent, answers_match, check_answer, extract_answer, generate_math, is_correct,
                   load_math_jsonl, normalise_answer)

if TYPE_CHECKING:
    from gradscope.trainers.config import TrainConfig

__all__ = [
    "Task", "TaskSet", "TaskError", "TaskFileError", "split", "load_tasks", "tasks_for", "TASK_NAMES",
    "generate_math", "load_math_jsonl", "extract_answer", "normalise_answer", "answers_match",
    "answers_equivalent", "check_answer", "is_correct", "load_humaneval", "generate_toy_code", "toy_body",
    "toy_program", "build_program", "sandbox_args",
]

#: Accepted ``task`` names; ``"code"`` means the toy family unless ``source="humaneval"``.
TASK_NAMES = ("math", "code", "code:toy", "code:humaneval", "humaneval")


def load_tasks(
    task: str,
    *,
    n_train: int | None,
    n_held_out: int,
    seed: int = 0,
    level: int = 1,
    path: str | Path | None = None,
    source: str | None = None,
) -> TaskSet:
    """A train / held-out :class:`TaskSet` fixed by ``seed``.

    * ``"math"``: ``n_train + n_held_out`` generated problems of ``level``, or, with ``path``, the
      tasks of a GSM8K/MATH JSONL file, of which ``n_held_out`` are held out and ``n_train``
      (``None``: all the rest) are used for training.
    * ``"code"`` / ``"code:toy"``: generated toy synthesis tasks of ``level``.
    * ``"code:humaneval"`` / ``"humaneval"`` (or ``"code"`` with ``source="humaneval"``): the 164
      HumanEval problems (``path``: another HumanEval-format file), split like a math file.

    For generated tasks ``n_train=None`` is an error (the space is open-ended).
    """
    kind, _, sub = task.partition(":")
    if kind == "humaneval" and not sub:
        kind, sub = "code", "humaneval"
    if source is not None:
        if sub and sub != source:
            raise TaskError(f"task {task!r} conflicts with source={source!r}")
        sub = source
    if n_held_out is None or n_held_out < 0 or (n_train is not None and n_train < 0):
        raise TaskError(f"n_train and n_held_out must be >= 0 (got {n_train}, {n_held_out})")

    if kind == "math" and sub in ("", "gen", "generated", "file", "jsonl"):
        if path is not None:
            pool = load_math_jsonl(path)
            return split(pool, n_held_out=n_held_out, n_train=n_train, seed=seed,
                         name=f"math:{Path(path).name}")
        if sub in ("file", "jsonl"):
            raise TaskError(f"task {task!r} needs a path")
        return _generated(generate_math, "math", n_train, n_held_out, seed, level)
    if kind == "code" and sub in ("", "toy"):
        if path is not None:
            raise TaskError("the toy code task is generated; it takes no path")
        return _generated(generate_toy_code, "code:toy", n_train, n_held_out, seed, level)
    if kind == "code" and sub == "humaneval":
        pool = load_humaneval(path)
        return split(pool, n_held_out=n_held_out, n_train=n_train, seed=seed, name="code:humaneval")
    raise TaskError(f"unknown task {task!r}{f' (source {source!r})' if source else ''}; "
                    f"choose from {', '.join(TASK_NAMES)}")


def tasks_for(cfg: TrainConfig) -> TaskSet:
    """The tasks a training config trains and evaluates on (its ``task``, ``task_file``, ``task_level``,
    ``n_train``, ``n_held_out`` and ``seed``): a task file or HumanEval trains on every task not held
    out, whatever ``n_train`` says."""
    n_train = None if cfg.task_file or cfg.task.endswith("humaneval") else cfg.n_train
    return load_tasks(cfg.task, n_train=n_train, n_held_out=cfg.n_held_out, seed=cfg.seed,
                      level=cfg.task_level, path=cfg.task_file)


@functools.lru_cache(maxsize=16)
def _pool(generate, n: int, level: int, seed: int) -> tuple[Task, ...]:
    """``generate``'s n tasks (pure in its arguments; Tasks are frozen): generated once per process, not once
    per cell when a sweep validates 100s of cells on the same tasks (432 cells: 33 s → 2 s)."""
    return tuple(generate(n, level=level, seed=seed))


def _generated(generate, name: str, n_train, n_held_out: int, seed: int, level: int) -> TaskSet:
    if n_train is None:
        raise TaskError(f"{name}: n_train is required for generated tasks")
    pool = list(_pool(generate, n_train + n_held_out, level, seed))
    name = f"{name}:L{level}"
    firsts: dict[str, Task] = {}
    for t in pool:
        firsts.setdefault(t.prompt, t)
    if len(firsts) == len(pool):
        return split(pool, n_held_out=n_held_out, seed=seed, name=name)
    # the level's prompt space is exhausted and the pool repeats prompts: hold out distinct prompts
    # and train only on the others, so that no held-out prompt is ever trained on
    if len(firsts) <= n_held_out:
        raise TaskError(f"{name}: the level has {len(firsts)} distinct prompts, too few to hold out {n_held_out} "
                        "and train on others (lower --n-held-out, or choose another level)")
    parts = split(list(firsts.values()), n_held_out=n_held_out, seed=seed, name=name)
    held = {t.prompt for t in parts.held_out}
    train = [t for t in pool if t.prompt not in held]
    train += [replace(t, id=f"{t.id}#{i // len(train) + 1}") for i, t in
              zip(range(n_train - len(train)), itertools.cycle(train))]
    if n_held_out:
        warnings.warn(f"{name}: the level has {len(firsts)} distinct prompts: the {n_held_out} held-out tasks are "
                      f"distinct, the {n_train} training tasks repeat the other {len(parts.train)}", GradscopeWarning,
                      stacklevel=3)
    return TaskSet(name=name, train=train[:n_train], held_out=parts.held_out)
