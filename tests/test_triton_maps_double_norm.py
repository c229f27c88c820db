"""The Triton double normalisation (``vitlab.ops.triton_double_norm``) against the paper's equation and the plain path.

Run with ``TRITON_INTERPRET=1`` (set before triton is imported) on the CPU, or on a CUDA machine; skipped otherwise.
Tiny shapes: the interpreter runs every program in NumPy.
"""

from __future__ import annotations

import os

import pytest
import torch

if not (os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available()):
    pytest.skip(
        "the Triton kernels need TRITON_INTERPRET=1 (set before triton is imported) or CUDA", allow_module_level=True
    )
triton = pytest.importorskip("triton", reason="the Triton kernels need the triton package")

from vitlab.mixers import ExternalAttention, MultiHeadExternalAttention  # noqa: E402
from vitlab.ops import fast_paths  # noqa: E402
from vitlab.ops import triton_double_norm as tdn  # noqa: E402
from vitlab.ops.double_norm import double_normalize  # noqa: E402
from vitlab.ops.triton_support import triton_runs_on  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def naive(logits: torch.Tensor, token_dim: int, memory_dim: int, eps: float) -> torch.Tensor:
    """Paper Algorithm 1 in float64, term by term: exp / Σ_tokens exp, then / (Σ_slots + eps)."""
    e = logits.double().exp()
    a = e / e.sum(token_dim, keepdim=True)
    return a / (a.sum(memory_dim, keepdim=True) + eps)


SHAPES = [  # shape, token_dim: (B, N, S) single head, (B, N, heads, S) EAMLP, (B, H, N, N) on self-attention maps
    ((2, 7, 5), 1),
    ((2, 9, 3, 6), 1),
    ((1, 2, 5, 5), -2),
]


@pytest.fixture(params=[(4096, 1024), (16, 4), (16, 8)], ids=["one-tile", "two-chunks", "four-chunks"])
def tile(request, monkeypatch):
    """The default tile, and tiles of one or two token rows with the tokens of a column split into chunks of
    several (or one) tiles, whose partial column sums are combined."""
    monkeypatch.setattr(tdn, "_TILE", request.param[0])
    monkeypatch.setattr(tdn, "_TARGET_PROGRAMS", request.param[1])


@pytest.mark.parametrize("shape, token_dim", SHAPES)
def test_values_and_gradients_are_the_equation(shape, token_dim, tile):
    torch.manual_seed(0)
    logits = (torch.randn(shape, dtype=torch.float64) * 4).float().to(DEVICE)
    assert triton_runs_on(logits) and tdn.supports(logits, token_dim, -1)
    x = logits.clone().requires_grad_()
    out = tdn.double_normalize_triton(x, token_dim, 1e-9)
    ref_x = logits.double().requires_grad_()
    ref = naive(ref_x, token_dim, -1, 1e-9)
    torch.testing.assert_close(out.double(), ref, rtol=2e-6, atol=1e-9)
    grad = torch.randn(shape, dtype=torch.float64).to(DEVICE)
    out.backward(grad.float())
    ref.backward(grad)
    torch.testing.assert_close(x.grad.double(), ref_x.grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_keeps_fp32_sums(dtype):
    torch.manual_seed(1)
    logits = (torch.randn(2, 33, 2, 16) * 3).to(dtype).to(DEVICE)
    x = logits.clone().requires_grad_()
    out = double_normalize(x, token_dim=1, memory_dim=-1)
    assert out.dtype == dtype
    ref_x = logits.double().requires_grad_()
    ref = naive(ref_x, 1, -1, 1e-9)
    tol = 8e-3 if dtype == torch.bfloat16 else 1e-3  # one rounding of the output
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=1e-5)
    grad = torch.randn(logits.shape, dtype=torch.float64).to(DEVICE)
    out.backward(grad.to(dtype))
    ref.backward(grad.to(dtype).double())
    torch.testing.assert_close(x.grad.double(), ref_x.grad, rtol=2 * tol, atol=2 * tol * ref_x.grad.abs().max().item())


