"""Where the work runs: one device story for every command, and what depends on the device.

Every command takes ``--device auto|cpu|cuda|cuda:N`` (``mps`` too; :func:`add_device_argument`, spelled as
:data:`vitlab.common.options.device` checks, resolved by :func:`resolve_device`): ``auto`` is the GPU of this process
when CUDA is present (``cuda:LOCAL_RANK`` under ``torchrun``), else the CPU. Around it:

* mixed precision (:func:`amp_dtype`, :func:`autocast`, :func:`grad_scaler`): bf16 autocast on CPU and GPU,
  fp16 autocast with a gradient scaler on GPU (fp16's 5-bit exponent underflows small gradients, which the
  scaler shifts into range; bf16 has fp32's exponent and needs none);
* timing (:func:`time_call`): CUDA kernels run asynchronously, so a wall clock around a call measures its
  launch, not its work; on a GPU the call is timed with CUDA events and a synchronisation;
* peak memory (:func:`reset_peak_memory`, :func:`device_memory`): on a GPU, ``max_memory_allocated`` after a
  reset of the allocator's peak counter (the host's RSS says little there); on the CPU the resident set
  size is measured by the caller (:mod:`vitlab.measure.process`);
* TF32 (:func:`set_tf32`): Ampere and later GPUs can run fp32 matrix products and convolutions on tensor
  cores with a 10-bit mantissa; off by default, so that fp32 means fp32.

A foundation module (it imports only :mod:`vitlab.common.options`): every layer may use it.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time
from collections.abc import Callable

import torch

from . import options as opt

DEVICE_HELP = "auto (this process's GPU when CUDA is present, else the CPU), cpu, cuda or cuda:N (or mps)"
AMP_CHOICES = ("auto", "none", "bf16", "fp16")


def add_device_argument(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup, default: str | None = "auto"
) -> None:
    """``--device`` with the same spelling check and help in every command (``default=None``: unset unless given,
    for a caller that layers a recipe file under the flags; it then means auto)."""
    parser.add_argument(
        "--device",
        type=opt.device,
        default=default,
        metavar="DEVICE",
        help=f"{DEVICE_HELP} (default {default or 'auto'})",
    )


def local_rank() -> int:
    """This process's index on its node (``torchrun`` sets ``LOCAL_RANK``; 0 otherwise)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def resolve_device(spec: str | torch.device = "auto") -> torch.device:
    """The device ``spec`` names on this machine; ``auto`` and ``cuda`` mean this process's GPU
    (``cuda:LOCAL_RANK``). A GPU that is not there is one :class:`ValueError` line."""
    spec = opt.device.check(str(spec), "--device")
    if spec == "auto":
        spec = "cuda" if torch.cuda.is_available() else "cpu"
    if spec == "cpu":
        return torch.device("cpu")
    if spec == "mps":
        if not torch.backends.mps.is_available():
            raise ValueError("--device mps asked for an Apple GPU, but MPS is not available; use --device cpu")
        return torch.device("mps")
    if not torch.cuda.is_available():
        build = "a CPU-only torch build" if torch.version.cuda is None else "no GPU visible to this process"
        raise ValueError(f"--device {spec} asked for a GPU, but CUDA is not available ({build}); use --device cpu")
    index = local_rank() if spec == "cuda" else int(spec.split(":")[1])
    count = torch.cuda.device_count()
    if index >= count:
        raise ValueError(f"--device cuda:{index} does not exist: this machine has {count} GPU(s), cuda:0..{count - 1}")
    return torch.device("cuda", index)


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --------------------------------------------------------------------------- mixed precision


def amp_dtype(amp: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype of ``--amp`` on ``device``: ``auto`` = fp16 on a GPU, none on the CPU (bf16 is asked
    for by name there); fp16 needs a GPU."""
    if amp not in AMP_CHOICES:
        raise ValueError(f"--amp must be one of {', '.join(AMP_CHOICES)}, got {amp!r}")
    if amp == "auto":
        return torch.float16 if device.type == "cuda" else None
    if amp == "fp16" and device.type != "cuda":
        raise ValueError("fp16 autocast needs a GPU; use --amp bf16 on the CPU")
    return {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}[amp]


def autocast(device: torch.device, dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    """``torch.autocast`` to ``dtype`` on ``device`` (nothing when ``dtype`` is None)."""
    return torch.autocast(device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext()


def grad_scaler(device: torch.device, dtype: torch.dtype | None) -> torch.amp.GradScaler:
    """A gradient scaler, enabled for fp16 only (a disabled scaler passes every call through)."""
    return torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)


def set_tf32(enabled: bool) -> None:
    """Allow (or forbid) TF32 tensor-core math for fp32 matrix products and cuDNN convolutions (GPU only)."""
    # the flags every torch since 2.4 has; torch.export and others read them, and setting the newer per-backend
    # ``fp32_precision`` beside them makes that read an error
    torch.backends.cuda.matmul.allow_tf32 = enabled
    torch.backends.cudnn.allow_tf32 = enabled


# --------------------------------------------------------------------------- timing and memory


def time_call(fn: Callable[[], object], device: torch.device) -> float:
    """Seconds ``fn()`` takes on ``device``: CUDA events around it and a synchronisation on a GPU (what the
    kernels took, not their launch), the wall clock on the CPU."""
    if device.type != "cuda":
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize(device)  # earlier work is not this call's
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak of the GPU allocator (after the queued work); nothing on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def device_memory(device: torch.device) -> dict[str, int] | None:
    """The GPU allocator's bytes: ``allocated`` now, ``peak`` allocated since the last reset, ``reserved``
    (cached by the allocator) at its peak; None on the CPU (measure the RSS there)."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    return {
        "allocated": torch.cuda.memory_allocated(device),
        "peak": torch.cuda.max_memory_allocated(device),
        "reserved": torch.cuda.max_memory_reserved(device),
    }
