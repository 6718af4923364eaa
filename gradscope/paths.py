"""Paths gradscope reads from or writes to: what kind of file a path is, and writing an output so
that nothing but a regular file is ever replaced (never a device, a FIFO, a folder, or the target of
a symbolic link), and a reader never sees half of it."""
from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

from gradscope.errors import ConfigError, GradscopeError

_KINDS = ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a directory"),
          (stat.S_ISFIFO, "a named pipe (FIFO)"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def kind_of(mode: int) -> str | None:
    """What a ``st_mode`` is, in words ("a directory", "a named pipe (FIFO)", ...); None for a
    regular file."""
    if stat.S_ISREG(mode):
        return None
    return next((kind for test, kind in _KINDS if test(mode)), "not a regular file")


def fsync(path: str | os.PathLike[str]) -> None:
    """Flush a file's or a folder's data to disk (a folder: the entries created or renamed in it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def check_output(path: str | os.PathLike[str], error: type[GradscopeError] = ConfigError) -> None:
    """``error`` (one line) unless ``path`` is absent or a regular file (a symbolic link is refused
    even when it points at one: writing through it would change a file elsewhere)."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    except OSError as exc:
        raise error(f"{path}: cannot check the output path ({exc.strerror})") from None
    kind = kind_of(mode)
    if kind is not None:
        raise error(f"{path}: is {kind}; refusing to write over it (outputs replace regular files only)")


@contextlib.contextmanager
def atomic_output(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a fresh temporary path beside ``path``; once the block succeeds it is renamed over
    ``path`` (checked with :func:`check_output` before and again just before the rename). On
    failure the temporary file is removed and ``path`` is untouched. Folders are created as needed.

    Raises:
        ConfigError: ``path`` is not replaceable, or its folder cannot be created or written.
    """
    path = Path(path)
    check_output(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot write ({exc.strerror or exc})") from None
    os.close(fd)
    tmp = Path(name)
    try:
        # mkstemp makes the file private (0600); give it what a plain open() would have.
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        yield tmp
        check_output(path)
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise ConfigError(f"{path}: cannot write ({exc.strerror or exc})") from None
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
