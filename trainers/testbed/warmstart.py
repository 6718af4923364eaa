"""Warm start of the testbed: a short supervised phase on synthetic, role-formatted traces.

Every role of every workflow sees its own prompt format for math and toy-code tasks, so RL starts
from a model that knows each role's output format and is right often enough to have signal:

* solvers (voter, generator, worker) and refiners are trained on the right answer only with
  probability ``p_solver`` (label noise keeps base accuracy well below 1);
* evaluators on the true verdict of a candidate that is right half the time;
* pickers (aggregator, synthesizer) to pick a correct candidate when one exists — trained on
  random picks they stay near-uniform and RL barely moves them (DESIGN.md, testbed notes);
* the orchestrator on a fixed strategy list.

The result is cached on disk and reproducible on a machine: see :mod:`.cache`, which builds it in a
child process with fixed float kernels (other CPUs may still build other bytes: the pin records ours).
"""
from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass

import torch

from gradscope.trainers.tasks import generate_math, generate_toy_code
from gradscope.trainers.tasks.base import Task
from gradscope.trainers.workflows.templates import Templates

STRATEGIES = {"math": "col|tens|swap", "code": "direct|expand|check"}


@dataclass(frozen=True)
class WarmStartConfig:
    skill_steps: int = 400       # phase 1: clean solver traces only (learn the arithmetic / code)
    role_steps: int = 300        # phase 2: every role's format, with label noise
    batch_size: int = 64
    lr: float = 3e-3
    p_solver: float = 0.7        # phase 2: probability a solver trace shows the right answer
    code_fraction: float = 0.25  # share of toy-code tasks among the traces' tasks
    p_eval_noise: float = 0.1   # probability an evaluator trace shows the wrong verdict
    math_level: int = 1
    code_level: int = 1
    seed: int = 0
    hidden: int = 128            # model size (testbed_config)
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 256

    def model_sizes(self) -> dict[str, int]:
        return dict(hidden=self.hidden, layers=self.layers, heads=self.heads, kv_heads=self.kv_heads,
                    intermediate=self.intermediate)


def _wrong(task: Task, rng: random.Random) -> str:
    """A plausible wrong answer of the task's format."""
    if task.kind == "math":
        value = int(task.answer) + rng.choice([-10, -2, -1, 1, 2, 10])
        width = len(task.answer)
        return str(abs(value)).zfill(width)
    expr = task.answer.removeprefix("return ")
    return "return " + expr + rng.choice(["+1", "-1", "*2"])


def traces(tasks: list[Task], cfg: WarmStartConfig, rng: random.Random) -> list[tuple[str, str]]:
    """(prompt, target) pairs, one per role kind per task, in the testbed template style."""
    t = Templates("testbed")
    out = []
    for task in tasks:
        q, right = task.prompt, task.answer

        def solver_target() -> str:
            return right if rng.random() < cfg.p_solver else _wrong(task, rng)

        strategies = STRATEGIES[task.kind].split("|")
        out.append((t.render("solver", q=q), solver_target()))
        out.append((t.render("solver", q=q, strategy=rng.choice(strategies)), solver_target()))
        out.append((t.render("refiner", q=q, answer=_wrong(task, rng), verdict="Incorrect"), solver_target()))
        shown = right if rng.random() < 0.5 else _wrong(task, rng)
        verdict = (shown == right) != (rng.random() < cfg.p_eval_noise)
        out.append((t.render("evaluator", q=q, answer=shown), "Correct" if verdict else "Incorrect"))
        candidates = [right if rng.random() < 0.4 else _wrong(task, rng) for _ in range(3)]
        good = [i for i, c in enumerate(candidates) if c == right]
        out.append((t.render("picker", q=q, candidates=candidates), str(rng.choice(good or [0, 1, 2]) + 1)))
        out.append((t.render("planner", q=q), STRATEGIES[task.kind]))
    return out


def train_warm_start(cfg: WarmStartConfig, on_step: Callable[[int, int], object] | None = None) -> torch.nn.Module:
    """Full fine-tuning of a fresh testbed model (loss on target tokens only), in two phases.

    Phase 1 teaches the skill on clean solver traces: arithmetic is learnt in a sudden transition
    after ~10^4 clean examples, which mixed, noisy traces would take several times longer to reach.
    Phase 2 teaches every role's format on the noisy traces of :func:`traces`.
    ``on_step(step, total)`` is called after every optimizer step.
    """
    # here, not at import: transformers costs seconds, and the config (--scale) is read before any model
    from gradscope.trainers.testbed.model import build_testbed_model
    from gradscope.trainers.testbed.tokenizer import build_tokenizer

    rng = random.Random(cfg.seed)
    torch.manual_seed(cfg.seed)
    tok = build_tokenizer()
    model = build_testbed_model(cfg.seed, **cfg.model_sizes())
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    templates = Templates("testbed")
    total = cfg.skill_steps + cfg.role_steps
    n_code = round(cfg.batch_size * cfg.code_fraction)
    for step in range(total):
        seed = cfg.seed * 100_003 + step
        if step < cfg.skill_steps:
            tasks = generate_math(cfg.batch_size - n_code, cfg.math_level, seed=seed)
            tasks += generate_toy_code(n_code, cfg.code_level, seed=seed)
            pairs = [(templates.render("solver", q=t.prompt), t.answer) for t in tasks]
        else:
            n_tasks = cfg.batch_size // 6 + 1  # traces() yields 6 pairs per task
            k = round(n_tasks * cfg.code_fraction)
            tasks = generate_math(n_tasks - k, cfg.math_level, seed=seed) + generate_toy_code(k, cfg.code_level, seed=seed)
            pairs = traces(tasks, cfg, rng)[: cfg.batch_size]
        ids, attn, labels = _encode(tok, pairs)
        for group in optimizer.param_groups:  # cosine decay over both phases
            group["lr"] = cfg.lr * 0.5 * (1 + math.cos(math.pi * step / total))
        loss = model(input_ids=ids, attention_mask=attn, labels=labels).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if on_step is not None:
            on_step(step + 1, total)
    model.eval()
    return model


def _encode(tok, pairs: list[tuple[str, str]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Left-padded prompt+target+EOS; labels -100 except on target and EOS tokens."""
    seqs, n_target = [], []
    for prompt, target in pairs:
        p = tok(prompt, add_special_tokens=False)["input_ids"]
        y = tok(target, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        seqs.append(p + y)
        n_target.append(len(y))
    width = max(map(len, seqs))
    ids = torch.full((len(seqs), width), tok.pad_token_id)
    attn = torch.zeros((len(seqs), width), dtype=torch.long)
    labels = torch.full((len(seqs), width), -100)
    for i, (s, n) in enumerate(zip(seqs, n_target)):
        ids[i, width - len(s):] = torch.tensor(s)
        attn[i, width - len(s):] = 1
        labels[i, width - n:] = ids[i, width - n:]
    return ids, attn, labels
