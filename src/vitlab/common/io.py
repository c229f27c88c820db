"""Atomic file writes: a reader, or a run killed mid-write, sees the old complete file or the new one.

Every file vitlab writes that a user keeps (checkpoints, weights, logs, summaries, tables) goes through
:func:`atomic_path`: the content is written to a fresh temporary file in the destination's folder, flushed
to disk, and renamed over the destination. The temporary name is random and created exclusively
(``mkstemp``), so a symlink planted in the output folder is never followed. A write that fails because the
disk is full, a size limit is reached, or the folder is read-only or not ours becomes one :class:`WriteError`
line; the previous file is then untouched and the temporary file removed. :func:`check_writable_file` and
:func:`check_writable_folder` answer a wrong output path before any work starts. This module imports nothing
from vitlab: every layer may use it.
"""

from __future__ import annotations

import contextlib
import csv
import errno
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

# failures of a write that the user can fix, and how to say them
WRITE_ERRNOS = {
    errno.ENOSPC: "no space left on the device",
    errno.EDQUOT: "the disk quota is exhausted",
    errno.EFBIG: "the file-size limit was reached",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.EROFS: "the file system is read-only",
}
# the temporary names atomic_path creates: ".NAME." + mkstemp's 8 random characters + ".tmp"
TEMP_NAME = re.compile(r"^\..+\.[a-z0-9_]{8}\.tmp$")


class WriteError(ValueError):
    """A file could not be written where asked (full disk, size limit, no permission, wrong kind of path):
    one line for the command line."""


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


def _write_errno(e: BaseException, folder: Path) -> int | None:
    """The errno of a failed write to a file in ``folder`` (or below) behind ``e`` (torch and safetensors
    wrap the OSError of a failed write in their own errors), or None for any other failure."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        # an OSError about a file elsewhere (read inside the with block) is not a failed write
        ours = isinstance(e, OSError) and (
            e.filename is None or Path(os.fsdecode(e.filename)).absolute().is_relative_to(folder.absolute())
        )
        if ours and e.errno in WRITE_ERRNOS:
            return e.errno
        found = re.search(r"os error (\d+)", str(e))
        if found and int(found.group(1)) in WRITE_ERRNOS:
            return int(found.group(1))
        e = e.__cause__ or e.__context__
    return None


def write_failed(path: Path, code: int, existed: bool) -> WriteError:
    """The one line for a failed write of ``path``: what failed, where, and that nothing old was lost."""
    kept = f"the previous {path.name} is intact" if existed else "nothing was written"
    return WriteError(f"could not write {path}: {WRITE_ERRNOS[code]} ({errno.errorcode[code]}); {kept}")


@contextlib.contextmanager
def _write_errors(path: Path, cleanup: Callable[[], None]) -> Iterator[None]:
    """Around a write of ``path``: on any error ``cleanup`` runs, and a failed write becomes :class:`WriteError`."""
    try:
        yield
    except BaseException as e:
        cleanup()
        code = _write_errno(e, path.parent)
        if code is None:
            raise
        raise write_failed(path, code, path.exists()) from e


def _prepare(path: Path) -> None:
    """Create ``path``'s folder if needed; one line if ``path`` cannot be a file there."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise WriteError(f"cannot write {path}: a part of its folder {path.parent} is a file") from None
    if path.is_dir():
        raise WriteError(f"cannot write {path}: it is a folder; give a file name")


