"""External attention: goldens (xmu, EANet, EAMLP multi-head and token layer), the double normalisation
written out, stability for huge logits, M_v = M_kᵀ init, build, bad input."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import vitlab.mixers.external
from conftest import allocations_of, assert_close_to_golden, load_golden
from vitlab.mixers import ExternalAttention, MultiHeadExternalAttention, build
from vitlab.mixers.base import split_heads
from vitlab.ops.double_norm import double_normalize


def naive_double_norm(logits: torch.Tensor, eps: float = 1e-9) -> torch.Tensor:
    """α̂_ij = exp(α̃_ij) / Σ_k exp(α̃_kj) over tokens i, then α_ij = α̂_ij / (eps + Σ_k α̂_ik); (..., N, S), float64.

    The per-slot max is subtracted first (it cancels in the ratio) so that the reference itself is exact for
    logits ~1e4.
    """
    e = torch.exp(logits.double() - logits.double().amax(dim=-2, keepdim=True))
    a_hat = e / e.sum(dim=-2, keepdim=True)
    return a_hat / (eps + a_hat.sum(dim=-1, keepdim=True))


# ----------------------------------------------------------------------------- goldens


def test_golden_xmu_single_head():
    g = load_golden("ea_single_xmu.npz")
    x = g.input("x")
    m = ExternalAttention(32, memory_size=16).eval()
    m.load_state_dict(g.state())  # mk.weight, mv.weight: same names
    out = m(x)
    assert_close_to_golden(out, g.output("x"))
    # xmu has no eps in the ℓ1 step: same function up to a relative 1e-9 of each row's sum
    exact = ExternalAttention(32, memory_size=16, eps=0.0).eval()
    exact.load_state_dict(g.state())
    assert_close_to_golden(exact(x), g.output("x"))
    assert (out - exact(x)).abs().max() <= 1e-6 * out.abs().max()


# EANet's segmentation module (conv -> EA -> conv + BN -> residual -> ReLU) is the public
# vitlab.layers.ExternalAttentionConv; its golden test is in test_ablation_models.py.


def test_golden_eamlp_multi_head():
    g = load_golden("ea_multihead_eamlp.npz")
    m = MultiHeadExternalAttention(32, num_heads=2).eval()
    names = {"trans_dims": "query", "linear_0": "mk", "linear_1": "mv", "proj": "proj"}
    m.load_state_dict({names[k.split(".")[0]] + "." + k.split(".")[1]: v for k, v in g.state().items()})
    out, aux = m(g.input("x"), return_aux=True)
    assert_close_to_golden(out, g.output("x"))
    assert aux["memory_attn"].shape == (2, 8, 17, 64)  # 4·num_heads heads, S = 256 // 4


def test_golden_eamlp_token_layer():
    """T2T token EA: t = q_linear(x); out = t + proj(M_v(double_normalize(t M_kᵀ))), 128 slots, M_v with bias."""
    g = load_golden("ea_token_eamlp.npz")
    t = F.linear(g.input("x"), g.param("q_linear.weight"), g.param("q_linear.bias"))
    attn = double_normalize(F.linear(t, g.param("linear_1.weight")), token_dim=1, memory_dim=2)
    y = F.linear(
        F.linear(attn, g.param("linear_2.weight"), g.param("linear_2.bias")),
        g.param("proj.weight"),
        g.param("proj.bias"),
    )
    assert attn.shape[-1] == 128
    assert_close_to_golden(t + y, g.output("x"))


# ----------------------------------------------------------------------------- formulas, naive


def test_double_normalize_matches_paper_equations_on_any_axes():
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 7, 5, dtype=torch.float64) * 3
    ref = naive_double_norm(logits)
    torch.testing.assert_close(double_normalize(logits), ref, rtol=1e-5, atol=1e-12)
    # the same map laid out (B, S, N), as EANet's (b, k, n)
    moved = double_normalize(logits.transpose(-1, -2), token_dim=-1, memory_dim=-2)
    torch.testing.assert_close(moved.transpose(-1, -2), ref, rtol=1e-5, atol=1e-12)
    torch.testing.assert_close(ref.sum(-1), torch.ones(2, 3, 7, dtype=torch.float64))  # rows ℓ1-normalised


@pytest.mark.parametrize("dims", [(1, 3), (-2, -1), (-1, -2), (1, 2)])
def test_double_normalize_gradient_is_the_naive_formulas(dims, monkeypatch):
    """The closed-form backward pass equals autograd through the paper's formulas, on any axes; gradcheck too."""
    torch.manual_seed(4)
    token_dim, memory_dim = dims
    logits = (torch.randn(2, 5, 3, 4, dtype=torch.float64) * 3).requires_grad_(True)
    grad = torch.randn(2, 5, 3, 4, dtype=torch.float64)
    out = double_normalize(logits, token_dim, memory_dim)
    (fast,) = torch.autograd.grad(out, logits, grad)
    moved = logits.movedim((token_dim, memory_dim), (-2, -1))
    ref = naive_double_norm(moved).movedim((-2, -1), (token_dim, memory_dim))
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-14)
    (slow,) = torch.autograd.grad(ref, logits, grad)
    torch.testing.assert_close(fast, slow, rtol=1e-8, atol=1e-12)
    small = logits.detach()[:1, :3, :2, :3].clone().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda x: double_normalize(x, token_dim, memory_dim), (small,))
    # a captured graph (compile, trace, export) records the composite operations: the same map and gradient
    monkeypatch.setattr(vitlab.ops.double_norm, "eager_fast_path", lambda: False)
    plain = double_normalize(logits, token_dim, memory_dim)
    assert plain.grad_fn is not None and "DoubleNormalize" not in type(plain.grad_fn).__name__
    torch.testing.assert_close(plain, out, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(torch.autograd.grad(plain, logits, grad)[0], fast, rtol=1e-8, atol=1e-12)


@pytest.mark.usefixtures("fast_path")
def test_double_normalize_overwrites_fresh_logits_under_autograd():
    """``inplace`` while autograd records (the mixers' own logits): the map is the logits' buffer, and the map and
    the gradients upstream of it are the paper's formulas' (autograd through the naive reference)."""
    torch.manual_seed(5)
    lin = torch.nn.Linear(6, 5).double()
    x = torch.randn(2, 7, 6, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(2, 7, 5, dtype=torch.float64)
    logits = lin(x)
    out = double_normalize(logits, token_dim=1, memory_dim=2, inplace=True)
    assert out.data_ptr() == logits.data_ptr()
    got = torch.autograd.grad(out, (x, lin.weight, lin.bias), grad)
    ref = naive_double_norm(lin(x))
    want = torch.autograd.grad(ref, (x, lin.weight, lin.bias), grad)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-14)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-8, atol=1e-12)
    # logits another node saved for its backward pass: overwriting them is an error there, never a wrong gradient
    scale = torch.ones(5, dtype=torch.float64, requires_grad=True)
    logits = lin(x)
    scaled = logits * scale  # saves the logits for scale's gradient
    double_normalize(logits, token_dim=1, memory_dim=2, inplace=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        scaled.sum().backward()


@pytest.mark.usefixtures("fast_path")
def test_double_normalize_allocates_one_map_a_training_step():
    """The claim of :class:`_DoubleNormalize`'s docstring: with the logits overwritten, the forward pass allocates no
    map-sized buffer and the backward pass one, the gradient it returns (each such buffer above glibc's mmap
    threshold is page-faulted anew on every call)."""
    torch.manual_seed(6)
    x = torch.randn(2, 96, 8, 16, requires_grad=True)
    logits = x.clone()  # a fresh non-leaf, as a projection's output (its backward allocates nothing)
    map_bytes = logits.numel() * logits.element_size()
    out = []
    assert len(allocations_of(lambda: out.append(double_normalize(logits, 1, -1, inplace=True)), map_bytes)) == 0
    g = torch.randn_like(out[0])
    assert len(allocations_of(lambda: torch.autograd.grad(out[0], x, g), map_bytes)) == 1
    assert len(allocations_of(lambda: double_normalize(x, 1, -1), map_bytes)) == 1  # not overwritten: the map


def test_single_head_matches_naive_algorithm_1():
    torch.manual_seed(1)
    m = ExternalAttention(12, memory_size=9, bias=True).double()
    with torch.no_grad():
        m.mv.bias.normal_()
    x = torch.randn(3, 8, 12, dtype=torch.float64)
    out, aux = m(x, return_aux=True)
    a = naive_double_norm(x @ m.mk.weight.T + m.mk.bias)
    torch.testing.assert_close(aux["memory_attn"], a, rtol=1e-5, atol=1e-12)
    torch.testing.assert_close(out, a @ m.mv.weight.T + m.mv.bias, rtol=1e-5, atol=1e-12)


def test_multi_head_matches_naive_per_head_loop():
    torch.manual_seed(2)
    dim, heads, coef, s = 12, 3, 2, 5
    m = MultiHeadExternalAttention(dim, num_heads=heads, coef=coef, memory_size=s).double()
    x = torch.randn(2, 6, dim, dtype=torch.float64)
    t = x @ m.query.weight.T + m.query.bias
    d = dim // heads
    outs = []
    for h in range(heads * coef):  # every head: same memories
        a = naive_double_norm(t[..., h * d : (h + 1) * d] @ m.mk.weight.T + m.mk.bias)
        outs.append(a @ m.mv.weight.T + m.mv.bias)
    ref = torch.cat(outs, -1) @ m.proj.weight.T + m.proj.bias
    torch.testing.assert_close(m(x), ref, rtol=1e-5, atol=1e-12)
    assert m.memory_size == s and MultiHeadExternalAttention(dim, heads, coef=4).memory_size == 64


# ----------------------------------------------------------------------------- stability, init, dtypes


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_double_normalize_is_stable_for_huge_logits(dtype):
    torch.manual_seed(3)
    logits = (torch.randn(2, 16, 8) * 1e4).to(dtype)
    out = double_normalize(logits, token_dim=1, memory_dim=2)
    assert out.dtype == dtype and torch.isfinite(out).all()
    ref = naive_double_norm(logits)  # exact, from the same (rounded) logits
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)
    # eps keeps tokens that no slot attends to at exactly 0 (no 0/0)
    assert (out == 0).any()


