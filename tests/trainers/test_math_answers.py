"""Math answer equivalence: HF math-verify for GSM8K / MATH tasks, exact arithmetic for generated ones.

Each "more complete" case is one the hand-written normaliser (``answers_match``) gets wrong, so a
pass here is math-verify's doing; the negatives must stay wrong under both.
"""
from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from gradscope.trainers.tasks import (answers_equivalent, answers_match, check_answer, generate_math, is_correct,
                                      load_math_jsonl)

# (prediction, reference): equal, and beyond answers_match
MORE_COMPLETE = [
    (r"\frac{\sqrt{3}}{2}", r"\frac{\sqrt3}{2}"),            # fractions
    (r"0.75", r"\frac{3}{4} \text{ of the cake}"),
    (r"2\sqrt{2}", r"\sqrt{8}"),
    (r"\pi/2", r"\frac{\pi}{2}"),
    (r"\boxed{\frac{\pi}{4}}", r"\pi/4"),                     # \boxed
    (r"\boxed{2\sqrt{2}}", r"\sqrt{8}"),
    ("5 cm", "5"),                                            # units
    (r"5\text{ cm}", "5"),
    (r"12 \mathrm{m}^2", "12"),
    ("50%", "50"),                                            # percentages
    (r"12.5\%", "12.5"), ("18.5 percent", "18.5"), (r"12.5\%", "0.125"),
    (r"50\%", "50"),
    (r"25\%", r"\frac{1}{4}"),
    ("1,234,567 dollars", "1234567"),                         # thousands separators, unit words after the number
    ("7 km/h", "7"), ("12 m/s", "12"), ("5 cm^2", "5"), ("3 m^3", "3"), (r"\frac{1}{2} m/s", r"\frac12"),
    (r"36\pi cm^2", r"36\pi"), ("2 pi", r"2\pi"),
    ("x=3", "3"),
    ("10^{3}", "1000"),
    ("3, 4", "4, 3"),
]
# equal under both (the exact path keeps them)
BOTH = [("042", "42"), ("1,234", "1234"), ("0.5", r"\frac{1}{2}"), (r"\boxed{\frac{1}{2}}", "1/2"), ("2.50", "2.5"),
        (r"\$1,234.50", "1234.5")]
# never equal
WRONG = [("0.33", r"\frac{1}{3}"), ("1,235", "1234"), (r"\frac{1}{3}", r"\frac{1}{2}"), ("51%", "50"), ("5 cm", "6"),
         (r"\sqrt{2}", r"\sqrt{3}"), ("x=4", "3"), ("", "3"), (None, "3"), ("3", None), (r"\boxed{2}", r"\boxed{3}"),
         # one number of an expression, read as plain text, paid a wrong answer (either side)
         ("72x", "72"), ("72^{5}", "72"), (r"72\sqrt{2}", "72"), ("72!", "72"), ("3", r"3\sqrt{2}"), ("10", "10^{3}"),
         ("2", "2x+3"), ("3", r"3\pi"), ("2", "2^{10}"),
         # two guesses in one answer paid whichever was right
         (r"71 \approx 72", "72"), (r"72 \text{ (or 71)}", "71"), ("72 xy 71", "71"), ("7 or eight", "7"), ("7 or 8", "8"),
         # words after a number that change it are no unit
         ("7 thousand", "7"), ("3 squared", "3"), ("12 minus three", "12"), ("5 is not right", "5"), ("2 dozen", "2"),
         ("72 x", "72"), ("Yes No", "Yes"),
         # math-verify's own unit list dropped the reference's variables; its 6-decimal rounding paid approximations
         ("4", "4ab"), ("2", "2m"), ("5", "5t"), ("x+5", "x+5t"), ("1.414214", r"\sqrt{2}"), ("3.141593", r"\pi"),
         ("1.333333", r"1\frac{1}{3}"), ("0.25", r"25\%"), (r"12.5\%", "12.6"), (r"12.5\%", "0.13")]
