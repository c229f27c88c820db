"""Tests of readers that must not block: a deadline for code that may hang in Python, and a watcher that
frees a reader blocked in C on a named pipe (where no signal handler runs until the call returns)."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import pytest


class Hang(BaseException):
    """Raised by :func:`deadline`: a BaseException, so no reader's ``except OSError`` / ``except Exception``
    hides it."""


@contextlib.contextmanager
def deadline(seconds: int) -> Iterator[None]:
    """Fail with :class:`Hang`, instead of hanging the suite, when the block has not finished in ``seconds``."""

    def expired(*_):
        raise Hang(f"still blocked after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def unblocked(fn: Callable[[], object], fifos: Path | Iterable[Path], seconds: float = 10.0) -> object:
    """``fn()`` in a thread, so that a reader blocked on one of the named pipes ``fifos`` cannot hang the test:
    after ``seconds`` a writer opens and closes the pipes (the reader sees their end) as often as the reader opens
    them again, and the test fails as having blocked. ``fn``'s exception is raised here."""
    pipes = [fifos] if isinstance(fifos, Path) else fifos  # a list the caller may still fill
    box: dict = {}

    def target():
        try:
            box["value"] = fn()
        except BaseException as e:  # handed to the test thread
            box["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():
        end = time.monotonic() + seconds
        while t.is_alive() and time.monotonic() < end:
            for fifo in list(pipes):
                with contextlib.suppress(OSError):  # no reader at this instant
                    os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            t.join(0.05)
        pytest.fail(f"a reader blocked on a named pipe ({', '.join(map(str, pipes))})")
    if "error" in box:
        raise box["error"]
    return box.get("value")
