"""``RunWriter``: append one record per optimizer step to a SWMR run file, cheaply.

The cost model: ``log_step`` only validates and copies into preallocated numpy buffers (a few
microseconds); every ``flush_every`` records the buffers go to disk as one block per dataset,
then the file is flushed, then ``/committed`` is advanced and the file flushed again. A reader
trusts only the committed counts, so it never sees half a record, and a killed writer loses at
most the records logged since the last completed flush.

``RunWriter.resume`` continues a run after a restart: it copies the records below a step into a
fresh file and atomically replaces the old one (a killed writer's file cannot be reopened for
writing).
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import time
import warnings
from collections.abc import Mapping
from types import TracebackType
from typing import Any

import h5py
import numpy as np
from h5py import h5s

from gradscope.errors import RunFileError
from gradscope.paths import check_output, fsync
from gradscope.runfile import limits, schema
from gradscope.runfile.reader import RunReader, is_run_file, open_run
from gradscope.runfile.schema import RunMeta

#: Chunks of ~this many bytes: small enough that rewriting the open chunk at every flush is
#: cheap, big enough that a long run does not need millions of chunks.
_CHUNK_BYTES = 32 * 1024
#: Evaluations/metrics/events logged between step flushes are flushed once this many are pending.
_MAX_PENDING_ROWS = 1024
#: ``RunWriter.resume`` builds the new file at ``<path>`` + this suffix, then renames it.
RESUME_SUFFIX = ".resume-tmp"
#: ``RunWriter.resume`` copies records in blocks of about this many bytes.
_COPY_BYTES = 64 * 1024 * 1024
_CLOSED = schema.COMMITTED_FIELDS.index("closed")
#: Records per flush of a writer not told otherwise, and of a resume of a file that records none.
DEFAULT_FLUSH_EVERY = 10


def _record_bytes(fields: dict[str, tuple[tuple[int, ...], np.dtype]]) -> int:
    """Bytes of one record of every ``/steps`` dataset (``fields``: :func:`schema.step_fields`)."""
    return sum(int(np.prod(shape, dtype=np.int64)) * dtype.itemsize for shape, dtype in fields.values())


def _chunk_rows(row_bytes: int) -> int:
    """Rows per chunk for a dataset whose records are ``row_bytes`` long (a power of two)."""
    rows = max(1, _CHUNK_BYTES // max(row_bytes, 1))
    return int(min(4096, max(16, 1 << (rows.bit_length() - 1))))


def _fit(text: str, width: int, what: str, stacklevel: int = 3) -> bytes:
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
                  stacklevel=stacklevel)
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
        overwrite: replace an existing run file instead of refusing (only a regular file that
            holds a gradscope run: see :func:`check_overwrite`).

    Raises:
        RunFileError: the path exists (without ``overwrite``), is anything but a run file (with
            it), or the file cannot be created.
        ValueError: inconsistent ``meta`` or ``flush_every``.

    Use it as a context manager (or call :meth:`close`): closing writes the buffered records and
    marks the file as cleanly closed, also when the block raises (KeyboardInterrupt included).
    To continue an existing run after a restart, use :meth:`resume` instead of the constructor.
    """

    def __init__(self, path: str | os.PathLike[str], meta: RunMeta, flush_every: int = DEFAULT_FLUSH_EVERY, *,
                 overwrite: bool = False) -> None:
        flush_every = _as_int(flush_every, "flush_every")
        if flush_every < 1:
            raise ValueError(f"flush_every must be >= 1, got {flush_every}")
        meta.validate_new()
        self.path = os.fspath(path)
        self.meta = dataclasses.replace(meta.with_defaults(), flush_every=flush_every)
        self.flush_every = flush_every
        self.resumed: tuple[int, str] | None = None  # (step, message) of the "resume" event a resume wrote
        self._f: h5py.File | None = None  # set only once the file is fully created
        if os.path.lexists(self.path):
            if not overwrite:
                raise RunFileError(f"{self.path}: already exists (pass overwrite=True to replace a run file)")
            check_overwrite(self.path)
            try:
                os.remove(self.path)
            except OSError as exc:
                raise RunFileError(f"{self.path}: cannot replace the run file ({_one_line(exc)})") from None

        K, G, S = len(self.meta.agents), len(self.meta.groups), len(self.meta.scalar_names)
        self._components = self.meta.update_components
        self._fields = schema.step_fields(K, G, S, len(self._components))
        self._K, self._G = K, G
        self._scalar_col = {name: i for i, name in enumerate(self.meta.scalar_names)}
        self._policy_index = {name: i for i, name in enumerate(self.meta.policies)}
        self._last_scalar_keys: tuple[str, ...] | None = None
        self._last_scalar_cols = np.zeros(0, dtype=np.intp)

        try:  # "x": O_CREAT|O_EXCL, so never through a link or into something that appeared meanwhile
            f = h5py.File(self.path, "x", libver="latest")
        except OSError as exc:
            raise RunFileError(f"{self.path}: cannot create run file ({_one_line(exc)})") from None
        try:
            self._create(f)
            # From here on no object or attribute can be created: everything exists already.
            f.swmr_mode = True
        except BaseException as exc:
            f.close()
            os.remove(self.path)  # a half-created file (ours: "x" created it) is of no use to anyone
            if isinstance(exc, OSError):
                raise RunFileError(f"{self.path}: cannot create run file ({_one_line(exc)})") from None
            raise
        self._f = f
        self._t0 = time.perf_counter()
        self._next_opt_step = 0
        self._closed = False
        # Committed count: records [0, n) of /steps are on disk and announced in /committed (the
        # row tables keep their own, see _Table).
        self._n_steps = 0
        B = flush_every
        self._buf = {name: np.empty((B, *shape), dtype) for name, (shape, dtype) in self._fields.items()}
        self._pending = 0  # buffered step records
        # Hot-path shortcuts: attribute and dict lookups add up at ~1 µs per call.
        self._b_step, self._b_opt, self._b_policy = self._buf["step"], self._buf["opt_step"], self._buf["policy"]
        self._b_time, self._b_gram, self._b_tokens = self._buf["time"], self._buf["gram"], self._buf["tokens"]
        self._b_scalars = self._buf["scalars"]
        self._b_group = self._buf.get("group_gram")
        self._b_method = self._buf["method"]
        self._b_update = [self._buf[name] for name in schema.UPDATE_FIELDS] if self._components else None

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
        if self._components:
            components = json.dumps(self._components)
            self._ds["update_gram"].attrs["components"] = components
            self._ds["update_interference"].attrs["components"] = components
        self._ds["time"].attrs["units"] = "s"
        self._ds["method"].attrs["codes"] = json.dumps(list(schema.PROBE_METHODS))
        for name, (dtype, _) in schema.TABLES.items():
            ds = f.create_dataset(name, shape=(0,), maxshape=(None,), dtype=dtype,
                                  chunks=(_chunk_rows(dtype.itemsize),))
            ds.attrs["description"] = schema.DESCRIPTIONS[name]
            self._ds[name] = ds
        ds = f.create_dataset(schema.COMMITTED, data=np.zeros(len(schema.COMMITTED_FIELDS), "<i8"))
        ds.attrs["fields"] = list(schema.COMMITTED_FIELDS)
        ds.attrs["description"] = schema.DESCRIPTIONS[schema.COMMITTED]
        self._ds[schema.COMMITTED] = ds
        self._append = {name: _Appender(d) for name, d in self._ds.items() if name != schema.COMMITTED}
        self._tables = {name: _Table(dtype, schema.COMMITTED_FIELDS.index(counter), self._append[name])
                        for name, (dtype, counter) in schema.TABLES.items()}
        self._committed_id = ds.id
        self._counts = np.zeros(len(schema.COMMITTED_FIELDS), "<i8")

    # --- logging -------------------------------------------------------------------------------

    def log_step(self, step: int, gram: Any, tokens: Any, *, opt_step: int | None = None,
                 policy: str | None = None, group_gram: Any = None,
                 scalars: Mapping[str, float] | None = None, method: str | None = None,
                 update: Any = None) -> None:
        """Buffer one record (one optimizer step); flushes every ``flush_every`` records.

        Args:
            step: training step.
            gram: (K, K) per-agent Gram matrix (array-like or a torch tensor).
            tokens: (K,) non-negative token counts per agent.
            opt_step: optimizer-step index; default: the previous one + 1 (first: 0).
            policy: name of the policy (parameter set) stepped, one of ``meta.policies``.
            group_gram: (G, K, K) per-group Grams; only when groups were declared (else NaN).
            scalars: values of declared scalar metrics; the others are NaN for this record.
            method: what measured the Gram (``StepResult.method``), one of
                :data:`~gradscope.runfile.schema.PROBE_METHODS`; None: not recorded.
            update: the optimizer step's update attribution: a
                :class:`gradscope.probe.updates.UpdateResult`, or any object with ``gram`` (C, C),
                ``interference`` (C, K), ``grad_scale`` and ``residual`` (and optionally
                ``components``, checked against ``meta.update_components``). Only when
                ``meta.update_unit`` is set; None: NaN for this record.

        Raises:
            ValueError: a shape, a policy, a scalar name, a method or update components do not match
                the metadata.
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
            ti = t.astype(np.int64) if np.isfinite(t).all() else None  # (casting NaN warns)
            if ti is None or not np.array_equal(ti, t):
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
        code = schema.METHOD_UNRECORDED
        if method is not None:
            if method not in schema.PROBE_METHODS:
                raise ValueError(f"unknown probe method {method!r}; known: {list(schema.PROBE_METHODS)}")
            code = schema.PROBE_METHODS.index(method)
        upd = None if update is None else self._update_values(update)
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
        self._b_method[i] = code
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
        if self._b_update is not None:
            for buf, value in zip(self._b_update, upd or (np.nan,) * len(self._b_update)):
                buf[i] = value
        self._next_opt_step = opt + 1
        self._pending = i + 1
        if self._pending == self.flush_every:
            self.flush()

    def _update_values(self, update: Any) -> tuple[np.ndarray, np.ndarray, float, float]:
        """Validated (gram, interference, grad_scale, residual) of an update for ``log_step``."""
        C, K = len(self._components), self._K
        if not C:
            raise ValueError("update given but the run has no update attribution (RunMeta.update_unit is empty)")
        components = getattr(update, "components", None)
        if components is not None and list(components) != self._components:
            raise ValueError(f"update components {list(components)} differ from the run's {self._components}")
        try:
            gram, inter = update.gram, update.interference
            scale, residual = float(update.grad_scale), float(update.residual)
        except (AttributeError, TypeError, ValueError) as exc:
            raise ValueError(f"update must have gram, interference, grad_scale and residual: {exc}") from None
        gram = _as_array(gram, np.float64, "update gram")
        inter = _as_array(inter, np.float64, "update interference")
        if gram.shape != (C, C) or inter.shape != (C, K):
            raise ValueError(f"update gram must have shape ({C}, {C}) and interference ({C}, {K}), got "
                             f"{gram.shape} and {inter.shape}")
        return gram, inter, scale, residual

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
        self._log_long(schema.EVALS, "log_eval", "eval", step, values)

    def log_metrics(self, step: int, values: Mapping[str, float]) -> None:
        """Buffer per-training-step metrics ``{name: value}`` at ``step`` (written at the next flush).

        For what happens once per training step rather than per optimizer step (reward mean,
        update norm or optimizer steps per policy, timings, ...). Names are free-form and need no
        declaration, at most 64 UTF-8 bytes (longer ones are truncated, see docs/format.md).
        """
        self._log_long(schema.METRICS, "log_metrics", "metric", step, values)

    def _log_long(self, table: str, method: str, what: str, step: int, values: Mapping[str, float]) -> None:
        """Shared by the long tables (/evals, /metrics): one (step, name, value) row per entry."""
        if self._closed:
            raise ValueError(f"{self.path}: {method} on a closed RunWriter")
        step = _as_int(step, "step")
        rows = []
        for name, value in values.items():
            try:
                v = float(value)
            except (TypeError, ValueError):
                raise ValueError(f"{what} {name!r} must be a number, got {value!r}") from None
            # stacklevel 4: the warning points at the caller of log_eval/log_metrics.
            rows.append((step, _fit(name, schema.NAME_BYTES, f"{what} name", stacklevel=4), v))
        self._queue(table, rows)

    def log_event(self, step: int, kind: str, message: str, severity: str = "info") -> None:
        """Buffer an event (e.g. an alert) at training ``step`` (written at the next flush).

        ``kind`` <= 32, ``severity`` <= 16, ``message`` <= 256 UTF-8 bytes; longer values are
        truncated (docs/format.md).
        """
        if self._closed:
            raise ValueError(f"{self.path}: log_event on a closed RunWriter")
        self._queue(schema.EVENTS, [(
            _as_int(step, "step"),
            time.perf_counter() - self._t0,
            _fit(kind, schema.EVENT_KIND_BYTES, "event kind"),
            _fit(severity, schema.EVENT_SEVERITY_BYTES, "event severity"),
            _fit(message, schema.EVENT_MESSAGE_BYTES, "event message"),
        )])

    def _queue(self, table: str, rows: list[tuple[Any, ...]]) -> None:
        """Add validated rows to a table's pending ones; flush once too many are pending."""
        pending = self._tables[table].rows
        pending.extend(rows)
        if len(pending) >= _MAX_PENDING_ROWS:
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
        counts = self._counts  # scratch: the committed state lives in _n_steps and _Table.n
        b = self._pending
        counts[0] = self._n_steps + b
        if b:
            for name, buf in self._buf.items():
                self._append[name].write(self._n_steps, buf[:b])
        for t in self._tables.values():
            counts[t.field] = t.n + len(t.rows)
            if t.rows:
                t.append.write(t.n, np.array(t.rows, t.dtype))
        counts[_CLOSED] = int(closed)
        # Data (and the new dataset extents) reach the file before the counters that announce
        # them: a reader that sees the counters finds the rows.
        f.flush()
        self._committed_id.write(h5s.ALL, h5s.ALL, counts)
        f.flush()
        self._n_steps = int(counts[0])
        self._pending = 0
        for t in self._tables.values():
            t.n = int(counts[t.field])
            t.rows.clear()

    def close(self) -> None:
        """Flush, mark the file as cleanly closed and close it. Safe to call more than once."""
        if self._closed or self._f is None:
            return
        self._closed = True  # even if the final flush fails: never write to a half-closed writer
        try:
            self._commit(closed=True)
        finally:
            self._f.close()

    def _abandon(self) -> None:
        """Close the file without committing anything more (the caller discards it)."""
        self._closed = True
        if self._f is not None:
            with contextlib.suppress(Exception):
                self._f.close()

    # --- resuming ------------------------------------------------------------------------------

    @classmethod
    def resume(cls, path: str | os.PathLike[str], *, keep_below_step: int,
               flush_every: int | None = None, config: Mapping[str, Any] | None = None) -> RunWriter:
        """Continue the run in ``path`` after a restart, keeping what was logged below a step.

        For a trainer restarted from the checkpoint of training step ``keep_below_step``: the new
        file keeps every committed record, evaluation, metric and event row with
        ``step < keep_below_step`` (bit for bit, ``opt_step`` and ``time`` included) and drops the
        rest, which the trainer will log again. It has the old file's metadata. The returned
        writer appends after the kept records: the next default ``opt_step`` is the last kept one
        + 1 and ``time`` continues from the last kept time (the downtime is not counted). An event
        of kind ``"resume"`` at step ``keep_below_step`` says how many rows were kept and dropped.
        ``keep_below_step=0`` keeps only the metadata (a trainer killed before its first checkpoint
        starts over).

        The old file may have been closed cleanly or left behind by a killed writer (its writer
        must not be running any more). A killed writer's file cannot be reopened for writing, so
        the new file is written next to it (``<path>.resume-tmp``) and then atomically renamed
        over it: if anything fails before that, the old file is untouched and the temporary file
        removed.

        Args:
            path: the run file to continue.
            keep_below_step: first training step to drop (and to be logged again).
            flush_every: records per flush; default: the old file's ``flush_every``, or
                :data:`DEFAULT_FLUSH_EVERY` where it records none (0 or absent).
            config: replaces the stored ``RunMeta.config`` (a resumed trainer's settings, e.g. a
                new step count); default: the old file's.

        Raises:
            RunFileError: the old file cannot be read as a run file, is of a newer schema, stores a
                ``flush_every`` no writer can take (:func:`flush_every_problem`) and none is given, or the
                new one cannot be written (one line; the old file is unchanged).
            ValueError: ``keep_below_step`` or ``flush_every`` is not a valid integer.
        """
        path = os.fspath(path)
        keep = _as_int(keep_below_step, "keep_below_step")
        if flush_every is not None and _as_int(flush_every, "flush_every") < 1:
            raise ValueError(f"flush_every must be >= 1, got {flush_every}")
        tmp = path + RESUME_SUFFIX
        w: RunWriter | None = None
        try:
            with contextlib.suppress(FileNotFoundError):  # a killed resume's leftover (by its name ours)
                check_output(tmp, error=RunFileError)
                os.remove(tmp)
            with open_run(path) as old:
                check_output(path, error=RunFileError)  # it will be replaced: a run file, never a link to one
                version = schema.parse_version(old.schema_version)
                if version > schema.parse_version(schema.SCHEMA_VERSION):
                    raise RunFileError(f"{path}: schema version {old.schema_version} is newer than this "
                                       f"gradscope writes ({schema.SCHEMA_VERSION}); resume it with a "
                                       f"newer gradscope")
                # the stored attribute, not the reader's narrowing of it to the committed records' methods
                meta = dataclasses.replace(old.meta, probe_method=old.configured_probe_method)
                if config is not None:
                    meta = dataclasses.replace(meta, config=dict(config))
                if flush_every is None:  # the old file's, unless it records none
                    problem = flush_every_problem(meta)
                    if problem is not None:
                        raise RunFileError(f"{path}: cannot resume: its flush_every attribute is {meta.flush_every}: "
                                           f"{problem}; the run file is unchanged (set the attribute to a "
                                           f"record count, e.g. 10, to resume it)")
                    flush_every = meta.flush_every or DEFAULT_FLUSH_EVERY
                w = cls(tmp, meta, flush_every)
                message = w._copy_below(old, keep)
            w.log_event(keep, "resume", message)
            w.resumed = (keep, message)
            w.flush()
            fsync(tmp)
            with contextlib.suppress(OSError):
                shutil.copymode(path, tmp)
            os.replace(tmp, path)
        except BaseException as exc:
            if w is not None:  # the temporary file is ours: discard it
                w._abandon()
                with contextlib.suppress(OSError):
                    os.remove(tmp)
            if isinstance(exc, OSError):
                raise RunFileError(f"{path}: cannot resume, the run file is unchanged "
                                   f"({_one_line(exc)})") from None
            raise
        w.path = path
        with contextlib.suppress(OSError):  # make the rename durable, where the OS allows
            fsync(os.path.dirname(os.path.abspath(path)))
        return w

    def _copy_below(self, old: RunReader, keep: int) -> str:
        """Copy ``old``'s committed rows with ``step < keep`` into this (empty) file; position the
        writer after them. Returns the message of the "resume" event."""
        n = old.n_steps
        row_bytes = _record_bytes(self._fields)
        block = max(1, _COPY_BYTES // max(row_bytes, 1))
        kept = 0
        last_opt = -1
        t_resume = 0.0
        for lo in range(0, n, block):
            hi = min(n, lo + block)
            mask = old.read("step", lo, hi) < keep
            m = int(np.count_nonzero(mask))
            if not m:
                continue
            for name in self._fields:
                rows = old.read(name, lo, hi) if old.has(name) else np.full(hi - lo, schema.METHOD_UNRECORDED)
                if m < len(rows):
                    rows = rows[mask]
                self._append[name].write(kept, rows)
                if name == "opt_step":
                    last_opt = int(rows[-1])
                elif name == "time":
                    t_resume = max(t_resume, float(np.nanmax(rows)))
            kept += m
        self._n_steps = kept
        tables = []
        for name, t in self._tables.items():
            rows = old.read_table(name)
            sel = rows[rows["step"] < keep]
            t.append.write(0, sel)
            t.n = len(sel)
            tables.append(f"{name} {len(sel)}/{len(rows) - len(sel)}")
            if name == schema.EVENTS and len(sel):
                t_resume = max(t_resume, float(np.nanmax(sel["time"])))
        # Continue after the kept rows: opt_step from the last kept one, time from the latest.
        self._next_opt_step = last_opt + 1
        self._t0 = time.perf_counter() - t_resume
        return (f"resumed below step {keep}: kept {kept} records, dropped {n - kept}; "
                f"rows kept/dropped: {', '.join(tables)}")

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

    @property
    def committed(self) -> dict[str, int]:
        """Rows on disk and announced in ``/committed``, per counter (``n_steps``, ``n_evals``,
        ``n_events``, ``n_metrics``): after :meth:`flush`, everything logged so far. A trainer
        stores them with its checkpoint; :func:`committed_below` counts them again on resume."""
        return {"n_steps": self._n_steps,
                **{schema.TABLES[name][1]: t.n for name, t in self._tables.items()}}

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


def committed_below(run: RunReader, step: int) -> dict[str, int]:
    """Committed rows of ``run`` with a step below ``step``, per counter of :attr:`RunWriter.committed`."""
    return {"n_steps": int(np.count_nonzero(run.step < step)),
            **{counter: int(np.count_nonzero(run.read_table(name)["step"] < step))
               for name, (_, counter) in schema.TABLES.items()}}


def flush_every_problem(meta: RunMeta) -> str | None:
    """Why a writer cannot take ``meta.flush_every`` (a file's stored one) as its records per flush, in a few
    words; None when it can, or when the file records none (0, also what an absent attribute reads as).

    A writer buffers ``flush_every`` records in memory: a negative count is no count, and one whose buffers
    would not fit the read budget (``GRADSCOPE_READ_BUDGET``) is a damaged file's, not a writer's."""
    n = meta.flush_every
    if n == 0:
        return None
    if n < 0:
        return "not a number of records >= 1"
    fields = schema.step_fields(len(meta.agents), len(meta.groups), len(meta.scalar_names),
                                len(meta.update_components))
    need = n * _record_bytes(fields)
    budget = limits.read_budget()
    if need > budget:
        return f"buffers of {limits.size_text(need)} in memory, over the read budget of {limits.size_text(budget)}"
    return None


def check_overwrite(path: str | os.PathLike[str]) -> None:
    """RunFileError unless ``path`` may be replaced by a new run file: it is absent, or a regular
    file (not a symbolic link) that holds a gradscope run, finished, live or left by a killed
    writer. A device, FIFO, folder, link or any other file is never replaced."""
    path = os.fspath(path)
    check_output(path, error=RunFileError)
    if os.path.lexists(path) and not is_run_file(path):
        raise RunFileError(f"{path}: not a gradscope run file; refusing to replace it")


class _Table:
    """A row table (/evals, /events, /metrics): rows logged since the last flush, committed count."""

    __slots__ = ("dtype", "field", "append", "rows", "n")

    def __init__(self, dtype: np.dtype, field: int, append: _Appender) -> None:
        self.dtype = dtype
        self.field = field  # index of its counter in /committed
        self.append = append
        self.rows: list[tuple[Any, ...]] = []
        self.n = 0  # committed rows


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
