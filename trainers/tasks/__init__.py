"""Tasks for the training stack: math (generated or from JSONL files) and code (toy or HumanEval).

``load_tasks("math", n_train=64, n_held_out=64, seed=0, level=1)`` is the entry point the trainer
uses; see ``docs/tasks.md`` for the formats, levels and the answer extractor's rules.
"""
from __future__ import annotations

from pathlib import Path

from .base import Task, TaskError, TaskFileError, TaskSet, split
from .code import (build_program, generate_toy_code, load_humaneval, sandbox_args, toy_body,
                   toy_program)
from .math import (answers_equivalent, answers_match, check_answer, extract_answer, generate_math, is_correct,
                   load_math_jsonl, normalise_answer)

__all__ = [
    "Task", "TaskSet", "TaskError", "TaskFileError", "split", "load_tasks", "TASK_NAMES",
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


def _generated(generate, name: str, n_train, n_held_out: int, seed: int, level: int) -> TaskSet:
    if n_train is None:
        raise TaskError(f"{name}: n_train is required for generated tasks")
    pool = generate(n_train + n_held_out, level=level, seed=seed)
    return split(pool, n_held_out=n_held_out, seed=seed, name=f"{name}:L{level}")
