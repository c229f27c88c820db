"""AFT-full/local's kernels compile for an H100/H200 (sm_90) with Triton's own ptxas and fit its shared memory,
no GPU needed (``scripts/triton_compile_check.py`` compiles every form; this keeps the ones an H200 refused).

The kernels once loaded both bias factors' whole rows (rank 128-256) into shared memory and asked 240-416 KiB a
block; an H200 has 227 KiB, and the interpreter, which has no shared memory, passed them. Slow (about a minute),
so not in the default run.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="needs the triton package")
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("compiles kernels: run without TRITON_INTERPRET", allow_module_level=True)

from triton.backends.compiler import GPUTarget

from vitlab.ops import triton_aft

_spec = importlib.util.spec_from_file_location(
    "triton_compile_check", Path(__file__).resolve().parents[1] / "scripts" / "triton_compile_check.py"
)
check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check)


@pytest.mark.slow
@pytest.mark.parametrize("kernel", [triton_aft._sums_fwd, triton_aft._sums_bwd_kv, triton_aft._sums_bwd_w])
@pytest.mark.parametrize("rank", [128, 256])
def test_factorised_kernels_fit_sm90_at_the_models_ranks(kernel, rank):
    """The blocks the modules pick for a rank-``rank`` bias on a GPU, compiled with Triton's default pipelining."""

    class OnGpu:  # the tiles' choice reads the keys' shape and device only
        shape, device = (1, 1024, 256), type("Device", (), {"type": "cuda"})

    blk, bc, br = triton_aft._blocks(OnGpu, rank)
    flags = dict(CAUSAL=True, WINDOW=False, OUTSIDE_ZERO=True, FACTORED=True, BLK=blk, BC=bc, BR=br,
                 PREC="tf32", BIAS_PREC="tf32x3")  # fmt: skip
    error, shared = check.compile_one(kernel, flags, "bf16", GPUTarget("cuda", 90, 32))
    assert error is None, error
    assert "stages" not in shared, shared  # fits without the launch's fallback to fewer stages
