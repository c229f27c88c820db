"""Compile every specialisation of vitlab's AFT Triton kernels for a GPU target, without a GPU.

Triton's interpreter (the CPU tests) runs the kernels with NumPy and accepts code the compiler refuses (globals
that are not constexpr, operand types, tile shapes, ``tl.dot`` precisions). This script runs the real compiler
down to the GPU binary (Triton ships its own ``ptxas``), for the flags and dtypes the modules use, and prints one
line per kernel with the shared memory a block asks. A kernel over the target's limit per block is compiled again
with fewer pipelining stages, as :func:`vitlab.ops.triton_support.launch` does on the GPU, and fails only if none
fits. The exit status is the number of failures. About 5 CPU-minutes for the default target.

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
from vitlab.ops.triton_support import STAGE_LADDER  # the launch's: the default pipelining, then fewer

SCALARS = ("T", "C", "R", "B", "H", "W", "CX")  # upper-case kernel arguments that are sizes, not tensors
# shared memory a block may take (bytes, opt-in maximum) by compute capability x 10
SHARED_LIMIT = {80: 166912, 86: 101376, 89: 101376, 90: 232448, 100: 232448, 120: 101376}


def signature_of(kernel, constexprs: dict, dtype: str) -> dict:
    signature = {}
    for name in kernel.arg_names:
        size = name in SCALARS and not (name == "W" and "FACTORED" in constexprs)  # AFT-full's W is its bias table
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in ("Q", "K", "V") or (name in ("GQ", "GK", "GV") and "BT" in constexprs):
            signature[name] = f"*{dtype}"  # (AFT-simple writes its gradient in the projection's dtype)
        elif name.isupper() and not size:
            signature[name] = "*fp32"
        elif name == "margin":
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
    return signature


def compile_one(kernel, constexprs: dict, dtype: str, target: GPUTarget) -> tuple[str | None, str]:
    """Compile ``kernel`` with these compile-time values and K, V (Q) in ``dtype``: (the error or None, the
    shared memory of each stage count tried)."""
    src = ASTSource(fn=kernel, signature=signature_of(kernel, constexprs, dtype),
                    constexprs={(kernel.arg_names.index(k),): v for k, v in constexprs.items()})  # fmt: skip
    limit, tried = SHARED_LIMIT.get(target.arch, 101376), []
    for stages in STAGE_LADDER:
        try:
            options = {} if stages is None else {"num_stages": stages}
            shared = triton.compile(src, target=target, options=options).metadata.shared
        except Exception as error:  # every failure is reported, then the next kernel compiled
            cause = error.__cause__ or error
            return f"{type(cause).__name__}: {str(cause)[-400:]}", ""
        tried.append(f"{shared // 1024} KiB" + ("" if stages is None else f" at {stages} stages"))
        if shared <= limit:
            return None, ", ".join(tried)
    return f"shared memory over the {limit // 1024} KiB a block may take at every stage count", ", ".join(tried)


def cases():
    """(kernel, compile-time values, dtype) for every form the modules launch."""
    for causal, dtype in itertools.product((False, True), ("fp32", "bf16", "fp16")):
        yield triton_aft_simple._simple_fwd, dict(CAUSAL=causal, BT=64, BC=32), dtype
        backward = triton_aft_simple._causal_bwd if causal else triton_aft_simple._global_bwd
        yield backward, dict(BT=64, BC=32), dtype
    for causal, window, outside_zero, factored, dtype in itertools.product(
        (False, True), (0, 32), (True, False), (True, False), ("fp32", "bf16")
    ):
        if not window and not outside_zero:
            continue
        # the bias rank in blocks of at most 64 (triton_aft._blocks), whatever the factors' rank
        flags = dict(CAUSAL=causal, WINDOW=window > 0, OUTSIDE_ZERO=outside_zero, FACTORED=factored, BLK=64,
                     BC=64, BR=64, PREC="tf32x3" if dtype == "fp32" else "tf32", BIAS_PREC="tf32x3")  # fmt: skip
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
        error, shared = compile_one(kernel, flags, dtype, target)
        failures += error is not None
        shown = " ".join(f"{k}={v}" for k, v in flags.items())
        print(f"{'FAIL' if error else 'ok'} {name} {dtype} {shown} ({shared})" + (f"\n  {error}" if error else ""),
              flush=True)  # fmt: skip
    return failures


if __name__ == "__main__":
    sys.exit(main())
