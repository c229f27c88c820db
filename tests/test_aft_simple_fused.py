"""AFT-simple's fused core (closed-form backward on the [Q | K | V] projection) against the paper's equation."""

from __future__ import annotations

import pytest
import torch

from conftest import allocations_of
from vitlab.mixers import AFTSimple
from vitlab.ops import fast_paths
from vitlab.ops.aft import aft_simple
from vitlab.ops.aft_simple import _AFTSimpleProjected, _AFTSimpleQKV, aft_simple_projected, aft_simple_qkv


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


def grad_fns(out: torch.Tensor) -> set[str]:
    """The names of the autograd nodes behind ``out``."""
    walk, visited = [out.grad_fn], {}
    while walk:
        fn = walk.pop()
        if fn is not None and id(fn) not in visited:
            visited[id(fn)] = type(fn).__name__
            walk += [f for f, _ in fn.next_functions]
    return set(visited.values())


@pytest.mark.usefixtures("fast_path")
def test_module_trains_through_the_fused_core_with_the_plain_gradients():
    torch.manual_seed(3)
    m = AFTSimple(16, hidden_dim=12).double()
    x = torch.randn(2, 10, 16, dtype=torch.float64, requires_grad=True)
    out = m(x)
    # the fused core is in the graph
    assert "_AFTSimpleQKVBackward" in grad_fns(out), "AFT-simple's training step did not take the fused core"
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


@pytest.fixture
def aten_products(fast_path, monkeypatch):
    """The fast paths on and the training products in aten, whatever the probe chose on this CPU (where it takes
    oneDNN's training product the fused projection stays: :func:`test_onednn_training_keeps_the_fused_projection`)."""
    from dataclasses import replace

    from vitlab.ops import probe

    decision = probe.onednn_linear(torch.float32, True)
    monkeypatch.setitem(probe._DECISIONS, (torch.float32, True), replace(decision, taken=False))


@pytest.mark.parametrize("bias", [True, False])
def test_projected_gradcheck(bias):
    torch.manual_seed(4)
    x = torch.randn(2, 7, 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(12, 5, dtype=torch.float64, requires_grad=True)
    b = torch.randn(12, dtype=torch.float64, requires_grad=True) if bias else None
    assert torch.autograd.gradcheck(_AFTSimpleProjected.apply, (x, w, b))


@pytest.mark.parametrize("scale", [1.0, 1e4], ids=["unit", "huge-logits"])
def test_projected_values_and_gradients_are_the_paper_equation(scale):
    # the projection, then the naive float64 equation; keys of 1e4 magnitude shift without overflow
    torch.manual_seed(5)
    x, w, b = torch.randn(3, 11, 6, dtype=torch.float64), torch.randn(24, 6, dtype=torch.float64), torch.randn(24)
    w[8:16] *= scale
    grad_y = torch.randn(3, 11, 8, dtype=torch.float64)
    inputs = [t.double().clone().requires_grad_() for t in (x, w, b)]
    expected = naive_simple(torch.nn.functional.linear(*inputs))
    expected_grads = torch.autograd.grad(expected, inputs, grad_y)
    for dtype in (torch.float64, torch.float32):
        tol = 1e-12 if dtype == torch.float64 else 1e-5
        got_in = [t.detach().to(dtype).requires_grad_() for t in (x, w, b)]
        y = aft_simple_projected(*got_in)
        torch.testing.assert_close(y.double(), expected, rtol=tol, atol=tol)
        for got, want in zip(torch.autograd.grad(y, got_in, grad_y.to(dtype)), expected_grads, strict=True):
            assert torch.isfinite(got).all()
            torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * want.abs().max())


@pytest.mark.parametrize("trained", ["input", "weights"])
def test_projected_gradients_of_what_requires_them(trained):
    # only the input (a frozen mixer) or only the weights (the first layer's tokens): the others come back None
    torch.manual_seed(6)
    x, w, b = torch.randn(2, 5, 4), torch.randn(9, 4), torch.randn(9)
    wants = {"input": [x], "weights": [w, b]}[trained]
    for t in wants:
        t.requires_grad_()
    y = aft_simple_projected(x, w, b)
    y.sum().backward()
    assert [t.grad is not None for t in (x, w, b)] == [any(t is u for u in wants) for t in (x, w, b)]
    expected = torch.autograd.grad(naive_simple(torch.nn.functional.linear(x, w, b)).sum(), wants)
    for t, want in zip(wants, expected, strict=True):
        # K's bias gradient is 0 in real arithmetic (the softmax ignores a shift): absolute tolerance
        torch.testing.assert_close(t.grad, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


@pytest.mark.usefixtures("aten_products")
def test_fp32_module_trains_through_the_projected_core():
    # fp32 on the CPU: the projection and the core in one function, the same values and gradients as the plain
    # module
    torch.manual_seed(7)
    m = AFTSimple(16, hidden_dim=12)
    x = torch.randn(2, 10, 16, requires_grad=True)
    out = m(x)
    assert "_AFTSimpleProjectedBackward" in grad_fns(out)
    grads = torch.autograd.grad(out.square().sum(), [x, *m.parameters()])
    plain = m.proj(aft_simple(*m.qkv(x).chunk(3, -1)))
    torch.testing.assert_close(out, plain, rtol=1e-5, atol=1e-6)
    for got, want in zip(grads, torch.autograd.grad(plain.square().sum(), [x, *m.parameters()]), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


@pytest.mark.usefixtures("aten_products")
def test_projected_core_is_a_fast_path():
    m, x = AFTSimple(8), torch.randn(1, 6, 8, requires_grad=True)
    assert "_AFTSimpleProjectedBackward" in grad_fns(m(x))
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast's products: the fused projection
        assert "_AFTSimpleProjectedBackward" not in grad_fns(m(x))
    with fast_paths(False):
        assert "_AFTSimpleProjectedBackward" not in grad_fns(m(x))


def test_projected_backward_never_holds_the_whole_projection_gradient():
    """The fused form's backward pass allocated the (B, T, 3C) gradient of the projection; this one forms a (B, T, C)
    block at a time (profiler's record of the allocations of that size)."""
    b, t, c = 2, 64, 32
    x, w, bias = torch.randn(b, t, c, requires_grad=True), torch.randn(3 * c, c, requires_grad=True), torch.randn(3 * c)
    y, g = aft_simple_projected(x, w, bias), torch.randn(b, t, c)
    assert allocations_of(lambda: torch.autograd.grad(y, [x, w], g), b * t * 3 * c * 4) == []
    qkv = torch.nn.functional.linear(x, w, bias)
    y = aft_simple_qkv(qkv)  # the fused form, for contrast: the claim is the count's difference
    assert len(allocations_of(lambda: torch.autograd.grad(y, [x, w], g), b * t * 3 * c * 4)) >= 1


def test_onednn_training_keeps_the_fused_projection(onednn_linear):
    onednn_linear(torch.float32, training=True)
    m, x = AFTSimple(8), torch.randn(1, 6, 8, requires_grad=True)
    assert "_AFTSimpleProjectedBackward" not in grad_fns(m(x))
