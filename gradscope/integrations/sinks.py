"""Dashboards as sinks: what ``gradscope train --log-to`` and ``gradscope export`` write to.

A :class:`Sink` takes scalars per training step (names from :mod:`gradscope.integrations.scalars`)
and text per step (alerts, findings). One module per dashboard, imported only when asked for:
``tensorboard`` (:mod:`gradscope.integrations.tensorboard`), ``wandb`` (offline mode) and
``mlflow`` (a local store). :class:`SinkWriter` puts sinks beside a :class:`~gradscope.runfile.RunWriter`.
"""
from __future__ import annotations

import importlib
import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import ModuleType, TracebackType
from typing import Any

import numpy as np

from gradscope.errors import ConfigError, GradscopeError
from gradscope.integrations.scalars import DashboardNames, finite_items, step_scalars

#: Sink name → (module under gradscope.integrations, the pip extra that installs its library).
SINKS = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}
#: Text tags: alert and other run events, and the analysis' findings.
EVENTS_TAG = "gradscope/events"
FINDINGS_TAG = "gradscope/findings"


class Sink(ABC):
    """One dashboard run. Steps must be logged in non-decreasing order (W&B's rule)."""

    #: the sink's name in --to/--log-to, for error messages
    name = "sink"

    @abstractmethod
    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        """Log finite ``{name: value}`` at training step ``step``."""

    @abstractmethod
    def text(self, step: int, tag: str, lines: Sequence[str]) -> None:
        """Log lines of text under ``tag`` at ``step``."""

    @abstractmethod
    def close(self) -> None:
        """Write everything out; the sink is unusable afterwards."""


def parse_sinks(spec: str | Sequence[str]) -> list[str]:
    """``"tensorboard,wandb"`` → ``["tensorboard", "wandb"]``; unknown names raise ConfigError."""
    names = [s.strip() for s in (spec.split(",") if isinstance(spec, str) else spec) if s.strip()]
    unknown = [n for n in names if n not in SINKS]
    if unknown:
        raise ConfigError(f"unknown sink(s) {unknown}; use {', '.join(SINKS)}")
    return list(dict.fromkeys(names))


def open_sink(name: str, dest: str | os.PathLike[str], *, run_name: str, config: Mapping[str, Any]) -> Sink:
    """A sink writing to ``dest`` (a folder; for mlflow also a tracking URI).

    Raises:
        ConfigError: unknown sink, or its library is not installed (the message names the extra);
        GradscopeError: ``dest`` cannot be written.
    """
    try:
        return sink_module(name).open_sink(os.fspath(dest), run_name=run_name, config=dict(config))
    except OSError as exc:
        raise GradscopeError(f"cannot write {name} output to {dest}: {exc.strerror or exc}") from None


def sink_dest(log_dir: str | os.PathLike[str], name: str) -> Path:
    """The ``dest`` that puts sink ``name``'s output in ``log_dir/name`` (``--log-to``): W&B writes into a folder
    ``wandb`` of its own under the one it is given, so it is given ``log_dir``."""
    return Path(log_dir) if name == "wandb" else Path(log_dir) / name


def check_sink(name: str, dest: str | os.PathLike[str], *, new: bool = True) -> None:
    """What can be checked of sink ``name`` at ``dest`` before anything is written, creating nothing:
    ConfigError for an unknown sink, a missing library or dependency (naming the extra), a ``dest``
    that cannot become a folder, or (``new``: not a resumed run) one holding another run's TensorBoard
    event files."""
    sink_module(name).check(os.fspath(dest), new=new)


