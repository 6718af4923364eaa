"""Alert rules: a one-line language over per-step statistics (grammar and names: docs/alerts.md).

::

    rule      := condition [":" action ("," action)*]
    condition := "nonfinite" [options]
               | statistic op threshold [options]
    statistic := NAME ["[" (NAME ["|" NAME] | "*") "]"]   coherence[voter], share[*], acc_drop,
                                                      cosine[voter0|voter1]
    op        := ">" | ">=" | "<" | "<="
    threshold := NUMBER                               0.75
               | [NUMBER "x"] AGG "(" INT ")"         3x median(50): 3 times the median of the
                                                      statistic's previous 50 observed values
    AGG       := median | mean | min | max
    options   := ["for" INT] ["cooldown" INT]         persistence; re-arm after INT false values
    action    := warn | record | checkpoint | stop    (record is always done)

A parse error names the offending token and its column.
"""
from __future__ import annotations

import difflib
import math
import re
import reprlib
from dataclasses import dataclass, field
from pathlib import Path

from gradscope.errors import ConfigError
from gradscope.paths import read_text_file

ACTIONS = ("warn", "record", "checkpoint", "stop")
AGGREGATES = ("median", "mean", "min", "max")
OPS = (">=", "<=", ">", "<")

#: Statistic → what its selector names ("" = takes no selector). Names with a "/" are metrics
#: (``train/accuracy``); ``opt.NAME[policy]``, ``eval.NAME`` and ``metric.NAME`` are namespaces.
STATISTICS: dict[str, str] = {
    "grad_norm": "role", "coherence": "role", "amplification": "role", "signal_fraction": "role",
    "share": "role", "token_share": "role", "per_token_share": "role",
    "mass_share": "role", "agent_norm": "agent", "total_norm": "policy",
    "cosine": "agent pair", "role_cosine": "role pair",
    "update_share": "role", "update_share_gap": "role", "role_update_norm": "role",
    "update_cosine": "role pair", "interference": "role pair",
    "update_norm": "policy", "update_rel": "policy", "opt_steps": "policy",
    "accuracy": "", "acc_smooth": "", "acc_peak": "", "acc_drop": "", "acc_drop_rel": "",
    "nonfinite": "",
}
NAMESPACES = ("opt.", "eval.", "metric.")

#: Default cooldown: a condition must be false this many observations before its rule re-arms.
DEFAULT_COOLDOWN = 10
#: Largest persistence, cooldown or aggregate window (in observations) a rule may ask for.
MAX_COUNT = 10**9
#: An alert file larger than this is refused unread (rules are a few lines each).
MAX_FILE_BYTES = 1 << 20
#: A rule quoted in an error message is cut to this many characters.
_QUOTE_CHARS = 120
#: How a malformed YAML entry is shown: a few levels and items (it can be an alias bomb, whose full
#: repr would never finish).
_SHORT = reprlib.Repr()
_SHORT.maxlevel, _SHORT.maxlist, _SHORT.maxdict, _SHORT.maxstring, _SHORT.maxother = 2, 3, 3, 40, 40

_TOKEN = re.compile(r"""
    (?P<space>\s+)
  | (?P<factor>[-+]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?x)(?![\w.])
  | (?P<number>[-+]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?)(?![\w])
  | (?P<name>[A-Za-z_][\w./-]*)
  | (?P<op>>=|<=|>|<)
  | (?P<punct>[\[\]():,*|])
""", re.VERBOSE)


@dataclass(frozen=True)
class Rule:
    """A parsed rule. ``selector`` is None (no selector), a name, or ``"*"`` (every one seen).

    ``threshold`` is the fixed value, or the factor when ``aggregate`` is set (then the statistic
    is compared with ``threshold * aggregate(previous window values)``).
    """

    text: str
    statistic: str
    selector: str | None = None
    op: str | None = None
    threshold: float = 0.0
    aggregate: str | None = None
    window: int = 0
    persist: int = 1
    cooldown: int = DEFAULT_COOLDOWN
    actions: tuple[str, ...] = ("warn", "record")
    name: str = field(default="", compare=False)

    @property
    def label(self) -> str:
        return self.name or self.text

    def compare(self, value: float, reference: float) -> bool:
        return {">": value > reference, ">=": value >= reference,
                "<": value < reference, "<=": value <= reference}[self.op]


