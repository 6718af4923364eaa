"""``TrainConfig``: every setting of a training run, each one a ``gradscope train`` flag.

The resolved config (defaults filled in for the chosen model) is stored in the run file.
"""
from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field

from gradscope.ranges import COUNT, WHOLE, Range
from gradscope.trainers.flags import flag
from gradscope.trainers.grpo_config import GRPOConfig




@dataclass
class TrainConfig:
    workflow: str = flag("voting", "voting | eval-opt | orch-workers")
    task: str = flag("math", "math | code (toy programs) | code:humaneval")
    task_file: str | None = flag(None, "GSM8K/MATH-style JSONL file for --task math (default: generated)")
    task_level: int = flag(1, "difficulty level of generated tasks (1-3)")
    policy: str = flag("ip", "ip | sp | role=adapter,... (e.g. voter=a,aggregator=b)")
    model: str = flag("testbed", "'testbed' or a local Hugging Face causal-LM folder")
    steps: int = flag(200, "training steps")
    tasks_per_step: int = flag(8, "tasks per training step, each rolled out group_size times (the paper, "
                                  "arXiv 2605.24202: 64)")
    n_train: int = flag(2000, "generated training tasks (files and HumanEval: all not held out)")
    n_held_out: int = flag(128, "held-out evaluation tasks")
    eval_every: int = flag(25, "evaluate every N steps (and at step 0 and the end; 0: only those)")
    probe: str = flag("gram", "gram | gram,groups (per-adapter Grams too) | none")
    probe_every: int = flag(1, "probe every Kth training step (all its optimizer steps)")
    probe_sketch: int = flag(0, "sketch per-agent gradients to K numbers per parameter group (0: exact; "
                                "for full fine-tuning, docs/distributed.md)")
    probe_updates: str = flag("off", "split every AdamW step into per-role (role) or per-agent (agent) updates, "
                                     "needs --probe-every 1 (off: no update attribution; docs/probe.md)")
    out: str = flag("run.h5", "run file to write")
    overwrite: bool = flag(False, "replace an existing run file")
    log_to: str = flag("", "also log to dashboards: tensorboard,wandb,mlflow (comma-separated; docs/integrations.md)")
    log_dir: str | None = flag(None, "folder for --log-to, one subfolder per dashboard (default: <out>.logs)")
    resume: bool = flag(False, "continue the run file --out from its last checkpoint")
    checkpoint_every: int = flag(50, "save adapters + optimizer state every N steps (0: only at the end)")
    seed: int = flag(0, "random seed (tasks, sampling, initialisation)")
    lora_rank: int = flag(0, "LoRA rank (0: 64 for real models, 8 for the testbed)")
    lora_alpha: float = flag(0.0, "LoRA alpha (0: 32 for real models, 16 for the testbed)")
    max_new_tokens: int = flag(0, "generation limit per turn (0: 24 testbed, 1024 real models)")
    max_evals: int = flag(0, "Eval-Opt evaluation limit (0: 3 for math, 2 for code)")
    alert: list = flag([], "alert rule 'RULE[: warn,record,checkpoint,stop]', repeatable (docs/alerts.md)")
    alerts: str | None = flag(None, "YAML file of alert rules")
    default_alerts: bool = flag(True, "the built-in alert rules (warn + record); --no-default-alerts: off")
    dist_timeout: float = flag(300.0, "under torchrun: seconds a collective may wait for a silent rank")
    threads: int = flag(0, "torch intra-op threads per process (0: 1 for the testbed on CPU, torch's default "
                           "otherwise)")
    unsafe_sandbox: bool = flag(False, "code tasks: run generated programs even where the sandbox lacks a layer "
                                       "(user namespaces, seccomp); docs/sandbox.md")
    grpo: GRPOConfig = field(default_factory=GRPOConfig)

    def resolved(self) -> "TrainConfig":
        """A copy with the model-dependent defaults filled in."""
        testbed = self.model == "testbed"
        import torch  # only here: building the flags must not load torch

        grpo = dataclasses.replace(self.grpo, lr=self.grpo.lr if self.grpo.lr > 0 else (1e-3 if testbed else 2e-5),
                                   mini_batch_size=self.grpo.mini_batch_size or self.tasks_per_step * self.grpo.group_size)
        return dataclasses.replace(
            self, grpo=grpo,
            threads=self.threads or (1 if testbed and not torch.cuda.is_available() else torch.get_num_threads()),
            lora_rank=self.lora_rank or (8 if testbed else 64),
            lora_alpha=self.lora_alpha or (16.0 if testbed else 32.0),
            max_new_tokens=self.max_new_tokens or (24 if testbed else 1024),
            max_evals=self.max_evals or (2 if self.task.startswith("code") or self.task == "humaneval" else 3))


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per TrainConfig and GRPOConfig field, named after it (``--tasks-per-step``)."""
    for cls in (TrainConfig, GRPOConfig):
        for f in dataclasses.fields(cls):
            if f.name == "grpo":
                continue
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            if isinstance(default, list):
                parser.add_argument(_flag(f.name), dest=f.name, action="append", default=default,
                                    metavar="RULE", help=f.metadata["help"])
            elif isinstance(default, bool):
                parser.add_argument(_flag(f.name), dest=f.name, action=argparse.BooleanOptionalAction,
                                    default=default, help=f.metadata.get("help"))
            else:
                kind = {int: int, float: float}.get(type(default), str)
                parser.add_argument(_flag(f.name), dest=f.name, type=kind, default=default,
                                    help=f.metadata["help"])


def from_arguments(args: argparse.Namespace) -> TrainConfig:
    grpo = GRPOConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(GRPOConfig)})
    fields = {f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig) if f.name != "grpo"}
    return TrainConfig(**fields, grpo=grpo)


#: Allowed values of every numeric TrainConfig field, checked by ``train.validate`` before any model is
#: built (0 means "the model's default" where the help says so). Upper bounds only where a larger value
#: breaks a library: numpy seeds are 32-bit, ``timedelta`` overflows.
RANGES: dict[str, Range] = {
    "task_level": Range(1, 3, whole=True),
    "steps": COUNT, "tasks_per_step": COUNT, "n_train": COUNT, "n_held_out": COUNT, "probe_every": COUNT,
    "eval_every": WHOLE, "probe_sketch": WHOLE, "checkpoint_every": WHOLE, "lora_rank": WHOLE,
    "max_new_tokens": WHOLE, "max_evals": WHOLE, "threads": WHOLE,
    "seed": Range(0, 2**32 - 1, whole=True),
    "lora_alpha": Range(0),
    "dist_timeout": Range(0, 10**6, lo_open=True),
}
