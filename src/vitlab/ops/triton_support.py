"""Where vitlab's Triton kernels run: on CUDA tensors, and on CPU tensors in Triton's interpreter for the tests.

The GPU kernels of this layer are written in Triton. On a CUDA device a module calls them when
:func:`triton_runs_on` says so (the one switch of :mod:`.switch` on, no graph being captured, Triton importable).
Without a GPU the same kernels run on CPU tensors under ``TRITON_INTERPRET=1`` (Triton's interpreter executes
each program with NumPy): the tests compare them there with the plain path and the paper's equation, so every
kernel is checked on any machine. The CPU keeps its own paths otherwise: the interpreter is a correctness tool,
hundreds of times slower than the CPU kernels, so modules take it only when a test asks (:func:`interpreting`).
Every kernel of the layer is launched through :func:`launch`, which fits its loops' pipelining to the GPU's
shared memory.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from typing import Any

from torch import Tensor

from .switch import eager_fast_path


@functools.cache
def triton_available() -> bool:
    """Whether the ``triton`` package can be imported (it ships with torch's CUDA wheels, and installs on CPU)."""
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``, read by Triton at import)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def triton_runs_on(*tensors: Tensor) -> bool:
    """Whether a Triton kernel may take ``tensors``: the fast paths on and eager, Triton importable, and the
    tensors all on one CUDA device, or all on the CPU while the interpreter runs."""
    if not (tensors and eager_fast_path() and triton_available()):
        return False
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        return False
    device = devices.pop()
    return device.type == "cuda" or (device.type == "cpu" and interpreting())


# Triton's default software pipelining (num_stages 3 on CUDA), then fewer stages: each stage buffers one more set
# of a loop's tiles in shared memory. Seen on an H200 (227 KiB a block): AFT-full/local's sums asked 240-416 KiB
STAGE_LADDER: tuple[int | None, ...] = (None, 2, 1)
_STAGES_THAT_FIT: dict[tuple, int | None] = {}


def launch(kernel: Any, grid: tuple[int, ...], *args: Any, **meta: Any) -> None:
    """``kernel[grid](*args, **meta)``, with fewer pipelining stages where the GPU's shared memory cannot hold the
    default's buffers. Triton raises ``OutOfResources`` when it loads such a binary, before anything runs, so the
    next rung of :data:`STAGE_LADDER` is tried at once; the stages that fit are kept per kernel, device and
    compile-time flags, and later calls launch with them directly. The tiles and the results are the same on
    every rung (the stages change when loads are issued, not what is summed); the interpreter ignores them."""
    from triton.runtime.errors import OutOfResources

    device = next((a.device for a in args if isinstance(a, Tensor)), None)
    key = (kernel, device, tuple(sorted(meta.items())))
    if key in _STAGES_THAT_FIT:
        _launch_with(kernel, grid, args, meta, _STAGES_THAT_FIT[key])
        return
    for stages in STAGE_LADDER:
        try:
            _launch_with(kernel, grid, args, meta, stages)
        except OutOfResources as e:
            if stages == STAGE_LADDER[-1]:
                name = getattr(kernel, "__name__", kernel)
                raise RuntimeError(
                    f"the Triton kernel {name} does not fit this GPU even unpipelined ({e}); run vitlab's plain "
                    "path with vitlab.ops.set_fast_paths(False) or VITLAB_FAST_PATHS=0"
                ) from e
            continue
        _STAGES_THAT_FIT[key] = stages
        return


def _launch_with(kernel: Any, grid: tuple[int, ...], args: tuple, meta: dict, stages: int | None) -> None:
    extra: dict[str, int] = {} if stages is None else {"num_stages": stages}
    kernel[grid](*args, **meta, **extra)
