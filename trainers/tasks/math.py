"""Math tasks: a seeded arithmetic generator, GSM8K / MATH JSONL loaders, answer extraction.

Generated problems are sized for the character-level testbed model (prompts of 5-8 characters,
fixed-width answers); the loaders take real datasets given by path. Model outputs are scored with
:func:`extract_answer` + :func:`check_answer` (or :func:`is_correct`, which does both): generated
problems by exact arithmetic (:func:`answers_match`), GSM8K / MATH file problems by
:func:`answers_equivalent`, which adds HF math-verify's symbolic equivalence.
"""
from __future__ import annotations

import re
import threading
from fractions import Fraction
from functools import lru_cache
from pathlib import Path
from typing import Callable

from .base import Task, TaskError, TaskFileError, rng_for, unique_draws
from .jsonl import read_records

__all__ = [
    "PROMPT_TEMPLATE", "LEVELS", "DEFAULT_WIDTH", "format_prompt", "format_answer", "generate_math",
    "load_math_jsonl", "extract_answer", "extract_boxed", "normalise_answer", "parse_number",
    "answers_match", "answers_equivalent", "check_answer", "is_correct",
]

# ---------------------------------------------------------------------------------------------
# Generator
# ---------------------------------------------------------------------------------------------

#: How a generated problem is shown to the agents — the one place to change it.
PROMPT_TEMPLATE = "{expr}="

LEVELS = {
    1: "two-digit addition aa+bb",
    2: "three-digit addition or subtraction (non-negative result)",
    3: "small multiplication or two-step expression: a*bb, a*b+cc, a*b-c, aa+b*c",
}

#: Answer width per level: wide enough for the level's largest answer (198, 1998, 891).
DEFAULT_WIDTH = {1: 3, 2: 4, 3: 3}
_MAX_ANSWER = {1: 198, 2: 1998, 3: 891}


def format_prompt(expr: str) -> str:
    """The prompt for an arithmetic expression, e.g. ``"57+68"`` → ``"57+68="``."""
    return PROMPT_TEMPLATE.format(expr=expr)


def format_answer(value: int, width: int | None) -> str:
    """``value`` as a string, zero-padded to ``width`` digits when ``width`` is set (``42`` → ``"042"``)."""
    if width is None:
        return str(value)
    if value < 0:
        raise ValueError("fixed-width answers must be non-negative")
    s = str(value).zfill(width)
    if len(s) > width:
        raise ValueError(f"{value} does not fit in {width} digits")
    return s


def _draw(level: int) -> Callable:
    def level1(rng):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        return f"{a}+{b}", a + b

    def level2(rng):
        a, b = rng.randint(100, 999), rng.randint(100, 999)
        if rng.random() < 0.5:
            return f"{a}+{b}", a + b
        a, b = max(a, b), min(a, b)
        return f"{a}-{b}", a - b

    def level3(rng):
        form = rng.randrange(4)
        if form == 0:
            a, b = rng.randint(2, 9), rng.randint(10, 99)
            return f"{a}*{b}", a * b
        if form == 1:
            a, b, c = rng.randint(2, 9), rng.randint(2, 9), rng.randint(10, 99)
            return f"{a}*{b}+{c}", a * b + c
        if form == 2:
            a, b = rng.randint(2, 9), rng.randint(2, 9)
            c = rng.randint(1, a * b)
            return f"{a}*{b}-{c}", a * b - c
        a, b, c = rng.randint(10, 99), rng.randint(2, 9), rng.randint(2, 9)
        return f"{a}+{b}*{c}", a + b * c

    try:
        return {1: level1, 2: level2, 3: level3}[level]
    except KeyError:
        raise TaskError(f"unknown math level {level!r}; levels are {sorted(LEVELS)}") from None


def generate_math(n: int, level: int = 1, seed: int = 0, *, width: int | None | str = "auto") -> list[Task]:
    """``n`` arithmetic problems of ``level`` (1, 2 or 3), fixed by ``seed``.

    ``width="auto"`` pads answers to the level's :data:`DEFAULT_WIDTH`; an int sets the width
    (it must fit the level's largest answer); ``None`` gives unpadded answers. Prompts are distinct
    unless ``n`` (nearly) exhausts the level's space.
    """
    draw = _draw(level)
    if width == "auto":
        width = DEFAULT_WIDTH[level]
    if width is not None:
        if not isinstance(width, int) or isinstance(width, bool) or width < len(str(_MAX_ANSWER[level])):
            raise TaskError(f"width {width!r} cannot hold level-{level} answers (up to {_MAX_ANSWER[level]})")
    if n < 0:
        raise TaskError(f"n must be >= 0, got {n}")
    items = unique_draws(rng_for(seed, "math", level), n, lambda rng: (lambda e: (e[0], e))(draw(rng)))
    return [
        Task(id=f"math/L{level}/s{seed}/{i}", kind="math", prompt=format_prompt(expr),
             answer=format_answer(value, width),
             meta={"source": "generated", "level": level, "difficulty": level, "expression": expr,
                   "value": value, "width": width})
        for i, (expr, value) in enumerate(items)
    ]


