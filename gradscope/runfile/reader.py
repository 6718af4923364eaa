"""``open_run`` / ``RunReader``: read a run file, finished, live or left behind by a killed writer.

Everything a reader returns is trimmed to the committed counts (``/committed``), so it never
sees half of a record even while the writer appends. Any problem with the file itself becomes a
one-line :class:`~gradscope.errors.RunFileError` naming the file.
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from types import TracebackType
from typing import TYPE_CHECKING, Any

import h5py
import numpy as np

from gradscope.errors import RunFileError
from gradscope.runfile import schema
from gradscope.runfile.schema import RunMeta

if TYPE_CHECKING:
    import pandas as pd

_HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"
# Errors h5py raises for damaged files; wrapped into RunFileError wherever the file is read.
_H5_ERRORS = (OSError, KeyError, ValueError, RuntimeError, TypeError)


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text or type(exc).__name__


def _is_hdf5(path: str) -> bool:
    """HDF5's signature sits at byte 0 or, after a user block, at 512, 1024, 2048, ..."""
    try:
        with open(path, "rb") as fh:
            offset = 0
            while True:
                fh.seek(offset)
                head = fh.read(8)
                if len(head) < 8:
                    return False
                if head == _HDF5_SIGNATURE:
                    return True
                offset = 512 if offset == 0 else offset * 2
    except OSError:
        return False


def _open_h5(path: str) -> h5py.File:
    """Open read-only, falling back to SWMR for a live file or one whose writer was killed.

    A plain open first, because it checks the file's length against its superblock (SWMR
    reading skips that check, so a truncated file could read as zeros). A file whose writer is
    running or died holds "open for write" consistency flags; only a SWMR reader may open it.
    """
    if not os.path.exists(path):
        raise RunFileError(f"{path}: no such file")
    if os.path.isdir(path):
        raise RunFileError(f"{path}: is a directory, not a run file")
    if not os.access(path, os.R_OK):
        raise RunFileError(f"{path}: permission denied")
    if not _is_hdf5(path):
        raise RunFileError(f"{path}: not an HDF5 file")
    try:
        return h5py.File(path, "r")
    except OSError as exc:
        plain = _one_line(exc)
    if "already open for write" in plain or "consistency flags" in plain:
        try:
            return h5py.File(path, "r", libver="latest", swmr=True)
        except OSError as exc:
            plain = _one_line(exc)
    if "unable to lock file" in plain:
        raise RunFileError(f"{path}: locked by another process (a writer that has not started SWMR "
                           f"mode yet?); retry, or set HDF5_USE_FILE_LOCKING=FALSE ({plain})")
    if "truncated" in plain:
        raise RunFileError(f"{path}: truncated HDF5 file ({plain})")
    raise RunFileError(f"{path}: cannot open as HDF5 ({plain})")


