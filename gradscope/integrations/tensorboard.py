"""The TensorBoard sink: scalars and text into an event file (``torch.utils.tensorboard``).

Needs the ``tensorboard`` package (``pip install 'gradscope[tensorboard]'``). ``DEST`` is the log
directory (``tensorboard --logdir DEST``).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import tensorboard  # noqa: F401  (fail here, with the package's name, when it is missing)
from torch.utils.tensorboard import SummaryWriter

from gradscope.errors import ConfigError
from gradscope.integrations.sinks import Sink, check_folder


class TensorBoardSink(Sink):
    name = "tensorboard"

    def __init__(self, logdir: str) -> None:
        self._writer = SummaryWriter(log_dir=logdir)

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        for name, value in values.items():
            self._writer.add_scalar(name, value, global_step=step)

    def text(self, step: int, tag: str, lines: Sequence[str]) -> None:
        # TensorBoard renders text as Markdown: two spaces before a newline keep the lines apart.
        self._writer.add_text(tag, "  \n".join(lines), global_step=step)

    def close(self) -> None:
        self._writer.close()


def check(dest: str, *, new: bool = True) -> None:
    """ConfigError unless ``dest`` can be the log directory (nothing is created). A new run's (``new``)
    must hold no event files yet: TensorBoard would draw theirs and its values as one series."""
    check_folder("tensorboard", dest)
    if new and any(Path(dest).glob("events.out.tfevents.*")):
        raise ConfigError(f"{dest} already holds TensorBoard event files (TensorBoard would draw them and "
                          f"this run's as one series): give an empty or new folder")


def open_sink(dest: str, *, run_name: str, config: Mapping[str, Any]) -> TensorBoardSink:
    """A writer into log directory ``dest`` (created if needed); ``run_name``/``config`` unused."""
    return TensorBoardSink(dest)
