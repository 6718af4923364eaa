"""``open_run`` / ``RunReader``: read a run file, finished, live or left behind by a killed writer.

Everything a reader returns is trimmed to the committed counts (``/committed``), so it never
sees half of a record even while the writer appends. Any problem with the file itself becomes a
one-line :class:`~gradscope.errors.RunFileError` naming the file.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import stat
from collections.abc import Iterator
from types import TracebackType
from typing import TYPE_CHECKING, Any

import h5py
import numpy as np

from gradscope.errors import RunFileError
from gradscope.paths import kind_of
from gradscope.runfile import limits, schema
from gradscope.runfile.schema import RunMeta

if TYPE_CHECKING:
    import pandas as pd

_HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"
# Errors h5py raises for damaged files; wrapped into RunFileError wherever the file is read.
# (MemoryError: a damaged size field that slipped past the checks on declared sizes.)
_H5_ERRORS = (OSError, KeyError, ValueError, RuntimeError, TypeError, OverflowError, MemoryError)
#: What each dataset's values may be stored as (numpy dtype kinds): integers where the schema has
#: integers, any real number where it has floats, fixed-width bytes for strings.
_KINDS = {"i": "iu", "f": "fiu", "S": "S"}


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text or type(exc).__name__


def _regular_size(path: str) -> int:
    """The size of ``path``, which must be a regular file (a symbolic link to one is fine).

    Pipes, devices, sockets and directories are refused before anything opens them: opening a
    FIFO blocks until someone writes, and ``/dev/urandom`` never ends.
    """
    try:
        st = os.stat(path)
    except FileNotFoundError:
        dangling = " (a symbolic link to a missing file)" if os.path.islink(path) else ""
        raise RunFileError(f"{path}: no such file{dangling}") from None
    except OSError as exc:
        raise RunFileError(f"{path}: cannot access ({exc.strerror or _one_line(exc)})") from None
    kind = kind_of(st.st_mode)
    if kind is not None:
        raise RunFileError(f"{path}: is {kind}, not a run file")
    return st.st_size


def _is_hdf5(path: str, size: int) -> bool:
    """HDF5's signature sits at byte 0 or, after a user block, at 512, 1024, 2048, ... < ``size``."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # never blocks, even if a FIFO was swapped in
    except OSError:
        return False
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return False
        offset = 0
        while offset + 8 <= size:
            if os.pread(fd, 8, offset) == _HDF5_SIGNATURE:
                return True
            offset = 512 if offset == 0 else offset * 2
        return False
    except OSError:
        return False
    finally:
        os.close(fd)


