"""Every file the package writes goes through here: written to a temporary file in the target's
directory and renamed into place, so that a reader never sees half a file, and an exception or a
KeyboardInterrupt anywhere before the rename leaves the target as it was (absent, or the old
file intact) and no temporary file behind.

    check_target(path, "path")                              # before the work: fail fast
    ...                                                     # the export
    write_atomically(path, "path", lambda tmp: write_the_file(tmp))

The temporary file lives in the target's own directory because a rename is atomic only within
one file system. The renamed file gets the permissions an ordinary `open(path, "w")` would give
(0o666 less the umask), whatever the writer did to `tmp` (one that writes a 0o600 file of its
own and renames it over `tmp`, as safetensors does). Its contents are flushed to disk before the
rename: a crash right after it leaves the whole new file or the old one, not an empty one.
"""
from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Callable

__all__ = ["check_target", "write_atomically"]


def _fspath(path: object, argument: str) -> str:
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"{argument} must be a file path (str or os.PathLike), got {type(path).__name__}")
    p = os.fspath(path)
    if not isinstance(p, str):
        raise TypeError(f"{argument} must be a file path (str or os.PathLike), got bytes {p!r}")
    if not p:
        raise ValueError(f"{argument} is empty: give the file to write")
    return p


def _directory(p: str) -> str:
    return os.path.dirname(os.path.abspath(p))


def _check_location(p: str, argument: str) -> str:
    """The target's directory, after checking that the target can be a file there."""
    directory = _directory(p)
    if not os.path.exists(directory):
        raise FileNotFoundError(f"{argument} {p}: the directory {directory} does not exist (create it first)")
    if not os.path.isdir(directory):
        raise NotADirectoryError(f"{argument} {p}: {directory} is not a directory")
    if os.path.isdir(p):
        raise IsADirectoryError(f"{argument} {p} is a directory: give the file to write")
    if os.path.exists(p) and not os.access(p, os.W_OK):
        raise PermissionError(f"{argument} {p}: the file exists and is read-only")
    return directory


def _create_temporary(p: str, argument: str, directory: str) -> tuple[str, int]:
    """A new empty file next to `p` (a hidden name no other writer picks), created with
    O_EXCL, and its permission bits (those a plain `open(p, "w")` gives)."""
    base = os.path.basename(p)
    for _ in range(100):
        tmp = os.path.join(directory, f".{base}.{secrets.token_hex(6)}.tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        except FileExistsError:
            continue
        except PermissionError as e:
            raise PermissionError(f"{argument} {p}: cannot write in {directory} ({e.strerror})") from None
        except OSError as e:
            raise OSError(e.errno, f"{argument} {p}: cannot write in {directory} ({e.strerror})") from None
        try:
            mode = os.fstat(fd).st_mode & 0o777
        finally:
            os.close(fd)
        return tmp, mode
    raise FileExistsError(f"{argument} {p}: no free temporary name in {directory}")


def check_target(path: object, argument: str) -> str:
    """`path` as a str, once it is known that a file can be written there: its directory
    exists, it is not a directory, and a file can be created beside it (tried, with a temporary
    file removed at once: permission bits alone do not say so for root or a read-only file
    system). Raises FileNotFoundError, NotADirectoryError, IsADirectoryError or PermissionError
    naming `argument` and the path; TypeError for a path that is not one."""
    p = _fspath(path, argument)
    directory = _check_location(p, argument)
    os.unlink(_create_temporary(p, argument, directory)[0])
    return p


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_directory(directory: str) -> None:
    """Makes the rename itself durable (where the platform lets a directory be opened)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_atomically(path: object, argument: str, write: Callable[[str], object]) -> None:
    """Calls `write(tmp)` to write the whole file at `tmp`, a temporary path beside `path`, then
    renames it to `path`. On any exception or KeyboardInterrupt from `write` (or before the
    rename) the temporary file is removed and `path` is untouched; the exception propagates
    unchanged, except an OSError of the write, which is raised again naming `argument` and the
    path."""
    p = _fspath(path, argument)
    directory = _check_location(p, argument)
    tmp, mode = _create_temporary(p, argument, directory)
    try:
        try:
            write(tmp)
        except OSError as e:
            raise OSError(e.errno, f"{argument} {p}: cannot write ({e.strerror or e})") from e
        # a writer that itself writes a temporary file and renames it (safetensors does) leaves
        # that file's 0o600 behind
        os.chmod(tmp, mode)
        _fsync(tmp)
        os.replace(tmp, p)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_directory(directory)