AUTOCAST = [
    pytest.param("cpu", torch.bfloat16, id="cpu-bf16"),
    pytest.param("cuda", torch.bfloat16, id="cuda-bf16", marks=needs_cuda),
    pytest.param("cuda", torch.float16, id="cuda-fp16", marks=needs_cuda),
]


@pytest.mark.parametrize(("device", "low"), [pytest.param("cpu", None, id="cpu-fp32"), *AUTOCAST])
def test_modules_stable_for_huge_logits_in_fp32_and_under_autocast(device, low):
    torch.manual_seed(4)
    single, multi = ExternalAttention(16, memory_size=8), MultiHeadExternalAttention(16, num_heads=2)
    x = torch.randn(2, 10, 16) * 1e3  # logits ~1e4 (within fp16's range, 65504)
    logits = {single: lambda: single.mk(x), multi: lambda: multi.mk(split_heads(multi.query(x), multi.num_heads))}
    for m, make_logits in logits.items():
        if low is None:
            out, aux = m(x, return_aux=True)
            assert torch.isfinite(out).all()
            ref = naive_double_norm(make_logits().detach())
            torch.testing.assert_close(aux["memory_attn"].double(), ref, rtol=1e-5, atol=1e-6)
            continue
        with torch.autocast(device, dtype=low):
            out, aux = m.to(device)(x.to(device), return_aux=True)
        assert torch.isfinite(out).all() and aux["memory_attn"].dtype == low
        assert (aux["memory_attn"].float().sum(-1) <= 1.01).all()  # ℓ1 rows: 1, or 0 for unattended tokens


