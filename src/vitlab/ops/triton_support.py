"""Where vitlab's Triton kernels run: on CUDA tensors, and on CPU tensors in Triton's interpreter for the tests.

The GPU kernels of this layer are written in Triton. On a CUDA device a module calls them when
:func:`triton_runs_on` says so (the one switch of :mod:`.switch` on, no graph being captured, Triton importable).
Without a GPU the same kernels run on CPU tensors under ``TRITON_INTERPRET=1`` (Triton's interpreter executes
each program with NumPy): the tests compare them there with the plain path and the paper's equation, so every
kernel is checked on any machine. The CPU keeps its own paths otherwise: the interpreter is a correctness tool,
hundreds of times slower than the CPU kernels, so modules take it only when a test asks (:func:`interpreting`).
"""

from __future__ import annotations

import functools
import importlib.util
import os

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
