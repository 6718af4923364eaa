"""The MLflow sink: metrics into a local MLflow store (no server, no network).

Needs ``mlflow-skinny`` with SQLAlchemy and Alembic (``pip install 'gradscope[mlflow]'``). ``DEST``
is either a folder — the store is then the SQLite database ``DEST/mlflow.db`` with artifacts in
``DEST/artifacts`` (MLflow 3 keeps its plain-file store only behind an opt-in; SQLite is its
recommended local store; view with ``mlflow ui --backend-store-uri sqlite:///DEST/mlflow.db``) — or
a tracking URI (``sqlite:///...``, ``file:...``, ``http://...``), used as given (MLflow 3 opens a
``file:`` store only with ``MLFLOW_ALLOW_FILE_STORE=true``). Runs go to the
experiment ``gradscope``. Text (alerts, findings) becomes one artifact per tag,
``<tag>.txt`` (e.g. ``gradscope/events.txt``), lines prefixed with their step, rewritten with every
new line (an alert shows in the dashboard while the run goes on; MLflow appends to no artifact).
"""
from __future__ import annotations

import importlib.util
import logging
import textwrap
import time
from collections import defaultdict
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from mlflow.entities import Metric
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from gradscope.errors import ConfigError
from gradscope.integrations.sinks import Sink, check_folder

EXPERIMENT = "gradscope"
#: Database URI schemes, whose MLflow store needs SQLAlchemy.
SQL_SCHEMES = ("sqlite:", "postgresql", "mysql", "mssql")
#: The environment variable without which MLflow 3 refuses its plain-file (``file:``) store.
ALLOW_FILE_STORE = "MLFLOW_ALLOW_FILE_STORE"
#: MLflow takes at most this many metrics per log_batch call.
_BATCH = 1000


def is_uri(dest: str) -> bool:
    """Whether ``dest`` is a tracking URI (else a folder)."""
    return "://" in dest or dest.startswith("file:")


def tracking_uri(dest: str) -> tuple[str, str | None]:
    """The tracking URI for ``dest`` and, for a folder, the artifact location to use (nothing is created)."""
    if is_uri(dest):
        return dest, None
    folder = Path(dest).resolve()
    return f"sqlite:///{folder / 'mlflow.db'}", (folder / "artifacts").as_uri()


def check(dest: str, *, new: bool = True) -> None:
    """ConfigError for what can be told of the store at ``dest`` before it is opened (nothing is
    created): a folder that cannot be created, a database store without SQLAlchemy or Alembic. ``new``
    makes no difference: every run is an MLflow run of its own."""
    if not is_uri(dest):
        check_folder("mlflow", dest)
    uri, _ = tracking_uri(dest)
    # (without them MLflow registers no SQL scheme and names only an "unsupported URI")
    missing = [m for m in ("sqlalchemy", "alembic") if importlib.util.find_spec(m) is None]
    if uri.startswith(SQL_SCHEMES) and missing:
        raise ConfigError(f"mlflow store {uri} needs the {missing[0]} package: pip install 'gradscope[mlflow]'")


def _message(exc: Exception) -> str:
    """An MLflow error's first line, cut at a word (at most 300 characters)."""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return textwrap.shorten(first, 300, placeholder=" ...")


class MlflowSink(Sink):
    name = "mlflow"

    def __init__(self, dest: str, run_name: str, config: Mapping[str, Any]) -> None:
        check(dest)
        uri, artifacts = tracking_uri(dest)
        if not is_uri(dest):
            Path(dest).mkdir(parents=True, exist_ok=True)
        try:
            with _quiet("alembic", "mlflow.store.db.utils"):  # "Creating initial MLflow database tables" lines
                self.client = MlflowClient(tracking_uri=uri)
                exp = self.client.get_experiment_by_name(EXPERIMENT)
            exp_id = exp.experiment_id if exp else self.client.create_experiment(EXPERIMENT, artifact_location=artifacts)
            self.run_id = self.client.create_run(exp_id, run_name=run_name).info.run_id
        except ImportError as exc:  # mlflow-skinny without what its SQL store needs
            raise ConfigError(f"mlflow store {uri} needs the {exc.name or 'sqlalchemy'} package: "
                              "pip install 'gradscope[mlflow]'") from None
        except MlflowException as exc:  # an unreachable server (after MLflow's own retries), a bad URI, ...
            if ALLOW_FILE_STORE in str(exc):  # MLflow 3's file: store, opt-in only (its hint ends a long message)
                raise ConfigError(f"mlflow store {uri} cannot be used: MLflow opens a file: store only with "
                                  f"{ALLOW_FILE_STORE}=true set; or give a folder (a SQLite store)") from None
            raise ConfigError(f"mlflow store {uri} cannot be used: {_message(exc)}") from None
        params = {k: str(v)[:500] for k, v in config.items() if not isinstance(v, (dict, list))}
        for key, value in params.items():
            self.client.log_param(self.run_id, key, value)
        self._text: dict[str, list[str]] = defaultdict(list)

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        now = int(time.time() * 1000)
        metrics = [Metric(name, value, now, step) for name, value in values.items()]
        try:
            for i in range(0, len(metrics), _BATCH):
                self.client.log_batch(self.run_id, metrics=metrics[i:i + _BATCH])
        except MlflowException as exc:  # a name MLflow refuses ("a//b", "a/", "..") or a failing store
            raise ConfigError(f"mlflow refused the values of step {step}: {_message(exc)}") from None

    def text(self, step: int, tag: str, lines: Sequence[str]) -> None:
        self._text[tag] += [f"step {step}: {line}" for line in lines]
        self.client.log_text(self.run_id, "\n".join(self._text[tag]) + "\n", f"{tag}.txt")

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


@contextmanager
def _quiet(*loggers: str) -> Iterator[None]:
    """These loggers' INFO lines off while the block runs (their warnings and errors still show)."""
    levels = [(logging.getLogger(name), logging.getLogger(name).level) for name in loggers]
    for logger, _ in levels:
        logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        for logger, level in levels:
            logger.setLevel(level)


def open_sink(dest: str, *, run_name: str, config: Mapping[str, Any]) -> MlflowSink:
    """A run named ``run_name`` in experiment ``gradscope`` of the store at ``dest``; the scalar
    entries of ``config`` become its parameters."""
    return MlflowSink(dest, run_name, config)
