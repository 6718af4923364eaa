"""Reading a solver's answer and scoring a workflow's final answer against the task.

Math answers are checked with ``check_answer`` (exact arithmetic for generated tasks, math-verify
equivalence for GSM8K / MATH files); code answers pass only if the program
passes the task's tests inside the sandbox — never in-process. Code verdicts are cached per
(task, answer): GRPO groups produce many identical programs. A wall-clock time-out is not cached: it
depends on how busy the machine was, and a correct program would otherwise score 0 for the rest of
the run.
"""
from __future__ import annotations

import re
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from gradscope.trainers.sandbox import Limits, check_program
from gradscope.trainers.tasks import check_answer, extract_answer, sandbox_args
from gradscope.trainers.tasks.base import Task
from gradscope.trainers.workflows.base import Episode
from gradscope.trainers.workflows.templates import without_thinking


def solver_answer(task: Task, text: str) -> tuple[str | None, bool]:
    """The answer a solver's output states, and whether the output had the expected format.

    A code answer is the output without its trailing whitespace and leading blank lines: the indentation
    of its first line is kept, since a HumanEval completion is the function's body, indented to follow
    the prompt (stripped, ``prompt + completion`` does not compile). ``<think>…</think>`` blocks are no
    answer (a boxed guess while thinking is not the stated one)."""
    text = without_thinking(text)
    if task.kind == "math":
        answer = extract_answer(text)
        return answer, answer is not None
    body = _LEADING_BLANK_LINES.sub("", text.rstrip())
    return (body or None), bool(body)

_LEADING_BLANK_LINES = re.compile(r"\A(?:[ \t]*\n)+")


class Scorer:
    """Sets ``episode.reward`` to 1.0 for a correct final answer, else 0.0."""

    def __init__(self, limits: Limits = Limits(wall_s=5.0, cpu_s=5.0), workers: int = 2, *,
                 unsafe: bool = False) -> None:
        self.limits = limits
        self.workers = workers
        self.unsafe = unsafe  # run even where the sandbox lacks a layer (--unsafe-sandbox)
        self._code_cache: dict[tuple[str, str], bool] = {}

    def score(self, episodes: Sequence[Episode]) -> None:
        code = {(ep.task.id, ep.answer): ep.task for ep in episodes
                if ep.task.kind == "code" and ep.answer is not None}
        todo = [key for key in code if key not in self._code_cache]
        with ThreadPoolExecutor(self.workers) as pool:  # each check is a sandboxed subprocess
            verdicts = pool.map(lambda key: check_program(*sandbox_args(code[key], key[1]), limits=self.limits,
                                                          unsafe=self.unsafe), todo)
            verdict = {}
            for key, result in zip(todo, verdicts):
                verdict[key] = result.verdict == "pass"
                if not result.wall_timeout:
                    self._code_cache[key] = verdict[key]
        for ep in episodes:
            if ep.answer is None:
                ep.reward = 0.0
            elif ep.task.kind == "math":
                ep.reward = float(check_answer(ep.task, ep.answer))
            else:
                key = (ep.task.id, ep.answer)
                ep.reward = float(self._code_cache[key] if key in self._code_cache else verdict[key])
