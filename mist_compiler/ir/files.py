"""Writing the files the compiler produces (plans, profiles, reports): checked first, atomically.

:func:`check_output` is called before any long work (a search, a profile), so an unwritable
path is an error in the first second, not after minutes. :func:`write_atomic` writes to a
temporary file in the same directory and renames it over the target: a full disk, a size limit
or a crash leaves either the old file or the new one, never a cut one.
"""
from __future__ import annotations

import os
import tempfile


class OutputError(ValueError):
    """An output path that cannot be written; the message names the option and the path."""


def check_output(path: str, option: str = "-o") -> str:
    """The absolute path, after checking its directory exists and is writable and it is not a directory."""
    full = os.path.abspath(path)
    if os.path.isdir(full):
        raise OutputError(f"{option} {path}: is a directory; give a file name")
    folder = os.path.dirname(full)
    if not os.path.isdir(folder):
        raise OutputError(f"{option} {path}: the directory {folder} does not exist")
    if not os.access(folder, os.W_OK) or (os.path.exists(full) and not os.access(full, os.W_OK)):
        raise OutputError(f"{option} {path}: not writable")
    return full


def check_output_dir(path: str, option: str = "-o") -> str:
    """An output directory: created if missing (its parent must exist), must be writable."""
    full = os.path.abspath(path)
    if os.path.exists(full) and not os.path.isdir(full):
        raise OutputError(f"{option} {path}: is a file, not a directory")
    if not os.path.isdir(full):
        parent = os.path.dirname(full)
        if not os.path.isdir(parent):
            raise OutputError(f"{option} {path}: the directory {parent} does not exist")
        try:
            os.makedirs(full, exist_ok=True)
        except OSError as error:
            raise OutputError(f"{option} {path}: cannot create it ({error.strerror})") from None
    if not os.access(full, os.W_OK):
        raise OutputError(f"{option} {path}: not writable")
    return full


def write_atomic(path: str, data: str | bytes) -> None:
    """Write ``data`` to ``path`` via a temporary file and a rename (see the module docstring)."""
    folder = os.path.dirname(os.path.abspath(path))
    mode = "wb" if isinstance(data, bytes) else "w"
    handle, temporary = tempfile.mkstemp(prefix=".tmp-", suffix=os.path.basename(path), dir=folder)
    try:
        with os.fdopen(handle, mode) as stream:
            stream.write(data)
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(temporary, path)
    except BaseException as error:
        try:
            os.unlink(temporary)
        except OSError:
            pass
        if isinstance(error, OSError):
            raise OutputError(f"cannot write {path}: {error.strerror or error}") from None
        raise
