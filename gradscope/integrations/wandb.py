"""The Weights & Biases sink, in offline mode: nothing leaves the machine.

Needs the ``wandb`` package (``pip install 'gradscope[wandb]'``). The run is written under
``DEST/wandb/offline-run-*``; ``wandb sync`` on that folder uploads it later, if wanted. Text
(alerts, findings) is logged as string values under its tag, so W&B shows it beside the step.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import wandb

from gradscope.integrations.sinks import Sink, check_folder


class WandbSink(Sink):
    name = "wandb"

    def __init__(self, dest: str, run_name: str, config: Mapping[str, Any]) -> None:
        Path(dest).mkdir(parents=True, exist_ok=True)
        self._run = wandb.init(mode="offline", dir=dest, project="gradscope", name=run_name, config=dict(config),
                               reinit="create_new", settings=wandb.Settings(silent=True))
        # A key logged twice at one step keeps only its last value: a step's text is sent once, whole.
        self._text: dict[str, list[str]] = {}
        self._text_step = 0

    def _flush_text(self, before: int | None = None) -> None:
        if self._text and (before is None or before != self._text_step):
            self._run.log({tag: "\n".join(lines) for tag, lines in self._text.items()}, step=self._text_step)
            self._text = {}

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        self._flush_text(before=step)
        self._run.log(dict(values), step=step)

    def text(self, step: int, tag: str, lines: Sequence[str]) -> None:
        self._flush_text(before=step)
        self._text_step = step
        self._text.setdefault(tag, []).extend(lines)

    def close(self) -> None:
        self._flush_text()
        self._run.finish()
        # finish() returns before wandb's service has written the last records to the offline run file
        # (measured: the final record missing in 5 of 6 reads right after it). Tearing the service down
        # waits for them; only when no other run of this process still needs it.
        if wandb.run is None:
            wandb.teardown()


def check(dest: str, *, new: bool = True) -> None:
    """ConfigError unless ``dest`` can be the run's folder (nothing is created); ``new`` makes no
    difference: every run is a W&B run of its own."""
    check_folder("wandb", dest)


def open_sink(dest: str, *, run_name: str, config: Mapping[str, Any]) -> WandbSink:
    """An offline W&B run named ``run_name`` under ``dest``, with ``config`` as its config."""
    return WandbSink(dest, run_name, config)
