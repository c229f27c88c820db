"""AFT token mixers: paper equations (naive float64 sums), identities, causality, stability, bad input.

The goldens (community implementations) are in test_aft_golden.py.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from functools import partial

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import allocations_of
from vitlab.measure.process import tensor_peak_bytes
from vitlab.mixers import AFTConv, AFTFull, AFTLocal, AFTSimple, TokenLayout, build
from vitlab.mixers import aft as aft_mod
from vitlab.ops import aft as aft_ops
from vitlab.ops import fast_paths
from vitlab.ops.aft_banded import MIN_BLOCK, band_positions, local_bias_band

# ---------------------------------------------------------------- naive references (float64, literal sums)


def naive_full(q, k, v, w, causal=False):
    """Paper Eq. 2 term by term: Y_t = σ(Q_t) Σ_t' e^{K_t'+w[t,t']} V_t' / Σ_t' e^{K_t'+w[t,t']}.

    Every exponent is shifted by the largest one of its sum (exact in real arithmetic; without it float64
    overflows for the 1e4-sized stability inputs).
    """
    q, k, v, w = (a.double() for a in (q, k, v, w))
    b, n, c = k.shape
    y = torch.empty(b, n, c, dtype=torch.float64)
    for t in range(n):
        keys = slice(0, t + 1) if causal else slice(0, n)
        logits = k[:, keys] + w[t, keys, None]  # (B, S, C): the exponents of the sums over t'
        weights = torch.exp(logits - logits.amax(1, keepdim=True))
        y[:, t] = torch.sigmoid(q[:, t]) * (weights * v[:, keys]).sum(1) / weights.sum(1)
    return y


def naive_conv_paper(q, k, v, w, grid, num_prefix):
    """Paper Eq. 6 literally (no shift; small inputs): global sums + Σ over the s x s window of (e^w - 1)."""
    q, k, v, w = (a.double() for a in (q, k, v, w))
    b, n, c = v.shape
    h, s = k.shape[-1], w.shape[-1]
    r, p = c // h, s // 2
    ek = k.exp()
    y = torch.empty(b, n, c, dtype=torch.float64)
    for t in range(n):
        for i in range(h):
            ch = slice(i * r, (i + 1) * r)
            num = sum(ek[:, u, i, None] * v[:, u, ch] for u in range(n))
            den = sum(ek[:, u, i] for u in range(n))
            if t >= num_prefix:
                row, col = divmod(t - num_prefix, grid[1])
                for dy in range(-p, p + 1):
                    for dx in range(-p, p + 1):
                        rr, cc = row + dy, col + dx
                        if 0 <= rr < grid[0] and 0 <= cc < grid[1]:
                            u = num_prefix + rr * grid[1] + cc
                            coef = torch.expm1(w[i, dy + p, dx + p])
                            num = num + coef * ek[:, u, i, None] * v[:, u, ch]
                            den = den + coef * ek[:, u, i]
            y[:, t, ch] = torch.sigmoid(q[:, t, ch]) * num / den[:, None]
    return y


def conv_pair_bias(w, grid, num_prefix, outside=0.0):
    """AFT-conv's implied pair-wise bias (h, N, N): w[i, dy+p, dx+p] inside the window between patches, else
    ``outside`` (0: global connectivity; -inf: the paper's ablation)."""
    h, s = w.shape[0], w.shape[-1]
    p, n = s // 2, num_prefix + grid[0] * grid[1]
    out = torch.full((h, n, n), outside, dtype=w.dtype)
    for t in range(num_prefix, n):
        for u in range(num_prefix, n):
            (r1, c1), (r2, c2) = divmod(t - num_prefix, grid[1]), divmod(u - num_prefix, grid[1])
            if abs(r2 - r1) <= p and abs(c2 - c1) <= p:
                out[:, t, u] = w[:, r2 - r1 + p, c2 - c1 + p]
    return out


def naive_conv_pairs(q, k, v, w, grid, num_prefix, outside=0.0):
    """AFT-conv as AFT-full per head with the implied pair bias (an independent form of Eq. 6)."""
    b, n, c = v.shape
    h = k.shape[-1]
    r = c // h
    wp = conv_pair_bias(w.double(), grid, num_prefix, outside)
    heads = [
        naive_full(q[..., i * r : (i + 1) * r], k[..., i : i + 1].expand(b, n, r), v[..., i * r : (i + 1) * r], wp[i])
        for i in range(h)
    ]
    return torch.cat(heads, -1)


def naive_bias(m, n):
    """w[t, t'] of AFTFull / AFTLocal from its parameters, entry by entry (u_t · v_t' or the table; window)."""
    w = torch.empty(n, n, dtype=torch.float64)
    for t in range(n):
        for s in range(n):
            w[t, s] = m.w[t, s].double() if m.w is not None else (m.u[t].double() * m.v[s].double()).sum()
            if isinstance(m, AFTLocal) and abs(t - s) >= m.window:
                w[t, s] = 0.0 if m.outside == "zero" else -math.inf
    return w


def split_qkv(m, x):
    """q, k, v of module m for tokens x, in x's dtype (float64 in, float64 out)."""
    wt = m.qkv.weight.to(x.dtype)
    bias = None if m.qkv.bias is None else m.qkv.bias.to(x.dtype)
    qkv = F.linear(x, wt, bias)
    if isinstance(m, AFTConv):
        return qkv.split([m.dim, m.num_heads, m.dim], -1)
    return qkv.chunk(3, -1)


def reference(m, x, layout=None, qkv=None):
    """Float64 forward of module m through the naive formulas (qkv: precomputed projections, optional)."""
    q, k, v = qkv if qkv is not None else split_qkv(m, x.double())
    q, k, v = q.double(), k.double(), v.double()
    n = x.shape[1]
    if isinstance(m, AFTConv):
        y = naive_conv_pairs(q, k, v, m.position_bias().double(), layout.grid, layout.num_prefix)
    elif isinstance(m, AFTSimple) or (isinstance(m, AFTLocal) and m.window == 0):
        y = naive_full(q, k, v, torch.zeros(n, n), m.causal)
    else:
        y = naive_full(q, k, v, naive_bias(m, n), m.causal)
    return F.linear(y, m.proj.weight.double(), m.proj.bias.double())


def assert_rel(actual, expected, rtol):
    """max |actual - expected| <= rtol * max |expected| (and finite)."""
    assert torch.isfinite(actual).all(), "non-finite output"
    scale = expected.abs().max().item()
    err = (actual.double() - expected.double()).abs().max().item()
    assert err <= rtol * scale + 1e-12, f"max abs error {err:.3g} > {rtol} x {scale:.3g}"


GRID = TokenLayout(grid=(4, 5), num_prefix=1)  # N = 21


def make(kind, **kw):
    torch.manual_seed(0)
    return {"full": AFTFull, "local": AFTLocal, "simple": AFTSimple, "conv": AFTConv}[kind](24, **kw)


CASES = [
    ("full", {"max_len": 21}),
    ("full", {"max_len": 21, "bias_dim": None, "hidden_dim": 16}),
    ("full", {"max_len": 21, "causal": True, "qkv_bias": False}),
    ("local", {"max_len": 21, "window": 3}),
    ("local", {"max_len": 21, "window": 4, "outside": "-inf"}),
    ("local", {"max_len": 21, "window": 3, "causal": True, "outside": "-inf"}),
    ("local", {"max_len": 21, "window": 5, "causal": True, "bias_dim": None}),
    ("simple", {}),
    ("simple", {"causal": True, "hidden_dim": 16}),
    ("conv", {"num_heads": 4, "kernel_size": 3}),
    ("conv", {"num_heads": 2, "kernel_size": 5, "qkv_bias": False}),
]
IDS = [f"{k}-{'-'.join(f'{a}={b}' for a, b in kw.items())}" for k, kw in CASES]


def randomise_conv(m):
    """Give γ, β non-zero values (they start at 0, which hides the local term and w's gradient)."""
    if isinstance(m, AFTConv) and m.reparam:
        with torch.no_grad():
            m.gamma.normal_(0, 1.0)
            m.beta.normal_(0, 0.5)


# ---------------------------------------------------------------- shapes, gradients, paper equations


@pytest.mark.parametrize(("kind", "kw"), CASES, ids=IDS)
def test_shapes_and_gradients(kind, kw):
    m = make(kind, **kw)
    randomise_conv(m)
    x = torch.randn(2, 21, 24, requires_grad=True)
    out, aux = m(x, GRID, return_aux=True)
    assert out.shape == x.shape and out.dtype == x.dtype
    key_width = m.num_heads if kind == "conv" else m.hidden_dim
    assert aux["keys"].shape == (2, 21, key_width)
    assert torch.equal(m(x, GRID), out)  # aux does not change the output
    out.square().sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    for name, p in m.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, f"no gradient reaches {name}"


@pytest.mark.parametrize(("kind", "kw"), CASES, ids=IDS)
def test_matches_naive_paper_equation(kind, kw):
    m = make(kind, **kw)
    randomise_conv(m)
    x = torch.randn(2, 21, 24)
    assert_rel(m(x, GRID), reference(m, x, GRID), 1e-5)


@pytest.mark.parametrize("context", [torch.inference_mode, torch.no_grad], ids=["inference_mode", "no_grad"])
@pytest.mark.parametrize(("kind", "kw"), CASES, ids=IDS)
def test_no_autograd_path_equals_autograd_path(kind, kw, context):
    # without autograd the cores work in place and AFT-full multiplies per batch item: the same sums, only
    # the rounding of an fp32 reduction over the 21 tokens (and 24 channels) may differ
    m = make(kind, **kw)
    randomise_conv(m)
    x = torch.randn(2, 21, 24)
    expected = m(x, GRID)  # parameters require grad: the autograd path
    assert expected.requires_grad
    with context():
        out = m(x, GRID)
    assert_rel(out, expected, 4 * torch.finfo(torch.float32).eps * (21 + 24))
    assert_rel(out, reference(m, x, GRID), 1e-5)


@pytest.fixture
def row_products(monkeypatch) -> list[tuple[int, int]]:
    """The (start, stop) output rows of every separate product the AFT mixers make (``linear_rows``), with the
    fast paths on, whatever VITLAB_FAST_PATHS says (a test of the path)."""
    from vitlab.ops import switch

    monkeypatch.setattr(switch, "_enabled", True)
    seen: list[tuple[int, int]] = []
    original = aft_mod.linear_rows
    monkeypatch.setattr(aft_mod, "linear_rows", lambda *a: seen.append(a[2:]) or original(*a))
    return seen


@pytest.mark.usefixtures("fast_path")
@pytest.mark.parametrize("causal", [False, True])
def test_full_training_allocates_three_bias_sized_matrices(causal):
    """AFT-full's training step with a full (T, T) bias: the bias weights (forward), their gradient and w's
    (backward), and causal one more, the mask's gradient; no more: the whole-table slice w[0:T] cost a zero (T, T)
    matrix and a copy in its backward pass, and the causal rows were shifted into a buffer of their own. Each
    (T, T) matrix is 64 MB at T = 4096, above glibc's mmap threshold: page-faulted anew each time."""
    torch.manual_seed(7)
    t, c = 64, 16  # a (T, T) fp32 matrix is 16 KB; the activations (1, T, C..3C) are 4-12 KB
    m = AFTFull(c, max_len=t, bias_dim=None, causal=causal)
    x, g = torch.randn(1, t, c), torch.randn(1, t, c)
    square = t * t * 4

    def step():
        m.zero_grad(set_to_none=True)
        m(x).backward(g)

    step()
    made = allocations_of(step, square)
    assert len(made) == (4 if causal else 3), made
    naive = m.w.grad.clone()
    with fast_paths(False):
        step()
    torch.testing.assert_close(naive, m.w.grad, rtol=1e-5, atol=1e-7)


def test_inference_projects_q_k_v_apart_on_the_cpu(row_products):
    """AFT-full's (and AFT-local's) CPU inference computes Q, K and V as three products, each its own contiguous
    buffer, where training and the plain path take views of the one fused projection: the same output and keys."""
    seen = row_products
    for kind, kw in CASES[:6]:
        m = make(kind, **kw).eval()
        x = torch.randn(2, 21, 24)
        expected, trained = m(x, GRID, return_aux=True)  # autograd records: the fused projection
        assert seen == []
        with torch.inference_mode():
            out, aux = m(x, GRID, return_aux=True)
        h = m.hidden_dim
        assert seen == [(0, h), (h, 2 * h), (2 * h, 3 * h)], kind
        assert all(t.is_contiguous() for t in (aux["keys"], out))
        assert_rel(out, expected, 4 * torch.finfo(torch.float32).eps * (21 + 24))
        assert_rel(aux["keys"], trained["keys"], 1e-6)
        seen.clear()
        with torch.inference_mode(), fast_paths(False):
            m(x, GRID)
        assert seen == []


def test_simple_inference_projects_k_and_v_apart_then_q(row_products):
    """Non-causal AFT-simple's inference: K and V as two products (reduced to the context), then Q: the same
    output as the fused projection under autograd."""
    seen = row_products
    m, x = make("simple", hidden_dim=16).eval(), torch.randn(2, 21, 24)
    expected = m(x, GRID)
    assert seen == []
    with torch.inference_mode():
        out = m(x, GRID)
    assert seen == [(16, 32), (32, 48), (0, 16)]
    assert_rel(out, expected, 4 * torch.finfo(torch.float32).eps * (21 + 24))


def test_conv_matches_literal_eq6():
    """The exp(w) - 1 form of Eq. 6, summed literally, on a grid smaller than the kernel in one axis."""
    torch.manual_seed(1)
    layout = TokenLayout(grid=(3, 6), num_prefix=2)
    b, n, h, c = 2, 20, 3, 12
    q, v, k = torch.randn(b, n, c), torch.randn(b, n, c), torch.randn(b, n, h)
    w = torch.randn(h, 5, 5)
    y = aft_ops.aft_conv(torch.cat([q, k, v], -1), w, layout.grid, layout.num_prefix)
    assert_rel(y, naive_conv_paper(q, k, v, w, layout.grid, layout.num_prefix), 1e-5)
    assert_rel(y, naive_conv_pairs(q, k, v, w, layout.grid, layout.num_prefix), 1e-5)


@pytest.mark.parametrize("scale", [1.0, 30.0, 1e4])
def test_conv_without_global_context_is_local_only(scale):
    """outside='-inf' (the paper's global-connectivity ablation): AFT-full with w = -inf outside the window."""
    torch.manual_seed(2)
    grid = (4, 5)
    b, n, h, c = 2, 20, 2, 8
    q, v, k = torch.randn(b, n, c), torch.randn(b, n, c), torch.randn(b, n, h) * scale
    w = torch.randn(h, 3, 3) * scale
    y = aft_ops.aft_conv(torch.cat([q, k, v], -1), w, grid, 0, global_context=False)
    assert torch.isfinite(y).all()
    assert_rel(y, naive_conv_pairs(q, k, v, w, grid, 0, outside=-math.inf), 1e-5)
    m = make("conv", num_heads=2, kernel_size=3, outside="-inf")
    with pytest.raises(ValueError, match="prefix"):
        m(torch.randn(1, 21, 24), TokenLayout(grid, 1))


def test_conv_kernel_reparameterisation():
    m = make("conv", num_heads=3, kernel_size=5)
    randomise_conv(m)
    w = m.w.detach().double()
    for i in range(3):
        std = w[i].flatten().std(unbiased=False)
        expected = m.gamma[i].double() * (w[i] - w[i].mean()) / torch.sqrt(std**2 + m.eps) + m.beta[i].double()
        assert torch.allclose(m.position_bias()[i].double(), expected, rtol=1e-5, atol=1e-6)
    assert torch.allclose(m.effective_kernel(), torch.expm1(m.position_bias()))
    assert make("conv", num_heads=3).effective_kernel().abs().max() == 0  # γ = β = 0 at init


# ---------------------------------------------------------------- identities


def copy_projections(dst, src):
    dst.qkv.load_state_dict(src.qkv.state_dict())
    dst.proj.load_state_dict(src.proj.state_dict())


@pytest.mark.parametrize("causal", [False, True])
def test_simple_equals_local_window0_and_full_with_zero_bias(causal):
    simple = make("simple", causal=causal)
    local0 = make("local", max_len=21, window=0, causal=causal)
    full = make("full", max_len=21, causal=causal)
    assert not list(local0.parameters())[4:]  # window 0: qkv and proj only, no bias parameters
    for m in (local0, full):
        copy_projections(m, simple)
    with torch.no_grad():
        full.u.zero_()
    x = torch.randn(2, 21, 24)
    ref = simple(x)
    assert torch.allclose(local0(x), ref, rtol=1e-5, atol=1e-6)
    assert torch.allclose(full(x), ref, rtol=1e-5, atol=1e-6)
    assert local0(torch.randn(1, 7, 24)).shape == (1, 7, 24)  # no table: any token count


def test_local_with_window_covering_everything_equals_full():
    full = make("full", max_len=21)
    local = make("local", max_len=21, window=21)
    local.load_state_dict(full.state_dict())
    x = torch.randn(2, 21, 24)
    assert torch.allclose(local(x), full(x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("num_prefix", [0, 1])
def test_conv_at_init_equals_simple_with_repeated_keys(num_prefix):
    conv = make("conv", num_heads=4, kernel_size=3)
    simple = make("simple")
    d, h = 24, 4
    with torch.no_grad():
        wq, wk, wv = conv.qkv.weight.split([d, h, d])
        bq, bk, bv = conv.qkv.bias.split([d, h, d])
        simple.qkv.weight.copy_(torch.cat([wq, wk.repeat_interleave(d // h, 0), wv]))
        simple.qkv.bias.copy_(torch.cat([bq, bk.repeat_interleave(d // h, 0), bv]))
        simple.proj.load_state_dict(conv.proj.state_dict())
    layout = TokenLayout(grid=(4, 5), num_prefix=num_prefix)
    x = torch.randn(2, 20 + num_prefix, 24)
    assert torch.allclose(conv(x, layout), simple(x, layout), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("kind", "kw"),
    [
        ("full", {"max_len": 16, "causal": True}),
        ("local", {"max_len": 16, "window": 3, "causal": True}),
        ("local", {"max_len": 16, "window": 3, "causal": True, "outside": "-inf"}),
        ("simple", {"causal": True}),
    ],
)
def test_causal_outputs_ignore_the_future(kind, kw):
    m = make(kind, **kw)
    x = torch.randn(2, 16, 24)
    out = m(x)
    for t in (0, 5, 14):
        x2 = x.clone()
        x2[:, t + 1 :] = torch.randn(2, 15 - t, 24) * 10
        out2 = m(x2)
        assert torch.allclose(out2[:, : t + 1], out[:, : t + 1], rtol=1e-5, atol=1e-6)
        assert not torch.allclose(out2[:, t + 1 :], out[:, t + 1 :])
    # a shorter sequence is exactly the prefix of the model's output (top-left block of w)
    assert torch.allclose(m(x[:, :9]), out[:, :9], rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- numerical stability


class FallbackCounter:
    def __init__(self, monkeypatch):
        self.entries = 0
        original = aft_ops._exact_entries

        def counting(k, v, rows, b, t, g):
            self.entries += b.numel()
            return original(k, v, rows, b, t, g)

        monkeypatch.setattr(aft_ops, "_exact_entries", counting)


def big(*shape, scale=1e4):
    return torch.randn(*shape) * scale


@pytest.mark.parametrize("causal", [False, True])
def test_full_core_stable_for_huge_keys_and_biases(causal, monkeypatch):
    torch.manual_seed(2)
    counter = FallbackCounter(monkeypatch)
    b, n, c = 2, 24, 8
    q, v = torch.randn(b, n, c), torch.randn(b, n, c)
    k = big(b, n, c).requires_grad_()
    w = big(n, n).requires_grad_()
    y = aft_ops.aft_full(q, k, v, w, causal)
    kd, wd = k.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref = naive_full(q, kd, v, wd, causal)
    assert_rel(y, ref, 1e-5)
    assert counter.entries > 0  # the max-shifted products underflowed: per-factor shifts are not enough
    with torch.inference_mode():  # the in-place path replaces the same entries
        assert_rel(aft_ops.aft_full(q, k.detach(), v, w.detach(), causal), ref, 1e-5)
    # gradients through the fallback entries are exact too
    g = torch.randn(b, n, c)
    (y * g).sum().backward()
    (ref * g.double()).sum().backward()
    assert_rel(w.grad, wd.grad, 1e-4)
    assert_rel(k.grad, kd.grad, 1e-4)


def test_no_fallback_in_normal_use(monkeypatch):
    counter = FallbackCounter(monkeypatch)
    x = torch.randn(4, 21, 24) * 3
    for kind, kw in CASES:
        m = make(kind, **kw)
        randomise_conv(m)
        m(x, GRID)
    assert counter.entries == 0


def test_local_and_simple_cores_stable(monkeypatch):
    torch.manual_seed(3)
    counter = FallbackCounter(monkeypatch)
    b, n, c = 2, 20, 6
    q, v, k = torch.randn(b, n, c), torch.randn(b, n, c), big(b, n, c)
    far = (torch.arange(n)[:, None] - torch.arange(n)[None]).abs() >= 3
    w = big(n, n).masked_fill(far, -math.inf)  # AFT-local with -inf outside, huge biases inside
    assert_rel(aft_ops.aft_full(q, k, v, w, True), naive_full(q, k, v, w, True), 1e-5)
    zeros = torch.zeros(n, n)
    assert_rel(aft_ops.aft_simple(q, k, v, True), naive_full(q, k, v, zeros, True), 1e-5)
    assert_rel(aft_ops.aft_simple(q, k, v, False), naive_full(q, k, v, zeros, False), 1e-5)
    assert counter.entries > 0


@pytest.mark.usefixtures("fast_path")
@pytest.mark.parametrize("scale", [1.0, 1e4], ids=["normal", "huge"])
@pytest.mark.parametrize("causal", [False, True])
def test_full_core_without_autograd_in_bands_is_the_paper_equation(causal, scale, monkeypatch):
    """Without autograd e^{w - rowmax} is formed a band of rows at a time (5 rows of 23 here, the last band
    shorter; causal bands read only their columns t' <= t); huge inputs take the exact repair inside bands."""
    torch.manual_seed(5)
    counter = FallbackCounter(monkeypatch)
    bands = []
    original = aft_ops._bias_weights
    monkeypatch.setattr(aft_ops, "_BIAS_BAND_ELEMS", 5 * 23)
    monkeypatch.setattr(aft_ops, "_bias_weights", lambda w, *a: bands.append(a) or original(w, *a))
    b, n, c = 3, 23, 6
    q, v = torch.randn(b, n, c), torch.randn(b, n, c)
    k, w = torch.randn(b, n, c) * scale, torch.randn(n, n) * scale
    with torch.inference_mode():
        y = aft_ops.aft_full(q, k, v, w, causal)
    assert [a[:2] for a in bands] == [(0, 5), (5, 10), (10, 15), (15, 20), (20, 23)]
    assert_rel(y, naive_full(q, k, v, w, causal), 1e-5)
    assert (counter.entries > 0) == (scale > 1)


@pytest.mark.usefixtures("fast_path")
def test_full_core_without_autograd_holds_a_band_of_the_bias_weights():
    """Inference at T = 2048: the tensors' peak is one band of e^{w - rowmax} (4 MB) and a few activations, not the
    (T, T) matrix (16 MB) that autograd keeps (exact allocation record)."""
    torch.manual_seed(7)
    b, n, c = 1, 2048, 16
    q, k, v, w = torch.randn(b, n, c), torch.randn(b, n, c), torch.randn(b, n, c), torch.randn(n, n)
    with torch.inference_mode():
        peak = tensor_peak_bytes(lambda: aft_ops.aft_full(q, k, v, w))
    assert peak is not None and peak <= 4 * aft_ops._BIAS_BAND_ELEMS + 8 * 4 * b * n * c < 4 * n * n, peak


@pytest.mark.usefixtures("fast_path")
@pytest.mark.parametrize("causal", [False, True])
def test_full_core_without_autograd_holds_three_activations_beside_the_weights(causal):
    """A short sequence without autograd: e^{w - rowmax} formed once, the denominator's product from e^K, then
    e^K ⊙ V in e^K's buffer and the numerator's product: the weights and at most three one-activation buffers
    (exact allocation record; the stacked key context and its stacked product held four), and the paper's values."""
    torch.manual_seed(8)
    b, n, c = 4, 64, 32
    q, k, v, w = torch.randn(b, n, c), torch.randn(b, n, c), torch.randn(b, n, c), torch.randn(n, n)
    unit = 4 * b * n * c
    with torch.inference_mode():
        peak = tensor_peak_bytes(lambda: aft_ops.aft_full(q, k, v, w, causal))
        y = aft_ops.aft_full(q, k, v, w, causal)
    assert peak is not None and peak <= 4 * n * n + 3 * unit + 16384, (peak, unit)  # + small reductions
    assert_rel(y, naive_full(q, k, v, w, causal), 1e-5)


@pytest.mark.usefixtures("fast_path")
def test_simple_without_autograd_holds_at_most_three_activations():
    """Inference projects [K | V], reduces it to the context vector and frees it before Q: at most K, V and e^K
    (3 activations) at once, where the fused [Q | K | V] projection alone is 3 (exact allocation record); the
    values are those of the fused path."""
    m = make("simple").eval()
    x = torch.randn(2, 512, 24)
    unit = 4 * x.numel()
    with torch.inference_mode():
        peak = tensor_peak_bytes(lambda: m(x, TokenLayout.sequence()))
        keys_first = m(x, TokenLayout.sequence())
        fused, _ = m.mix(x, TokenLayout.sequence(), None, True)  # the keys asked for: the fused projection
    assert peak is not None and peak <= 3 * unit + 4096, (peak, unit)
    torch.testing.assert_close(keys_first, fused, rtol=1e-5, atol=1e-6)


def test_full_core_trains_the_bias_alone():
    """Frozen projections (keys and values without gradient) and a trained bias take the autograd path with its
    own layout of the key context (a stacked one, from the inference path, once gave wrong outputs here)."""
    torch.manual_seed(6)
    b, n, c = 2, 9, 4
    q, k, v = torch.randn(b, n, c), torch.randn(b, n, c), torch.randn(b, n, c)
    w = torch.randn(n, n, requires_grad=True)
    wd = w.detach().double().requires_grad_()
    y, ref = aft_ops.aft_full(q, k, v, w), naive_full(q, k, v, wd)
    assert_rel(y, ref, 1e-5)
    y.sum().backward()
    ref.sum().backward()
    assert_rel(w.grad, wd.grad, 1e-5)
    m = AFTFull(24, max_len=21, bias_dim=None)
    m.qkv.requires_grad_(False)
    x = torch.randn(2, 21, 24)
    out, _ = m.mix(x, TokenLayout(), None, False)
    with torch.no_grad():
        q, k, v = m.qkv(x).chunk(3, -1)
        expected = m.proj(naive_full(q, k, v, m.w).float())
    assert_rel(out, expected, 1e-5)


@pytest.mark.parametrize("bias_sign", [1.0, -1.0])
def test_conv_core_stable(bias_sign, monkeypatch):
    """Huge keys and kernels; bias_sign -1 makes e^w - 1 ≈ -1, where Eq. 6's literal form cancels."""
    torch.manual_seed(4)
    layout = TokenLayout(grid=(4, 5), num_prefix=1)
    b, n, h, c = 2, 21, 2, 8
    q, v, k = torch.randn(b, n, c), torch.randn(b, n, c), big(b, n, h, scale=30)
    w = bias_sign * big(h, 3, 3).abs()
    y = aft_ops.aft_conv(torch.cat([q, k, v], -1), w, layout.grid, layout.num_prefix)
    assert_rel(y, naive_conv_pairs(q, k, v, w, layout.grid, layout.num_prefix), 1e-5)
    k = big(b, n, h)
    y = aft_ops.aft_conv(torch.cat([q, k, v], -1), w, layout.grid, layout.num_prefix)
    assert_rel(y, naive_conv_pairs(q, k, v, w, layout.grid, layout.num_prefix), 1e-5)


def huge_module(kind, kw):
    """A module whose keys (and biases) are of magnitude ~1e4."""
    m = make(kind, **kw)
    with torch.no_grad():
        kpart = slice(24, 24 + m.num_heads) if kind == "conv" else slice(m.hidden_dim, 2 * m.hidden_dim)
        m.qkv.weight[kpart] *= 1e4 / 3
        if kind == "conv":
            m.gamma.fill_(1e4)
            m.beta.fill_(-1e4)
        elif getattr(m, "w", None) is not None:
            m.w.normal_(0, 1e4)
        elif getattr(m, "u", None) is not None:
            m.u.normal_(0, 100)
            m.v.normal_(0, 100)
    return m


STRESS = [
    ("full", {"max_len": 21}),
    ("full", {"max_len": 21, "bias_dim": None, "causal": True}),
    ("local", {"max_len": 21, "window": 3, "outside": "-inf"}),
    ("simple", {"causal": True}),
    ("conv", {"num_heads": 4, "kernel_size": 3}),
]


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
# every precision a module runs in: fp32, and autocast to each low-precision dtype the device has
PRECISIONS = [
    pytest.param("cpu", None, id="cpu-fp32"),
    pytest.param("cpu", torch.bfloat16, id="cpu-bf16"),
    pytest.param("cuda", None, id="cuda-fp32", marks=needs_cuda),
    pytest.param("cuda", torch.bfloat16, id="cuda-bf16", marks=needs_cuda),
    pytest.param("cuda", torch.float16, id="cuda-fp16", marks=needs_cuda),
]


@pytest.mark.parametrize("mode", [nullcontext, torch.inference_mode], ids=["autograd", "inference"])
@pytest.mark.parametrize(("device", "low"), PRECISIONS)
@pytest.mark.parametrize(("kind", "kw"), STRESS, ids=[s[0] for s in STRESS])
def test_modules_stable_in_fp32_and_under_autocast(kind, kw, device, low, mode):
    """Under inference mode the mixers take their inference paths (AFT-simple: [K | V] projected before Q)."""
    m = huge_module(kind, kw)
    x = torch.randn(2, 21, 24)
    on = m.to(device)
    if low is None:  # K ~ 1e4 from an fp32 matmul: logits carry ~1e-3 abs error
        with mode():
            out = on(x.to(device), GRID).cpu()
        assert_rel(out, reference(m.cpu(), x, GRID), 1e-4)
        return
    with torch.autocast(device, dtype=low), mode():
        out16 = on(x.to(device), GRID).cpu()
        qkv16 = [t.cpu() for t in split_qkv(on, x.to(device))]  # F.linear under autocast: the module's projections
    assert out16.dtype == x.dtype
    assert qkv16[0].dtype == low  # projections did run in low precision
    # reference: the same low-precision projections, everything after them in float64; proj ran in bf16 / fp16
    assert_rel(out16, reference(m.cpu(), x, GRID, qkv=qkv16), 3e-2)


# ---------------------------------------------------------------- causal AFT-local: the O(T·s·d) band


class CoreSpy:
    """Records which AFT core ran (aft_full: the dense O(N²) path, aft_local_banded: the band)."""

    def __init__(self, monkeypatch, names=("aft_full", "aft_local_banded")):
        self.calls = []
        for name in names:
            original = getattr(aft_mod, name)

            def spy(*args, _name=name, _core=original, **kw):
                self.calls.append(_name)
                return _core(*args, **kw)

            monkeypatch.setattr(aft_mod, name, spy)


def randomise_bias(m, std):
    with torch.no_grad():
        for p in (m.u, m.v, m.w):
            if p is not None:
                p.normal_(0, std)


def dense_forward(m, x):
    """AFTLocal's O(N²) path written out: AFT-full's core on the module's dense masked bias."""
    q, k, v = m.qkv(x).chunk(3, -1)
    return m.proj(aft_ops.aft_full(q, k, v, m.position_bias(x.shape[1]), causal=m.causal))


@pytest.mark.parametrize(
    ("n", "window", "outside", "factorised"),
    [
        (50, 7, "zero", True),
        (64, 16, "zero", True),
        (37, 20, "zero", False),
        (50, 3, "-inf", True),
        (33, 32, "zero", True),
        (45, 1, "zero", False),
    ],
)
def test_banded_core_is_the_paper_equation(n, window, outside, factorised):
    torch.manual_seed(0)
    b, c = 2, 6
    q, k, v = (torch.randn(b, n, c, dtype=torch.float64) * 2 for _ in range(3))
    m = AFTLocal(c, n, window=window, outside=outside, bias_dim=4 if factorised else None, causal=True).double()
    randomise_bias(m, 1.0)
    band = local_bias_band(n, max(window, MIN_BLOCK), m.u, m.v, m.w)
    # bias rows lambda t, g: None: no fallback
    y = aft_ops.aft_local_banded(q, k, v, band, window, outside == "zero", lambda t, g: None, causal=True)
    ref = naive_full(q, k, v, naive_bias(m, n), causal=True)
    assert torch.allclose(y, ref, rtol=1e-10, atol=1e-12)


def test_band_positions_cover_the_window():
    t, tk = band_positions(10, 4)
    assert t.shape == (3, 4, 1) and tk.shape == (3, 1, 8)
    lag = t - tk
    # every (t, t') with 0 <= t - t' < 4 appears exactly once in the band
    for q in range(10):
        keys = tk.expand(3, 4, 8)[(t.expand(3, 4, 8) == q) & (lag >= 0) & (lag < 4) & (tk >= 0)]
        assert sorted(keys.tolist()) == list(range(max(0, q - 3), q + 1))


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize(
    "kw", [{}, {"bias_dim": None}, {"outside": "-inf"}, {"window": 40}, {"window": 1}, {"recompute": True}]
)
def test_banded_module_equals_dense_forward_and_gradients(kw, causal, monkeypatch):
    """Causal: N=50 < max_len; non-causal: N == max_len (the table unchanged)."""
    torch.manual_seed(1)
    m = AFTLocal(24, 64 if causal else 50, causal=causal, **{"window": 7, **kw})
    randomise_bias(m, 0.5)
    spy = CoreSpy(monkeypatch)
    x = torch.randn(2, 50, 24, requires_grad=True)
    y = m(x)
    assert spy.calls == ["aft_local_banded"]
    y_ref = dense_forward(m, x)
    assert torch.allclose(y, y_ref, rtol=1e-5, atol=1e-6)
    g = torch.randn_like(y)
    params = list(m.parameters())
    for a, b in zip(torch.autograd.grad(y, [x, *params], g), torch.autograd.grad(y_ref, [x, *params], g)):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-5)


def test_build_causal_aft_local_takes_the_band_path(monkeypatch):
    torch.manual_seed(2)
    m = build("aft_local", 24, causal=True, max_len=40, window=5)
    assert m.recompute is False and "recompute" not in repr(m)
    randomise_bias(m, 0.5)
    spy = CoreSpy(monkeypatch)
    for x, layout in ((torch.randn(2, 33, 24), None), (torch.randn(2, 21, 24), GRID)):  # shorter than max_len
        spy.calls.clear()
        out = m(x, layout)
        assert spy.calls == ["aft_local_banded"]  # a sequence or a grid with a class token: 1-D token order
        assert_rel(out, reference(m, x, layout), 1e-5)
    # no longer than the window, or a resampled bias: the dense path
    spy.calls.clear()
    m(torch.randn(2, 5, 24))
    build("aft_local", 24, max_len=40, window=5, resample=True)(torch.randn(2, 30, 24))
    assert spy.calls == ["aft_full", "aft_full"]
    assert "recompute=True" in repr(build("aft_local", 24, causal=True, max_len=40, recompute=True))


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("window", [0, 5, 16, 40])
def test_forward_takes_the_path_uses_band_reports(causal, window, monkeypatch):
    """AFTLocal decides its path in one place (``uses_band``): the forward runs that core and ``extra_flops`` counts
    it, for token counts below, at and above the window and below and at max_len (others are resampled)."""
    from vitlab.ops.aft_banded import band_block, banded_flops

    m = AFTLocal(8, 36, window=window, causal=causal, resample=True)
    spy = CoreSpy(monkeypatch, ("aft_full", "aft_simple", "aft_local_banded"))
    seen = set()
    for n in (3, 5, 6, 16, 17, 30, 36, 40):
        spy.calls.clear()
        m(torch.randn(2, n, 8))
        band = m.uses_band(n)
        seen.add(band)
        assert spy.calls == ["aft_local_banded" if band else "aft_simple" if window == 0 else "aft_full"]
        dense = aft_mod.aft_simple_flops if window == 0 else aft_mod.aft_full_flops
        assert m.extra_flops(2, n) == (banded_flops(2, n, 8, band_block(window), causal) if band else dense(2, n, 8))
    assert seen == ({False} if window in (0, 40) else {True, False})


@pytest.mark.parametrize(
    "m",
    [
        AFTFull(8, 20, causal=True),
        AFTFull(8, 20, bias_dim=None, causal=True),
        AFTLocal(8, 20, window=4, causal=True),
        AFTLocal(8, 20, window=4, outside="-inf", bias_dim=None, causal=True),
    ],
    ids=["full", "full-w", "local", "local-inf"],
)
def test_bias_row_is_a_row_of_the_position_bias(m):
    """Incremental decoding weighs the prefix with ``bias_row(t)``: row t of the bias the forward uses."""
    randomise_bias(m, 1.0)
    with torch.no_grad():
        for n in (7, 20):
            w = m.position_bias(n)
            for t in range(n):
                torch.testing.assert_close(m.bias_row(t), w[t, : t + 1], rtol=1e-5, atol=1e-5)  # u vᵀ: fp32 round-off


def test_banded_path_stable_for_huge_keys_and_biases(monkeypatch):
    torch.manual_seed(3)
    counter = FallbackCounter(monkeypatch)
    n, c, window = 40, 4, 6
    q, v = torch.randn(2, n, c), torch.randn(2, n, c)
    k = torch.randn(2, n, c) * 1e3
    m = AFTLocal(c, n, window=window, bias_dim=None, causal=True)
    randomise_bias(m, 1e3)
    band = local_bias_band(n, MIN_BLOCK, w=m.w)
    y = aft_ops.aft_local_banded(q, k, v, band, window, True, partial(m._bias_rows, n), causal=True)
    ref = naive_full(q, k, v, naive_bias(m, n), causal=True)
    assert counter.entries > 0  # the exact float64 fallback ran
    assert torch.isfinite(y).all()
    assert torch.allclose(y.double(), ref, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- non-causal AFT-local: the band of blocks i-1, i, i+1


@pytest.mark.parametrize(
    ("n", "window", "outside", "factorised"),
    [
        (50, 7, "zero", True),
        (64, 16, "zero", True),
        (37, 20, "zero", False),
        (50, 3, "-inf", True),
        (33, 32, "zero", True),
        (45, 1, "zero", False),
        (100, 5, "-inf", False),
        (81, 16, "zero", True),
    ],
)
def test_noncausal_banded_core_is_the_paper_equation(n, window, outside, factorised):
    torch.manual_seed(0)
    b, c = 2, 6
    q, k, v = (torch.randn(b, n, c, dtype=torch.float64) * 2 for _ in range(3))
    m = AFTLocal(c, n, window=window, outside=outside, bias_dim=4 if factorised else None).double()
    randomise_bias(m, 1.0)
    band = local_bias_band(n, max(window, MIN_BLOCK), m.u, m.v, m.w, causal=False)
    y = aft_ops.aft_local_banded(q, k, v, band, window, outside == "zero", lambda t, g: None)  # no fallback
    # Eq. 2 term by term over all t' (every exponent shifted by the largest of its sum)
    w = naive_bias(m, n)
    ref = torch.empty_like(y)
    for t in range(n):
        logits = k + w[t, :, None]
        weights = torch.exp(logits - logits.amax(1, keepdim=True))
        ref[:, t] = torch.sigmoid(q[:, t]) * (weights * v).sum(1) / weights.sum(1)
    assert torch.allclose(y, ref, rtol=1e-10, atol=1e-12)


def test_noncausal_band_positions_cover_the_window():
    t, tk = band_positions(10, 4, causal=False)
    assert t.shape == (3, 4, 1) and tk.shape == (3, 1, 12)
    t, tk, lag = t.expand(3, 4, 12), tk.expand(3, 4, 12), t - tk
    for q in range(10):  # every (t, t') with |t - t'| < 4 appears exactly once
        keys = tk[(t == q) & (lag.abs() < 4) & (tk >= 0) & (tk < 10)]
        assert sorted(keys.tolist()) == list(range(max(0, q - 3), min(10, q + 4)))


@pytest.mark.parametrize(
    ("window", "outside", "layout"),
    [
        (5, "zero", TokenLayout(grid=(6, 8), num_prefix=1)),
        (5, "-inf", TokenLayout(grid=(6, 8))),
        (3, "zero", GRID),
        (20, "zero", None),
        (48, "-inf", None),
    ],
)
def test_noncausal_module_takes_the_band_and_is_the_paper_equation(window, outside, layout, monkeypatch):
    torch.manual_seed(5)
    n = 49 if layout is None else layout.num_prefix + layout.grid[0] * layout.grid[1]  # N = max_len
    m = AFTLocal(24, n, window=window, outside=outside, resample=True)
    randomise_bias(m, 0.5)
    spy = CoreSpy(monkeypatch)
    x = torch.randn(2, n, 24)
    out = m(x, layout)
    assert spy.calls == ["aft_local_banded"]  # a grid with or without a class token: 1-D token order
    assert_rel(out, reference(m, x, layout), 1e-5)


def test_noncausal_dense_when_the_bias_is_not_the_table(monkeypatch):
    """N <= window, or N != max_len (resampled bias, 1-D or 2-D): the dense path; causal spans 2b keys."""
    m = AFTLocal(24, 36, window=5, resample=True)
    spy = CoreSpy(monkeypatch)
    m(torch.randn(2, 5, 24))
    m(torch.randn(2, 30, 24))
    m(torch.randn(2, 26, 24), TokenLayout(grid=(5, 5), num_prefix=1))
    m(torch.randn(2, 36, 24), TokenLayout(grid=(6, 6)))  # the table's own grid: w as is
    assert spy.calls == ["aft_full", "aft_full", "aft_full", "aft_local_banded"]
    spy.calls.clear()
    AFTLocal(24, 36, window=5, causal=True)(torch.randn(2, 30, 24))
    assert spy.calls == ["aft_local_banded"]


@pytest.mark.parametrize("outside", ["zero", "-inf"])
def test_noncausal_banded_path_stable_for_huge_keys_and_biases(outside, monkeypatch):
    torch.manual_seed(3)
    counter = FallbackCounter(monkeypatch)
    n, c, window = 40, 4, 6
    q, v = torch.randn(2, n, c), torch.randn(2, n, c)
    k = big(2, n, c).requires_grad_()
    m = AFTLocal(c, n, window=window, outside=outside, bias_dim=None)
    randomise_bias(m, 1e4)
    band = local_bias_band(n, MIN_BLOCK, w=m.w, causal=False)
    y = aft_ops.aft_local_banded(q, k, v, band, window, outside == "zero", partial(m._bias_rows, n))
    kd = k.detach().double().requires_grad_()
    ref = naive_full(q, kd, v, naive_bias(m, n))
    assert counter.entries > 0  # the exact float64 fallback ran
    assert_rel(y, ref, 1e-5)
    g = torch.randn(2, n, c)
    (y * g).sum().backward()
    (ref * g.double()).sum().backward()
    # saturated weights: gradients ~0 in float64, fp32 round-off of (V - Y) in ours
    assert torch.isfinite(k.grad).all()
    assert torch.allclose(k.grad.double(), kd.grad, atol=1e-6)


# ---------------------------------------------------------------- bad input and token counts


def test_bad_input_raises():
    m = make("full", max_len=16)
    with pytest.raises(ValueError, match=r"\(B, N, C=24\)"):
        m(torch.randn(16, 24))
    with pytest.raises(ValueError, match=r"\(B, N, C=24\)"):
        m(torch.randn(2, 16, 23))
    with pytest.raises(ValueError, match=r"N = 12.*max_len = 16.*resample=True"):
        m(torch.randn(2, 12, 24))
    with pytest.raises(ValueError, match=r"N = 12.*max_len = 16"):
        make("local", max_len=16, window=2)(torch.randn(2, 12, 24))
    with pytest.raises(ValueError, match=r"N = 20.*N <= max_len = 16"):
        make("full", max_len=16, causal=True)(torch.randn(2, 20, 24))
    for bad in (0, -3, "none", 2.5, True):  # a string from a config file, not None: one line, not a TypeError
        with pytest.raises(ValueError, match=f"bias_dim must be a positive integer or None .*got {bad!r}"):
            make("full", max_len=16, bias_dim=bad)
    assert make("full", max_len=16, bias_dim=np.int64(4)).u.shape == (16, 4)
    conv = make("conv", num_heads=4)
    with pytest.raises(ValueError, match="needs the patch grid"):
        conv(torch.randn(2, 16, 24))
    with pytest.raises(ValueError, match="grid 4x5 needs N = 1 prefix \\+ 20"):
        conv(torch.randn(2, 20, 24), GRID)
    with pytest.raises(ValueError, match="odd"):
        AFTConv(24, 4, kernel_size=4)
    with pytest.raises(ValueError, match="divisible"):
        AFTConv(24, 5)
    with pytest.raises(ValueError, match="outside"):
        AFTLocal(24, 16, outside="inf")
    with pytest.raises(ValueError, match="max_len"):
        AFTFull(24, 0)
    with pytest.raises(ValueError, match="unknown option"):
        build("aft_simple", 24, max_len=16)


def test_registry_builds_each_kind():
    assert isinstance(build("aft_full", 24, max_len=8), AFTFull)
    assert isinstance(build("aft_local", 24, max_len=8, window=2), AFTLocal)
    assert isinstance(build("aft_simple", 24), AFTSimple)
    assert isinstance(build("aft_conv", 24, num_heads=3, kernel_size=3), AFTConv)


def test_resample_2d_keeps_prefix_and_grid_orientation():
    m = AFTFull(24, max_len=17, bias_dim=4, resample=True)  # 1 prefix + 4 x 4 patches
    with torch.no_grad():
        m.u[0] = 7.0
        m.u[1:] = torch.arange(4.0).repeat_interleave(4)[:, None]  # patch (r, c) -> r
        m.v.fill_(0.25)  # w[t, t'] = u_t · v_t' = u_t[0]
    layout = TokenLayout(grid=(6, 3), num_prefix=1)
    w = m.position_bias(19, layout)
    assert w.shape == (19, 19)
    assert torch.allclose(w[0], torch.full((19,), 7.0))  # prefix row kept
    rows = w[1:, 0].view(6, 3)
    assert torch.allclose(rows, rows[:, :1].expand(6, 3), atol=1e-6)  # depends on the grid row only
    assert (rows[1:, 0] >= rows[:-1, 0] - 1e-6).all() and rows[-1, 0] > rows[0, 0]
    # the patch rows went through the 2-D bicubic path
    expect = F.interpolate(m.u[1:, :1].T.reshape(1, 1, 4, 4), size=(6, 3), mode="bicubic", align_corners=False)
    assert torch.allclose(rows.flatten(), expect.flatten(), atol=1e-5)
    out = m(torch.randn(2, 19, 24), layout)
    assert out.shape == (2, 19, 24) and torch.isfinite(out).all()


def test_resample_1d_and_unchanged_at_max_len():
    torch.manual_seed(5)
    for bias_dim in (8, None):
        m = AFTFull(24, max_len=10, bias_dim=bias_dim, resample=True)
        ref = AFTFull(24, max_len=10, bias_dim=bias_dim)
        ref.load_state_dict(m.state_dict())
        x = torch.randn(2, 10, 24)
        assert torch.equal(m(x), ref(x))  # N == max_len: nothing resampled
        assert torch.equal(m(x, TokenLayout(grid=(3, 3), num_prefix=1)), ref(x))
        out = m(torch.randn(2, 19, 24))  # no grid: 1-D linear over the sequence
        assert out.shape == (2, 19, 24) and torch.isfinite(out).all()
    with torch.no_grad():
        m.w.copy_(torch.arange(10.0)[:, None] + torch.zeros(10))  # w[t, t'] = t
    w = m.position_bias(19)
    assert torch.allclose(w, w[:, :1].expand(19, 19))
    assert (w[1:, 0] >= w[:-1, 0]).all() and w[0, 0] == 0 and w[-1, 0] == 9


def test_resample_causal_longer_sequence():
    m = AFTLocal(24, max_len=8, window=2, causal=True, resample=True)
    assert m(torch.randn(1, 12, 24)).shape == (1, 12, 24)
    assert m.position_bias(5).shape == (5, 5)  # shorter: the prefix block, not a resample
    assert torch.allclose(m.position_bias(5), m.position_bias(8)[:5, :5])


def test_conv_any_grid_size():
    m = make("conv", num_heads=4, kernel_size=5)
    randomise_conv(m)
    for grid in [(1, 1), (2, 7), (6, 7)]:
        layout = TokenLayout(grid=grid, num_prefix=0)
        x = torch.randn(1, grid[0] * grid[1], 24)
        assert_rel(m(x, layout), reference(m, x, layout), 1e-5)