# ---------------------------------------------------------------------------------------------
# Answer extraction and normalisation
# ---------------------------------------------------------------------------------------------

# A number as written in text: optional sign (not when it is a binary minus after a digit, letter or
# closing bracket), thousands separators or plain digits, optional decimals, optional "/denominator".
_NUM = (r"(?:(?<![\w)\]}])-)?(?<![\w.])"
        r"(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?(?:/\d+(?!\.\d))?"
        r"|(?:(?<![\w)\]}])-)?(?<![\w.])\.\d+")
_NUM_RE = re.compile(_NUM)
_FRAC_RE = re.compile(r"-?\\[dt]?frac\s*(?:\{[^{}]*\}|\d)\s*(?:\{[^{}]*\}|\d)")
_TOKEN_RE = re.compile(rf"{_FRAC_RE.pattern}|{_NUM}")
_HASH_RE = re.compile(r"####[ \t]*([^\n]*)")
_ANSWER_RE = re.compile(r"\banswer\s*(?:is\s*:?|:|=)", re.IGNORECASE)


def extract_boxed(text: str) -> str | None:
    """The content of the last non-empty ``\\boxed{...}`` (or ``\\fbox{...}``), nested braces kept; ``None``
    if absent.

    ``\\boxed 5`` (no braces) gives ``"5"``; an unclosed ``\\boxed{`` and an empty ``\\boxed{}`` are ignored.
    """
    best = None
    closing = _matching_braces(text)
    for m in re.finditer(r"\\(?:boxed|fbox)\s*", text):
        i = m.end()
        if i < len(text) and text[i] == "{":
            if i in closing and text[i + 1:closing[i]].strip():  # an empty box answers nothing
                best = text[i + 1:closing[i]].strip()
        else:
            tok = re.match(r"[^\s$]+", text[i:])
            if tok:
                best = tok.group(0)
    return best


def _matching_braces(text: str) -> dict[int, int]:
    """{index of a '{': index of its matching '}'} for the braces of ``text`` that close, in one pass
    (scanning on from every unclosed ``\\boxed{`` was quadratic: 5 s for 32,000 characters)."""
    out, stack = {}, []
    for j, ch in enumerate(text):
        if ch == "{":
            stack.append(j)
        elif ch == "}" and stack:
            out[stack.pop()] = j
    return out


def _first_token(s: str) -> str | None:
    m = _TOKEN_RE.search(s)
    return m.group(0) if m else None


def extract_answer(text: str | None) -> str | None:
    """The final answer in a model output, as written (normalise it with :func:`normalise_answer`).

    Precedence: the last ``\\boxed{...}`` (nested braces allowed); else the last ``#### X`` line
    (its first number, or the whole line if it has none); else the last "answer is X" /
    "Answer: X" / "answer = X" — a ``$...$`` right after it, or the rest of the sentence when that
    is one word (``x^2+1``, ``Paris``), else the first number or fraction in the sentence;
    else the last number in the text. ``None`` when nothing is found.
    """
    if not text:
        return None
    boxed = extract_boxed(text)
    if boxed:
        return boxed
    hashes = [m.group(1).strip() for m in _HASH_RE.finditer(text)]
    hashes = [h for h in hashes if h]
    if hashes:
        return _first_token(hashes[-1]) or hashes[-1]
    answers = list(_ANSWER_RE.finditer(text))
    if answers:
        line = text[answers[-1].end():].split("\n", 1)[0].strip().strip("*_ ")  # Markdown emphasis
        math = re.match(r"\$+([^$]+)\$+|\\\[(.+?)\\\]|\\\((.+?)\\\)", line)
        inner = math and next(g for g in math.groups() if g is not None).strip()
        if inner:
            return inner
        sentence = re.split(r"[.!?;](?:\s|$)", line, maxsplit=1)[0].strip().rstrip(".,;:!?").strip()
        if sentence and not re.search(r"\s", sentence):
            return sentence.strip("$*_")
        tok = _first_token(sentence)
        if tok:
            return tok
        if sentence:
            return sentence
    numbers = [m.group(0) for m in _NUM_RE.finditer(text)]
    return numbers[-1] if numbers else None


