"""The MLflow sink: metrics into a local MLflow store (no server, no network).

Needs ``mlflow-skinny`` with SQLAlchemy and Alembic (``pip install 'gradscope[mlflow]'``). ``DEST``
is either a folder — the store is then the SQLite database ``DEST/mlflow.db`` with artifacts in
``DEST/artifacts`` (MLflow 3 keeps its plain-file store only behind an opt-in; SQLite is its
recommended local store; view with ``mlflow ui --backend-store-uri sqlite:///DEST/mlflow.db``) — or
a tracking URI (``sqlite:///...``, ``file:...``, ``http://...``), used as given. Runs go to the
experiment ``gradscope``. Text (alerts, findings) becomes one artifact per tag,
``<tag>.txt`` (e.g. ``gradscope/events.txt``), lines prefixed with their step, rewritten with every
new line (an alert shows in the dashboard while the run goes on; MLflow appends to no artifact).
"""
from __future__ import annotations

import importlib.util
import logging
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
from gradscope.integrations.sinks import Sink

EXPERIMENT = "gradscope"
#: Database URI schemes, whose MLflow store needs SQLAlchemy.
SQL_SCHEMES = ("sqlite:", "postgresql", "mysql", "mssql")
#: MLflow takes at most this many metrics per log_batch call.
_BATCH = 1000


def tracking_uri(dest: str) -> tuple[str, str | None]:
    """The tracking URI for ``dest`` and, for a folder, the artifact location to use."""
    if "://" in dest or dest.startswith("file:"):
        return dest, None
    folder = Path(dest).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{folder / 'mlflow.db'}", (folder / "artifacts").as_uri()


class MlflowSink(Sink):
    def __init__(self, dest: str, run_name: str, config: Mapping[str, Any]) -> None:
        uri, artifacts = tracking_uri(dest)
        if uri.startswith(SQL_SCHEMES) and importlib.util.find_spec("sqlalchemy") is None:
            # (MLflow then registers no SQL scheme and names only an "unsupported URI")
            raise ConfigError(f"mlflow store {uri} needs the sqlalchemy package: pip install 'gradscope[mlflow]'")
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
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ConfigError(f"mlflow store {uri} cannot be used: {first[:300]}") from None
        params = {k: str(v)[:500] for k, v in config.items() if not isinstance(v, (dict, list))}
        for key, value in params.items():
            self.client.log_param(self.run_id, key, value)
        self._text: dict[str, list[str]] = defaultdict(list)

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        now = int(time.time() * 1000)
        metrics = [Metric(name, value, now, step) for name, value in values.items()]
        for i in range(0, len(metrics), _BATCH):
            self.client.log_batch(self.run_id, metrics=metrics[i:i + _BATCH])

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