# right, with letters that are variables, not units (dropping them as units failed these)
WITH_VARIABLES = [("x^2 + y^2", "x^2+y^2"), ("a^2 - b^2", "a^2-b^2"), (r"\pi r^2", r"\pi r^2"), ("2 x^2", "2x^2"),
                  (r"\frac{1}{2} x^2", r"\frac{x^2}{2}"), (r"4 \pi r^2", r"4\pi r^2"), ("x^3 + 3 x^2", "x^3+3x^2")]


@pytest.mark.parametrize("pred, ref", MORE_COMPLETE)
def test_math_verify_is_more_complete(pred: str, ref: str) -> None:
    assert not answers_match(pred, ref), "the hand-written normaliser already gets this one"
    assert answers_equivalent(pred, ref)


@pytest.mark.parametrize("pred, ref", BOTH)
def test_plain_equalities_hold_under_both(pred: str, ref: str) -> None:
    assert answers_match(pred, ref) and answers_equivalent(pred, ref)


@pytest.mark.parametrize("pred, ref", WITH_VARIABLES)
def test_letters_of_an_expression_are_no_units(pred: str, ref: str) -> None:
    assert answers_equivalent(pred, ref)


@pytest.mark.parametrize("pred, ref", WRONG)
def test_wrong_answers_stay_wrong(pred, ref) -> None:
    assert not answers_match(pred, ref) and not answers_equivalent(pred, ref)


def test_generated_tasks_keep_the_exact_arithmetic_check() -> None:
    """The testbed's problems are scored exactly: an expression that evaluates to the answer, a unit
    or a percent sign is not the answer there (math-verify would accept ``4+38`` for 42)."""
    task = next(t for t in generate_math(50, level=1, seed=3) if t.meta["value"] > 20)
    value = task.meta["value"]
    assert check_answer(task, str(value)) and check_answer(task, task.answer)
    for wrong in (f"{value - 10}+10", f"{value} cm", f"{value}%", str(value + 1)):
        assert not check_answer(task, wrong), wrong
    assert answers_equivalent(f"{value - 10}+10", str(value))  # ... as it would on a file task


def file_tasks(path: Path, rows: list[dict]) -> list:
    """The tasks of a JSONL file of ``rows`` written at ``path``."""
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return load_math_jsonl(path)


def test_file_tasks_use_math_verify(tmp_path: Path) -> None:
    gsm, math, pct = file_tasks(tmp_path / "mixed.jsonl", [
        {"question": "How many?", "answer": "She has 1234 eggs.\n#### 1,234"},
        {"problem": "Evaluate.", "solution": r"So it is $\boxed{\frac{\sqrt3}{2}}$."},
        {"problem": "What percent?", "solution": r"The share is $\boxed{25}$."}])
    assert is_correct(gsm, "The total is $1,234.00.") and is_correct(gsm, "#### 1234")
    assert not is_correct(gsm, "The total is 1,243.")
    assert is_correct(math, r"Hence the value is $\boxed{\dfrac{\sqrt{3}}{2}}$.")
    assert not is_correct(math, r"Hence $\boxed{\frac{\sqrt{2}}{2}}$.")
    assert is_correct(pct, r"so the answer is $\boxed{25\%}$") and not check_answer(pct, "52%")


def test_other_threads_fall_back_to_the_exact_check() -> None:
    """math-verify's timeout needs SIGALRM (main thread only); elsewhere the exact check decides."""
    got: dict[str, bool] = {}

    def work() -> None:
        got["units"] = answers_equivalent(r"7\text{ cm}", "7")
        got["plain"] = answers_equivalent("1,000", "1000")

    t = threading.Thread(target=work)
    t.start()
    t.join(60)
    assert got == {"units": False, "plain": True}
    assert answers_equivalent(r"7\text{ cm}", "7")  # and in the main thread, math-verify


