"""Every file hobbitpy writes for a user (statistics, results, profiles) follows one rule:
it is new. An existing name, a symlink included (even a dangling one), is refused, checked
before the work starts (`new_output_error`) and again when written (`write_new`), where the
content goes to a fresh temporary file in the target folder and is linked to its name —
a link that fails if the name appeared meanwhile, and never follows a symlink. With the
commands' `--force` (`replace=True`) an existing regular file is replaced instead: the
temporary file is renamed over it, so a reader sees the old file or the new one, never
half of one; a symlink or a folder of that name is still refused, and a rename replaces
a link that appeared meanwhile rather than writing through it.

Large files written for minutes (companions, uniform quants, inflated models) go through `partial_output`:
the partial file carries its writer's process id, so the next run removes what a killed
one left; SIGTERM and SIGHUP end the writer the way Ctrl-C does, removing the partial file;
and the free space is checked before the first byte (`check_free_space`).

A write that fails either way (a full disk, an I/O error) is an `OutputWriteError` whose
message names the file and the cause, and leaves no file behind.
"""

from __future__ import annotations

import contextlib
import errno
import glob
import os
import pathlib
import re
import shutil
import signal
import tempfile
import threading
from collections.abc import Iterator

from ..errors import HobbitError


class OutputExistsError(FileExistsError):
    pass


class OutputWriteError(HobbitError, OSError):
    """A file could not be written (a full disk, an I/O error, a read-only folder): the message
    names the file and the cause, and nothing of the file is left. An OSError too, with the
    cause's errno."""


# the errors of a write that failed, rather than of whatever else a long writer does (a
# missing input file keeps its own message)
WRITE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO})


@contextlib.contextmanager
def _naming_the_output(path: str | os.PathLike, errnos: frozenset[int] | None = None,
                       partial: pathlib.Path | None = None) -> Iterator[None]:
    """An OSError raised inside (of errnos; None: any but an existing name) as an
    OutputWriteError naming path: the caller's one line, where the OSError names a temporary
    file or nothing. partial: the file being written, to find the cause of a short write."""
    try:
        yield
    except OSError as e:
        if isinstance(e, (FileExistsError, HobbitError)):
            raise
        cause = (_cause_of_short_write(partial) if e.errno is None and partial is not None else None) or e
        if errnos is not None and cause.errno not in errnos:
            raise
        error = OutputWriteError(f"{os.fspath(path)}: cannot write it ({cause.strerror or cause})")
        error.errno = cause.errno
        raise error from e


def _cause_of_short_write(partial: pathlib.Path) -> OSError | None:
    """Why writing partial stopped, when the error did not say: numpy's tofile (gguf's writer
    of tensors) reports a short write as "N requested and M written", without the errno (a
    full disk, an I/O error) that stopped it. Writing on at the end meets it again."""
    try:
        with open(partial, "ab") as f:
            f.write(bytes(1 << 20))
    except OSError as e:
        return e if e.errno is not None else None
    return None


def new_output_error(path: str | os.PathLike, replace: bool = False) -> str | None:
    """Why the file cannot be written at path (a new one, or with replace a regular file
    replaced), or None."""
    path = os.fspath(path)
    if os.path.islink(path):
        return (f"{path}: already exists as a symlink; hobbitpy never writes through one (remove it or choose "
                "another name)")
    if os.path.isdir(path):
        return f"{path}: already exists as a folder"
    if os.path.lexists(path) and not (replace and os.path.isfile(path)):
        return (f"{path}: already exists; hobbitpy overwrites a file only with --force (or remove it, or choose "
                "another name)")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK):
        return f"{path}: cannot write there (no such writable directory)"
    return None


