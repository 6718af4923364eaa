"""``RunWriter``: append one record per optimizer step to a SWMR run file, cheaply.

The cost model: ``log_step`` only validates and copies into preallocated numpy buffers (a few
microseconds); every ``flush_every`` records the buffers go to disk as one block per dataset,
then the file is flushed, then ``/committed`` is advanced and the file flushed again. A reader
trusts only the committed counts, so it never sees half a record, and a killed writer loses at
most the records logged since the last completed flush.
"""
from __future__ import annotations

import dataclasses
import os
import time
import warnings
from collections.abc import Mapping
from types import TracebackType
from typing import Any

import h5py
import numpy as np
from h5py import h5s

from gradscope.errors import RunFileError
from gradscope.runfile import schema
from gradscope.runfile.schema import RunMeta

#: Chunks of ~this many bytes: small enough that rewriting the open chunk at every flush is
#: cheap, big enough that a long run does not need millions of chunks.
_CHUNK_BYTES = 32 * 1024
#: Evaluations/events logged between step flushes are flushed once this many are pending.
_MAX_PENDING_ROWS = 1024


def _chunk_rows(row_bytes: int) -> int:
    """Rows per chunk for a dataset whose records are ``row_bytes`` long (a power of two)."""
    rows = max(1, _CHUNK_BYTES // max(row_bytes, 1))
    return int(min(4096, max(16, 1 << (rows.bit_length() - 1))))


def _fit(text: str, width: int, what: str) -> bytes:
    """UTF-8 encode ``text`` into at most ``width`` bytes.

    The rule (docs/format.md): a value that does not fit is cut to its longest prefix of whole
    characters that fits in ``width - 3`` bytes, followed by ``"..."``.
    """
    raw = str(text).encode("utf-8")
    if len(raw) <= width:
        return raw
    mark = schema.TRUNCATION_MARK.encode()
    cut = raw[: width - len(mark)].decode("utf-8", errors="ignore").encode("utf-8")
    warnings.warn(f"{what} longer than {width} bytes was truncated: {text[:40]!r}...", RuntimeWarning,
                  stacklevel=3)
    return cut + mark


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def _as_int(value: Any, what: str) -> int:
    try:
        return int(value.__index__())  # ints and numpy integers, never floats or strings
    except (AttributeError, TypeError):
        raise ValueError(f"{what} must be an integer, got {value!r}") from None


def _as_array(value: Any, dtype: type, what: str) -> np.ndarray:
    if hasattr(value, "detach"):  # a torch tensor: no torch import needed
        value = value.detach().cpu().numpy()
    try:
        return np.asarray(value, dtype=dtype)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{what} must be numeric array-like: {exc}") from None


class RunWriter:
    """Write a run file: metadata once, then one record per optimizer step.

    Args:
        path: the ``.h5`` file to create.
        meta: the run's metadata; ``created``/``versions`` are filled where empty and
            ``flush_every`` is set from the argument.
        flush_every: records buffered in memory between flushes (>= 1).
        overwrite: replace an existing file instead of refusing.

    Raises:
        RunFileError: the file exists (without ``overwrite``) or cannot be created.
        ValueError: inconsistent ``meta`` or ``flush_every``.

    Use it as a context manager (or call :meth:`close`): closing writes the buffered records and
    marks the file as cleanly closed, also when the block raises (KeyboardInterrupt included).
    """

    def __init__(self, path: str | os.PathLike[str], meta: RunMeta, flush_every: int = 10, *,
                 overwrite: bool = False) -> None:
        flush_every = _as_int(flush_every, "flush_every")
        if flush_every < 1:
            raise ValueError(f"flush_every must be >= 1, got {flush_every}")
        meta.validate()
        self.path = os.fspath(path)
        self.meta = dataclasses.replace(meta.with_defaults(), flush_every=flush_every)
        self.flush_every = flush_every
        self._f: h5py.File | None = None  # set only once the file is fully created
        if os.path.isdir(self.path):
            raise RunFileError(f"{self.path}: is a directory")
        if os.path.exists(self.path) and not overwrite:
            raise RunFileError(f"{self.path}: already exists (pass overwrite=True to replace it)")

        K, G, S = len(self.meta.agents), len(self.meta.groups), len(self.meta.scalar_names)
        self._fields = schema.step_fields(K, G, S)
        self._K, self._G = K, G
        self._scalar_col = {name: i for i, name in enumerate(self.meta.scalar_names)}
        self._policy_index = {name: i for i, name in enumerate(self.meta.policies)}
        self._last_scalar_keys: tuple[str, ...] | None = None
        self._last_scalar_cols = np.zeros(0, dtype=np.intp)

        try:
            f = h5py.File(self.path, "w", libver="latest")
        except OSError as exc:
            raise RunFileError(f"{self.path}: cannot create run file ({_one_line(exc)})") from None
        try:
            self._create(f)
            # From here on no object or attribute can be created: everything exists already.
            f.swmr_mode = True
        except BaseException as exc:
            f.close()
            os.remove(self.path)  # a half-created file is of no use to anyone
            if isinstance(exc, OSError):
                raise RunFileError(f"{self.path}: cannot create run file ({_one_line(exc)})") from None
            raise
        self._f = f
        self._t0 = time.perf_counter()
        self._next_opt_step = 0
        self._closed = False
        # Committed counts: rows [0, n) of each dataset are on disk and announced in /committed.
        self._n_steps = self._n_evals = self._n_events = 0
        B = flush_every
        self._buf = {name: np.empty((B, *shape), dtype) for name, (shape, dtype) in self._fields.items()}
        self._pending = 0  # buffered step records
        self._evals: list[tuple[int, bytes, float]] = []
        self._events: list[tuple[int, float, bytes, bytes, bytes]] = []
        # Hot-path shortcuts: attribute and dict lookups add up at ~1 µs per call.
        self._b_step, self._b_opt, self._b_policy = self._buf["step"], self._buf["opt_step"], self._buf["policy"]
        self._b_time, self._b_gram, self._b_tokens = self._buf["time"], self._buf["gram"], self._buf["tokens"]
        self._b_scalars = self._buf["scalars"]
        self._b_group = self._buf.get("group_gram")

    # --- creation ------------------------------------------------------------------------------

    def _create(self, f: h5py.File) -> None:
        f.attrs["format"] = schema.FORMAT
        f.attrs["schema_version"] = schema.SCHEMA_VERSION
        for key, value in self.meta.to_attrs().items():
            f.attrs[key] = value
        steps = f.create_group(schema.STEPS)
        self._ds: dict[str, h5py.Dataset] = {}
        for name, (shape, dtype) in self._fields.items():
            rows = _chunk_rows(int(np.prod(shape, dtype=np.int64)) * dtype.itemsize)
            # A zero-length record axis (no scalars declared) cannot be chunked with a fixed
            # maximum of 0, so such axes are left unlimited.
            maxshape = (None, *(d if d else None for d in shape))
            ds = steps.create_dataset(name, shape=(0, *shape), maxshape=maxshape, dtype=dtype,
                                      chunks=(rows, *(max(d, 1) for d in shape)))
            ds.attrs["description"] = schema.DESCRIPTIONS[name]
            self._ds[name] = ds
        self._ds["scalars"].attrs["names"] = f.attrs["scalar_names"]
        self._ds["policy"].attrs["names"] = f.attrs["policies"]
        if self._G:
            self._ds["group_gram"].attrs["groups"] = f.attrs["groups"]
        self._ds["time"].attrs["units"] = "s"
        for name, dtype in ((schema.EVALS, schema.EVAL_DTYPE), (schema.EVENTS, schema.EVENT_DTYPE)):
            ds = f.create_dataset(name, shape=(0,), maxshape=(None,), dtype=dtype,
                                  chunks=(_chunk_rows(dtype.itemsize),))
            ds.attrs["description"] = schema.DESCRIPTIONS[name]
            self._ds[name] = ds
        ds = f.create_dataset(schema.COMMITTED, data=np.zeros(len(schema.COMMITTED_FIELDS), "<i8"))
        ds.attrs["fields"] = list(schema.COMMITTED_FIELDS)
        ds.attrs["description"] = schema.DESCRIPTIONS[schema.COMMITTED]
        self._ds[schema.COMMITTED] = ds
        self._append = {name: _Appender(d) for name, d in self._ds.items() if name != schema.COMMITTED}
        self._committed_id = ds.id
        self._counts = np.zeros(len(schema.COMMITTED_FIELDS), "<i8")

    # --- logging -------------------------------------------------------------------------------

    def log_step(self, step: int, gram: Any, tokens: Any, *, opt_step: int | None = None,
                 policy: str | None = None, group_gram: Any = None,
                 scalars: Mapping[str, float] | None = None) -> None:
        """Buffer one record (one optimizer step); flushes every ``flush_every`` records.

        Args:
            step: training step.
            gram: (K, K) per-agent Gram matrix (array-like or a torch tensor).
            tokens: (K,) non-negative token counts per agent.
            opt_step: optimizer-step index; default: the previous one + 1 (first: 0).
            policy: name of the policy (parameter set) stepped, one of ``meta.policies``.
            group_gram: (G, K, K) per-group Grams; only when groups were declared (else NaN).
            scalars: values of declared scalar metrics; the others are NaN for this record.

        Raises:
            ValueError: a shape, a policy or a scalar name does not match the metadata.
        """
        if self._closed:
            raise ValueError(f"{self.path}: log_step on a closed RunWriter")
        K = self._K
        step = _as_int(step, "step")
        opt = self._next_opt_step if opt_step is None else _as_int(opt_step, "opt_step")
        g = _as_array(gram, np.float64, "gram")
        if g.shape != (K, K):
            raise ValueError(f"gram must have shape ({K}, {K}) for {K} agents, got {g.shape}")
        t = _as_array(tokens, np.float64, "tokens") if not isinstance(tokens, np.ndarray) else tokens
        if t.shape != (K,):
            raise ValueError(f"tokens must have shape ({K},) for {K} agents, got {t.shape}")
        if t.dtype.kind != "i":
            ti = t.astype(np.int64)
            if not np.array_equal(ti, t):
                raise ValueError(f"tokens must be whole numbers, got {t}")
            t = ti
        if (t < 0).any():
            raise ValueError(f"tokens must be >= 0, got {t}")
        if policy is None:
            p = schema.NO_POLICY
        else:
            p = self._policy_index.get(policy, None)
            if p is None:
                raise ValueError(f"unknown policy {policy!r}; declared policies: {self.meta.policies}")
        gg = None
        if group_gram is not None:
            if not self._G:
                raise ValueError("group_gram given but no parameter groups were declared in RunMeta.groups")
            gg = _as_array(group_gram, np.float64, "group_gram")
            if gg.shape != (self._G, K, K):
                raise ValueError(f"group_gram must have shape ({self._G}, {K}, {K}), got {gg.shape}")
        cols: Any = None
        vals: Any = None
        if scalars:
            cols, vals = self._scalar_columns(scalars)

        # Validated: fill row i of every buffer (nothing above touched them).
        i = self._pending
        self._b_step[i] = step
        self._b_opt[i] = opt
        self._b_policy[i] = p
        self._b_time[i] = time.perf_counter() - self._t0
        self._b_gram[i] = g
        self._b_tokens[i] = t
        row = self._b_scalars[i]
        if cols is None or len(vals) < len(row):
            row.fill(np.nan)
        if cols is not None:
            row[cols] = vals
        if self._b_group is not None:
            if gg is None:
                self._b_group[i].fill(np.nan)
            else:
                self._b_group[i] = gg
        self._next_opt_step = opt + 1
        self._pending = i + 1
        if self._pending == self.flush_every:
            self.flush()

    def _scalar_columns(self, scalars: Mapping[str, float]) -> tuple[Any, Any]:
        """Column indices and float values of ``scalars``; ValueError for undeclared names.

        A training loop usually logs the same names in the same order every step, so the
        column indices of the last key sequence are cached (50 dict lookups cost ~5 µs).
        """
        keys = tuple(scalars)
        if keys == self._last_scalar_keys:
            try:
                return self._last_scalar_cols, np.fromiter(scalars.values(), np.float64, len(keys))
            except (TypeError, ValueError):
                pass  # a bad value: the slow path below names it
        col_of = self._scalar_col
        cols: list[int] = []
        vals: list[float] = []
        for name, value in scalars.items():
            col = col_of.get(name)
            if col is None:
                raise ValueError(
                    f"undeclared scalar {name!r}: declare every scalar in RunMeta.scalar_names "
                    f"(a SWMR file cannot grow new columns); declared: {self.meta.scalar_names}"
                )
            try:
                vals.append(float(value))
            except (TypeError, ValueError):
                raise ValueError(f"scalar {name!r} must be a number, got {value!r}") from None
            cols.append(col)
        self._last_scalar_keys, self._last_scalar_cols = keys, np.array(cols, dtype=np.intp)
        return self._last_scalar_cols, np.array(vals)

    def log_eval(self, step: int, values: Mapping[str, float]) -> None:
        """Buffer evaluation results ``{name: value}`` at training ``step`` (written at the next flush).

        Names are free-form (e.g. ``"accuracy"``, ``"length/voter"``), at most 64 UTF-8 bytes
        (longer ones are truncated, see docs/format.md).
        """
        if self._closed:
            raise ValueError(f"{self.path}: log_eval on a closed RunWriter")
        step = _as_int(step, "step")
        rows = []
        for name, value in values.items():
            try:
                v = float(value)
            except (TypeError, ValueError):
                raise ValueError(f"eval {name!r} must be a number, got {value!r}") from None
            rows.append((step, _fit(name, schema.EVAL_NAME_BYTES, "eval name"), v))
        self._evals.extend(rows)
        if len(self._evals) >= _MAX_PENDING_ROWS:
            self.flush()

    def log_event(self, step: int, kind: str, message: str, severity: str = "info") -> None:
        """Buffer an event (e.g. an alert) at training ``step`` (written at the next flush).

        ``kind`` <= 32, ``severity`` <= 16, ``message`` <= 256 UTF-8 bytes; longer values are
        truncated (docs/format.md).
        """
        if self._closed:
            raise ValueError(f"{self.path}: log_event on a closed RunWriter")
        self._events.append((
            _as_int(step, "step"),
            time.perf_counter() - self._t0,
            _fit(kind, schema.EVENT_KIND_BYTES, "event kind"),
            _fit(severity, schema.EVENT_SEVERITY_BYTES, "event severity"),
            _fit(message, schema.EVENT_MESSAGE_BYTES, "event message"),
        ))
        if len(self._events) >= _MAX_PENDING_ROWS:
            self.flush()

    # --- flushing ------------------------------------------------------------------------------

    def flush(self) -> None:
        """Write every buffered record, then advance ``/committed``.

        Rows are written at the committed offsets and the counters move only at the end, so a
        flush interrupted by an exception can simply be repeated.
        """
        if self._f is None or self._closed:
            return
        self._commit(closed=False)

    def _commit(self, closed: bool) -> None:
        f = self._f
        assert f is not None
        b = self._pending
        n_steps = self._n_steps + b
        if b:
            for name, buf in self._buf.items():
                self._append[name].write(self._n_steps, buf[:b])
        n_evals = self._n_evals + len(self._evals)
        if self._evals:
            self._append[schema.EVALS].write(self._n_evals, np.array(self._evals, schema.EVAL_DTYPE))
        n_events = self._n_events + len(self._events)
        if self._events:
            self._append[schema.EVENTS].write(self._n_events, np.array(self._events, schema.EVENT_DTYPE))
        # Data (and the new dataset extents) reach the file before the counters that announce
        # them: a reader that sees the counters finds the rows.
        f.flush()
        self._counts[:] = (n_steps, n_evals, n_events, int(closed))
        self._committed_id.write(h5s.ALL, h5s.ALL, self._counts)
        f.flush()
        self._n_steps, self._n_evals, self._n_events = n_steps, n_evals, n_events
        self._pending = 0
        self._evals.clear()
        self._events.clear()

    def close(self) -> None:
        """Flush, mark the file as cleanly closed and close it. Safe to call more than once."""
        if self._closed or self._f is None:
            return
        self._closed = True  # even if the final flush fails: never write to a half-closed writer
        try:
            self._commit(closed=True)
        finally:
            self._f.close()

    # --- state ---------------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def n_steps(self) -> int:
        """Records logged so far, buffered ones included."""
        return self._n_steps + self._pending

    @property
    def n_committed(self) -> int:
        """Records on disk and announced in ``/committed`` (what a reader or a crash keeps)."""
        return self._n_steps

    def __enter__(self) -> RunWriter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc_type is None:
            self.close()
            return
        # Keep what was logged, but never let a failing close hide the original exception.
        try:
            self.close()
        except Exception as close_exc:  # noqa: BLE001
            warnings.warn(f"{self.path}: closing after {exc_type.__name__} failed: {close_exc}",
                          RuntimeWarning, stacklevel=2)

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{self.n_steps} records, {self._n_steps} committed"
        return f"RunWriter({self.path!r}, {state})"


class _Appender:
    """Writes blocks of rows at given offsets of one resizable dataset, growing it as needed.

    Uses h5py's low-level API and reuses its dataspace objects: h5py's slicing machinery costs
    ~5x more per call, creating a dataspace ~6 µs, and this runs for every dataset at every flush.
    """

    def __init__(self, ds: h5py.Dataset) -> None:
        self._id = ds.id
        self._fspace = ds.id.get_space()
        self._maxshape = tuple(h5s.UNLIMITED if m is None else m for m in ds.maxshape)
        self._mspaces: dict[tuple[int, ...], h5s.SpaceID] = {}

    def write(self, start: int, block: np.ndarray) -> None:
        """Write ``block`` to rows ``[start, start + len(block))``; the dataset ends there."""
        shape = (start + block.shape[0], *block.shape[1:])
        self._id.set_extent(shape)
        if block.size == 0:
            return
        block = np.ascontiguousarray(block)
        # Our own file dataspace, kept in step with the dataset's extent.
        self._fspace.set_extent_simple(shape, self._maxshape)
        self._fspace.select_hyperslab((start,) + (0,) * (block.ndim - 1), block.shape)
        mspace = self._mspaces.get(block.shape)
        if mspace is None:
            mspace = self._mspaces[block.shape] = h5s.create_simple(block.shape)
        self._id.write(mspace, self._fspace, block)
