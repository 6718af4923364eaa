"""A tiny offline GRPO setup for the TRL integration tests: random-init Qwen3, the testbed's
character tokenizer, a Voting-shaped dataset (one agent per row) and a deterministic rollout.

``python -m tests.integrations.trl_case OUT.npz [--per-device N]`` trains one probed step with the
deterministic rollout and saves the Gram, token counts and TRL's ``grad_norm`` (main process) — run
plainly or under ``accelerate launch --num_processes 2`` to compare one process with two
(``--run-file RUN``: with the trainer's ``run_file``).
"""
from __future__ import annotations

import argparse
import os
import warnings
import zlib

import numpy as np
import torch
from datasets import Dataset
from peft import LoraConfig
from transformers import AutoModelForCausalLM, Qwen3Config
from trl import GRPOConfig, GRPOTrainer

from gradscope.errors import RunFileError
from gradscope.integrations.trl import AGENT_IDS, GradscopeGRPOTrainer
from gradscope.trainers.testbed.tokenizer import build_tokenizer

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
ROLES = {"voter0": "voter", "voter1": "voter", "voter2": "voter", "aggregator": "aggregator"}
GENERATIONS = 4


def tiny_model(tok, seed: int = 0):
    torch.manual_seed(seed)
    config = Qwen3Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=128,
                         tie_word_embeddings=False, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                         bos_token_id=tok.bos_token_id)
    return AutoModelForCausalLM.from_config(config)


def dataset(n_tasks: int = 1) -> Dataset:
    """One row per (task, agent): the agent's prompt and its name in the ``agent`` column."""
    rows = [(f"{t}+{t + 1}={a[0]}:", a) for t in range(n_tasks) for a in ROLES]
    return Dataset.from_dict({"prompt": [p for p, _ in rows], "agent": [a for _, a in rows]})


def length_reward(completions, **kwargs) -> list[float]:
    return [float(len(c) % 3) for c in completions]


def deterministic_rollout(prompts: list[str], trainer) -> dict[str, list]:
    """TRL's ``rollout_func``: each completion a function of its prompt and its place in its GRPO group
    (the global row index mod the group size), so one process and two produce the same batch."""
    tok = trainer.processing_class
    start = trainer.accelerator.process_index * len(prompts)
    prompt_ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
    completion_ids = []
    for i, p in enumerate(prompts):
        rng = np.random.default_rng(zlib.crc32(f"{p}|{(start + i) % GENERATIONS}".encode()))
        ids = rng.integers(4, len(tok), size=int(rng.integers(3, 9))).tolist()
        completion_ids.append(ids + [tok.eos_token_id] if rng.random() < 0.5 else ids)
    return {"prompt_ids": prompt_ids, "completion_ids": completion_ids,
            "logprobs": [[0.0] * len(c) for c in completion_ids]}


def make_trainer(out_dir: str, *, per_device: int = 16, accumulation: int = 1, lora: bool = True,
                 trainer_cls=GradscopeGRPOTrainer, **kwargs):
    """A trainer of one optimizer step on ``per_device`` completions per micro-batch."""
    tok = build_tokenizer()
    model = tiny_model(tok)
    config = dict(output_dir=out_dir, per_device_train_batch_size=per_device, gradient_accumulation_steps=accumulation,
                  num_generations=GENERATIONS, max_completion_length=8, max_steps=1, logging_steps=1, report_to=[],
                  use_cpu=True, save_strategy="no", learning_rate=1e-3, bf16=False, seed=0)
    config.update({k: kwargs.pop(k) for k in list(kwargs) if k in GRPOConfig.__dataclass_fields__})
    args = GRPOConfig(**config)
    peft = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False) if lora else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return trainer_cls(model=model, reward_funcs=length_reward, args=args, train_dataset=dataset(),
                           processing_class=tok, peft_config=peft, roles=ROLES, **kwargs)


class Recording(GradscopeGRPOTrainer):
    """Keeps every micro-batch of the first optimizer step and the trained parameters before it."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if self.state.global_step == 0 and model.training:
            if not hasattr(self, "batches"):
                self.before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
                self.batches = []
            self.batches.append((dict(inputs), self.current_gradient_accumulation_steps))
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


def brute_force_gram(trainer: Recording) -> tuple[np.ndarray, float]:
    """Per-agent gradients of TRL's own loss by autograd, one agent at a time, and the total's norm.

    Agent k's gradient: TRL's loss over the recorded micro-batches with every other token's
    log-prob and entropy detached (so only agent k's tokens carry gradient), at the parameters of the
    step's start. Independent of the trainer's per-token construction.
    """
    model = trainer.model
    params = dict((n, p) for n, p in model.named_parameters() if p.requires_grad)
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(trainer.before[n])
    model.train()
    original = trainer._get_per_token_logps_and_entropies
    grads = []
    for k in range(len(ROLES)):
        total = [torch.zeros_like(p) for p in params.values()]
        for inputs, accumulation in trainer.batches:
            mine = inputs[AGENT_IDS] == k

            def only_mine(*args, **kw):
                logps, ent, aux = original(*args, **kw)
                keep = lambda t: None if t is None else torch.where(mine, t, t.detach())  # noqa: E731
                return keep(logps), keep(ent), aux

            trainer._get_per_token_logps_and_entropies = only_mine
            trainer.current_gradient_accumulation_steps = accumulation
            try:
                loss = GRPOTrainer._compute_loss(trainer, model, inputs)  # TRL's own loss
            finally:
                del trainer._get_per_token_logps_and_entropies
            for t, g in zip(total, torch.autograd.grad(loss, list(params.values()), allow_unused=True)):
                if g is not None:
                    t += g
        grads.append(torch.cat([t.reshape(-1) for t in total]).double())
    G = torch.stack(grads)
    return (G @ G.T).numpy(), float(G.sum(0).norm())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--per-device", type=int, default=16)
    parser.add_argument("--run-file", default=None, help="the trainer's run_file; one that exists: each process "
                                                           "prints its RunFileError as 'rank N: ...' and exits 3")
    args = parser.parse_args()
    trainer = make_trainer(os.path.dirname(args.out) or ".", per_device=args.per_device, rollout_func=deterministic_rollout,
                           run_file=args.run_file)
    try:
        trainer.train()
    except RunFileError as exc:
        print(f"rank {trainer.accelerator.process_index}: {exc}", flush=True)
        raise SystemExit(3) from None
    if trainer.accelerator.is_main_process:
        r = trainer.gradscope_last
        np.savez(args.out, gram=r.gram, tokens=r.tokens, grad_norm=trainer.state.log_history[0]["grad_norm"],
                 world=trainer.accelerator.num_processes, measurement=trainer.probe.measurement)


if __name__ == "__main__":
    main()
