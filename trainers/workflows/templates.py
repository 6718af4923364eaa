"""Prompt templates and output parsers for every role kind, in two styles.

* ``testbed``: compact plain text for the tiny character-level model (short contexts, one line
  per field), e.g. a voter sees ``"57+68\\nA:"`` and answers ``"125"``.
* ``chat``: natural-language instructions wrapped in the tokenizer's chat template, for instruct
  checkpoints such as Qwen3.

Role *kinds* are shared by workflows: a Voting voter, an Eval-Opt generator and an Orch-Workers
worker are all ``solver``s; an aggregator and a synthesizer are ``picker``s.
"""
from __future__ import annotations

import re
from collections.abc import Callable, Sequence

STYLES = ("testbed", "chat")

_TESTBED: dict[str, Callable[..., str]] = {
    "solver": lambda q, strategy=None: f"{q}\nS:{strategy}\nA:" if strategy else f"{q}\nA:",
    "refiner": lambda q, answer, verdict: f"{q}\nA:{answer}\nE:{verdict}\nA:",
    "evaluator": lambda q, answer: f"{q}\nA:{answer}\nCheck:",
    "picker": lambda q, candidates: q + "".join(f"\n{i + 1}:{c}" for i, c in enumerate(candidates)) + "\nPick:",
    "planner": lambda q: f"{q}\nPlan:",
}

_CHAT_SYSTEM = {
    "solver": "Solve the problem. Put the final answer in \\boxed{} (math) or write only the function body (code).",
    "refiner": "Your previous answer was judged. Fix it if needed and give the final answer again.",
    "evaluator": "Judge the proposed answer. Reply 'Correct' or 'Incorrect', then one sentence of feedback.",
    "picker": "Several candidate answers follow. Reply with the number of the best candidate only.",
    "planner": "Propose up to three different strategies to solve the problem, separated by '|'.",
}

_CHAT_USER: dict[str, Callable[..., str]] = {
    "solver": lambda q, strategy=None: f"{q}\n\nUse this strategy: {strategy}" if strategy else q,
    "refiner": lambda q, answer, verdict: f"{q}\n\nPrevious answer:\n{answer}\n\nJudgement: {verdict}",
    "evaluator": lambda q, answer: f"Problem:\n{q}\n\nProposed answer:\n{answer}",
    "picker": lambda q, candidates: f"Problem:\n{q}\n\n" + "\n\n".join(
        f"Candidate {i + 1}:\n{c}" for i, c in enumerate(candidates)),
    "planner": lambda q: q,
}


class Templates:
    """Renders prompts for a style; ``chat`` needs the tokenizer that owns the chat template."""

    def __init__(self, style: str, tokenizer=None) -> None:
        if style not in STYLES:
            raise ValueError(f"unknown template style {style!r}; use one of {STYLES}")
        if style == "chat" and tokenizer is None:
            raise ValueError("the chat style needs a tokenizer with a chat template")
        self.style = style
        self.tokenizer = tokenizer

    def render(self, kind: str, **fields) -> str:
        if self.style == "testbed":
            return _TESTBED[kind](**fields)
        messages = [{"role": "system", "content": _CHAT_SYSTEM[kind]},
                    {"role": "user", "content": _CHAT_USER[kind](**fields)}]
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


# ------------------------------------------------------------------ parsers: (value, format_valid)
_THINKING = re.compile(r"<think>.*?(?:</think>|$)", re.DOTALL)


def without_thinking(text: str) -> str:
    """``text`` without ``<think>…</think>`` blocks (an unclosed one runs to the end; a ``</think>``
    whose ``<think>`` was in the prompt ends one that began with the text): a reasoning model's
    deliberation ("compare 1 and 3") is not its pick, verdict or plan."""
    text = _THINKING.sub("", text)
    return text.rsplit("</think>", 1)[1] if "</think>" in text else text


def parse_pick(text: str, n_candidates: int) -> tuple[int | None, bool]:
    """0-based index of the picked candidate: the first digit of the output (outside ``<think>``),
    valid when it is 1..n."""
    match = re.search(r"\d", without_thinking(text))
    if match and 1 <= int(match.group()) <= n_candidates:
        return int(match.group()) - 1, True
    return None, False


def parse_verdict(text: str) -> tuple[bool | None, bool]:
    """True for 'Correct', False for 'Incorrect': the output's first word (outside ``<think>``, after
    any punctuation such as ``**``), whole ('Correctness …' and 'Correctly …' are no verdict)."""
    match = re.match(r"\W*(incorrect|correct)\b", without_thinking(text).strip().lower())
    if match is None:
        return None, False
    return match.group(1) == "correct", True


def parse_plan(text: str, max_strategies: int = 3) -> tuple[list[str], bool]:
    """Up to ``max_strategies`` strategies separated by '|' or newlines (outside ``<think>``); valid if
    1..max given."""
    parts = [p.strip() for p in re.split(r"[|\n]", without_thinking(text)) if p.strip()]
    return parts[:max_strategies], 1 <= len(parts) <= max_strategies


def pad_strategies(strategies: Sequence[str], n: int) -> list[str]:
    """Exactly ``n`` strategies for ``n`` workers: cycle what was proposed, or a neutral default."""
    pool = list(strategies) or ["direct"]
    return [pool[i % len(pool)] for i in range(n)]