_INT_RE = re.compile(r"[+-]?\d+")
_DEC_RE = re.compile(r"[+-]?(?:\d+\.\d*|\.\d+)")
_COMMA_NUM_RE = re.compile(r"[+-]?\d{1,3}(?:,\d{3})+(?:\.\d+)?")


def normalise_answer(s: str | None, *, width: int | None = None) -> str:
    """A canonical string for an answer.

    Strips ``$``, ``\\text{}``/``\\mathrm{}`` wrappers, spaces, LaTeX spacing, ``\\left``/``\\right``,
    a trailing full stop and degree signs; ``\\dfrac``/``\\tfrac`` → ``\\frac``. Numbers lose
    thousands separators (``1,234`` → ``1234``), trailing decimal zeros (``2.50`` → ``2.5``,
    ``3.0`` → ``3``), a leading ``+`` and leading zeros (``042`` → ``42``) — unless ``width`` is set,
    in which case non-negative integers are zero-padded to ``width`` (``42`` → ``"042"``).
    """
    if s is None:
        return ""
    s = str(s).strip()
    boxed = extract_boxed(s)
    if boxed is not None and re.fullmatch(r"\$*\\(?:boxed|fbox).*\$*", s, re.DOTALL):
        s = boxed
    s = re.sub(r"\\(?:text|textbf|mathrm|mbox)\s*\{([^{}]*)\}", r"\1", s)
    s = s.replace("\\left", "").replace("\\right", "").replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = re.sub(r"(?<!\\)\\[,!;: ]", "", s)  # LaTeX spacing, not the '\\ ' of a row break
    s = s.replace("^\\circ", "").replace("^{\\circ}", "").replace("°", "")
    s = s.replace("\\$", "").replace("$", "")  # a currency sign \$ whole, not its backslash left behind
    s = re.sub(r"\s+", "", s)
    s = s.rstrip(".")
    if _COMMA_NUM_RE.fullmatch(s):
        s = s.replace(",", "")
    if _INT_RE.fullmatch(s) and len(s) <= MAX_NUMBER_CHARS:  # int() refuses more (a long answer crashed)
        value = int(s)
        if width is not None and value >= 0:
            return str(value).zfill(width)
        return str(value)
    if _DEC_RE.fullmatch(s):
        sign = "-" if s.startswith("-") else ""
        body = s.lstrip("+-")
        whole, frac = body.split(".", 1)
        frac = frac.rstrip("0")
        whole = whole.lstrip("0") or "0"
        out = f"{whole}.{frac}" if frac else whole
        return "0" if out == "0" else sign + out
    return s


#: A number's normalised text longer than this, or with an exponent beyond ±MAX_EXPONENT, is not parsed as a
#: number (it is compared as a string): Python's int() refuses more than 4300 digits, and an exponent is expanded.
MAX_NUMBER_CHARS = 4300
MAX_EXPONENT = 4300
_LATEX_FRAC_FULL = re.compile(r"(-?)\\frac(?:\{([^{}]+)\}|(\d))(?:\{([^{}]+)\}|(\d))")


def parse_number(s: str | None) -> Fraction | None:
    """``s`` as an exact rational if it is a number: integers, decimals, ``1,234``, ``a/b``,
    ``\\frac{a}{b}`` (signs inside or outside), percentages are *not* converted. Else ``None``."""
    if s is None:
        return None
    t = normalise_answer(s)
    if not t:
        return None
    m = _LATEX_FRAC_FULL.fullmatch(t)
    if m:
        num, den = parse_number(m.group(2) or m.group(3)), parse_number(m.group(4) or m.group(5))
        if num is None or den is None or den == 0:
            return None
        value = num / den
        return -value if m.group(1) else value
    if len(t) > MAX_NUMBER_CHARS:
        return None
    m = re.fullmatch(r"[+-]?(?:\d+(?:\.\d+)?|\.\d+)(?:[eE]([+-]?\d+))?", t)
    if m:
        if m.group(1) is not None and abs(int(m.group(1))) > MAX_EXPONENT:
            return None  # Fraction would expand 10**exponent in full: 1e999999999 took hours
        return Fraction(t)
    m = re.fullmatch(r"([+-]?\d+)/([+-]?\d+)", t)
    if m:
        den = int(m.group(2))
        return Fraction(int(m.group(1)), den) if den else None
    return None