def _open_h5(path: str) -> h5py.File:
    """Open read-only, falling back to SWMR for a live file or one whose writer was killed.

    A plain open first, because it checks the file's length against its superblock (SWMR
    reading skips that check, so a truncated file could read as zeros). A file whose writer is
    running or died holds "open for write" consistency flags; only a SWMR reader may open it.
    """
    size = _regular_size(path)
    if not os.access(path, os.R_OK):
        raise RunFileError(f"{path}: permission denied")
    if not _is_hdf5(path, size):
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
                attrs = self._root_attrs()
                self._check_header(attrs)
                self.meta = self._read_meta(attrs)
                self._check_datasets()
                self._cache: dict[str, Any] = {}
                self._counts = self._read_counts()
                #: the ``probe_method`` attribute as stored (configured at creation); ``meta.probe_method``
                #: is narrowed to the methods that measured the committed records
                self.configured_probe_method = self.meta.probe_method
                self._derive_probe_method()
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

    def _file_size(self) -> int:
        """The size of the file open here, not of whatever the path names now (a resume renames another over it)."""
        fd = self._opened_fd()
        if fd is not None:
            return os.fstat(fd).st_size
        try:  # another HDF5 driver (HDF5_DRIVER=stdio, core): the path's
            return os.path.getsize(self.path)
        except OSError:
            return 0

    def _opened_fd(self) -> int | None:
        """The open file's descriptor: HDF5's default driver (sec2) only; None under another."""
        return self._f.id.get_vfd_handle() if self._f.driver == "sec2" else None

    def _root_attrs(self) -> dict[str, Any]:
        """The root attributes the reader uses, each one's declared size checked before it is read."""
        names = ("format", "schema_version", *(f.name for f in dataclasses.fields(RunMeta)))
        size = self._file_size()
        out = {}
        for name in names:
            if name not in self._f.attrs:
                continue
            aid = self._f.attrs.get_id(name)
            nbytes = math.prod(aid.shape or ()) * aid.dtype.itemsize
            limits.check_read(self.path, f"the attribute {name!r}", nbytes, file_size=size, filtered=False)
            out[name] = self._f.attrs[name]
        return out

    def _check_header(self, attrs: dict[str, Any]) -> None:
        fmt = _text(attrs.get("format"))
        if fmt is None:
            raise RunFileError(f"{self.path}: not a gradscope run file (no 'format' attribute)")
        if not isinstance(fmt, str) or fmt != schema.FORMAT:
            raise RunFileError(f"{self.path}: not a gradscope run file (format is {fmt!r}, "
                               f"expected {schema.FORMAT!r})")
        version = _text(attrs.get("schema_version"))
        if version is None:
            raise RunFileError(f"{self.path}: missing the 'schema_version' attribute")
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

    def _read_meta(self, attrs: dict[str, Any]) -> RunMeta:
        try:
            return RunMeta.from_attrs(attrs)
        except KeyError as exc:
            raise RunFileError(f"{self.path}: missing the {exc.args[0]!r} attribute") from None
        # bad JSON (too deeply nested: RecursionError), inconsistent metadata, inf where an int belongs
        except (ValueError, TypeError, OverflowError, RecursionError) as exc:
            raise RunFileError(f"{self.path}: invalid run metadata ({_one_line(exc)})") from None

    def _dataset(self, name: str) -> h5py.Dataset | None:
        """The dataset at ``/name``, or None if there is none. RunFileError if reaching or reading it
        would leave the file: an external or soft link on the way, external raw-data storage, or a
        virtual dataset (each could name a FIFO or a device, and reading it would block or never end)."""
        node: Any = self._f
        parts = name.split("/")
        for i, part in enumerate(parts):
            if not isinstance(node, h5py.Group):
                return None
            link = node.get(part, getlink=True)  # the link itself, not followed
            if link is None:
                return None
            if not isinstance(link, h5py.HardLink):
                kind = "an external link" if isinstance(link, h5py.ExternalLink) else "a soft link"
                raise RunFileError(f"{self.path}: /{'/'.join(parts[:i + 1])} is {kind}; a run file's "
                                   f"datasets must be inside it")
            node = node[part]
        if not isinstance(node, h5py.Dataset):
            return None
        if node.is_virtual:
            raise RunFileError(f"{self.path}: /{name} is a virtual dataset (its data lives in other files)")
        if node.id.get_create_plist().get_external_count():
            raise RunFileError(f"{self.path}: /{name} keeps its data in external files")
        return node

    def _check_datasets(self) -> None:
        meta = self.meta
        fields = schema.step_fields(len(meta.agents), len(meta.groups), len(meta.scalar_names),
                                    len(meta.update_components))
        # Those of a later minor may be absent. Presence is asked through _dataset: `in` would follow
        # an external /steps link (to a FIFO, say) and block.
        fields = {name: f for name, f in fields.items()
                  if name not in schema.OPTIONAL_STEP_FIELDS or self._dataset(f"{schema.STEPS}/{name}") is not None}
        wanted = [f"{schema.STEPS}/{name}" for name in fields]
        wanted += [*schema.TABLES, schema.COMMITTED]
        found = {name: self._dataset(name) for name in wanted}
        missing = [name for name, ds in found.items() if ds is None]
        if missing:
            raise RunFileError(f"{self.path}: missing required datasets: {', '.join('/' + m for m in missing)}")
        self._step_ds = {name: found[f"{schema.STEPS}/{name}"] for name in fields}
        for name, (shape, _) in fields.items():
            got = self._step_ds[name].shape[1:]
            if got != shape:
                raise RunFileError(f"{self.path}: /{schema.STEPS}/{name} has record shape {got}, "
                                   f"expected {shape} from the metadata")
        self._table_ds = {name: found[name] for name in schema.TABLES}
        self._committed_ds = found[schema.COMMITTED]
        shape = self._committed_ds.shape
        # Later minor versions may append counters; the known ones come first.
        if len(shape) != 1 or shape[0] < len(schema.COMMITTED_FIELDS):
            raise RunFileError(f"{self.path}: /{schema.COMMITTED} has shape {shape}, expected "
                               f"({len(schema.COMMITTED_FIELDS)},): {', '.join(schema.COMMITTED_FIELDS)}")
        self._check_dtypes(fields)

    def _check_dtypes(self, fields: dict[str, tuple[tuple[int, ...], np.dtype]]) -> None:
        """Every dataset holds the kind of values the schema says (any width), and one record of
        each fits the read budget: a file of strings where numbers belong, or of 20,000 agents, is
        refused here rather than failing deep inside an analysis."""
        def bad(path: str, got: np.dtype, expected: str) -> RunFileError:
            return RunFileError(f"{self.path}: /{path} holds values of type {got}, expected {expected}")

        for name, (_, dtype) in fields.items():
            ds = self._step_ds[name]
            if ds.dtype.kind not in _KINDS.get(dtype.kind, dtype.kind):
                raise bad(f"{schema.STEPS}/{name}", ds.dtype, "integers" if dtype.kind == "i" else "numbers")
            limits.check_read(self.path, f"one record of /{schema.STEPS}/{name}", _row_bytes(ds))
        for name, (dtype, _) in schema.TABLES.items():
            ds = self._table_ds[name]
            got = ds.dtype
            fields_ok = got.names is not None and all(
                f in got.names and got[f].kind in _KINDS.get(dtype[f].kind, dtype[f].kind) for f in dtype.names)
            if ds.ndim != 1 or not fields_ok:
                raise bad(name, got, f"one-dimensional rows of ({', '.join(dtype.names)})")
        if self._committed_ds.dtype.kind not in "iu":
            raise bad(schema.COMMITTED, self._committed_ds.dtype, "integers")

    def _read_counts(self, committed: np.ndarray | None = None) -> dict[str, int]:
        """Committed counts by field name, capped by every dataset's current length (so never a
        partial row); ``closed`` is 0 or 1."""
        if committed is None:
            committed = self._committed_ds[:len(schema.COMMITTED_FIELDS)]
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
            committed = self._committed_ds[:len(schema.COMMITTED_FIELDS)]
            for ds in (*self._step_ds.values(), *self._table_ds.values()):
                ds.refresh()
            self._counts = self._read_counts(committed)
            self._cache.clear()
            self._derive_probe_method()
        return self

    def _derive_probe_method(self) -> None:
        """``meta.probe_method`` names only the methods that measured the committed records."""
        if self.has("method"):
            self.meta.probe_method = schema.methods_that_ran(self.configured_probe_method, self.read("method"))

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

    def has(self, name: str) -> bool:
        """Whether the file has the per-record dataset ``/steps/<name>`` (optional ones came with a minor)."""
        return name in self._step_ds

    def read(self, name: str, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Records ``[start, stop)`` of ``/steps/<name>``, clipped to the committed ones.

        Negative indices count from the last committed record, as in Python slicing.
        """
        if name not in self._step_ds:
            raise KeyError(f"no per-record dataset {name!r}; have {sorted(self._step_ds)}")
        lo, hi, _ = slice(start, stop).indices(self.n_steps)
        hi = max(lo, hi)
        with self._errors(f"reading /{schema.STEPS}/{name}"):
            ds = self._step_ds[name]
            self._check_rows(ds, hi - lo, f"/{schema.STEPS}/{name}")
            return ds[lo:hi]

    def _check_rows(self, ds: h5py.Dataset, rows: int, what: str) -> None:
        """RunFileError unless ``rows`` rows of ``ds`` fit the read budget and the file's size."""
        filtered = ds.id.get_create_plist().get_nfilters() > 0
        limits.check_read(self.path, f"{rows:,} rows of {what}", rows * _row_bytes(ds),
                          file_size=self._file_size(), filtered=filtered)

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
        return self.policy_names(self.policy_index)

    def policy_names(self, index: np.ndarray) -> np.ndarray:
        """Values of ``/steps/policy`` → object array of policy names (None: no policy, or an
        index out of range in a damaged file, rather than a wrong name)."""
        names = np.array([*self.meta.policies, None], dtype=object)
        idx = np.asarray(index).astype(np.int64)
        return names[np.where((idx >= 0) & (idx < len(self.meta.policies)), idx, len(self.meta.policies))]

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
    def method(self) -> np.ndarray:
        """(N,) object array: what measured each record's Gram (a name of
        :data:`~gradscope.runfile.schema.PROBE_METHODS`), None where not recorded (and in 1.0 files)."""
        if not self.has("method"):
            return np.full(self.n_steps, None, dtype=object)
        names = np.array([*schema.PROBE_METHODS, None], dtype=object)
        codes = self._cached("method").astype(np.int64)
        return names[np.where((codes >= 0) & (codes < len(schema.PROBE_METHODS)), codes, len(schema.PROBE_METHODS))]

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
                self._check_rows(self._table_ds[name], n - min(start, n), f"/{name}")
                return self._table_ds[name][min(start, n):n]
        key = f"/{name}"
        if key not in self._cache:
            n = self._counts[schema.TABLES[name][1]]
            with self._errors(f"reading /{name}"):
                self._check_rows(self._table_ds[name], n, f"/{name}")
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
        step, per_step = steps.step_columns(cols, self.gram, self.step, meta.agents, meta.agent_roles, meta.roles)
        records = np.bincount(np.searchsorted(step, self.step), minlength=len(step))
        return pd.DataFrame({"step": step.astype(np.int64), "records": records.astype(np.int64), **per_step})

    def replaced(self) -> bool:
        """Whether the path now names another file than the one open here: a ``--resume`` (or an
        ``--overwrite``) writes a new file and renames it over the path, and a follower of the old one
        would never see another row."""
        fd = self._opened_fd()
        if fd is None:  # (another HDF5 driver: cannot tell)
            return False
        try:
            now = os.stat(self.path)
        except OSError:  # gone for now: nothing to switch to
            return False
        opened = os.fstat(fd)
        return (now.st_dev, now.st_ino) != (opened.st_dev, opened.st_ino)

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


def _row_bytes(ds: h5py.Dataset) -> int:
    """Bytes of one row (record) of ``ds``, in Python integers (a damaged shape cannot overflow)."""
    return math.prod(ds.shape[1:]) * ds.dtype.itemsize


def _text(value: Any) -> Any:
    """A string attribute as ``str`` (h5py may return bytes); anything else as it is."""
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value


def _decode(raw: np.ndarray) -> np.ndarray:
    """Fixed-width UTF-8 bytes -> object array of str (a cut-off character becomes U+FFFD)."""
    return np.array([b.decode("utf-8", "replace") for b in raw], dtype=object)


def is_run_file(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is (or links to) a regular HDF5 file whose ``format`` attribute says it is a
    gradscope run, of any schema version, finished, live or left by a killed writer."""
    try:
        with _open_h5(os.fspath(path)) as f:
            fmt = f.attrs.get("format")
    except (RunFileError, *_H5_ERRORS):
        return False
    fmt = _text(fmt)
    return isinstance(fmt, str) and fmt == schema.FORMAT


def open_run(path: str | os.PathLike[str]) -> RunReader:
    """Open a run file for reading (a finished one, a live one, or one whose writer was killed).

    Raises:
        RunFileError: one line naming the file and the problem: missing, not HDF5, truncated,
            not a gradscope run, unparseable or newer-major schema version, missing datasets.
    """
    return RunReader(path)