class _Tokens:
    def __init__(self, text: str) -> None:
        self.text, self.items, pos = text, [], 0
        while pos < len(text):
            m = _TOKEN.match(text, pos)
            if m is None:
                self.fail_at(pos, repr(text[pos]), "a name, number, operator or one of [ ] ( ) : , *")
            if m.lastgroup != "space":
                self.items.append((m.lastgroup, m.group(), pos))
            pos = m.end()
        self.i = 0

    def fail_at(self, pos: int, got: str, expected: str) -> None:
        raise ConfigError(f"bad alert rule {_clip(self.text, quote=True)}: at column {pos + 1}, {got}: "
                          f"expected {expected}")

    def peek(self) -> tuple[str, str, int] | None:
        return self.items[self.i] if self.i < len(self.items) else None

    def fail(self, expected: str) -> None:
        tok = self.peek()
        self.fail_at(tok[2] if tok else len(self.text), _clip(tok[1], quote=True) if tok else "end of rule", expected)

    def take(self, kind: str, value: str | None = None, expected: str = "") -> str:
        tok = self.peek()
        if tok is None or tok[0] != kind or (value is not None and tok[1] != value):
            self.fail(expected or (repr(value) if value else kind))
        self.i += 1
        return tok[1]

    def accept(self, kind: str, value: str | None = None) -> str | None:
        tok = self.peek()
        if tok is not None and tok[0] == kind and (value is None or tok[1] == value):
            self.i += 1
            return tok[1]
        return None


def _clip(text: str, quote: bool = False) -> str:
    """``text`` (``repr``-quoted if ``quote``) cut to a readable length (a rule may be any string a user
    typed); the count is of ``text``'s own characters."""
    if len(text) <= _QUOTE_CHARS:
        return repr(text) if quote else text
    head = repr(text[:_QUOTE_CHARS - 1])[:-1] if quote else text[:_QUOTE_CHARS]  # the opening quote counts
    return head + f"... ({len(text):,} characters)"


def parse_rule(text: str, *, name: str = "") -> Rule:
    """Parse one rule; :class:`ConfigError` with the offending token's column on a bad one."""
    toks = _Tokens(text)
    if not toks.items:
        raise ConfigError(f"bad alert rule {_clip(text, quote=True)}: empty")
    pos = toks.peek()[2]
    statistic = toks.take("name", expected="a statistic name, e.g. coherence[voter]")
    _check_statistic(toks, statistic, pos)
    selector = None
    if toks.accept("punct", "["):
        selector = toks.accept("punct", "*") or toks.take("name", expected="a role, agent or policy name, or *")
        if selector != "*" and toks.accept("punct", "|"):
            selector += "|" + toks.take("name", expected="the pair's second name")
        toks.take("punct", "]", expected="']'")
    _check_selector(toks, statistic, selector, pos)
    kw: dict = {}
    if statistic != "nonfinite":
        kw["op"] = toks.take("op", expected="a comparison: > >= < <=")
        kw.update(_threshold(toks))
    kw.update(_options(toks))
    if toks.accept("punct", ":"):
        actions = [_action(toks)]
        while toks.accept("punct", ","):
            actions.append(_action(toks))
        kw["actions"] = tuple(dict.fromkeys(["record", *actions]))
    if toks.peek() is not None:
        toks.fail("end of rule or ': actions'" if ":" not in text else "end of rule")
    return Rule(text=text.strip(), statistic=statistic, selector=selector, name=name, **kw)


def _check_statistic(toks: _Tokens, name: str, pos: int) -> None:
    if name in STATISTICS or "/" in name or any(name.startswith(ns) and len(name) > len(ns) for ns in NAMESPACES):
        return
    close = difflib.get_close_matches(name, STATISTICS, n=1)
    toks.fail_at(pos, f"unknown statistic {_clip(name, quote=True)}" + (f" (did you mean {close[0]!r}?)" if close else ""),
                 "one of " + ", ".join(STATISTICS) + ", a metric name with '/', or opt./eval./metric.NAME")


def _check_selector(toks: _Tokens, statistic: str, selector: str | None, pos: int) -> None:
    kind = STATISTICS.get(statistic)
    if kind and selector is None:
        toks.fail_at(pos, f"{statistic!r} needs a {kind}", f"{statistic}[<{kind}>] or {statistic}[*]")
    name = _clip(statistic)  # opt./metric. names may be any length
    if statistic.startswith("opt.") and selector is None:
        toks.fail_at(pos, f"{_clip(statistic, quote=True)} needs a policy", f"{name}[<policy>] or {name}[*]")
    if (kind == "" or statistic.startswith("metric.")) and selector is not None:
        toks.fail_at(pos, f"{_clip(statistic, quote=True)} takes no selector", f"{name} alone")
    if kind and selector not in (None, "*") and kind.endswith("pair") != ("|" in selector):
        toks.fail_at(pos, _clip(f"{statistic}[{selector}]"), f"{statistic}[A|B] or {statistic}[*]" if kind.endswith("pair")
                     else f"one {kind} in {statistic}[...]")