def answers_match(pred: str | None, ref: str | None) -> bool:
    """Whether a predicted answer equals the reference.

    Exactly as rationals when both parse as numbers (``042`` = ``42``, ``0.5`` = ``1/2`` = ``\\frac{1}{2}``,
    ``1,000`` = ``1000``; ``0.3333333333`` ≠ ``1/3``), else as normalised strings.
    ``None`` or empty never matches.
    """
    if pred is None or ref is None:
        return False
    a, b = parse_number(pred), parse_number(ref)
    if a is not None and b is not None:
        return a == b
    na, nb = normalise_answer(pred), normalise_answer(ref)
    return bool(na) and na == nb


#: Seconds math-verify may spend on one parse or one comparison (its SIGALRM timeout).
MATH_VERIFY_TIMEOUT_S = 2
#: A predicted answer longer than this (characters) is not handed to math-verify (its parse and
#: comparison of adversarial text take up to 2 s each); the exact comparison still applies.
MAX_VERIFY_CHARS = 500
#: Unit words after an answer (``1,234,567 dollars``, ``12 m/s``, ``5 cm^2``): the answer without them. A word
#: of one letter only with a ``/`` or a power (``x`` may be a variable).
_UNITS_AFTER = re.compile(r"(?:\s+(?:[A-Za-z]{2,12}|[A-Za-z](?=[/^²³]))(?:/[A-Za-z]{1,12})?(?:\^\{?\d\}?|[²³])?){1,8}\.?$")
#: What a unit follows: a number, a closing brace (``\frac{1}{2}``), ``\pi`` or a percent sign.
_BEFORE_UNIT = re.compile(r"(?:\d|\}|\\pi|%)$")
#: The part of a prediction searched for units (a bounded regex on a bounded tail: linear time).
_UNIT_TAIL_CHARS = 240
#: Words that change what the number before them says (``7 or eight``, ``7 thousand``, ``3 squared``): never
#: dropped as units; ``or`` anywhere makes a prediction two guesses, which never match.
_NOT_UNITS = frozenset("""or and not but is are was more less fewer least most up to than plus minus times over
    divided squared cubed mod choose factorial hundred thousand thousands million millions billion billions
    trillion dozen dozens half halves third thirds quarter quarters percent pi zero one two three four five six
    seven eight nine ten eleven twelve twenty thirty forty fifty hundredths tenths""".split())
_OR = re.compile(r"(?<![\\A-Za-z])or(?![A-Za-z])", re.IGNORECASE)
_PI_WORD = re.compile(r"(?<![\\A-Za-z])pi(?![A-Za-z])")
_PERCENT = re.compile(r"(.+?)\s*(?:\\?%|\s+percent)")


def answers_equivalent(pred: str | None, ref: str | None) -> bool:
    """Whether a predicted answer is mathematically the reference (GSM8K / MATH answers).

    :func:`answers_match` first (exact numbers, normalised strings); when that fails and either side
    is not a plain number, HF math-verify (``parse`` + ``verify``) decides: ``\\frac{\\sqrt{3}}{2}``
    = ``\\frac{\\sqrt3}{2}``, ``2\\sqrt{2}`` = ``\\sqrt{8}``, ``5 cm`` / ``5\\text{ cm}`` = ``5``,
    ``50\\%`` = ``50`` and ``25\\%`` = ``\\frac{1}{4}`` (math-verify reads a percent both ways),
    ``\\$1,234.50`` = ``1234.5``, ``1,234,567 dollars`` = ``1234567``, ``12 m/s`` = ``12`` (unit words after
    an answer dropped; not words that change it, ``7 thousand``, ``3 squared``; an ``or`` never matches),
    ``x=3`` = ``3``, ``10^{3}`` = ``1000``, ``3, 4`` = ``4, 3`` (sets), ``(1,2)`` = ``(1, 2)`` (intervals).
    Each side is read as LaTeX (inside ``$…$``), and as plain text only when that finds nothing: a
    plain-text read keeps one number of an expression (``72^{5}``, ``3\\sqrt{2}``, ``2x+3`` read as 72, 3,
    2), which paid a wrong answer, or two guesses at once (``71 \\approx 72``). A prediction longer
    than :data:`MAX_VERIFY_CHARS` is not handed to math-verify. math-verify's timeout is a SIGALRM
    alarm (it cancels one the caller had set), which only the main thread can take: in another
    thread the comparison stops at :func:`answers_match`. Results are cached.
    """
    if pred is None or ref is None:
        return False
    pred, ref = str(pred).strip(), str(ref).strip()
    if _OR.search(pred):  # "7 or 8": two guesses
        return False
    pred = _PI_WORD.sub(r"\\pi", pred)  # "2 pi" is 2π (a LaTeX reading makes it 2·p·i)
    percent = _PERCENT.fullmatch(pred)
    if percent and "%" not in ref:
        n, value = parse_number(percent.group(1)), parse_number(ref)
        if n is not None and value is not None:  # both readings, exactly (math-verify's: whole percents only)
            return n == value or n / 100 == value
    pred = _without_units(pred, ref)
    if answers_match(pred, ref):
        return True
    if parse_number(pred) is not None and parse_number(ref) is not None:
        return False  # two plain numbers: the exact comparison is the answer
    if threading.current_thread() is not threading.main_thread() or len(pred) > MAX_VERIFY_CHARS:
        return False
    return _verified(pred, ref)


