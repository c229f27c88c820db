"""AFT-conv's eager core (vitlab.ops.aft_conv) against the composite form and the naive Eq. 6.

The eager core is a linear operator on head planes with a hand-written backward pass; the composite form
(what graph capture records) is the reference: forward and every gradient (q, k, v through the fused
projection, the kernel w, and gamma, beta through the re-parameterisation) must agree, in float64 to rounding
and through the fp32 module within the rounding of its reductions.
"""

from __future__ import annotations

import math

import pytest
import torch

from test_aft import FallbackCounter, naive_conv_pairs, randomise_conv
from vitlab.mixers import AFTConv, TokenLayout
from vitlab.ops import aft as aft_mod
from vitlab.ops.aft_conv import AFTConvCore, kernel_and_scale, window_sums

# (grid, num_prefix, heads, head width r, kernel s, global context, query)
CONFIGS = [
    ((4, 5), 0, 2, 3, 3, True, True),
    ((4, 5), 1, 2, 3, 3, True, True),
    ((3, 6), 2, 3, 2, 5, True, True),  # non-square, kernel wider than the grid's 3 rows
    ((2, 3), 1, 2, 1, 7, True, True),  # kernel larger than the grid; one value channel per head
    ((4, 5), 0, 2, 3, 3, False, True),  # w = -inf outside the window
    ((4, 5), 1, 2, 3, 3, True, False),  # no query term
    ((4, 4), 0, 4, 1, 3, False, False),
]
IDS = [
    f"grid{g[0]}x{g[1]}-P{p}-h{h}-r{r}-s{s}-{'global' if gc else 'local'}-{'q' if q else 'noq'}"
    for g, p, h, r, s, gc, q in CONFIGS
]


def inputs(grid, num_prefix, heads, r, s, query, dtype=torch.float64, seed=0):
    torch.manual_seed(seed)
    n, c = num_prefix + grid[0] * grid[1], heads * r
    qkv = torch.randn(2, n, (2 * c if query else c) + heads, dtype=dtype, requires_grad=True)
    w = torch.randn(heads, s, s, dtype=dtype, requires_grad=True)
    return qkv, w


def composite(monkeypatch):
    """Make aft_conv take its composite form (as under graph capture)."""
    monkeypatch.setattr(aft_mod, "eager_fast_path", lambda: False)


@pytest.mark.parametrize("config", CONFIGS, ids=IDS)
def test_function_passes_gradcheck(config):
    grid, p, h, r, s, global_context, query = config
    qkv, w = inputs(grid, p, h, r, s, query)

    def core(qkv, w):
        return AFTConvCore.apply(qkv, w, grid, p, global_context, query, 1e-20)[0]

    assert torch.autograd.gradcheck(core, (qkv, w))


@pytest.mark.parametrize("config", CONFIGS, ids=IDS)
def test_eager_core_equals_composite_and_eq6_in_float64(config, monkeypatch):
    grid, p, h, r, s, global_context, query = config
    qkv, w = inputs(grid, p, h, r, s, query)
    g = torch.randn(qkv.shape[0], qkv.shape[1], h * r, dtype=torch.float64)
    fast = aft_mod.aft_conv(qkv, w, grid, p, global_context, query)
    fast_grads = torch.autograd.grad(fast, (qkv, w), g)
    with torch.no_grad():
        inference = aft_mod.aft_conv(qkv, w, grid, p, global_context, query)
    composite(monkeypatch)
    ref = aft_mod.aft_conv(qkv, w, grid, p, global_context, query)
    ref_grads = torch.autograd.grad(ref, (qkv, w), g)
    tol = 64 * torch.finfo(torch.float64).eps
    torch.testing.assert_close(fast, ref, rtol=tol, atol=tol)
    torch.testing.assert_close(inference, ref, rtol=tol, atol=tol)
    for a, b in zip(fast_grads, ref_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol * b.abs().max().item())
    c = h * r
    q, k, v = (
        qkv.detach().split([c, h, c], -1)
        if query
        else (torch.full((2, qkv.shape[1], c), math.inf), *qkv.detach().split([h, c], -1))
    )
    naive = naive_conv_pairs(q, k, v, w.detach(), grid, p, 0.0 if global_context else -math.inf)
    torch.testing.assert_close(fast.detach(), naive, rtol=1e-10, atol=1e-10)


def test_adjoint_is_the_flipped_kernel_operator():
    """<L(x), y> = <x, L*(y)> with L* = window_sums with the kernel flipped (prefix rows included)."""
    torch.manual_seed(3)
    b, h, r1, grid, s = 2, 3, 4, (5, 3), 5
    x, y = torch.randn(2, b, grid[0] * grid[1], h, r1, dtype=torch.float64)
    # x_pre, y_pre stand for sums over the prefix tokens, each of which gets the same prefix row
    x_pre, y_pre = torch.randn(2, b, h, r1, dtype=torch.float64)
    kernel, scale = kernel_and_scale(torch.randn(h, s, s, dtype=torch.float64), True)
    lx, lx_pre = window_sums(x, x_pre, kernel, scale, grid)
    ly, ly_pre = window_sums(y, y_pre, kernel.flip(-1, -2), scale, grid)
    left = (lx * y).sum() + (lx_pre * y_pre).sum()
    right = (x * ly).sum() + (x_pre * ly_pre).sum()
    torch.testing.assert_close(left, right, rtol=1e-12, atol=0)