def write_new(path: str | os.PathLike, data: str | bytes, replace: bool = False) -> pathlib.Path:
    """Write data to a new file at path (with replace, over a regular file of that name);
    raises OutputExistsError if the name exists (with replace: is a symlink or a folder),
    OutputWriteError (a full disk, a read-only folder) with nothing left behind."""
    path = pathlib.Path(path)
    if os.path.lexists(path) and (why := new_output_error(path, replace)):
        raise OutputExistsError(why)
    raw = data.encode() if isinstance(data, str) else data
    with _naming_the_output(path):
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".partial")
        try:
            os.fchmod(fd, 0o666 & ~_umask())  # as open() would create it (mkstemp makes it private)
            with os.fdopen(fd, "wb") as f:
                f.write(raw)
            if replace:
                os.rename(tmp, path)  # atomic; a symlink that appeared meanwhile is replaced, not followed
            else:
                os.link(tmp, path)
        except FileExistsError:
            raise OutputExistsError(new_output_error(path)) from None
        except IsADirectoryError:
            raise OutputExistsError(new_output_error(path, replace)) from None
        finally:
            if os.path.lexists(tmp):
                os.unlink(tmp)
    return path


class NotEnoughSpaceError(OutputWriteError):
    pass


def check_free_space(folder: str | os.PathLike, need_bytes: int, what: str) -> None:
    """Raise NotEnoughSpaceError, naming both sizes, if folder's file system has less than
    need_bytes free for `what` (and a 1 % margin for metadata)."""
    free = shutil.disk_usage(folder).free
    if free < need_bytes * 1.01:
        raise NotEnoughSpaceError(f"{what} needs {need_bytes / 1e9:.2f} GB and {folder} has {free / 1e9:.2f} GB free")


@contextlib.contextmanager
def partial_output(path: str | os.PathLike) -> Iterator[pathlib.Path]:
    """A new, empty partial file beside path, to be written and then published with
    `publish(partial, path)`; removed however the block ends (an error, Ctrl-C, SIGTERM,
    SIGHUP). Partial files of path left by processes that no longer run are removed first. A
    write that fails inside (WRITE_ERRNOS) is an OutputWriteError naming path."""
    path = pathlib.Path(path)
    _remove_dead_partials(path)
    with _naming_the_output(path):
        fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.{os.getpid()}.", suffix=".partial")
    os.close(fd)
    partial = pathlib.Path(name)
    try:
        with _naming_the_output(path, WRITE_ERRNOS, partial), _signals_end_the_writer():
            yield partial
    finally:
        partial.unlink(missing_ok=True)


def publish(partial: pathlib.Path, path: str | os.PathLike) -> pathlib.Path:
    """Give the written partial file its name: a link, which fails if the name appeared
    meanwhile (a symlink too), so nothing is overwritten."""
    os.chmod(partial, 0o666 & ~_umask())  # as open() would create it (mkstemp makes it private)
    try:
        os.link(partial, path)
    except FileExistsError:
        raise OutputExistsError(new_output_error(path)) from None
    return pathlib.Path(path)


def replace(partial: pathlib.Path, path: str | os.PathLike) -> pathlib.Path:
    """Give the written partial file its name, replacing a file of that name: for hobbitpy's
    own caches (a stale one is replaced), never for a user's output (publish)."""
    os.chmod(partial, 0o666 & ~_umask())
    os.replace(partial, path)
    return pathlib.Path(path)


def _remove_dead_partials(path: pathlib.Path) -> None:
    pattern = re.compile(rf"\.{re.escape(path.name)}\.(\d+)\.[^.]+\.partial")
    for entry in path.parent.glob(f".{glob.escape(path.name)}.*.partial"):
        match = pattern.fullmatch(entry.name)
        if match and not _process_runs(int(match.group(1))) and not entry.is_symlink():
            entry.unlink(missing_ok=True)


def _process_runs(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


class Terminated(SystemExit):
    """SIGTERM or SIGHUP while a partial file was being written: exits with 128 + the signal."""


@contextlib.contextmanager
def _signals_end_the_writer() -> Iterator[None]:
    """SIGTERM and SIGHUP raise Terminated in the main thread (their default kills the process
    at once, and the partial file would stay); handlers are the main thread's to set, so
    elsewhere nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def end(signum, _frame):
        raise Terminated(128 + signum)

    previous = {sig: signal.signal(sig, end) for sig in (signal.SIGTERM, signal.SIGHUP)
                if signal.getsignal(sig) in (signal.SIG_DFL, None)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
