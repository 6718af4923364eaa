"""``TrainConfig``: every setting of a training run, each one a ``gradscope train`` flag.

The resolved config (defaults filled in for the chosen model) is stored in the run file. Settings
come, each overriding the one before, from the field defaults (or, with ``--resume``, the run's
stored config), a ``--config FILE.yaml`` and the command line; ``--resume`` may change only
:data:`RESUMABLE` ones.
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gradscope.errors import ConfigError
from gradscope.paths import read_text_file
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
    dtype: str = flag("auto", "weights' dtype: auto (bf16 for a real model on CUDA, else fp32) | fp32 | bf16")
    scale: str = flag("0.3M", "testbed size: 0.3M | 1.5M | 6M parameters (stand-ins for Qwen3 0.6B / 1.7B / 4B; "
                              "each its own cached warm start)")
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
    log_to: str = flag("", "also log to dashboards: tensorboard,wandb,mlflow (comma-separated; docs/integrations.md; "
                           "default: none, the run file only)")
    log_dir: str | None = flag(None, "folder for --log-to, one subfolder per dashboard (default: <out>.logs)")
    resume: bool = flag(False, "continue the run file --out from its last checkpoint")
    checkpoint_every: int = flag(50, "save adapters + optimizer state every N steps (0: only at the end)")
    seed: int = flag(0, "random seed (tasks, sampling, initialisation)")
    lora_rank: int = flag(0, "LoRA rank (0: 64 for real models, 8 for the testbed)")
    lora_alpha: float = flag(0.0, "LoRA alpha (0: 32 for real models, 16 for the testbed)")
    max_new_tokens: int = flag(0, "generation limit per turn (0: 24 testbed, 1024 real models)")
    max_evals: int = flag(0, "Eval-Opt evaluation limit (0: 3 for math, 2 for code)")
    alert: list = flag([], "alert rule 'RULE[: warn,record,checkpoint,stop]', repeatable (docs/alerts.md); "
                           "default: none beyond the built-in rules")
    alerts: str | None = flag(None, "YAML file of alert rules (default: none beyond the built-in rules)")
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


#: What ``--resume`` may change: how long to train, when to evaluate and checkpoint, the alert rules,
#: where else to log, how the processes run. Every other setting must equal the run's stored one.
RESUMABLE = ("steps", "eval_every", "checkpoint_every", "alert", "alerts", "default_alerts", "log_to", "log_dir",
             "threads", "dist_timeout", "unsafe_sandbox", "out", "overwrite", "resume")
#: Settings that always come from the command line (or their defaults), never from a stored config.
_INVOCATION = ("out", "overwrite", "resume")
#: A ``--config`` file larger than this is refused unread.
MAX_CONFIG_BYTES = 1 << 20


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def settings() -> dict[str, dataclasses.Field]:
    """Every setting by field name: TrainConfig's and (flat, as the flags are) GRPOConfig's."""
    return {f.name: f for cls in (TrainConfig, GRPOConfig) for f in dataclasses.fields(cls) if f.name != "grpo"}


def _default(f: dataclasses.Field) -> Any:
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()


def from_settings(values: Mapping[str, Any]) -> TrainConfig:
    """A TrainConfig from flat settings (field name → value); missing ones take their defaults."""
    grpo_names = {f.name for f in dataclasses.fields(GRPOConfig)}
    grpo = GRPOConfig(**{k: v for k, v in values.items() if k in grpo_names})
    return TrainConfig(**{k: v for k, v in values.items() if k not in grpo_names}, grpo=grpo)


def checked(name: str, value: Any) -> Any:
    """``value`` as setting ``name`` takes it (an int is a float where a float is due, one rule string
    a list of one); ValueError, one line, for an unknown name or a value of the wrong type."""
    known = settings()
    if name not in known:
        close = difflib.get_close_matches(name, known, n=1)
        raise ValueError(f"unknown setting {name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    default = _default(known[name])
    parse = known[name].metadata.get("type")  # a flag with its own syntax (per-role coefficients)
    if parse is not None and isinstance(value, (int, float, str)) and not isinstance(value, bool):
        try:
            return parse(str(value))
        except (argparse.ArgumentTypeError, ValueError) as exc:
            raise ValueError(f"{name}: {exc}") from None
    if isinstance(default, bool):
        ok, want = isinstance(value, bool), "true or false"
    elif isinstance(default, int):
        ok, want = isinstance(value, int) and not isinstance(value, bool), "a whole number"
    elif isinstance(default, float):
        if isinstance(value, str):  # YAML 1.1 reads 2e-5 (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        ok, want = isinstance(value, (int, float)) and not isinstance(value, bool), "a number"
        value = float(value) if ok else value
    elif isinstance(default, list):
        value = [value] if isinstance(value, str) else value
        ok, want = isinstance(value, list) and all(isinstance(v, str) for v in value), "a list of strings"
    else:  # a string, or None where none is the default
        ok, want = isinstance(value, str) or (value is None and default is None), "a string"
    if not ok:
        raise ValueError(f"{name}: expected {want}, got {_show(value)}")
    return value


def _show(value: Any) -> str:
    return json.dumps(value) if isinstance(value, (bool, int, float, str, list, type(None))) else repr(value)


def stored_settings(config: Mapping[str, Any]) -> dict[str, Any]:
    """The settings in a run file's stored config (nested ``grpo`` flattened; recorded facts such as
    ``world_size`` and settings this version does not know are left out). ConfigError for a
    value of the wrong type."""
    flat = {**{k: v for k, v in config.items() if k != "grpo"}, **dict(config.get("grpo") or {})}
    known = settings()
    try:
        return {k: checked(k, v) for k, v in flat.items() if k in known}
    except ValueError as exc:
        raise ConfigError(f"the run's stored config: {exc}") from None


def check_resumable(cfg: TrainConfig, stored: Mapping[str, Any]) -> None:
    """ConfigError naming the first setting outside :data:`RESUMABLE` whose resolved value differs
    from the run's stored config (a setting the stored config lacks is not compared)."""
    current = stored_settings(json.loads(json.dumps(dataclasses.asdict(cfg.resolved()))))
    for name, value in stored_settings(stored).items():
        if name not in RESUMABLE and current[name] != value:
            raise ConfigError(f"--resume: {_flag(name)} is {_show(current[name])} but the run was made with "
                              f"{_show(value)}; only {', '.join(_flag(n) for n in RESUMABLE if n not in _INVOCATION)} may "
                              f"change on resume "
                              f"(leave the others out: they are read from the run file)")