def test_memory_init_mv_is_mk_transpose_copy():
    m = ExternalAttention(10, memory_size=6)
    assert torch.equal(m.mv.weight, m.mk.weight.T)
    assert m.mv.weight.data_ptr() != m.mk.weight.data_ptr()  # not tied
    with torch.no_grad():
        m.mk.weight.add_(1.0)
    assert not torch.equal(m.mv.weight, m.mk.weight.T)
    with torch.no_grad():
        m.mv.weight.normal_()
    m.reset_parameters()
    assert torch.equal(m.mv.weight, m.mk.weight.T)
    assert m.mk.bias is None and m.mv.bias is None  # paper: memories without bias


# ----------------------------------------------------------------------------- contract


@pytest.mark.parametrize(
    "make",
    [
        lambda: ExternalAttention(16, memory_size=8, bias=True, attn_drop=0.1),
        lambda: MultiHeadExternalAttention(16, num_heads=2, attn_drop=0.1, proj_drop=0.1),
    ],
)
def test_shapes_and_gradients_reach_every_parameter(make):
    torch.manual_seed(5)
    m = make().train()
    x = torch.randn(2, 7, 16)
    out = m(x)
    assert out.shape == x.shape
    out.square().sum().backward()
    for name, p in m.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_build_by_name():
    assert type(build("external", 32)) is ExternalAttention
    assert type(build("external", 32, num_heads=1, memory_size=16)) is ExternalAttention
    mh = build("external", 32, num_heads=4)
    assert type(mh) is MultiHeadExternalAttention and mh.num_heads == 16
    assert type(build("external_mh", 32, num_heads=2, coef=2)) is MultiHeadExternalAttention


def test_bad_input_raises():
    with pytest.raises(ValueError, match="expected tokens of shape"):
        ExternalAttention(16)(torch.randn(2, 5, 8))
    with pytest.raises(ValueError, match="expected tokens of shape"):
        MultiHeadExternalAttention(16, num_heads=2)(torch.randn(5, 16))
    with pytest.raises(ValueError, match="divisible"):
        MultiHeadExternalAttention(18, num_heads=4)
    with pytest.raises(ValueError, match="memory_size"):
        ExternalAttention(16, memory_size=0)
    with pytest.raises(ValueError, match="MultiHeadExternalAttention"):
        ExternalAttention(16, num_heads=2)
    with pytest.raises(ValueError, match="coef"):
        MultiHeadExternalAttention(16, num_heads=2, coef=0)
