"""AFT-conv's window sums on Triton (vitlab.ops.triton_aft_conv): values and gradients equal to the paper's Eq. 6
in float64 and to the CPU core, odd grids, kernels of size 1, 3, 5 and larger than the grid, prefix tokens, the
ablations, keys and biases of magnitude 1e4 (the exact repair taken), bf16 inputs, and the module's dispatch.

Runs on CUDA, or on the CPU in Triton's interpreter (``TRITON_INTERPRET=1`` set before triton is imported: the
step of ``scripts/test.sh``); elsewhere it skips (tests/test_triton_aft.py explains why).
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from test_aft import FallbackCounter, naive_conv_pairs, randomise_conv
from vitlab.mixers import AFTConv, TokenLayout
from vitlab.ops import aft as aft_ops
from vitlab.ops import fast_paths

pytest.importorskip("triton")

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
pytestmark = pytest.mark.skipif(
    not (CUDA or os.environ.get("TRITON_INTERPRET") == "1"),
    reason="Triton's interpreter is off in this process: run with TRITON_INTERPRET=1",
)


@pytest.fixture
def triton_conv():
    from vitlab.ops import triton_aft_conv

    return triton_aft_conv


def rel(actual: torch.Tensor, expected: torch.Tensor) -> float:
    expected = expected.double().cpu()
    return ((actual.double().cpu() - expected).norm() / expected.norm().clamp_min(1e-30)).item()


def split(qkv, h, c, query):
    """q (inf without the query term: a gate of 1), k, v of a fused projection, for the naive equation."""
    if query:
        return qkv.split([c, h, c], -1)
    return (torch.full((*qkv.shape[:2], c), math.inf, dtype=qkv.dtype), *qkv.split([h, c], -1))


# (grid, num_prefix, heads, head width r, kernel s, global context, query)
CASES = [
    ((5, 7), 0, 2, 3, 3, True, True),  # 35 patches: three tiles of 16 in the interpreter
    ((5, 7), 1, 2, 3, 5, True, True),
    ((3, 5), 2, 4, 2, 1, True, True),  # k = 1
    ((3, 5), 1, 2, 1, 7, True, True),  # kernel larger than the grid
    ((5, 7), 0, 2, 3, 3, False, True),  # w = -inf outside the window
    ((5, 3), 1, 3, 2, 3, True, False),  # no query term
]


@pytest.mark.parametrize(
    "case",
    CASES,
    ids=lambda c: (
        f"grid{c[0][0]}x{c[0][1]}-P{c[1]}-h{c[2]}-r{c[3]}-s{c[4]}-{'global' if c[5] else 'local'}-{'q' if c[6] else 'noq'}"
    ),
)
def test_kernel_is_the_paper_equation_and_the_cpu_core(triton_conv, case):
    grid, p, h, r, s, global_context, query = case
    torch.manual_seed(0)
    c, n = h * r, p + grid[0] * grid[1]
    qkv = torch.randn(2, n, (2 * c if query else c) + h, dtype=torch.float64)
    w = torch.randn(h, s, s, dtype=torch.float64)
    x, wd = qkv.float().to(DEVICE).requires_grad_(), w.float().to(DEVICE).requires_grad_()
    y = triton_conv.aft_conv_triton(x, wd, grid, p, global_context, query)
    ref_in = [qkv.clone().requires_grad_(), w.clone().requires_grad_()]
    ref = naive_conv_pairs(*split(ref_in[0], h, c, query), ref_in[1], grid, p, 0.0 if global_context else -math.inf)
    assert y.dtype == torch.float32 and rel(y, ref) < 1e-6
    g = torch.randn(2, n, c, dtype=torch.float64)
    got = torch.autograd.grad(y, (x, wd), g.float().to(DEVICE))
    want = torch.autograd.grad(ref, ref_in, g)
    for a, b in zip(got, want, strict=True):
        assert rel(a, b) < 1e-5
    plain_in = [qkv.float().requires_grad_(), w.float().requires_grad_()]  # the CPU core in fp32
    plain = aft_ops.aft_conv(*plain_in, grid, p, global_context, query)
    assert rel(y, plain) < 1e-6
    for a, b in zip(got, torch.autograd.grad(plain, plain_in, g.float()), strict=True):
        assert rel(a, b) < 1e-5


def test_kernel_exact_for_huge_keys_and_biases(triton_conv, monkeypatch):
    """Keys and biases of magnitude 1e4: denominators underflow and are recomputed exactly; values equal Eq. 6 in
    float64, gradients the naive equation's."""
    torch.manual_seed(7)
    counter = FallbackCounter(monkeypatch)
    grid, p, h, c = (3, 5), 1, 2, 8
    n = p + 15
    q, v = torch.randn(2, n, c), torch.randn(2, n, c)
    k, w = torch.randn(2, n, h) * 1e4, torch.randn(h, 3, 3) * 1e4
    qkv = torch.cat([q, k, v], -1)
    x, wd = qkv.to(DEVICE).requires_grad_(), w.to(DEVICE).requires_grad_()
    y = triton_conv.aft_conv_triton(x, wd, grid, p)
    assert counter.entries > 0
    ref_in = [t.double().requires_grad_() for t in (q, k, v, w)]
    ref = naive_conv_pairs(*ref_in, grid, p)
    assert rel(y, ref) < 1e-5
    g = torch.randn(2, n, c)
    dqkv, dw = torch.autograd.grad(y, (x, wd), g.to(DEVICE))
    want = torch.autograd.grad(ref, ref_in, g.double())
    # the kernel's gradient exact to fp32 round-off of the terms it sums (the biases' gradient is ~1e-111 here:
    # the terms cancel, and an H200 left 7e-9 of them where the interpreter left 0)
    top = max(b.norm() for b in want)
    for a, b in zip([*dqkv.cpu().split([c, h, c], -1), dw], want, strict=True):
        assert (a.double().cpu() - b).norm() <= 1e-4 * b.norm() + 1e-7 * top


