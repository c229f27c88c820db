"""What the kernel-layer micro-benchmarks share: the line saying what ran, and two forms timed in turns.

Timing the forms alternately in one process (rather than one after the other) spreads the machine's drifts over
both; the figures explain a kernel, they are not the fresh-process comparisons of ``peer_bench``.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch


def machine() -> str:
    """torch's version, its thread count and the ISA its CPU kernels were dispatched for."""
    return (
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, ISA {torch.backends.cpu.get_cpu_capability()}"
    )


def alternate(forms: dict[str, Callable[[], float]], repeats: int, warmup: int = 2) -> dict[str, float]:
    """The median milliseconds of each form over ``repeats`` turns, after ``warmup`` uncounted ones; each callable
    runs the form once and returns the seconds it measured (so that it times only what it means to)."""
    times: dict[str, list[float]] = {key: [] for key in forms}
    for turn in range(warmup + repeats):
        for key, form in forms.items():
            elapsed = form()
            if turn >= warmup:
                times[key].append(elapsed)
    return {key: statistics.median(values) * 1e3 for key, values in times.items()}
