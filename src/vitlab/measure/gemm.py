"""The machine's own GEMM rate: the yardstick for the models' utilisation.

A model's utilisation is its achieved FLOP/s (model FLOPs = 2 x MACs per
second) divided by the rate at which this machine, with the same number of
threads, runs plain matrix products. That rate is measured here, in the same
run (and, in ``vitlab bench``, in the same process right before each model is
timed), so that the figure says how well the model's implementation uses the
machine rather than how fast the machine is, and partly cancels what other
jobs on a shared machine take away.

The products are ``x @ Wᵀ`` as ``nn.Linear`` computes them: shapes typical of
the models (DeiT-S's MLP and qkv at batch 8: 1576 tokens x 384 -> 1536, 1536 ->
384, 384 -> 1152) and one big square product. For each shape, rounds of
back-to-back calls are timed; a round's rate is its FLOPs over its wall time,
the shape's rate is its best round (a *sustained* rate: a round is several
calls, not one lucky call), and the machine's rate is the best shape's.

On a GPU the products run on that GPU (the yardstick of a model timed there), each round timed with CUDA
events and a synchronisation, and a large square product (:data:`SQUARE_GPU`) joins the shapes: the
model-sized products leave much of a large GPU idle.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch

from ..device import time_call

# (M, K, N): M tokens of width K through a K -> N linear layer
MODEL_SHAPES: tuple[tuple[int, int, int], ...] = ((1576, 384, 1536), (1576, 1536, 384), (1576, 384, 1152))
SQUARE = (1536, 1536, 1536)
SQUARE_GPU = (8192, 8192, 8192)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class GemmRate:
    """The best sustained rate (FLOP/s) over the measured shapes, and each shape's rate."""

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
    rounds: int = 5,
    round_time: float = 0.05,
    device: torch.device | str = "cpu",
) -> float:
    """Best sustained FLOP/s of ``x (m, k) @ w (n, k)ᵀ`` on ``device`` over ``rounds`` rounds of about
    ``round_time`` s each."""
    dev = torch.device(device)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(m, k, generator=gen).to(dev, dtype)
    w = torch.randn(n, k, generator=gen).to(dev, dtype)
    out = torch.empty(m, n, dtype=dtype, device=dev)
    flops = 2.0 * m * k * n

    def product() -> None:
        torch.mm(x, w.t(), out=out)

    product()  # warm the BLAS (packing buffers, thread pool; cuBLAS handles and workspace)
    calls = max(1, int(round_time / max(time_call(product, dev), 1e-6)))

    def round_of_calls() -> None:
        for _ in range(calls):
            product()

    return max(calls * flops / time_call(round_of_calls, dev) for _ in range(rounds))


def measure_gemm(
    dtype: str = "fp32",
    threads: int | None = None,
    shapes: tuple[tuple[int, int, int], ...] | None = None,
    rounds: int = 5,
    round_time: float = 0.05,
    device: torch.device | str = "cpu",
) -> GemmRate:
    """The GEMM rate of ``device`` (this machine's CPU with ``threads`` threads, None: torch's current setting;
    or a GPU), in this process. ``shapes`` default to the model shapes and a square product (a large one on
    a GPU)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    dev = torch.device(device)
    if shapes is None:
        shapes = (*MODEL_SHAPES, SQUARE_GPU if dev.type == "cuda" else SQUARE)
    if threads is not None:
        torch.set_num_threads(threads)
    t0 = time.perf_counter()
    by_shape = {
        "x".join(map(str, s)): shape_rate(*s, dtype=DTYPES[dtype], rounds=rounds, round_time=round_time, device=dev)
        for s in shapes
    }
    seconds = time.perf_counter() - t0
    return GemmRate(max(by_shape.values()), dtype, torch.get_num_threads(), by_shape, seconds, str(dev))
