"""Compile every specialisation of vitlab's AFT Triton kernels for a GPU target, without a GPU.

Triton's interpreter (the CPU tests) runs the kernels with NumPy and accepts code the compiler refuses (globals
that are not constexpr, operand types, tile shapes, ``tl.dot`` precisions). This script runs the real compiler
down to the GPU binary (Triton ships its own ``ptxas``), for the flags and dtypes the modules use, and prints one
line per kernel; the exit status is the number of failures. About 3 CPU-minutes for the default target.

    PYTHONPATH=src python scripts/triton_compile_check.py [--arch 90] [--only _sums_fwd]
"""

from __future__ import annotations

import argparse
import itertools
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from vitlab.ops import triton_aft, triton_aft_conv, triton_aft_decode, triton_aft_simple

SCALARS = ("T", "C", "R", "B", "H", "W", "CX")  # upper-case kernel arguments that are sizes, not tensors


def compile_one(kernel, constexprs: dict, dtype: str, target: GPUTarget) -> str | None:
    """Compile ``kernel`` with these compile-time values and K, V (Q) in ``dtype``; the error, or None."""
    signature = {}
    for name in kernel.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in ("Q", "K", "V") or (name in ("GQ", "GK", "GV") and "BT" in constexprs):
            signature[name] = f"*{dtype}"  # (AFT-simple writes its gradient in the projection's dtype)
        elif name.isupper() and name not in SCALARS:
            signature[name] = "*fp32"
        elif name == "margin":
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
    fixed = {(kernel.arg_names.index(k),): v for k, v in constexprs.items()}
    try:
        triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=fixed), target=target)
    except Exception as error:  # every failure is reported, then the next kernel compiled
        cause = error.__cause__ or error
        return f"{type(cause).__name__}: {str(cause)[-400:]}"
    return None


def cases():
    """(kernel, compile-time values, dtype) for every form the modules launch."""
    for causal, dtype in itertools.product((False, True), ("fp32", "bf16", "fp16")):
        yield triton_aft_simple._simple_fwd, dict(CAUSAL=causal, BT=64, BC=32), dtype
        backward = triton_aft_simple._causal_bwd if causal else triton_aft_simple._global_bwd
        yield backward, dict(BT=64, BC=32), dtype
    for causal, window, outside_zero, factored, rank, dtype in itertools.product(
        (False, True), (0, 32), (True, False), (True, False), (64, 256), ("fp32", "bf16")
    ):
        if (not window and not outside_zero) or (not factored and rank != 64):
            continue
        flags = dict(CAUSAL=causal, WINDOW=window > 0, OUTSIDE_ZERO=outside_zero, FACTORED=factored, BLK=64,
                     BC=64, BR=rank, PREC="tf32x3" if dtype == "fp32" else "tf32", BIAS_PREC="tf32x3")  # fmt: skip
        for kernel in (triton_aft._sums_fwd, triton_aft._sums_bwd_kv, triton_aft._sums_bwd_w):
            yield kernel, flags, dtype


def decode_and_conv_cases():
    """The one-token decoding steps (projections in fp32, bf16, fp16) and AFT-conv's window kernels (fp32 context),
    for kernel sizes 3 and 11 (AFT-conv-tiny's)."""
    for dtype in ("fp32", "bf16", "fp16"):
        yield triton_aft_decode._running_step, dict(BC=128), dtype
        yield triton_aft_decode._prefix_step, dict(BT=64, BC=128), dtype
    for s in (3, 11):
        for flip, far in ((False, True), (False, False), (True, False)):
            yield triton_aft_conv._window_fwd, dict(S=s, FLIP=flip, HAS_FAR=far, BT=64, BC=64), "fp32"
        yield triton_aft_conv._window_grad_kernel, dict(S=s, BT=64, BC=64), "fp32"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", type=int, default=90, help="CUDA compute capability x 10 (90: H100/H200)")
    p.add_argument("--only", help="compile only the kernels of this name")
    args = p.parse_args(argv)
    target = GPUTarget("cuda", args.arch, 32)
    failures = 0
    for kernel, flags, dtype in itertools.chain(cases(), decode_and_conv_cases()):
        name = kernel.fn.__name__
        if args.only and name != args.only:
            continue
        error = compile_one(kernel, flags, dtype, target)
        failures += error is not None
        shown = " ".join(f"{k}={v}" for k, v in flags.items())
        print(f"{'FAIL' if error else 'ok'} {name} {dtype} {shown}" + (f"\n  {error}" if error else ""), flush=True)
    return failures


if __name__ == "__main__":
    sys.exit(main())
