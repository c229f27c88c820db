"""The Triton head mix + training BatchNorm (``vitlab.ops.triton_head_mix``) against the float64 modules.

``c · BN(W A + b)`` from the maps' first two moments and one affine mix: the modules' output, running statistics
and gradients of every input. Run with ``TRITON_INTERPRET=1`` (set before triton is imported) on the CPU, or on a
CUDA machine; skipped otherwise. Tiny shapes: the interpreter runs every program in NumPy.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch

if not (os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available()):
    pytest.skip(
        "the Triton kernels need TRITON_INTERPRET=1 (set before triton is imported) or CUDA", allow_module_level=True
    )
triton = pytest.importorskip("triton", reason="the Triton kernels need the triton package")

from vitlab.mixers import ReAttention, RefinerAttention  # noqa: E402
from vitlab.mixers.attention import HeadMix  # noqa: E402
from vitlab.ops import fast_paths  # noqa: E402
from vitlab.ops import triton_head_mix as thm  # noqa: E402
from vitlab.ops.head_mix_norm import can_fuse, triton_takes  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.double() - expected.double()).abs().max() / expected.double().abs().max().clamp_min(1e-30)).item()


@pytest.fixture(params=[(64, 1024), (16, 4)], ids=["default-tiles", "split-tiles"])
def tiles(request, monkeypatch):
    """The default tiles, and tiles of 16 rows with two programs per batch element summing partial moments."""
    monkeypatch.setattr(thm, "_BLOCK_L", request.param[0])
    monkeypatch.setattr(thm, "_MAX_PROGRAMS", request.param[1])


def modules(heads_in, heads_out, bias, affine, track, momentum):
    torch.manual_seed(0)
    mix = HeadMix(heads_in, heads_out, bias=bias)
    bn = torch.nn.BatchNorm2d(heads_out, affine=affine, track_running_stats=track, momentum=momentum)
    with torch.no_grad():
        if affine:
            bn.weight.uniform_(0.5, 1.5)
            bn.bias.normal_()
        if bias:
            mix.bias.normal_()
    return mix.to(DEVICE), bn.to(DEVICE)


CASES = [  # heads in, heads out, mix bias, BN affine, running stats, momentum, scale, heads-last maps
    (4, 4, True, True, True, 0.1, 1.0, False),
    (3, 7, True, True, True, None, 0.3, True),  # expansion; cumulative running average
    (6, 2, False, True, True, 0.1, 2.0, False),  # reduction without bias
    (4, 5, True, False, False, 0.1, 0.5, True),  # no BN affine, no running statistics
]


@pytest.mark.parametrize("case", CASES)
def test_values_statistics_and_gradients_are_the_float64_modules(case, tiles):
    *spec, scale, heads_last = case
    mix, bn = modules(*spec)
    ref_mix, ref_bn = copy.deepcopy(mix).double(), copy.deepcopy(bn).double()
    a = torch.randn(2, spec[0], 7, 7).mul(3).softmax(-1).to(DEVICE)
    a = a.contiguous(memory_format=torch.channels_last) if heads_last else a  # either input layout
    grad = torch.randn(2, spec[1], 7, 7, device=DEVICE)
    for _ in range(2):  # the running statistics move twice
        x, ref_x = a.clone(memory_format=torch.preserve_format).requires_grad_(), a.double().requires_grad_()
        out = thm.head_mix_batchnorm_triton(x, mix, bn, scale, heads_last)
        ref = ref_bn(ref_mix(ref_x)) * scale
    assert out.dtype == torch.float32 and rel_err(out, ref) < 1e-5
    assert out.is_contiguous(memory_format=torch.channels_last if heads_last else torch.contiguous_format)
    out.backward(grad)
    ref.backward(grad.double())
    assert rel_err(x.grad, ref_x.grad) < 1e-4
    assert x.grad.is_contiguous(memory_format=torch.channels_last if heads_last else torch.contiguous_format)
    assert rel_err(mix.weight.grad, ref_mix.weight.grad) < 1e-4
    if spec[2]:  # the batch mean cancels the mix bias: its gradient is 0
        assert mix.bias.grad.abs().max() == 0 and ref_mix.bias.grad.abs().max() < 1e-8
    if spec[3]:
        assert rel_err(bn.weight.grad, ref_bn.weight.grad) < 1e-4 and rel_err(bn.bias.grad, ref_bn.bias.grad) < 1e-5
    if spec[4]:
        for buf in ("running_mean", "running_var", "num_batches_tracked"):
            assert rel_err(getattr(bn, buf), getattr(ref_bn, buf)) < 1e-6, buf


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_maps_keep_fp32_sums(dtype):
    """Half-precision maps and fp32 parameters (autocast's situation): the output rounded once to the maps' dtype,
    the gradients within a few roundings of that dtype."""
    mix, bn = modules(4, 6, True, True, True, 0.1)
    ref_mix, ref_bn = copy.deepcopy(mix).double(), copy.deepcopy(bn).double()
    a = torch.randn(2, 4, 9, 9).mul(3).softmax(-1).to(dtype).to(DEVICE)
    x, ref_x = a.clone().requires_grad_(), a.double().requires_grad_()
    out = thm.head_mix_batchnorm_triton(x, mix, bn, 1.0, False)
    ref = ref_bn(ref_mix(ref_x))
    eps = torch.finfo(dtype).eps
    assert out.dtype == dtype and rel_err(out, ref) < eps
    grad = torch.randn(2, 6, 9, 9).to(dtype).to(DEVICE)
    out.backward(grad)
    ref.backward(grad.double())
    assert x.grad.dtype == dtype and rel_err(x.grad, ref_x.grad) < 4 * eps
    assert mix.weight.grad.dtype == torch.float32 and rel_err(mix.weight.grad, ref_mix.weight.grad) < 1e-4
    assert rel_err(bn.running_var, ref_bn.running_var) < 1e-6


def test_half_precision_and_autocast_take_the_kernels():
    bn = torch.nn.BatchNorm2d(4).to(DEVICE)
    a = torch.randn(1, 4, 5, 5, device=DEVICE)
    assert triton_takes(a.bfloat16(), 4) and can_fuse(a.half(), bn)
    with torch.autocast(a.device.type, dtype=torch.bfloat16):
        assert can_fuse(a.bfloat16(), bn)
    assert not triton_takes(a.double(), 4) and not triton_takes(a, 65)
    with fast_paths(False):
        assert not can_fuse(a, bn)


def test_module_training_steps_equal_the_plain_path_and_the_switch_turns_the_kernels_off(monkeypatch):
    """Re-attention and the official refiner block (expansion + BN + ReLU6, depth-wise conv, reduction + BN):
    the kernels run (counted) and give the plain modules' outputs, gradients and running statistics in float64 (to
    fp32 rounding relative to each tensor's largest entry); with the fast paths off the kernels never run."""
    calls = []
    real = thm.head_mix_batchnorm_triton
    monkeypatch.setattr(thm, "head_mix_batchnorm_triton", lambda *a, **k: calls.append(1) or real(*a, **k))
    torch.manual_seed(3)
    models = [
        ReAttention(24, num_heads=4, transform_scale=True),
        RefinerAttention(24, num_heads=4, expansion=2, official_extras=True),
    ]
    for model in models:
        model = model.to(DEVICE).train()
        x = torch.randn(2, 6, 24, device=DEVICE)
        results = []
        for enabled, dtype in ((True, torch.float32), (False, torch.float32), (False, torch.float64)):
            twin = copy.deepcopy(model).to(dtype)
            calls.clear()
            with fast_paths(enabled):
                out = twin(x.to(dtype))
                out.square().sum().backward()
            assert bool(calls) == enabled
            grads = [p.grad for p in twin.parameters()]
            stats = [b for name, b in twin.named_buffers() if "running" in name]
            results.append([out, *grads, *stats])
        for fast, plain, exact in zip(*results, strict=True):
            assert rel_err(fast, exact) < max(1e-5, 10 * rel_err(plain, exact))


def test_under_autocast_the_kernels_agree_with_the_plain_modules_to_bf16_rounding(monkeypatch):
    """Re-attention in a bf16 autocast region (the GPU training setting): the kernels take the bf16 maps with the
    fp32 parameters; outputs and gradients agree with the plain modules under autocast to bf16's rounding, both
    measured against the float64 module."""
    taken = []
    real = thm.head_mix_batchnorm_triton
    monkeypatch.setattr(thm, "head_mix_batchnorm_triton", lambda a, *r, **k: taken.append(a.dtype) or real(a, *r, **k))
    torch.manual_seed(4)
    model = ReAttention(32, num_heads=4, transform_scale=True).to(DEVICE).train()
    x = torch.randn(2, 9, 32, device=DEVICE)
    results = []
    for enabled, dtype in ((True, torch.bfloat16), (False, torch.bfloat16), (False, torch.float64)):
        twin = copy.deepcopy(model).to(torch.float64 if dtype == torch.float64 else torch.float32)
        with fast_paths(enabled), torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=dtype != torch.float64):
            out = twin(x.to(torch.float64) if dtype == torch.float64 else x)
        out.float().square().sum().backward()
        results.append([out, twin.reatten_matrix.weight.grad, twin.qkv.weight.grad, twin.var_norm.running_var])
    assert taken == [torch.bfloat16]
    for fast, plain, exact in zip(*results, strict=True):
        assert rel_err(fast, exact) < max(2e-2, 2 * rel_err(plain, exact))
