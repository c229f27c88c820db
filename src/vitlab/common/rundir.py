"""Run folders: one run owns its output folder, and a new run never mixes with an old one.

Every command that writes a run folder (``vitlab train``, ``vitlab compare``, ``vitlab lm train``) holds a
:class:`RunLock` on it for the whole run: an exclusive ``flock`` on ``OUT/.vitlab.lock``, which records the
owner (pid, host, command, start time) so that a second writer is refused with one line naming it. The
operating system drops a ``flock`` when its process dies, so the lock of a killed run is simply taken over
(with a note); the lock file is removed when the run ends.

Taking the lock also removes what a writer killed mid-write left (``vitlab.common.io``'s temporary files, older
than the lock) and checks the folder: a folder that already holds a run is refused unless the run is resumed
or started over (``--force``), and starting over first moves the old run's files into
``OUT/.replaced-<time>/``, so nothing of the old run stays beside the new one, whatever happens to it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shlex
import shutil
import socket
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from .distributed import World, broadcast_object
from .io import check_writable_folder, remove_temp_files

LOCK_NAME = ".vitlab.lock"
REPLACED_PREFIX = ".replaced-"
MIB = 2**20


class RunDirError(ValueError):
    """The output folder cannot take this run (in use, holds another run, too little space): one line."""


def _same_file(fd: int, path: Path) -> bool:
    try:
        st = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)


def _read_owner(fd: int) -> dict[str, Any]:
    try:
        text = os.pread(fd, 4096, 0).decode(errors="replace")
        owner = json.loads(text) if text.strip() else {}
    except (OSError, ValueError):
        return {}
    return owner if isinstance(owner, dict) else {}


def describe(owner: dict[str, Any]) -> str:
    """``vitlab train (pid 123 on host) since 2025-01-01 10:00:00``, from what the lock file records."""
    if not owner:
        return "another process (it has not recorded itself yet)"
    return f"{owner.get('tool', '?')} (pid {owner.get('pid', '?')} on {owner.get('host', '?')}) since {owner.get('since', '?')}"


def _open_lock(path: Path) -> int:
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        return os.open(path, flags, 0o644)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise RunDirError(f"{path} is a symbolic link; remove it (vitlab's lock file is never a link)") from None
        raise


def _acquire(path: Path) -> int:
    """An open descriptor of ``path`` holding its exclusive lock; :class:`RunDirError` naming the owner when
    another process holds it."""
    for _ in range(20):
        fd = _open_lock(path)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = _read_owner(fd)
            os.close(fd)
            raise RunDirError(
                f"{path.parent} is in use by {describe(owner)}; wait for it to end or use another output folder"
            ) from None
        if _same_file(fd, path):
            return fd
        os.close(fd)  # the owner removed the file between our open and our lock: lock the new one
    raise RunDirError(f"cannot lock {path}: other runs keep replacing it")


class RunLock:
    """Exclusive ownership of the run folder ``folder`` (created if needed) for one run; a context manager.

    ``tool`` names the command in the message a second writer gets; ``log`` receives the notes (a lock of
    a process that died, temporary files removed, old files moved aside)."""

    def __init__(self, folder: str | os.PathLike, tool: str, log: Callable[[str], None] = print) -> None:
        self.folder, self.log = Path(folder), log
        check_writable_folder(self.folder)
        self.created = not self.folder.exists()
        self.folder.mkdir(parents=True, exist_ok=True)
        self.path = self.folder / LOCK_NAME
        self.since = time.time()
        self.fd: int | None = _acquire(self.path)
        try:
            previous = self._record(tool)
        except BaseException:
            self.release()
            raise
        if previous:
            log(f"note: {self.folder} was still locked by {describe(previous)}, which has ended; taken over")
        removed = remove_temp_files(self.folder, before=self.since)
        if removed:
            log(f"note: removed {len(removed)} temporary file(s) an interrupted write left in {self.folder}")

    def _record(self, tool: str) -> dict[str, Any]:
        """Write this run into the lock file; returns what a run that died holding the lock had written."""
        previous = _read_owner(self.fd)
        owner = {
            "tool": tool,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "since": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.since)),
            "argv": shlex.join(sys.argv),
        }
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, (json.dumps(owner) + "\n").encode(), 0)
        return previous

    def release(self) -> None:
        """Give the folder up: the lock file goes, and so does the folder if this run created it and left
        nothing in it."""
        if self.fd is None:
            return
        if _same_file(self.fd, self.path):
            self.path.unlink(missing_ok=True)
        os.close(self.fd)  # drops the flock
        self.fd = None
        if self.created:
            with contextlib.suppress(OSError):
                self.folder.rmdir()  # only if empty

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def present(self, names: Sequence[str]) -> list[str]:
        """The entries of ``names`` that exist in the folder."""
        return [n for n in names if os.path.lexists(self.folder / n)]

    def check_fresh(self, names: Sequence[str], resume: bool, force: bool) -> list[str]:
        """The old run's entries (of ``names``) when starting over; refuses a folder that holds a run unless
        the run is resumed or ``force`` starts over."""
        found = self.present(names)
        if found and not resume and not force:
            raise RunDirError(
                f"{self.folder} already holds a run ({', '.join(found)}); pass --resume to continue it or --force "
                "to start over (the old files are then moved aside)"
            )
        return [] if resume else found

    def make_room(self, names: Sequence[str], force: bool) -> None:
        """Before a tool writes ``names``: refuse a folder that holds some of them (one line), unless ``force``,
        which moves them aside first (a new output never mixes with an old one)."""
        found = self.present(names)
        if found and not force:
            shown = ", ".join(found[:3]) + (f" and {len(found) - 3} more" if len(found) > 3 else "")
            raise RunDirError(
                f"{self.folder} already holds {shown}; pass --force to move them aside, or write to another folder"
            )
        self.move_aside(found)

    def move_aside(self, names: Sequence[str]) -> Path | None:
        """Move the entries of ``names`` that exist into a new ``.replaced-<time>`` folder; one note."""
        found = self.present(names)
        if not found:
            return None
        stamp = time.strftime("%Y%m%d-%H%M%S")
        dest = self.folder / f"{REPLACED_PREFIX}{stamp}"
        for i in range(1, 1000):
            try:
                dest.mkdir()
                break
            except FileExistsError:
                dest = self.folder / f"{REPLACED_PREFIX}{stamp}-{i}"
        for name in found:
            os.rename(self.folder / name, dest / name)
        self.log(f"starting over: moved the previous run's {', '.join(found)} to {dest}")
        return dest


@contextlib.contextmanager
def own_folder(
    folder: str | os.PathLike | None,
    tool: str,
    names: Sequence[str],
    resume: bool,
    force: bool,
    log: Callable[[str], None],
    world: World | None = None,
) -> Iterator[Callable[[], None]]:
    """A run owns ``folder`` while the block runs: rank 0 holds its :class:`RunLock` (a second writer is
    refused, a folder holding a run of ``names`` needs ``resume`` or ``force``), and every rank of a
    ``torchrun`` launch learns the verdict, so none waits for a rank that stopped. Yields ``start_over``,
    which moves an old run's files aside (``force``; call it just before the first write). No folder
    (``None``): nothing to own."""
    world = world or World()
    lock, error, old = None, None, []
    if folder is not None and world.main:
        try:
            lock = RunLock(folder, tool, log)
            old = lock.check_fresh(names, resume=resume, force=force)
        except ValueError as e:
            error = e
            if lock is not None:
                lock.release()
    verdict = broadcast_object(None if error is None else str(error), world)
    if error is not None:
        raise error
    if verdict is not None:
        raise RunDirError(verdict)
    try:
        yield lambda: lock.move_aside(old) if lock is not None and old else None
    finally:
        if lock is not None:
            lock.release()


def checkpoint_bytes(state: dict[str, Any], copies: int = 1) -> int:
    """The size of a checkpoint holding ``copies`` tensors like each of ``state`` (a state_dict): weights,
    optimizer moments, EMA, with a margin for what a checkpoint holds besides."""
    size = sum(t.numel() * t.element_size() for t in state.values() if hasattr(t, "element_size"))
    return int(size * copies * 1.05) + MIB


def check_free_space(folder: str | os.PathLike, need: int) -> None:
    """Raise :class:`RunDirError` unless ``folder`` has ``need`` bytes free (one checkpoint, written beside
    the previous one until it replaces it)."""
    free = shutil.disk_usage(folder).free
    if free < need:
        raise RunDirError(
            f"{folder} has {free / MIB:.0f} MiB free, one checkpoint needs about {need / MIB:.0f} MiB; "
            "free some space or use another --out"
        )
