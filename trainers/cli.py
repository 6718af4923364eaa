"""``gradscope train``: flags (over a ``--config`` file, over the stored config on ``--resume``) →
TrainConfig → Trainer, with a progress bar.

The flags are parsed before torch and the trainer stack are imported, so ``--help`` and a bad flag
are answered at once.
"""
from __future__ import annotations

import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gradscope.cli import ArgumentParser
from gradscope.errors import ConfigError, RunFileError
from gradscope.trainers.config import TrainConfig, add_arguments, given_arguments, load_config_file, locate, merge

if TYPE_CHECKING:
    from gradscope.trainers.train import Trainer


def run_with_progress(trainer: Trainer) -> Path:
    """Train, showing the phase (base evaluation, training, evaluation), the mean training reward and
    the last held-out accuracy per step."""
    from tqdm import tqdm

    cfg = trainer.cfg
    name = f"{cfg.workflow}/{cfg.task}/{cfg.policy}"
    last_acc: list[float] = []
    done = trainer.resume_from.step if trainer.resume_from is not None else 0  # a resumed run starts there
    with tqdm(total=cfg.steps, initial=done, desc=name, unit="step", dynamic_ncols=True,
              disable=not trainer.dist.is_main) as bar:
        def progress(step: int, metrics: dict[str, float]) -> None:
            if "eval_accuracy" in metrics:
                last_acc[:] = [metrics["eval_accuracy"]]
            bar.n = step
            reward = metrics.get("train/accuracy")  # none at step 0, the base evaluation
            bar.set_postfix(reward="-" if reward is None else f"{reward:.2f}",
                            eval_acc=f"{last_acc[0]:.3f}" if last_acc else "-")

        return trainer.run(on_step=progress, on_phase=lambda phase: bar.set_description(f"{name} ({phase})"))


def train_main(argv: Sequence[str]) -> int:
    parser = ArgumentParser(prog="gradscope train",
                            description="Train a multi-agent workflow with GRPO; every step probed into a run file.")
    add_arguments(parser)
    parser.add_argument("--config", default=None, metavar="FILE.yaml",
                        help="settings from a YAML file, one 'name: value' per flag (flags override it; without it: "
                             "the flags and their defaults)")
    args = parser.parse_args(list(argv))
    given = given_arguments(argv)
    cfg, origin = config_from(given, args.config)

    from tqdm import tqdm  # the trainer stack (torch, transformers, peft) loads only after parsing

    from gradscope.trainers.distributed import world_size_from_env
    from gradscope.trainers.train import Trainer

    # SIGINT always interrupts (and closes the run file), also when this process inherited it ignored: a
    # parent that ignores SIGINT (nohup, `&` in a script, some libraries' C code) passes that on, and then
    # neither Ctrl-C nor `gradscope sweep` interrupting its runs would stop the run.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if world_size_from_env() > 1:  # torchrun tears a job down with SIGTERM: close the run file cleanly
        signal.signal(signal.SIGTERM, _interrupt)
    try:
        trainer = Trainer(cfg, verbose=True, echo=lambda line: tqdm.write(line, file=sys.stderr))
    except ConfigError as exc:  # a bad value from the config file: say where it was set
        raise locate(exc, {k: where for k, where in origin.items() if k not in given}) from None
    from gradscope.trainers.rollout import Diverged

    finished, code = False, 0
    try:
        out = run_with_progress(trainer)
        finished = True
    except Diverged as exc:  # every rank raises it (Trainer._sampled): each ends with the line, after the others
        finished, code = True, 1
        print(f"gradscope: error: training diverged at step {trainer.diverged_at}: {exc} (the run file keeps what "
              f"was written before, and a 'diverged' event)", file=sys.stderr)
    finally:
        trainer.dist.close(finished)
    if trainer.dist.is_main and not code:
        if trainer.stopped_by is not None:
            print(f"gradscope: stopped after step {trainer.stopped_after} by alert: {trainer.stopped_by.message}")
        print(f"wrote {out}")
    if trainer.dist.active:
        # Everything is written and the process group is gone: skip the interpreter's teardown, in which
        # gloo's worker threads can still take the GIL of a finalising interpreter and abort the rank
        # (SIGABRT, "terminate called without an active exception"), failing a finished torchrun job.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def config_from(given: dict[str, Any], config_file: str | None) -> tuple[TrainConfig, dict[str, str]]:
    """The run's settings: defaults, or with ``--resume`` the run file's stored config, then the config
    file's, then the ``given`` flags'. Returns the config and where the file set each of its settings."""
    file, origin = load_config_file(config_file) if config_file else ({}, {})
    cfg = merge(given, file)
    if cfg.resume:
        from gradscope.runfile import open_run

        try:
            with open_run(cfg.out) as run:
                stored = run.meta.config
        except RunFileError:  # a missing, foreign or unreadable file: the trainer's checks say which
            return cfg, origin
        cfg = merge(given, file, stored=stored)
    return cfg, origin


def _interrupt(signum: int, frame: object) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut the clean close short
    raise KeyboardInterrupt