MODULES = [
    dict(num_heads=4, kernel_size=3),
    dict(num_heads=2, kernel_size=5, reparam=False),
    dict(num_heads=4, kernel_size=3, query=False),
    dict(num_heads=24, kernel_size=3),  # one value channel per head (the paper's AFT-conv-384 shape)
    dict(num_heads=4, kernel_size=7, outside="-inf"),
]
LAYOUTS = [TokenLayout((4, 5), 1), TokenLayout((3, 6), 2), TokenLayout((4, 5), 0), TokenLayout((2, 3), 0)]


def module_step(m, x, layout, g):
    m.zero_grad(set_to_none=True)
    out = m(x, layout)
    out.backward(g)
    return out.detach(), {n: p.grad.clone() for n, p in m.named_parameters()}


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: f"grid{lay.grid[0]}x{lay.grid[1]}-P{lay.num_prefix}")
@pytest.mark.parametrize("kw", MODULES, ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()))
def test_module_gradients_equal_the_composite_form(kw, layout, monkeypatch):
    if kw.get("outside") == "-inf" and layout.num_prefix:
        pytest.skip("no pairs for prefix tokens without the global context")
    torch.manual_seed(5)
    m = AFTConv(24, **kw)
    randomise_conv(m)
    with torch.no_grad():
        m.w.normal_(0, 1.0)
    n = layout.num_prefix + layout.grid[0] * layout.grid[1]
    x, g = torch.randn(2, n, 24), torch.randn(2, n, 24)
    out, grads = module_step(m, x, layout, g)
    composite(monkeypatch)
    ref, ref_grads = module_step(m, x, layout, g)
    # fp32 sums over the window, the grid and the batch: rounding grows with the number of terms
    tol = 8 * torch.finfo(torch.float32).eps * (2 * n + m.kernel_size**2 + 24)
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol * ref.abs().max().item())
    assert grads.keys() == ref_grads.keys()
    # w, gamma, beta: one scale (without the global context the output ignores a per-head shift of w, so beta's
    # exact gradient is 0 and both paths give rounding noise of the kernel gradients' size)
    kernel_scale = max(ref_grads[n].abs().max().item() for n in ("w", "gamma", "beta") if n in ref_grads)
    for name, grad in grads.items():
        scale = kernel_scale if name in ("w", "gamma", "beta") else ref_grads[name].abs().max().item()
        torch.testing.assert_close(
            grad, ref_grads[name], rtol=tol, atol=tol * scale, msg=lambda m, name=name: f"{name}: {m}"
        )


@pytest.mark.usefixtures("fast_path")
def test_large_negative_biases_stay_on_the_eager_path_and_exact(monkeypatch):
    """w << 0: Eq. 6's e^w - 1 ≈ -1 cancels in its literal form; the eager core's sums do not (no fallback)."""
    torch.manual_seed(6)
    counter = FallbackCounter(monkeypatch)
    spy = []
    monkeypatch.setattr(aft_mod, "_aft_conv_composite", lambda *a: spy.append(1))
    grid, p, h, c = (4, 5), 1, 2, 8
    n = p + 20
    qkv = torch.randn(2, n, 2 * c + h, requires_grad=True)
    w = (-40 - 10 * torch.rand(h, 3, 3)).requires_grad_()
    g = torch.randn(2, n, c)
    y = aft_mod.aft_conv(qkv, w, grid, p)
    assert not spy and counter.entries == 0
    qkv64, w64 = qkv.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    monkeypatch.undo()
    composite(monkeypatch)
    ref = aft_mod.aft_conv(qkv64, w64, grid, p)
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-6)
    grads = torch.autograd.grad(y, (qkv, w), g)
    ref_grads = torch.autograd.grad(ref, (qkv64, w64), g.double())
    for a, b in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-4 * b.abs().max().item())


def test_underflowed_denominators_fall_back_to_the_exact_repair(monkeypatch):
    """Keys and biases of magnitude 1e4: some denominators underflow in the eager core; the call is recomputed by
    the composite form, whose exact repair gives the naive values and gradients."""
    torch.manual_seed(7)
    counter = FallbackCounter(monkeypatch)
    grid, p, h, c = (4, 5), 1, 2, 8
    n = p + 20
    q, v = torch.randn(2, n, c), torch.randn(2, n, c)
    k, w = torch.randn(2, n, h) * 1e4, (torch.randn(h, 3, 3) * 1e4).requires_grad_()
    qkv = torch.cat([q, k, v], -1).requires_grad_()
    y = aft_mod.aft_conv(qkv, w, grid, p)
    assert counter.entries > 0
    ref_in = [t.detach().double().requires_grad_() for t in (q, k, v, w)]
    ref = naive_conv_pairs(*ref_in, grid, p)
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    g = torch.randn(2, n, c)
    dqkv, dw = torch.autograd.grad(y, (qkv, w), g)
    ref_grads = torch.autograd.grad(ref, ref_in, g.double())
    tiny = torch.finfo(torch.float32).tiny  # some gradients are e^-300 in float64: 0 in fp32
    for a, b in zip([*dqkv.split([c, h, c], -1), dw], ref_grads, strict=True):
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-4 * b.abs().max().item() + tiny)
