"""The role parsers (trainers/workflows/templates.py): what a pick, a verdict and a plan are."""
from __future__ import annotations

import pytest

from gradscope.trainers.workflows.templates import parse_pick, parse_plan, parse_verdict


@pytest.mark.parametrize("text, expected", [
    ("Correct", (True, True)), ("Incorrect.", (False, True)), ("**Correct**", (True, True)),
    ("  incorrect: the sign is wrong", (False, True)),
    # a first word that only starts with a verdict is none (they read as 'Correct')
    ("correctness is doubtful; wrong", (None, False)), ("Correctly computed but wrong sign: Incorrect", (None, False)),
    ("Not correct", (None, False)), ("", (None, False)),
    ("<think>Is it correct? No.</think>Incorrect", (False, True)), ("<think>Correct, I think", (None, False)),
    ("Correct? Let me check.</think>Incorrect", (False, True)),  # the <think> was in the prompt
])
def test_verdict_is_the_first_whole_word(text, expected):
    assert parse_verdict(text) == expected


@pytest.mark.parametrize("text, expected", [
    ("Pick: 2", (1, True)), ("3", (2, True)), ("12", (0, True)), ("0", (None, False)), ("7", (None, False)),
    ("none", (None, False)), ("<think>compare 1 and 3</think> 3", (2, True)),
])
def test_pick_is_the_first_digit_outside_thinking(text, expected):
    assert parse_pick(text, 3) == expected


def test_plan_is_read_outside_thinking():
    assert parse_plan("<think>a | b | c | d</think>guess | check") == (["guess", "check"], True)
    assert parse_plan("a\nb|c|d") == (["a", "b", "c"], False)