def check_folder(name: str, dest: str) -> None:
    """ConfigError unless ``dest`` is a writable folder or can be created as one (nothing is created)."""
    path = Path(dest).absolute()
    existing = next(p for p in (path, *path.parents) if os.path.lexists(p))
    if not existing.is_dir():
        raise ConfigError(f"cannot write {name} output to {dest}: {existing} is not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"cannot write {name} output to {dest}: {existing} is not writable")


def sink_module(name: str) -> ModuleType:
    """The module of sink ``name``, its library imported; ConfigError for an unknown sink or a missing
    library (the message names the extra): what a command checks before it writes anything."""
    parse_sinks([name])
    try:
        return importlib.import_module(f"gradscope.integrations.{SINKS[name]}")
    except ImportError as exc:
        raise ConfigError(f"--to/--log-to {name} needs the {exc.name or name} package: "
                          f"pip install 'gradscope[{name}]'") from None


def event_line(kind: str, severity: str, message: str) -> str:
    return f"[{severity}] {kind}: {message}"


class SinkWriter:
    """A run writer that also sends what it logs to sinks.

    Records are buffered per training step and sent as one set of step statistics when the step's
    metrics are logged (the trainer logs them after the step's records), when a record of a later
    step arrives, or at close. Everything else is forwarded to the wrapped writer unchanged.

    Args:
        writer: a :class:`~gradscope.runfile.RunWriter` (or anything with its ``log_*`` methods).
        sinks: where to send.
        agents, agent_roles: the run's agents and their roles (K each).
    """

    def __init__(self, writer: Any, sinks: Sequence[Sink], agents: Sequence[str], agent_roles: Sequence[str]) -> None:
        self.writer = writer
        self.sinks = list(sinks)
        self.agents, self.agent_roles = list(agents), list(agent_roles)
        self._records: list[tuple[int, np.ndarray, np.ndarray]] = []
        self._names = DashboardNames(agents, agent_roles)  # the names export gives: one rule for both ways out
        self._closed = False
        resumed = getattr(writer, "resumed", None)
        if isinstance(resumed, tuple):  # the resumed file's own event, written before the dashboards were attached
            step, message = resumed
            line = event_line("resume", "info", message)
            try:
                self._each(f"at step {step}", lambda sink: sink.text(step, EVENTS_TAG, [line]))
            except BaseException as exc:  # as a failure later would: the run writer closed, then the sinks
                self.__exit__(type(exc), exc, exc.__traceback__)
                raise

    def _each(self, when: str, call: Callable[[Sink], object]) -> None:
        """``call`` on every sink; a sink's failure is one line (the run file stays readable: the
        error closes it on its way out)."""
        for sink in self.sinks:
            try:
                call(sink)
            except GradscopeError:
                raise
            except Exception as exc:  # a dashboard library's own error (disk full, a rejected value, ...)
                raise GradscopeError(f"--log-to {sink.name} failed {when}: {type(exc).__name__}: "
                                     f"{exc}") from exc

    def _send(self, step: int, values: Mapping[str, float]) -> None:
        values = finite_items(values)
        if values:
            self._each(f"at step {step}", lambda sink: sink.scalars(step, values))

    def _flush_records(self) -> None:
        if not self._records:
            return
        rec_steps, grams, tokens = zip(*self._records)
        self._records = []
        uniq, cols = step_scalars(np.stack(grams), np.stack(tokens), np.array(rec_steps), self.agents, self.agent_roles)
        for t, step in enumerate(uniq.tolist()):
            self._send(step, {name: v[t] for name, v in cols.items()})

    def log_step(self, step: int, gram: Any, tokens: Any, **kwargs: Any) -> None:
        self.writer.log_step(step, gram, tokens, **kwargs)
        if self._records and self._records[-1][0] != step:
            self._flush_records()
        self._records.append((step, np.asarray(gram, dtype=np.float64), np.asarray(tokens, dtype=np.float64)))

    def log_metrics(self, step: int, values: Mapping[str, float]) -> None:
        self.writer.log_metrics(step, values)
        self._flush_records()
        self._send(step, {self._names.metric(n): v for n, v in values.items()})

    def log_eval(self, step: int, values: Mapping[str, float]) -> None:
        self.writer.log_eval(step, values)
        self._flush_records()
        self._send(step, {self._names.metric(n, "eval/"): v for n, v in values.items()})

    def log_event(self, step: int, kind: str, message: str, severity: str = "info") -> None:
        self.writer.log_event(step, kind, message, severity)
        # no flush: an event between two records of a step (a probe warning) must not split the step
        self._each(f"at step {step}", lambda sink: sink.text(step, EVENTS_TAG, [event_line(kind, severity, message)]))

    def close(self) -> None:
        self.__exit__(None, None, None)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.writer, name)

    def __enter__(self) -> "SinkWriter":
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        """Send what is buffered, close the run writer as its own ``__exit__`` would, then the sinks."""
        if self._closed:
            return
        self._closed = True
        try:
            self._flush_records()
        finally:
            try:
                self.writer.__exit__(exc_type, exc, tb)
            finally:
                self._each("closing", lambda sink: sink.close())