def test_kernel_takes_bf16_projections_and_accumulates_in_fp32(triton_conv):
    torch.manual_seed(3)
    grid, p, h, c = (5, 7), 1, 2, 8
    n = p + 35
    qkv = torch.randn(2, n, 2 * c + h).bfloat16()
    w = torch.randn(h, 5, 5)
    x = qkv.to(DEVICE).requires_grad_()
    y = triton_conv.aft_conv_triton(x, w.to(DEVICE), grid, p)
    assert y.dtype == torch.float32
    assert rel(y, naive_conv_pairs(*qkv.double().split([c, h, c], -1), w, grid, p)) < 1e-6  # the rounded inputs
    y.sum().backward()
    assert x.grad.dtype == torch.bfloat16 and torch.isfinite(x.grad).all()


MODULES = [
    (dict(num_heads=4, kernel_size=3), TokenLayout((5, 7), 1)),
    (dict(num_heads=2, kernel_size=5, query=False), TokenLayout((3, 5), 0)),
    (dict(num_heads=4, kernel_size=3, outside="-inf"), TokenLayout((5, 3), 0)),
]


@pytest.mark.parametrize("kw, layout", MODULES, ids=lambda x: str(x) if isinstance(x, dict) else "")
def test_module_takes_the_kernel_and_equals_the_plain_path(triton_conv, kw, layout, monkeypatch):
    torch.manual_seed(5)
    m = AFTConv(16, **kw).to(DEVICE)
    randomise_conv(m)
    with torch.no_grad():
        m.w.normal_(0, 1.0)
    calls = []
    original = triton_conv.aft_conv_triton
    monkeypatch.setattr(triton_conv, "aft_conv_triton", lambda *a: calls.append(1) or original(*a))
    n = layout.num_prefix + layout.grid[0] * layout.grid[1]
    x = torch.randn(2, n, 16, device=DEVICE)
    y = m(x, layout)
    assert calls, "the module did not take the Triton kernel"
    gy = torch.randn_like(y)
    names, params = zip(*m.named_parameters(), strict=True)
    got = torch.autograd.grad((y * gy).sum(), params)
    calls.clear()
    with fast_paths(False):  # the one switch: the plain path
        y_plain = m(x, layout)
        want = dict(zip(names, torch.autograd.grad((y_plain * gy).sum(), params), strict=True))
    assert not calls
    assert rel(y, y_plain) < 1e-5
    # w, gamma, beta on one scale: without the global context the output ignores a per-head shift of w, so beta's
    # exact gradient is 0 and both paths give rounding noise of the kernel gradients' size
    kernel_scale = max(want[k].norm() for k in ("w", "gamma", "beta") if k in want)
    for name, a in zip(names, got, strict=True):
        scale = kernel_scale if name in ("w", "gamma", "beta") else want[name].norm()
        assert ((a.cpu() - want[name].cpu()).norm() / scale).item() < 1e-4, name