def _commit(tmp: Path, path: Path) -> None:
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # mkstemp creates 0600; what we write are ordinary files
    os.replace(tmp, path)  # replaces a symlink at ``path`` itself, never what it points to


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path next to ``path``; when the block ends without error, the file written there
    is flushed to disk and renamed to ``path``. On an error (or a kill) the destination is untouched and the
    temporary file is removed; a full disk, a size limit or a read-only folder raise :class:`WriteError`."""
    path = Path(path)
    _prepare(path)
    tmp: Path | None = None
    with _write_errors(path, lambda: tmp is not None and tmp.unlink(missing_ok=True)):
        fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        os.close(fd)
        tmp = Path(name)
        yield tmp
        _commit(tmp, path)
    _fsync_dir(path.parent)


@contextlib.contextmanager
def atomic_path_with_companions(path: str | os.PathLike) -> Iterator[Path]:
    """:func:`atomic_path` for writers that put companion files beside the file they are given (ONNX's
    external weights, ``NAME.data``): yields ``path``'s name inside a fresh private folder next to it; when
    the block ends without error, every file written there is flushed and renamed beside ``path``, the
    companions first and ``path`` last."""
    path = Path(path)
    _prepare(path)
    folder: Path | None = None
    with _write_errors(path, lambda: folder is not None and shutil.rmtree(folder, ignore_errors=True)):
        folder = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp"))
        yield folder / path.name
        for f in sorted(folder.iterdir(), key=lambda f: f.name == path.name):
            _commit(f, path.parent / f.name)
        folder.rmdir()
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


def write_safetensors_atomic(
    tensors: Mapping[str, Any], path: str | os.PathLike, metadata: Mapping[str, str] | None = None
) -> Path:
    """Write tensors as a safetensors file (raw tensors and a JSON header: reading it never runs code),
    atomically. Tensors are saved contiguous, on the CPU; tensors sharing storage are saved as copies
    (safetensors refuses shared memory)."""
    import torch
    from safetensors.torch import save_file

    out: dict[str, Any] = {}
    seen: set[int] = set()
    for key, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"cannot save {key!r} as safetensors: a {type(t).__name__}, not a tensor")
        t = t.detach().cpu().contiguous()
        ptr = t.untyped_storage().data_ptr() if t.numel() else id(t)
        out[key] = t.clone() if ptr in seen else t
        seen.add(ptr)
    with atomic_path(path) as tmp:
        save_file(out, tmp, metadata=dict(metadata or {"format": "pt", "writer": "vitlab"}))
    return Path(path)


def write_csv_atomic(path: str | os.PathLike, rows: Sequence[dict[str, Any]]) -> Path:
    """Rows of dicts as CSV; the header is the union of their keys in first-seen order."""
    keys = list(dict.fromkeys(k for r in rows for k in r))
    with atomic_open(path, newline="") as f:
        w = csv.DictWriter(f, keys)
        w.writeheader()
        w.writerows(rows)
    return Path(path)


def copy_atomic(src: str | os.PathLike, dst: str | os.PathLike) -> Path:
    """``dst`` becomes a copy of the file ``src``, atomically (:func:`atomic_path`): a hard link when the file
    system allows one (no bytes copied; ``src`` being replaced later by a rename leaves ``dst`` as it was),
    else a copy of the bytes."""
    dst = Path(dst)
    with atomic_path(dst) as tmp:
        tmp.unlink()  # the random name is free again: a link takes it, or an exclusive create
        try:
            os.link(src, tmp, follow_symlinks=False)
        except OSError:
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
            with open(src, "rb") as f_in, open(os.open(tmp, flags, 0o600), "wb") as f_out:
                shutil.copyfileobj(f_in, f_out)
    return dst


def open_append(path: str | os.PathLike) -> IO[str]:
    """``open(path, "a")`` that refuses to follow a symlink planted at ``path`` (for logs written as they go)."""
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, 0o666)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise WriteError(f"cannot write {path}: it is a symbolic link; remove it") from None
        raise
    return open(fd, "a")


# ------------------------------------------------------------------------------------ before any work
def _nearest_existing(path: Path) -> Path:
    path = path.absolute()
    while not os.path.lexists(path) and path != path.parent:
        path = path.parent
    return path


def check_writable_folder(folder: str | os.PathLike, flag: str = "--out") -> Path:
    """Raise :class:`WriteError` unless ``folder`` is, or can be created as, a folder this process may write
    in; nothing is created."""
    folder = Path(folder)
    if os.path.lexists(folder) and not folder.is_dir():
        raise WriteError(f"{flag} {folder} is a file, not a folder; give a folder (or remove the file)")
    base = _nearest_existing(folder)
    if not base.is_dir():
        raise WriteError(f"{flag} {folder}: {base} is a file, so no folder can be created there")
    if not os.access(base, os.W_OK | os.X_OK):
        raise WriteError(f"{flag} {folder}: cannot write in {base} (permission denied or read-only)")
    return folder


def check_writable_file(path: str | os.PathLike, flag: str = "--out") -> Path:
    """Raise :class:`WriteError` unless ``path`` can be written as a file (not a folder, in a folder that is
    or can be made writable); nothing is created."""
    path = Path(path)
    if path.is_dir():
        raise WriteError(f"{flag} {path} is a folder; give a file name")
    check_writable_folder(path.parent, flag)
    return path


def remove_temp_files(folder: str | os.PathLike, before: float) -> list[Path]:
    """Remove what writers killed mid-write left in ``folder``: files (or links) named like
    :func:`atomic_path`'s temporary files and last changed before ``before`` (a ``time.time()``)."""
    removed = []
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return removed
    for entry in entries:
        if not TEMP_NAME.match(entry.name) or entry.is_dir(follow_symlinks=False):
            continue
        try:
            if entry.stat(follow_symlinks=False).st_mtime < before:
                os.unlink(entry.path)  # a symlink is removed itself, never its target
                removed.append(Path(entry.path))
        except FileNotFoundError:
            pass
    return removed


def write_figure_atomic(fig: Any, path: str | os.PathLike, **savefig_kwargs: Any) -> Path:
    """A matplotlib figure saved atomically (the format follows the file's suffix, PNG by default)."""
    path = Path(path)
    with atomic_open(path, "wb") as f:
        fig.savefig(f, format=path.suffix[1:].lower() or "png", **savefig_kwargs)
    return path