class RunReader:
    """A run file opened for reading. Use :func:`open_run` to get one.

    Array properties are read on first use and cached until :meth:`refresh`; all hold the first
    ``n_steps`` records (N), with K agents and G parameter groups.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self._f = _open_h5(self.path)
        try:
            with self._errors("reading the file's structure"):
                self._check_header()
                self.meta = self._read_meta()
                self._check_datasets()
                self._cache: dict[str, Any] = {}
                self._counts = self._read_counts()
        except BaseException:
            self._f.close()
            raise

    # --- opening -------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _errors(self, doing: str) -> Iterator[None]:
        """Turn an h5py failure on a damaged file into one RunFileError line naming the file."""
        try:
            yield
        except RunFileError:
            raise
        except _H5_ERRORS as exc:
            raise RunFileError(f"{self.path}: damaged run file, failed {doing} ({_one_line(exc)})") from None

    def _check_header(self) -> None:
        attrs = self._f.attrs
        fmt = attrs.get("format")
        if isinstance(fmt, bytes):
            fmt = fmt.decode("utf-8", "replace")
        if fmt is None:
            raise RunFileError(f"{self.path}: not a gradscope run file (no 'format' attribute)")
        if fmt != schema.FORMAT:
            raise RunFileError(f"{self.path}: not a gradscope run file (format is {fmt!r}, "
                               f"expected {schema.FORMAT!r})")
        version = attrs.get("schema_version")
        if version is None:
            raise RunFileError(f"{self.path}: missing the 'schema_version' attribute")
        if isinstance(version, bytes):
            version = version.decode("utf-8", "replace")
        try:
            major, minor = schema.parse_version(str(version))
        except ValueError:
            raise RunFileError(f"{self.path}: unparseable schema_version {str(version)!r} "
                               f"(expected 'MAJOR.MINOR')") from None
        if major > schema.SCHEMA_MAJOR:
            raise RunFileError(f"{self.path}: schema version {major}.{minor} is newer than this "
                               f"gradscope reads ({schema.SCHEMA_MAJOR}.x); upgrade gradscope")
        if major < schema.SCHEMA_MAJOR:
            raise RunFileError(f"{self.path}: unsupported schema version {major}.{minor} "
                               f"(this gradscope reads {schema.SCHEMA_MAJOR}.x)")
        self.schema_version = f"{major}.{minor}"

    def _read_meta(self) -> RunMeta:
        try:
            return RunMeta.from_attrs(self._f.attrs)
        except KeyError as exc:
            raise RunFileError(f"{self.path}: missing the {exc.args[0]!r} attribute") from None
        except (ValueError, TypeError) as exc:  # bad JSON or inconsistent metadata
            raise RunFileError(f"{self.path}: invalid run metadata ({_one_line(exc)})") from None

    def _check_datasets(self) -> None:
        meta = self.meta
        fields = schema.step_fields(len(meta.agents), len(meta.groups), len(meta.scalar_names),
                                    len(meta.update_components))
        wanted = [f"{schema.STEPS}/{name}" for name in fields]
        wanted += [*schema.TABLES, schema.COMMITTED]
        missing = [name for name in wanted if not isinstance(self._f.get(name), h5py.Dataset)]
        if missing:
            raise RunFileError(f"{self.path}: missing required datasets: {', '.join('/' + m for m in missing)}")
        self._step_ds = {name: self._f[f"{schema.STEPS}/{name}"] for name in fields}
        for name, (shape, _) in fields.items():
            got = self._step_ds[name].shape[1:]
            if got != shape:
                raise RunFileError(f"{self.path}: /{schema.STEPS}/{name} has record shape {got}, "
                                   f"expected {shape} from the metadata")
        self._table_ds = {name: self._f[name] for name in schema.TABLES}
        self._committed_ds = self._f[schema.COMMITTED]
        shape = self._committed_ds.shape
        # Later minor versions may append counters; the known ones come first.
        if len(shape) != 1 or shape[0] < len(schema.COMMITTED_FIELDS):
            raise RunFileError(f"{self.path}: /{schema.COMMITTED} has shape {shape}, expected "
                               f"({len(schema.COMMITTED_FIELDS)},): {', '.join(schema.COMMITTED_FIELDS)}")

    def _read_counts(self, committed: np.ndarray | None = None) -> dict[str, int]:
        """Committed counts by field name, capped by every dataset's current length (so never a
        partial row); ``closed`` is 0 or 1."""
        if committed is None:
            committed = self._committed_ds[()]
        raw = dict(zip(schema.COMMITTED_FIELDS, (int(x) for x in committed)))
        counts = {"n_steps": min([raw["n_steps"]] + [ds.shape[0] for ds in self._step_ds.values()])}
        for name, (_, field) in schema.TABLES.items():
            counts[field] = min(raw[field], self._table_ds[name].shape[0])
        counts = {field: max(n, 0) for field, n in counts.items()}
        counts["closed"] = int(bool(raw["closed"]))
        return counts

    # --- live files ----------------------------------------------------------------------------

    @property
    def swmr(self) -> bool:
        """Whether the file was opened as a SWMR reader (live, or its writer did not close it)."""
        return bool(self._f.swmr_mode)

    def refresh(self) -> RunReader:
        """Pick up what a live writer committed since the last look; drops cached arrays.

        Counts never decrease. On a file that was closed when opened this changes nothing.
        """
        with self._errors("refreshing"):
            if not self._f.swmr_mode:
                return self
            # Read the counters' *values* first, then refresh the datasets: everything the
            # counters announce was flushed before them, so the refreshed datasets are at least
            # that long. (Reading the counters after the datasets' refresh could announce rows
            # whose extent this reader has not seen yet.)
            self._committed_ds.refresh()
            committed = self._committed_ds[()]
            for ds in (*self._step_ds.values(), *self._table_ds.values()):
                ds.refresh()
            self._counts = self._read_counts(committed)
            self._cache.clear()
        return self

    # --- counts and metadata -------------------------------------------------------------------

    @property
    def n_steps(self) -> int:
        """Number of complete (committed) records N."""
        return self._counts["n_steps"]

    @property
    def n_evals(self) -> int:
        """Number of committed rows of ``/evals``."""
        return self._counts["n_evals"]

    @property
    def n_events(self) -> int:
        """Number of committed rows of ``/events``."""
        return self._counts["n_events"]

    @property
    def n_metrics(self) -> int:
        """Number of committed rows of ``/metrics``."""
        return self._counts["n_metrics"]

    @property
    def closed(self) -> bool:
        """True once the writer closed the file cleanly (False: still live, or killed)."""
        return bool(self._counts["closed"])

    # --- per-record arrays ---------------------------------------------------------------------

    def read(self, name: str, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Records ``[start, stop)`` of ``/steps/<name>``, clipped to the committed ones.

        Negative indices count from the last committed record, as in Python slicing.
        """
        if name not in self._step_ds:
            raise KeyError(f"no per-record dataset {name!r}; have {sorted(self._step_ds)}")
        lo, hi, _ = slice(start, stop).indices(self.n_steps)
        with self._errors(f"reading /{schema.STEPS}/{name}"):
            return self._step_ds[name][lo:max(lo, hi)]

    def _cached(self, name: str) -> np.ndarray:
        if name not in self._cache:
            self._cache[name] = self.read(name)
        return self._cache[name]

    @property
    def step(self) -> np.ndarray:
        """(N,) int64 training step of each record."""
        return self._cached("step")

    @property
    def opt_step(self) -> np.ndarray:
        """(N,) int64 optimizer-step index of each record."""
        return self._cached("opt_step")

    @property
    def policy_index(self) -> np.ndarray:
        """(N,) int16 index into ``meta.policies``; -1 = no policy."""
        return self._cached("policy")

    @property
    def policy(self) -> np.ndarray:
        """(N,) object array of policy names (None where the record has no policy)."""
        names = np.array([*self.meta.policies, None], dtype=object)
        idx = self.policy_index.astype(np.int64)
        # Out-of-range indices (a damaged file) become None rather than wrong names.
        idx = np.where((idx >= 0) & (idx < len(self.meta.policies)), idx, len(self.meta.policies))
        return names[idx]

    @property
    def time(self) -> np.ndarray:
        """(N,) float64 seconds since the writer started."""
        return self._cached("time")

    @property
    def gram(self) -> np.ndarray:
        """(N, K, K) float64 per-agent Gram matrices (NaN entries are kept as data)."""
        return self._cached("gram")

    @property
    def group_gram(self) -> np.ndarray | None:
        """(N, G, K, K) float64 per-group Grams, or None when no groups were declared."""
        return self._cached("group_gram") if "group_gram" in self._step_ds else None

    @property
    def update_gram(self) -> np.ndarray | None:
        """(N, C, C) float64 update-component Grams (``meta.update_components``; NaN = not logged), or
        None when the run has no update attribution."""
        return self._cached("update_gram") if "update_gram" in self._step_ds else None

    @property
    def update_interference(self) -> np.ndarray | None:
        """(N, C, K) float64 ``<Δθ_a, g_l>`` (NaN = not logged), or None without update attribution."""
        return self._cached("update_interference") if "update_interference" in self._step_ds else None

    @property
    def update_grad_scale(self) -> np.ndarray | None:
        """(N,) float64 clipping factor c per record (NaN = not logged), or None without update attribution."""
        return self._cached("update_grad_scale") if "update_grad_scale" in self._step_ds else None

    @property
    def tokens(self) -> np.ndarray:
        """(N, K) int64 tokens per agent."""
        return self._cached("tokens")

    @property
    def scalars(self) -> pd.DataFrame:
        """One row per record (index = record number): ``step`` (int64), ``policy`` (name; missing
        where the record has none), then one float64 column per declared scalar (a scalar itself
        named ``step`` or ``policy`` is shown as ``scalar/step``, ``scalar/policy``)."""
        import pandas as pd

        values = self._cached("scalars")
        cols: dict[str, Any] = {"step": self.step, "policy": self.policy}
        for j, name in enumerate(self.meta.scalar_names):
            cols["scalar/" + name if name in ("step", "policy") else name] = values[:, j]
        return pd.DataFrame(cols, index=pd.RangeIndex(self.n_steps))

    # --- evaluations, metrics and events -------------------------------------------------------

    def read_table(self, name: str, start: int = 0) -> np.ndarray:
        """The committed rows of ``/evals``, ``/events`` or ``/metrics`` as stored (a structured
        array; strings as fixed-width UTF-8 bytes). Cached until :meth:`refresh`; rows from
        ``start`` on (for followers of a live file) are read without the cache."""
        if name not in self._table_ds:
            raise KeyError(f"no table {name!r}; have {sorted(self._table_ds)}")
        if start:
            n = self._counts[schema.TABLES[name][1]]
            with self._errors(f"reading /{name}"):
                return self._table_ds[name][min(start, n):n]
        key = f"/{name}"
        if key not in self._cache:
            n = self._counts[schema.TABLES[name][1]]
            with self._errors(f"reading /{name}"):
                self._cache[key] = self._table_ds[name][:n]
        return self._cache[key]

    def _long(self, name: str) -> pd.DataFrame:
        """A long table (/evals, /metrics) as a DataFrame: step (int64), name (str), value (float64)."""
        import pandas as pd

        rows = self.read_table(name)
        return pd.DataFrame({
            "step": rows["step"].astype(np.int64),
            "name": _decode(rows["name"]),
            "value": rows["value"].astype(np.float64),
        })

    @staticmethod
    def _wide(long: pd.DataFrame) -> pd.DataFrame:
        """Pivot a long table: index step, one column per name (if repeated, the last non-NaN value)."""
        return long.pivot_table(index="step", columns="name", values="value", aggfunc="last",
                                dropna=False)

    @property
    def evals(self) -> pd.DataFrame:
        """Evaluations, long DataFrame with columns step (int64), name (str), value (float64)."""
        return self._long(schema.EVALS)

    def evals_wide(self) -> pd.DataFrame:
        """Evaluations pivoted: index step, one column per name (if repeated, the last non-NaN value)."""
        return self._wide(self.evals)

    @property
    def metrics(self) -> pd.DataFrame:
        """Per-training-step metrics, long DataFrame with columns step (int64), name (str),
        value (float64)."""
        return self._long(schema.METRICS)

    def metrics_wide(self) -> pd.DataFrame:
        """Metrics pivoted: index step, one column per name (if repeated, the last non-NaN value)."""
        return self._wide(self.metrics)

    @property
    def events(self) -> pd.DataFrame:
        """DataFrame with columns step, time, kind, severity, message."""
        import pandas as pd

        rows = self.read_table(schema.EVENTS)
        return pd.DataFrame({
            "step": rows["step"].astype(np.int64),
            "time": rows["time"].astype(np.float64),
            "kind": _decode(rows["kind"]),
            "severity": _decode(rows["severity"]),
            "message": _decode(rows["message"]),
        })

    # --- derived statistics --------------------------------------------------------------------

    def stats(self, per: str = "record") -> pd.DataFrame:
        """Every column of ``gradscope.stats.derive`` (and, with update attribution, of
        ``gradscope.stats.derive_updates``), per record or per training step.

        ``per="record"``: one row per record — ``step``, ``opt_step``, ``policy``, then the columns.
        ``per="step"``: one row per training step with records — ``step``, ``records`` (how many),
        then each column averaged over the step's records in which its agent / role has a gradient
        (``gradscope.steps.step_columns``: the rule the detectors and alerts use), so a step's
        several optimizer-step records (one per policy under IP) give one point, not a zigzag.
        """
        import pandas as pd

        from gradscope import steps  # lazy: the reader works without the stats modules
        from gradscope.stats import derive, derive_updates

        if per not in ("record", "step"):
            raise ValueError(f"stats(per=...) must be 'record' or 'step', got {per!r}")
        meta = self.meta
        cols: dict[str, Any] = derive(self.gram, self.tokens, meta.agents, meta.agent_roles)
        if meta.update_unit:
            units = meta.roles if meta.update_unit == "role" else meta.agent_roles
            cols.update(derive_updates(self.update_gram, self.update_interference, units, meta.agent_roles,
                                       meta.roles))
        if per == "record":
            return pd.DataFrame({"step": self.step, "opt_step": self.opt_step, "policy": self.policy, **cols})
        step, per_step = steps.step_columns(cols, self.gram, self.step, meta.agents, meta.agent_roles)
        records = np.bincount(np.searchsorted(step, self.step), minlength=len(step))
        return pd.DataFrame({"step": step.astype(np.int64), "records": records.astype(np.int64), **per_step})

    # --- lifetime ------------------------------------------------------------------------------

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> RunReader:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed cleanly" if self.closed else "not closed"
        return f"RunReader({self.path!r}, {self.n_steps} records, {state})"


def _decode(raw: np.ndarray) -> np.ndarray:
    """Fixed-width UTF-8 bytes -> object array of str (a cut-off character becomes U+FFFD)."""
    return np.array([b.decode("utf-8", "replace") for b in raw], dtype=object)


def open_run(path: str | os.PathLike[str]) -> RunReader:
    """Open a run file for reading (a finished one, a live one, or one whose writer was killed).

    Raises:
        RunFileError: one line naming the file and the problem: missing, not HDF5, truncated,
            not a gradscope run, unparseable or newer-major schema version, missing datasets.
    """
    return RunReader(path)
