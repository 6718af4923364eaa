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


def read_text_file(path: str | os.PathLike[str], what: str, limit: int = 1 << 20) -> str:
    """The UTF-8 text of a small file the user named (a config, a sweep or alert file); ConfigError, one
    line naming ``what`` and the path, for a missing or unreadable file, anything but a regular file (a
    FIFO would block the read, ``/dev/urandom`` never end it), more than ``limit`` bytes, or bytes that
    are not UTF-8."""
    try:
        st = os.stat(path)
        kind = kind_of(st.st_mode)
        if kind is not None:
            raise ConfigError(f"cannot read {what} {path}: it is {kind}, not a file")
        with open(path, "rb") as fh:
            data = fh.read(limit + 1)
        if st.st_size > limit or len(data) > limit:  # the read too: the file may grow after the stat
            raise ConfigError(f"{what} {path} is {max(st.st_size, len(data)):,} bytes; at most {limit:,} are read")
        return data.decode("utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{what} {path}: not UTF-8 text (byte {exc.start + 1})") from None


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


#: The HDF5 format signature, at offset 0 or, after a user block, at 512, 1024, 2048, ... bytes.
HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"


def is_hdf5(path: str | os.PathLike[str]) -> bool:
    """Whether the regular file ``path`` holds an HDF5 signature where the format puts it (False if
    unreadable)."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            offset = 0
            while offset + len(HDF5_SIGNATURE) <= size and offset <= 1 << 20:
                f.seek(offset)
                if f.read(len(HDF5_SIGNATURE)) == HDF5_SIGNATURE:
                    return True
                offset = 512 if offset == 0 else 2 * offset
    except OSError:
        return False
    return False


def check_derived_output(path: str | os.PathLike[str]) -> None:
    """:func:`check_output`, and ConfigError when ``path`` is an HDF5 file: a table or figure written
    with a mistyped ``--out`` must never replace a run file (its own input, say)."""
    check_output(path)
    if os.path.isfile(path) and is_hdf5(path):
        raise ConfigError(f"{path}: is an HDF5 file (a run file?); refusing to write over it (choose another --out)")


@contextlib.contextmanager
def atomic_output(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a fresh temporary path beside ``path``; once the block succeeds it is renamed over
    ``path`` (checked with :func:`check_derived_output` before and again just before the rename:
    only a regular file that is not an HDF5 file is replaced). On failure the temporary file is
    removed and ``path`` is untouched. Folders are created as needed. For derived outputs (tables,
    figures); a run file's writer replaces run files under its own checks.

    Raises:
        ConfigError: ``path`` is not replaceable, or its folder cannot be created or written.
    """
    path = Path(path)
    check_derived_output(path)
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
        check_derived_output(path)
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise ConfigError(f"{path}: cannot write ({exc.strerror or exc})") from None
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
