"""Process-wide allocator policy (glibc): the one setting of the CPU runtime that model code cannot make.

PyTorch's CPU tensors come from ``malloc``. glibc serves large blocks by ``mmap`` and gives freed memory
back to the OS (``munmap``, heap trimming); the next tensor of that size then starts on fresh pages, and
the kernel zeroes every 4 KiB page on first touch. A ViT forward pass allocates and frees its activations
block after block, so without a change DeiT-S at batch 8 takes about 25,000 page faults per forward pass
and ~15 % of its time (measured: ``vitlab bench`` with ``--allocator default``). This is why Intel's
PyTorch CPU guide recommends jemalloc or tcmalloc; here glibc is told instead to keep freed memory
(:func:`keep_freed_memory`), which removes the faults without a preloaded library.

:func:`return_freed_memory` is the opposite policy, for memory measurements: freed blocks go back to the
OS, so the resident size follows the live tensors.

The ``vitlab`` command applies :func:`keep_freed_memory` to every tool unless ``VITLAB_ALLOCATOR=default``;
library users call it themselves. Both functions return False (and change nothing) off glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

# glibc mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
_KEEP_THRESHOLDS = (1 << 30, 32 << 20)  # 1 GiB; 32 MiB where glibc refuses more (its dynamic ceiling)
_TIGHT_THRESHOLD = 128 << 10

_state = {"policy": "default"}


def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt, libc.malloc_trim  # noqa: B018 - glibc only
    except (OSError, AttributeError):
        return None
    return libc


def keep_freed_memory() -> bool:
    """Keep freed blocks in the heap for reuse (no ``munmap``, no trimming): no page faults on the next
    activation of the same size. Costs resident memory up to the process's peak, never more."""
    libc = _libc()
    if libc is None:
        return False
    ok = (
        any(libc.mallopt(_M_MMAP_THRESHOLD, t) == 1 for t in _KEEP_THRESHOLDS)  # large blocks from the heap too
        and libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1) == 1  # never give the heap top back
        and libc.mallopt(_M_TOP_PAD, 64 << 20) == 1  # grow the heap in 64 MiB steps
    )
    _state["policy"] = "keep" if ok else _state["policy"]
    return ok


def return_freed_memory() -> bool:
    """Serve blocks >= 128 KiB by ``mmap`` and unmap them on free, and release the free heap now, so that the
    resident size follows the live blocks (memory measurements).

    By default glibc raises its mmap threshold (up to 32 MiB) each time a large block is freed, after which
    freed blocks stay resident, so a process's RSS overstates its live memory by however fragmented the
    heap became. Fixing the threshold makes RSS follow the live blocks.
    """
    libc = _libc()
    if libc is None:
        return False
    ok = (
        libc.mallopt(_M_MMAP_THRESHOLD, _TIGHT_THRESHOLD) == 1
        and libc.mallopt(_M_TRIM_THRESHOLD, _TIGHT_THRESHOLD) == 1
    )
    libc.malloc_trim(0)
    _state["policy"] = "return" if ok else _state["policy"]
    return ok


def allocator_policy() -> str:
    """What this process's allocator does with freed memory: ``keep``, ``return`` or ``default``."""
    return _state["policy"]


def configure_from_env() -> str:
    """The ``vitlab`` command's setting: keep freed memory unless ``VITLAB_ALLOCATOR=default``."""
    choice = os.environ.get("VITLAB_ALLOCATOR", "keep").strip().lower()
    if choice not in ("keep", "default"):
        raise ValueError(f"VITLAB_ALLOCATOR must be 'keep' or 'default', got {choice!r}")
    if choice == "keep":
        keep_freed_memory()
    return allocator_policy()


def is_out_of_memory(e: BaseException) -> bool:
    """Whether ``e`` says the process ran out of memory: ``MemoryError``, torch's ``OutOfMemoryError`` (a GPU),
    or the RuntimeError of a CPU allocation that failed ("can't allocate memory")."""
    if isinstance(e, MemoryError) or type(e).__name__ == "OutOfMemoryError":
        return True
    text = str(e)
    return isinstance(e, RuntimeError) and ("can't allocate memory" in text or "out of memory" in text.lower())