def _without_units(pred: str, ref: str) -> str:
    """``pred`` without the unit words at its end (``12 m/s`` → ``12``): only after a number, ``}``, ``\\pi``
    or ``%``, never a word of :data:`_NOT_UNITS`, and not at all when ``ref`` has variables."""
    tail = _UNITS_AFTER.search(pred[-_UNIT_TAIL_CHARS:])
    if tail is None or _has_variable(ref):
        return pred
    head = pred[:len(pred) - len(tail.group())].rstrip()
    words = {w.lower() for w in re.findall(r"[A-Za-z]+", tail.group())}
    return head if _BEFORE_UNIT.search(head) and not words & _NOT_UNITS else pred


def _has_variable(text: str) -> bool:
    """Whether a LaTeX answer has letters outside ``\\text{}``-like wrappers and commands (``x^2+y^2``,
    ``4ab``), which are then its variables, never units."""
    text = re.sub(r"\\(?:text\w*|mathrm|mbox|operatorname)\s*\{[^{}]*\}", "", text)
    return re.search(r"[A-Za-z]", re.sub(r"\\[A-Za-z]+", "", text)) is not None


def _exact(value) -> Fraction | None:
    """A sympy number as an exact rational (a Float by its decimal digits), else None."""
    try:
        if value.is_Float:
            return Fraction(str(value))
        return Fraction(int(value.p), int(value.q)) if value.is_Rational else None
    except (ValueError, TypeError, AttributeError):
        return None


@lru_cache(maxsize=65536)
def _verified(pred: str, ref: str) -> bool:
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify  # ~1 s to import
    from latex2sympy2_extended.latex2sympy2 import NormalizationConfig

    # math-verify drops letters it takes for units (m, h, t, ab, ...) after a number: with variables in the
    # reference those are its variables (``4`` paid for ``4ab``)
    config = None if not _has_variable(ref) else [
        LatexExtractionConfig(normalization_config=NormalizationConfig(
            basic_latex=True, units=False, malformed_operators=True, nits=True, boxed="all", equations=False)),
        ExprExtractionConfig()]
    extra = {} if config is None else {"extraction_config": config}

    def parsed(text: str) -> list:
        latex = parse(f"${text}$", parsing_timeout=MATH_VERIFY_TIMEOUT_S, **extra)
        return [latex] if latex else [p for p in [parse(text, parsing_timeout=MATH_VERIFY_TIMEOUT_S, **extra)] if p]

    number = parse_number(pred)
    if number is not None:  # a plain number: exactly the reference's value (verify rounds to 6 decimals)
        gold = parsed(re.sub(r"\\?%$", "", ref))
        value = gold[0][0] if gold else None
        if getattr(value, "is_number", False):  # irrational (or not exact): no plain number equals it
            return _exact(value) == number

    return any(verify(gold, guess, timeout_seconds=MATH_VERIFY_TIMEOUT_S)
               for gold in parsed(ref) for guess in parsed(pred))


def check_answer(task: Task, pred: str | None) -> bool:
    """Whether an extracted answer solves a math ``task``: GSM8K / MATH file tasks by
    :func:`answers_equivalent`; generated tasks (the testbed's arithmetic) by the exact
    :func:`answers_match` — an expression such as ``4+38`` is not an answer to ``17+25=``."""
    if task.meta.get("format") in ("gsm8k", "math"):  # the reference as the file wrote it: for math-verify
        return answers_equivalent(pred, task.meta.get("reference", task.answer))
    return answers_match(pred, task.answer)


