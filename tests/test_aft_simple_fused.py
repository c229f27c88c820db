"""AFT-simple's fused core (closed-form backward on the [Q | K | V] projection) against the paper's equation."""

from __future__ import annotations

import pytest
import torch

from vitlab.mixers import AFTSimple
from vitlab.ops.aft import aft_simple
from vitlab.ops.aft_simple import _AFTSimpleQKV, aft_simple_qkv


def naive_simple(qkv: torch.Tensor) -> torch.Tensor:
    """AFT-simple (paper Eq. 2 with w = 0) term by term, float64: Y_t = σ(Q_t) Σ_t' e^{K_t'} V_t' / Σ_t' e^{K_t'}
    (every exponent shifted by the largest of its sum, exact in real arithmetic)."""
    q, k, v = qkv.double().chunk(3, -1)
    y = torch.empty_like(q)
    for t in range(q.shape[1]):
        weights = torch.exp(k - k.amax(1, keepdim=True))
        y[:, t] = torch.sigmoid(q[:, t]) * (weights * v).sum(1) / weights.sum(1)
    return y


def test_gradcheck():
    torch.manual_seed(0)
    qkv = torch.randn(2, 7, 15, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(_AFTSimpleQKV.apply, (qkv,))


@pytest.mark.parametrize("scale", [1.0, 1e4], ids=["unit", "huge-logits"])
def test_values_and_gradients_are_the_paper_equation(scale):
    # keys of 1e4 magnitude: every exponential is shifted, nothing overflows; gradients against autograd
    # through the naive float64 equation
    torch.manual_seed(1)
    qkv = torch.randn(3, 11, 24, dtype=torch.float64)
    qkv[..., 8:16] *= scale
    grad_y = torch.randn(3, 11, 8, dtype=torch.float64)
    expected_in = qkv.clone().requires_grad_()
    expected = naive_simple(expected_in)
    (expected_grad,) = torch.autograd.grad(expected, expected_in, grad_y)
    for dtype in (torch.float64, torch.float32):
        tol = 1e-12 if dtype == torch.float64 else 1e-5
        x = qkv.to(dtype).requires_grad_()
        y = aft_simple_qkv(x)
        (grad,) = torch.autograd.grad(y, x, grad_y.to(dtype))
        assert torch.isfinite(grad).all()
        torch.testing.assert_close(y.double(), expected, rtol=tol, atol=tol)
        # gradient entries are O(scale) for huge keys only through K, which the (V - s) factor keeps O(1)
        torch.testing.assert_close(grad.double(), expected_grad, rtol=tol, atol=tol * expected_grad.abs().max())


@pytest.mark.parametrize("context", [torch.inference_mode, torch.no_grad])
def test_no_autograd_path_equals_the_composite(context):
    torch.manual_seed(2)
    qkv = torch.randn(2, 9, 30)
    with context():
        out = aft_simple_qkv(qkv)
    torch.testing.assert_close(out, aft_simple(*qkv.chunk(3, -1)))
    torch.testing.assert_close(out.double(), naive_simple(qkv), rtol=1e-5, atol=1e-6)


@pytest.mark.usefixtures("fast_path")
def test_module_trains_through_the_fused_core_with_the_plain_gradients():
    torch.manual_seed(3)
    m = AFTSimple(16, hidden_dim=12).double()
    x = torch.randn(2, 10, 16, dtype=torch.float64, requires_grad=True)
    out = m(x)
    walk, found = [out.grad_fn], False
    while walk and not found:  # the fused core is in the graph
        fn = walk.pop()
        found = "AFTSimpleQKV" in type(fn).__name__
        walk += [f for f, _ in fn.next_functions if f is not None]
    assert found, "AFT-simple's training step did not take the fused core"
    grads = torch.autograd.grad(out.square().sum(), [x, *m.parameters()])
    # the same module through the composite operations (the core runs in fp32, as the module runs it)
    plain = m.proj(aft_simple(*m.qkv(x).float().chunk(3, -1)).double())
    torch.testing.assert_close(out, plain, rtol=1e-5, atol=1e-6)
    for got, want in zip(grads, torch.autograd.grad(plain.square().sum(), [x, *m.parameters()]), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_causal_module_keeps_the_cumulative_core():
    m = AFTSimple(8, causal=True)
    x = torch.randn(1, 6, 8, requires_grad=True)
    y = m(x)
    y[:, 2].sum().backward()
    assert x.grad[:, 3:].abs().sum() == 0  # no position sees the future
