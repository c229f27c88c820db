"""The one way a dataset reader opens a file it was told about by another file.

A split list, an ``ImageSets`` id, a manifest or an HDF5 link names a file; three things can go wrong that a
plain ``open`` does not catch:

- the name leaves the dataset (``../../outside/secret``, an absolute path, a symlink out of the root): vitlab
  would read, and train on, a file the user never gave it;
- the file is not a regular file (a named pipe blocks a reader forever, a device never ends);
- the file unpacks to far more than it holds (a small gzip stream that inflates to gigabytes).

:func:`inside_root` resolves a name against the dataset root and refuses what resolves outside it;
:func:`check_regular` / :func:`open_regular` refuse anything but a regular file without blocking on it (the
open is non-blocking, and the check is made on the opened descriptor, so a file swapped for a pipe between
check and open is still caught); :func:`read_bounded` reads at most a given number of bytes. Each refusal is
one :class:`DataFileError` line naming the file and what to do.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import IO

# A decoded sample larger than this is a damaged or hostile file, not data (ImageNet's largest JPEG decodes
# to ~200 MB; a ModelNet40 HDF5 part holds ~2 GB of float32 points at most).
_LIMIT = os.environ.get("VITLAB_MAX_UNPACKED_BYTES", "")
MAX_UNPACKED_BYTES = int(_LIMIT) if _LIMIT.isdigit() else 8 << 30


class DataFileError(ValueError):
    """A dataset file vitlab will not read: one line naming it and what to do."""


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a named pipe"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def inside_root(root: str | os.PathLike, name: str, what: str, fix: str) -> Path:
    """``root / name`` when it resolves (symlinks followed) inside ``root``; else one line.

    ``name`` comes from a file (a split list line, an image id): absolute names and names that climb out of
    the root with ``..`` or through a symlink are refused, so a reader never opens a file outside the dataset.
    """
    if not isinstance(name, str) or not name or "\x00" in name:
        raise DataFileError(f"{what} names an empty or invalid file {name!r}; {fix}")
    if os.path.isabs(name):
        raise DataFileError(f"{what} names the absolute path {name!r}: dataset files must lie inside {root}; {fix}")
    base = Path(root).resolve()
    path = Path(root) / name
    resolved = path.resolve()
    if resolved != base and base not in resolved.parents:
        raise DataFileError(
            f"{what} names {name!r}, which resolves to {resolved}, outside the dataset folder {base}; {fix}"
        )
    return path


def check_regular(path: str | os.PathLike, what: str, fix: str) -> Path:
    """``path`` when it is a regular file (symlinks followed); a missing file is ``FileNotFoundError``."""
    path = Path(path)
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise FileNotFoundError(f"{what} {path} does not exist; {fix}") from None
    except OSError as e:
        raise DataFileError(f"cannot read {what} {path} ({e.strerror or e}); {fix}") from None
    if not stat.S_ISREG(mode):
        raise DataFileError(f"{what} {path} is {_kind(mode)}, not a regular file; {fix}")
    return path


def open_regular(path: str | os.PathLike, what: str, fix: str) -> IO[bytes]:
    """Open ``path`` for binary reading if, once open, it is a regular file; never blocks on a pipe."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise FileNotFoundError(f"{what} {path} does not exist; {fix}") from None
    except OSError as e:
        raise DataFileError(f"cannot read {what} {path} ({e.strerror or e}); {fix}") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise DataFileError(f"{what} {path} is {_kind(mode)}, not a regular file; {fix}")
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_regular(path: str | os.PathLike, what: str, fix: str, limit: int = MAX_UNPACKED_BYTES) -> bytes:
    """The bytes of a regular file of at most ``limit`` bytes."""
    with open_regular(path, what, fix) as f:
        return read_bounded(f, limit, f"{what} {path}", fix)


def read_bounded(stream: IO[bytes], limit: int, what: str, fix: str) -> bytes:
    """Read ``stream`` to its end, refusing one that holds (or unpacks to) more than ``limit`` bytes."""
    try:
        data = stream.read(limit + 1)
    except OSError as e:
        raise DataFileError(f"cannot read {what} ({e.strerror or e}); {fix}") from None
    if len(data) > limit:
        raise DataFileError(
            f"{what} holds or unpacks to more than {limit >> 20} MiB, which no sample of this dataset needs: it is "
            f"damaged or hostile (raise VITLAB_MAX_UNPACKED_BYTES if it is real); {fix}"
        )
    return data