def is_correct(task: Task, output: str | None, *, strict_width: bool = False) -> bool:
    """Whether a model ``output`` answers a math ``task``: extract, then :func:`check_answer`.

    With ``strict_width`` and a fixed-width task, the extracted answer must also be written with
    exactly the task's width (``"042"``, not ``"42"``).
    """
    pred = extract_answer(output)
    if pred is None:
        return False
    width = task.meta.get("width")
    if strict_width and width is not None and re.sub(r"[\s$]", "", pred) != task.answer:
        return False
    return check_answer(task, pred)


# ---------------------------------------------------------------------------------------------
# JSONL loaders (GSM8K and MATH formats)
# ---------------------------------------------------------------------------------------------

_ID_KEYS = ("id", "task_id", "unique_id", "idx")


def _difficulty(record: dict):
    level = record.get("level", record.get("difficulty"))
    if isinstance(level, int) and not isinstance(level, bool):
        return level
    if isinstance(level, str):
        m = re.search(r"\d+", level)
        if m:
            return int(m.group(0))
    return None


def load_math_jsonl(path: str | Path) -> list[Task]:
    """Tasks from a JSONL file (optionally ``.gz``) of GSM8K-style or MATH-style records.

    * GSM8K: ``{"question": ..., "answer": "... #### 72"}`` — the reference is what follows the
      last ``####``; the text before it is kept as ``meta["solution"]``.
    * MATH: ``{"problem": ..., "solution": "... \\boxed{...}"}`` — the reference is the last
      ``\\boxed{}`` (nested braces allowed); a string ``"answer"`` field, when present, wins.

    Optional ``id``/``task_id``/``unique_id``/``idx`` give the task id (default ``"<stem>/<line>"``);
    ``level``/``difficulty`` and ``type``/``subject`` go to ``meta``. Blank lines are skipped.
    Anything else — unreadable file, bad JSON, not an object, missing keys, no ``####``/``\\boxed{}``,
    duplicate ids, no tasks at all — raises :class:`TaskFileError` naming the file and line.
    """
    path = Path(path)
    tasks: list[Task] = []
    ids: set[str] = set()

    def fail(lineno: int, why: str):
        raise TaskFileError(f"{path}:{lineno}: {why}") from None

    for lineno, record in read_records(path):
        if "question" in record:
            kind = "gsm8k"
            prompt, solution = record.get("question"), record.get("answer")
            if not isinstance(prompt, str) or not isinstance(solution, str):
                fail(lineno, "GSM8K record needs string fields 'question' and 'answer'")
            if "####" not in solution:
                fail(lineno, "GSM8K 'answer' has no '#### <answer>' line")
            head, _, tail = solution.rpartition("####")
            reference = tail.strip().split("\n", 1)[0].strip()
            answer = normalise_answer(reference)
            if not answer:
                fail(lineno, "GSM8K 'answer' has an empty '####' answer")
            meta = {"source": "gsm8k", "solution": head.strip(), "reference": reference}
        elif "problem" in record:
            kind = "math"
            prompt, solution = record.get("problem"), record.get("solution")
            if not isinstance(prompt, str):
                fail(lineno, "MATH record needs a string field 'problem'")
            given = record.get("answer")
            if isinstance(given, str) and given.strip():
                reference = given.strip()
            else:
                if not isinstance(solution, str):
                    fail(lineno, "MATH record needs a string field 'solution' (or 'answer')")
                boxed = extract_boxed(solution)
                if not boxed:
                    fail(lineno, "MATH 'solution' has no \\boxed{...} answer")
                reference = boxed
            answer = normalise_answer(reference)
            meta = {"source": "math", "solution": solution if isinstance(solution, str) else "",
                    "reference": reference}
            for key in ("type", "subject"):
                if key in record:
                    meta[key] = record[key]
        else:
            fail(lineno, "record has neither 'question'/'answer' (GSM8K) nor 'problem'/'solution' (MATH)")
        tid = next((str(record[k]) for k in _ID_KEYS if k in record), f"{path.stem}/{lineno}")
        if tid in ids:
            fail(lineno, f"duplicate task id {tid!r}")
        ids.add(tid)
        meta.update({"format": kind, "difficulty": _difficulty(record), "width": None,
                     "file": str(path), "line": lineno})
        tasks.append(Task(id=tid, kind="math", prompt=prompt, answer=answer, meta=meta))
    if not tasks:
        raise TaskFileError(f"{path}: no tasks in file")
    return tasks