def _finite(toks: _Tokens, text: str) -> float:
    """The number just taken, which must be finite (``1e999`` is not)."""
    value = float(text)
    if not math.isfinite(value):
        toks.i -= 1
        toks.fail("a finite number")
    return value


def _threshold(toks: _Tokens) -> dict:
    number = toks.accept("number")
    if number is not None:
        value = _finite(toks, number)
        if toks.accept("name", "x") is None:
            return {"threshold": value}
        factor = value
    else:
        factor_tok = toks.accept("factor")
        factor = _finite(toks, factor_tok[:-1]) if factor_tok else 1.0
    agg = toks.take("name", expected="a number, or an aggregate like 3x median(50)")
    if agg not in AGGREGATES:
        toks.i -= 1
        toks.fail("a number, or one of " + ", ".join(AGGREGATES) + "(N)")
    toks.take("punct", "(", expected="'('")
    window = _positive(toks, "a window length N >= 2")
    if window < 2:
        toks.i -= 1
        toks.fail("a window length N >= 2")
    toks.take("punct", ")", expected="')'")
    return {"threshold": factor, "aggregate": agg, "window": window}


def _options(toks: _Tokens) -> dict:
    out: dict = {}
    while (word := toks.accept("name", "for") or toks.accept("name", "cooldown")) is not None:
        key = "persist" if word == "for" else "cooldown"
        if key in out:
            toks.i -= 1
            toks.fail("no repeated option")
        out[key] = _positive(toks, f"a whole number of observations after {word!r}")
    return out


def _positive(toks: _Tokens, expected: str) -> int:
    tok = toks.peek()
    # isascii: int() also reads other scripts' digits; the length test keeps int() within its limits
    if tok is None or tok[0] != "number" or not (tok[1].isascii() and tok[1].isdigit()) \
            or len(tok[1]) > len(str(MAX_COUNT)) or not 1 <= int(tok[1]) <= MAX_COUNT:
        toks.fail(f"{expected} (at most {MAX_COUNT:,})")
    toks.i += 1
    return int(tok[1])


def _action(toks: _Tokens) -> str:
    tok = toks.peek()
    if tok is None or tok[0] != "name" or tok[1] not in ACTIONS:
        toks.fail("an action: " + ", ".join(ACTIONS))
    toks.i += 1
    return tok[1]


def load_rules(path: str | Path) -> list[Rule]:
    """Rules from a YAML file: a list of rule strings, or of ``{rule: ..., name: ...}`` mappings
    (optionally under a top-level ``alerts:`` key). Errors name the file and entry."""
    import yaml

    path = Path(path)
    text = read_text_file(path, "alert file", MAX_FILE_BYTES)
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        problem = " ".join(str(getattr(exc, "problem", None) or exc).split())
        raise ConfigError(f"{path}: not valid YAML{where}: {problem}") from None
    except RecursionError:
        raise ConfigError(f"{path}: not valid YAML: nested too deeply") from None
    if isinstance(data, dict) and set(data) == {"alerts"}:
        data = data["alerts"]
    if not isinstance(data, list):
        raise ConfigError(f"{path}: expected a list of rules (or 'alerts:' with a list), got {type(data).__name__}")
    rules = []
    for i, entry in enumerate(data, 1):
        if isinstance(entry, str):
            text, name = entry, ""
        elif isinstance(entry, dict) and isinstance(entry.get("rule"), str) and set(entry) <= {"rule", "name"} \
                and isinstance(entry.get("name", ""), (str, int, float)):
            text, name = entry["rule"], str(entry.get("name", ""))
        else:
            raise ConfigError(f"{path}: entry {i} must be a rule string or {{rule: ..., name: ...}}, "
                              f"got {_clip(_SHORT.repr(entry))}")
        try:
            rules.append(parse_rule(text, name=name))
        except ConfigError as exc:
            raise ConfigError(f"{path}: entry {i}: {exc}") from None
    return rules


#: On by default in ``gradscope train`` and ``watch`` (warn + record): one rule per pathology, an
#: early sign of cliffs, and non-finite gradients. Why these (measured on testbed runs): docs/alerts.md.
DEFAULT_RULES: tuple[Rule, ...] = tuple(parse_rule(text, name=name) for name, text in (
    ("amplification", "coherence[*] > 0.75 for 10"),
    ("capture", "per_token_share[*] > 0.7 for 10"),
    ("cliff", "acc_drop > 0.1"),
    ("cliff-early", "update_rel[*] > 0.05 for 3"),
    ("nonfinite", "nonfinite"),
))
