"""The machine's own GEMM rate: the yardstick for the models' utilisation.

A model's utilisation is its achieved FLOP/s (model FLOPs = 2 x MACs per
second) divided by the rate at which this machine, with the same number of
threads, runs plain matrix products. That rate is measured here, in the same
run (and, in ``vitlab bench``, in the same process right before each model is
timed), so that the figure says how well the model's implementation uses the
machine rather than how fast the machine is, and partly cancels what other
jobs on a shared machine take away.

The yardstick is the one of the peer comparison harness, so that both tools give one answer for the same
code: a square ``(2048 x 2048) @ (2048 x 2048)`` product (``torch.mm``) in the model's dtype, three untimed
calls, then single calls timed until at least ``min_calls`` calls and ``min_time`` seconds; the rate is the
MEDIAN of the calls' rates (FLOPs = 2·M·K·N per call). A run that measures it more than once (``vitlab bench``:
in every case process) divides by the best of those medians (a conservative denominator).

On a GPU the products run on that GPU (the yardstick of a model timed there), each call timed with CUDA events
and a synchronisation (:func:`vitlab.common.device.time_call`), and the square is larger (:data:`SQUARE_GPU`): a
2048³ product leaves much of a large GPU idle, and lasts about as long as the timing itself.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

import torch

from ..common.device import time_call

SQUARE = (2048, 2048, 2048)  # (M, K, N) of the yardstick product
SQUARE_GPU = (8192, 8192, 8192)  # on a GPU
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class GemmRate:
    """The GEMM rate (FLOP/s): the best of the measured shapes' median rates, and each shape's rate."""

    flops_per_s: float
    dtype: str
    threads: int
    by_shape: dict[str, float]
    seconds: float  # time spent measuring
    device: str = "cpu"

    @property
    def gflops(self) -> float:
        return self.flops_per_s / 1e9

    def as_dict(self) -> dict:
        return {**asdict(self), "gflops": self.gflops}


def shape_rate(
    m: int,
    k: int,
    n: int,
    dtype: torch.dtype = torch.float32,
    min_calls: int = 5,
    min_time: float = 2.0,
    device: torch.device | str = "cpu",
) -> float:
    """Median FLOP/s of single calls ``x (m, k) @ w (k, n)`` on ``device`` after 3 untimed calls, timed until at
    least ``min_calls`` calls and ``min_time`` seconds (at most 1000 calls)."""
    dev = torch.device(device)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(m, k, generator=gen).to(dev, dtype)
    w = torch.randn(k, n, generator=gen).to(dev, dtype)
    for _ in range(3):  # the BLAS's packing buffers, the thread pool (cuBLAS: its handle and workspace)
        torch.mm(x, w)
    rates: list[float] = []
    start = time.perf_counter()
    while len(rates) < min_calls or (time.perf_counter() - start < min_time and len(rates) < 1000):
        rates.append(2.0 * m * k * n / max(time_call(lambda: torch.mm(x, w), dev), 1e-9))
    return statistics.median(rates)


def measure_gemm(
    dtype: str = "fp32",
    threads: int | None = None,
    shapes: tuple[tuple[int, int, int], ...] | None = None,
    min_calls: int = 5,
    min_time: float = 2.0,
    device: torch.device | str = "cpu",
) -> GemmRate:
    """The GEMM rate of ``device`` (this machine's CPU with ``threads`` threads, None: torch's current setting;
    or a GPU), in this process: the best of the shapes' median rates (by default the one square yardstick,
    :data:`SQUARE`, on a GPU :data:`SQUARE_GPU`)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    dev = torch.device(device)
    shapes = shapes or ((SQUARE_GPU if dev.type == "cuda" else SQUARE),)
    if threads is not None:
        torch.set_num_threads(threads)
    t0 = time.perf_counter()
    by_shape = {"x".join(map(str, s)): shape_rate(*s, DTYPES[dtype], min_calls, min_time, dev) for s in shapes}
    seconds = time.perf_counter() - t0
    return GemmRate(max(by_shape.values()), dtype, torch.get_num_threads(), by_shape, seconds, str(dev))