def test_numbers_are_compared_exactly():
    """docs/tasks.md: two numbers are compared exactly as rationals (a relative tolerance of 1e-9 let
    ``37.9999999999`` score for ``38`` and ``0.3333333333`` for ``1/3``)."""
    task = generate_math(1, 1, 0)[0]
    value = int(task.answer)
    for near in (f"{value - 1}.9999999999", f"{value}.00000000001"):
        assert not answers_match(near, task.answer) and not is_correct(task, f"the answer is {near}")
    assert not answers_match("0.3333333333", "1/3") and not answers_equivalent("0.3333333333", "1/3")
    assert answers_match(f"{2 * value}/2", task.answer) and answers_match("3.8e1", "38")


def test_a_huge_number_is_neither_a_hang_nor_a_crash():
    """``\\boxed{1e999999999}`` made Fraction expand 10**999999999 (hours, in the trainer's process) and an answer
    of more than 4300 digits made int() raise out of the scorer: such answers are compared as strings."""
    from gradscope.trainers.tasks.math import MAX_EXPONENT, parse_number

    assert parse_number(f"1e{MAX_EXPONENT + 1}") is None and parse_number(f"-2.5e-{MAX_EXPONENT + 1}") is None
    assert parse_number(f"1e{MAX_EXPONENT}") == 10 ** MAX_EXPONENT
    task = generate_math(1, 1, 0)[0]
    for answer in (r"\boxed{1e999999999}", "the answer is " + "9" * 4301, "9" * 5000 + "/3"):
        assert not is_correct(task, answer)
    assert answers_match("9" * 5000, "0" + "9" * 5000) is False  # strings: no leading-zero normalising past 4300
    assert answers_match("9" * 5000, "9" * 5000)


def test_references_are_checked_as_the_file_wrote_them(tmp_path: Path) -> None:
    """Normalising the reference damaged it: '\\$18.90' became '\\18.90', a matrix's row break '\\\\ ' lost a
    backslash, '\\frac{\\pi}{3} radians' ran together: right answers scored 0."""
    money, vector, angle = file_tasks(tmp_path / "refs.jsonl", [
        {"question": "How much?", "answer": "So.\n#### \\$18.90"},
        {"problem": "Which vector?", "solution": r"It is $\boxed{\begin{pmatrix} 1 \\ 2 \end{pmatrix}}$."},
        {"problem": "Which angle?", "solution": r"It is $\boxed{\frac{\pi}{3} \text{ radians}}$."}])
    for output in (r"It costs \boxed{18.90} dollars.", "The answer is $18.90.", r"\boxed{18.9}"):
        assert is_correct(money, output), output
    assert not is_correct(money, r"\boxed{18.80}")
    assert is_correct(vector, r"\boxed{\begin{pmatrix}1\\2\end{pmatrix}}")
    assert not is_correct(vector, r"\boxed{\begin{pmatrix}2\\1\end{pmatrix}}")
    assert is_correct(angle, r"\boxed{\frac{\pi}{3}}") and not is_correct(angle, r"\boxed{\frac{\pi}{4}}")


def test_the_last_non_empty_box_is_the_answer() -> None:
    from gradscope.trainers.tasks.math import extract_answer, extract_boxed

    assert extract_boxed(r"\boxed{41} then \boxed{} 42") == "41" and extract_answer(r"\boxed{41}\boxed{}42") == "41"
    assert extract_boxed(r"\boxed{1} \boxed{\frac{1}{2}} \boxed{") == r"\frac{1}{2}"
    assert extract_boxed("\\boxed{" * 1000) is None


@pytest.mark.parametrize("text", ["The answer is: **18**", "The final answer is **18**.", r"The answer is \[18\]",
                                  r"The answer is \(18\).", "**Answer: 18**"])
def test_an_answer_in_markdown_or_display_math_is_read(text: str) -> None:
    from gradscope.trainers.tasks.math import extract_answer

    assert extract_answer(text) == "18"


def test_a_boxed_guess_while_thinking_is_not_the_answer() -> None:
    from gradscope.trainers.reward import solver_answer

    task = generate_math(1, 1, 0)[0]
    assert solver_answer(task, r"<think>\boxed{17}</think> The answer is 18.") == ("18", True)
    assert solver_answer(task, r"<think>so \boxed{17}") == (None, False)
