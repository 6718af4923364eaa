"""``GRPOConfig``: the optimisation settings of ``gradscope train``, each one a flag.

Kept apart from ``grpo.py`` (which needs torch) so that ``gradscope train --help`` builds its flags
without importing torch.
"""
from __future__ import annotations

from dataclasses import dataclass

from gradscope.ranges import COUNT, WHOLE, Range
from gradscope.trainers.flags import flag


@dataclass
class GRPOConfig:
    """Optimisation settings. Defaults are the paper's (arXiv 2605.24202: 8 rollouts per task, clip
    0.2 / 0.28, no KL, LR 2e-5 with 15 warm-up steps) where it states them. Every field is a
    ``train`` flag."""

    group_size: int = flag(8, "rollouts per task (the GRPO group)")
    clip_low: float = flag(0.2, "ratio clipped below at 1 - clip_low")
    clip_high: float = flag(0.28, "ratio clipped above at 1 + clip_high")
    kl_coef: float = flag(0.0, "k3 KL penalty to the base model, per token (the paper's anchor when > 0)")
    lr: float = flag(0.0, "AdamW learning rate (0: 2e-5 as in the paper; 1e-3 for the testbed)")
    warmup_steps: int = flag(15, "linear LR warm-up, in training steps")
    weight_decay: float = flag(0.01, "AdamW weight decay")
    grad_clip: float = flag(1.0, "max grad norm per optimizer step (0: off)")
    mini_batch_size: int = flag(0, "at most this many samples per optimizer step, split evenly "
                                   "(0: tasks_per_step x group_size)")
    temperature: float = flag(0.7, "sampling temperature (log-probs use the same)")
    shuffle: bool = flag(True, "shuffle a policy's samples before splitting them into mini-batches")


#: Allowed values of every numeric GRPOConfig field (checked with TrainConfig's, ``train.validate``).
GRPO_RANGES: dict[str, Range] = {
    "group_size": COUNT, "warmup_steps": WHOLE, "mini_batch_size": WHOLE,
    "clip_low": Range(0, 1), "clip_high": Range(0), "kl_coef": Range(0), "lr": Range(0),
    "weight_decay": Range(0), "grad_clip": Range(0), "temperature": Range(0, lo_open=True),
}