def test_huge_logits_stay_finite():
    logits = torch.tensor([[[1e4, -1e4, 0.0], [-1e4, 1e4, 3e4], [0.0, 0.0, -3e4]]], device=DEVICE)
    out = tdn.double_normalize_triton(logits, 1, 1e-9)
    a = logits.double().softmax(1)  # the equation with the max subtracted (exp(1e4) overflows even in float64)
    torch.testing.assert_close(out.double(), a / (a.sum(-1, keepdim=True) + 1e-9), atol=1e-6, rtol=0)
    assert torch.isfinite(out).all()


def test_inplace_overwrites_the_logits():
    torch.manual_seed(2)
    logits = torch.randn(2, 6, 4, device=DEVICE)
    ref = naive(logits, 1, -1, 1e-9).float()
    with torch.no_grad():
        out = double_normalize(logits, token_dim=1, memory_dim=2, inplace=True)
    assert out.data_ptr() == logits.data_ptr()
    torch.testing.assert_close(logits, ref, rtol=2e-6, atol=1e-9)


def test_modules_equal_the_plain_path_and_the_switch_turns_the_kernel_off(monkeypatch):
    """EA and EAMLP take the kernel (counted) and give the plain path's outputs and gradients; with the fast paths
    off the kernel is never called."""
    calls = []
    real = tdn.double_normalize_triton
    monkeypatch.setattr(tdn, "double_normalize_triton", lambda *a, **k: calls.append(1) or real(*a, **k))
    torch.manual_seed(3)
    for mixer in (ExternalAttention(8, memory_size=6), MultiHeadExternalAttention(8, num_heads=2, coef=2)):
        mixer = mixer.to(DEVICE)
        x = torch.randn(2, 5, 8, device=DEVICE)
        results = []
        for enabled in (True, False):
            calls.clear()
            with fast_paths(enabled):
                mixer.zero_grad()
                xi = x.clone().requires_grad_()
                out = mixer(xi)
                out.square().sum().backward()
            assert bool(calls) == enabled
            results.append((out, xi.grad, mixer.mk.weight.grad.clone()))
        for fast, plain in zip(*results, strict=True):
            torch.testing.assert_close(fast, plain, rtol=1e-5, atol=1e-6)


def test_unsupported_layouts_take_the_plain_path():
    """Slots not on the last axis: the kernel declines and the composite computes the same map."""
    logits = torch.randn(2, 4, 6, device=DEVICE)
    assert not tdn.supports(logits, -1, -2)
    out = double_normalize(logits, token_dim=-1, memory_dim=-2)
    torch.testing.assert_close(out.double(), naive(logits, -1, -2, 1e-9), rtol=2e-6, atol=1e-9)


def test_eamlp_under_autocast_takes_the_kernel_with_bf16_logits(monkeypatch):
    """EAMLP's attention in a bf16 autocast region: the kernel normalises the bf16 logits itself (no fp32 copy) and
    the output is as close to the float64 module as the plain path's."""
    taken = []
    real = tdn.double_normalize_triton
    monkeypatch.setattr(tdn, "double_normalize_triton", lambda x, *a, **k: taken.append(x.dtype) or real(x, *a, **k))
    torch.manual_seed(5)
    mixer = MultiHeadExternalAttention(16, num_heads=2, coef=2).to(DEVICE)
    x = torch.randn(2, 7, 16, device=DEVICE)
    outs = []
    for enabled, low in ((True, True), (False, True), (False, False)):
        with fast_paths(enabled), torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=low):
            outs.append(mixer.double()(x.double()) if not low else mixer.float()(x))
    fast, plain, exact = (o.double() for o in outs)
    assert taken == [torch.bfloat16]
    err = (fast - exact).abs().max() / exact.abs().max()
    assert err < max(2e-2, 2 * (plain - exact).abs().max() / exact.abs().max())
