"""Atomic file writes: a reader, or a run killed mid-write, sees the old complete file or the new one.

Every file vitlab writes that a user keeps (checkpoints, weights, logs, summaries, tables) goes through
:func:`atomic_path`: the content is written to a fresh temporary file in the destination's folder, flushed
to disk, and renamed over the destination. The temporary name is random and created exclusively
(``mkstemp``), so a symlink planted in the output folder is never followed. This module imports nothing
from vitlab: every layer may use it.
"""

from __future__ import annotations

import contextlib
import csv
import json
import os
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO, Any


def _fsync_dir(folder: Path) -> None:
    """Make a rename in ``folder`` durable (POSIX; a no-op where folders cannot be opened)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path next to ``path``; when the block ends without error, the file written there
    is flushed to disk and renamed to ``path``. On an error (or a kill) the destination is untouched and the
    temporary file is removed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.is_dir():
        raise IsADirectoryError(f"{path} is a folder; give a file name to write")
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp creates 0600; what we write are ordinary files
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "w", **kwargs: Any) -> Iterator[IO]:
    """``open(path, mode)`` for writing, made atomic (see :func:`atomic_path`)."""
    if not mode.startswith("w"):
        raise ValueError(f"atomic_open writes a new file: mode must start with 'w', got {mode!r}")
    with atomic_path(path) as tmp, open(tmp, mode, **kwargs) as f:
        yield f


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    with atomic_open(path) as f:
        f.write(text)
    return Path(path)


def write_json_atomic(path: str | os.PathLike, obj: Any, indent: int | None = 1) -> Path:
    return write_text_atomic(path, json.dumps(obj, indent=indent) + "\n")


def write_csv_atomic(path: str | os.PathLike, rows: Sequence[dict[str, Any]]) -> Path:
    """Rows of dicts as CSV; the header is the union of their keys in first-seen order."""
    keys = list(dict.fromkeys(k for r in rows for k in r))
    with atomic_open(path, newline="") as f:
        w = csv.DictWriter(f, keys)
        w.writeheader()
        w.writerows(rows)
    return Path(path)