def merge(given: Mapping[str, Any], file: Mapping[str, Any] | None = None,
          stored: Mapping[str, Any] | None = None) -> TrainConfig:
    """Defaults, then the run's ``stored`` config (resume; its invocation settings ``out``,
    ``overwrite``, ``resume`` excepted), then a config ``file``'s settings, then the ``given``
    command-line ones."""
    values = {k: v for k, v in stored_settings(stored or {}).items() if k not in _INVOCATION}
    return from_settings({**values, **(file or {}), **given})


def load_config_file(path: str) -> tuple[dict[str, Any], dict[str, str]]:
    """The settings of a YAML ``--config`` file: ``{setting: value}`` and ``{setting: "FILE:LINE"}``.

    A mapping of setting names (``tasks_per_step`` or ``tasks-per-step``, as the flags), GRPO ones
    at the top level or under ``grpo:``. ConfigError, one line with the file and line, for an
    unreadable file, bad YAML, an unknown or repeated setting, or a value of the wrong type.
    """
    import yaml  # only when a file is given

    text = read_text_file(path, "--config file", MAX_CONFIG_BYTES)
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else path
        raise ConfigError(f"{where}: not valid YAML: {' '.join(str(getattr(exc, 'problem', None) or exc).split())}") \
            from None
    values: dict[str, Any] = {}
    origin: dict[str, str] = {}
    grpo = {f.name for f in dataclasses.fields(GRPOConfig)}

    def read(mapping: yaml.Node, allowed: set[str] | None) -> None:
        if not isinstance(mapping, yaml.MappingNode):
            raise ConfigError(f"{path}:{mapping.start_mark.line + 1}: expected a mapping of settings (name: value)")
        for key_node, value_node in mapping.value:
            where = f"{path}:{key_node.start_mark.line + 1}"
            key = key_node.value if isinstance(key_node, yaml.ScalarNode) else None
            name = str(key).replace("-", "_")
            if allowed is None and name == "grpo" and isinstance(value_node, yaml.MappingNode):
                read(value_node, grpo)
                continue
            try:
                if not isinstance(key, str) or (allowed is not None and name not in allowed):
                    raise ValueError(f"unknown setting {key!r}" + (" under grpo" if allowed else ""))
                if name in values:
                    raise ValueError(f"{name} is set twice (first at {origin[name]})")
                values[name] = checked(name, yaml.safe_load(yaml.serialize(value_node)))
            except ValueError as exc:
                raise ConfigError(f"{where}: {exc}") from None
            origin[name] = where

    if root is not None:  # an empty file sets nothing
        read(root, None)
    return values, origin


def locate(error: ConfigError, origin: Mapping[str, str]) -> ConfigError:
    """``error`` with ``(FILE:LINE)`` appended when it names the flag of a setting a config file made."""
    for name, where in origin.items():
        if re.search(rf"{re.escape(_flag(name))}(?![\w-])", str(error)):
            return ConfigError(f"{error} ({where})")
    return error


def add_arguments(parser: argparse.ArgumentParser, defaults: bool = True) -> None:
    """One flag per TrainConfig and GRPOConfig field, named after it (``--tasks-per-step``).
    ``defaults=False``: a flag not given leaves no attribute (see :func:`given_arguments`)."""
    for name, f in settings().items():
        default = _default(f)
        kw = {"dest": name, "help": f.metadata["help"], "default": default if defaults else argparse.SUPPRESS}
        if isinstance(default, list):
            parser.add_argument(_flag(name), action="append", metavar="RULE", **kw)
        elif isinstance(default, bool):
            parser.add_argument(_flag(name), action=argparse.BooleanOptionalAction, **kw)
        else:
            kind = f.metadata.get("type") or {int: int, float: float}.get(type(default), str)
            parser.add_argument(_flag(name), type=kind, **kw)


def given_arguments(argv: Sequence[str]) -> dict[str, Any]:
    """The settings given on the command line ``argv`` (already checked by a parser built with
    :func:`add_arguments`), without the defaults of the others."""
    parser = argparse.ArgumentParser(add_help=False)
    add_arguments(parser, defaults=False)
    return vars(parser.parse_known_args(list(argv))[0])


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
