"""What a benchmark's figures were measured on, and how busy the machine was while it ran."""

from __future__ import annotations

import os
import platform
from typing import Any


def _meminfo(field: str) -> int | None:
    """A ``/proc/meminfo`` entry in bytes (Linux), or None where unavailable."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith(field))
    except (OSError, StopIteration):
        return None


def mem_available() -> int | None:
    """Memory the kernel could give a new process now, in bytes (None where unknown)."""
    return _meminfo("MemAvailable")


def usable_cores() -> int:
    """CPUs this process may run on (its affinity where the platform tells, else the machine's count)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def machine_info(threads: int | None = None) -> dict[str, Any]:
    """What the figures were measured on: versions, CPU model, cores (and those this process may use), memory,
    the GPUs present."""
    import torch

    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    return {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "threads": threads,
        "mem_total_bytes": _meminfo("MemTotal"),
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
    }
