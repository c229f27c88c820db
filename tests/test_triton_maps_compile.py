"""The map kernels compile for an H100 (sm_90) with Triton's own ptxas, no GPU needed.

The interpreter (``tests/test_triton_maps_*.py``) checks what the kernels compute; this checks what only the
compiler checks (``tl.dot`` shapes and precisions, types of loop-carried values, shared memory), for every
specialisation the modules launch, in each input dtype. Slow (about a minute), so not in the default run.
"""

from __future__ import annotations

import os

import pytest

triton = pytest.importorskip("triton", reason="needs the triton package")
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("compiles kernels: run without TRITON_INTERPRET", allow_module_level=True)

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from vitlab.ops import triton_double_norm as tdn  # noqa: E402
from vitlab.ops import triton_head_mix as thm  # noqa: E402

#: pointer arguments that always hold fp32 (statistics, partial sums, folded weights); the others hold the maps
FP32_POINTERS = {"lse_ptr", "n_ptr", "c_ptr", "xz_ptr", "sx_ptr", "wx_ptr", "wz_ptr"}
SPECIALISATIONS = [  # kernel, constexprs, whether its out_ptr holds the maps' dtype
    (tdn._columns_kernel, dict(BLOCK_T=64, BLOCK_S=64, GRAD=False), False),
    (tdn._columns_kernel, dict(BLOCK_T=64, BLOCK_S=64, GRAD=True), False),
    (tdn._rows_kernel, dict(BLOCK_T=64, BLOCK_S=64, GRAD=False, SAVE=True), True),
    (tdn._rows_kernel, dict(BLOCK_T=64, BLOCK_S=64, GRAD=True, SAVE=False), True),
    (thm._moments_kernel, dict(BLOCK_L=64, BC1=64, BC2=16), False),
    (thm._mix_kernel, dict(BLOCK_L=64, BCX=16, BCZ=64, BG=64, TWO=True), True),
]


def signature(kernel, constexprs: dict, maps_out: bool, dtype: str) -> dict[str, str]:
    sig = {}
    for name in kernel.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            fp32 = name in FP32_POINTERS or (name.startswith("out") and not maps_out)
            sig[name] = "*fp32" if fp32 else f"*{dtype}"
        else:
            sig[name] = "fp32" if name == "eps" else "i32"
    return sig


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("kernel, constexprs, maps_out", SPECIALISATIONS)
def test_kernel_compiles_for_sm90(kernel, constexprs, maps_out, dtype):
    source = ASTSource(kernel, signature(kernel, constexprs, maps_out, dtype), constexprs)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32))
    assert compiled.asm["cubin"] and compiled.metadata.shared <= 200 * 1024  # an H100 block has 227 KiB
