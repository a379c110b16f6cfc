"""Every file hobbitpy writes for a user (statistics, results, profiles) follows one rule:
it is new. An existing name, a symlink included (even a dangling one), is refused, checked
before the work starts (`new_output_error`) and again when written (`write_new`), where the
content goes to a fresh temporary file in the target folder and is linked to its name —
a link that fails if the name appeared meanwhile, and never follows a symlink.
"""

from __future__ import annotations

import os
import pathlib
import tempfile


class OutputExistsError(FileExistsError):
    pass


def new_output_error(path: str | os.PathLike) -> str | None:
    """Why a new file cannot be written at path, or None."""
    path = os.fspath(path)
    if os.path.lexists(path):
        return f"{path}: already exists; hobbitpy never overwrites a file (remove it or choose another name)"
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK):
        return f"{path}: cannot write there (no such writable directory)"
    return None


def write_new(path: str | os.PathLike, data: str | bytes) -> pathlib.Path:
    """Write data to a new file at path; raises OutputExistsError if the name exists, OSError
    (a full disk, a read-only folder) with nothing left behind."""
    path = pathlib.Path(path)
    if os.path.lexists(path):
        raise OutputExistsError(new_output_error(path))
    raw = data.encode() if isinstance(data, str) else data
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".partial")
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # as open() would create it (mkstemp makes it private)
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
        os.link(tmp, path)
    except FileExistsError:
        raise OutputExistsError(new_output_error(path)) from None
    finally:
        os.unlink(tmp)
    return path


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
