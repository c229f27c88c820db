"""Multi-head self-attention: SDPA path == explicit path (incl. causal), the equation written out, the map."""

from __future__ import annotations

import weakref

import pytest
import torch
import torch.nn.functional as F

from conftest import assert_close_to_golden, load_golden
from vitlab.mixers import Attention, TokenLayout, attention_map, build
from vitlab.mixers.attention import HeadMix


def naive_attention(x, m: Attention, causal: bool = False):
    """out = proj(concat_h softmax(Q_h K_hᵀ / sqrt(d_h)) V_h), head by head, row by row, float64."""
    p = {k: v.double() for k, v in m.state_dict().items()}
    x = x.double()
    c = x.shape[-1]
    hd = c // m.num_heads
    q, k, v = (x @ p["qkv.weight"].T + p["qkv.bias"]).split(c, dim=-1)
    heads, maps = [], []
    for h in range(m.num_heads):
        sl = slice(h * hd, (h + 1) * hd)
        logits = q[..., sl] @ k[..., sl].transpose(1, 2) / hd**0.5
        if causal:  # query i sees keys j <= i
            n = logits.shape[-1]
            logits = logits.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        e = torch.exp(logits - logits.amax(-1, keepdim=True))
        a = e / e.sum(-1, keepdim=True)
        maps.append(a)
        heads.append(a @ v[..., sl])
    return torch.cat(heads, -1) @ p["proj.weight"].T + p["proj.bias"], torch.stack(maps, 1)


@pytest.mark.parametrize("causal", [False, True])
def test_matches_naive_equation_on_both_paths(causal):
    torch.manual_seed(0)
    m = Attention(24, num_heads=3, causal=causal).double().eval()
    x = torch.randn(2, 7, 24, dtype=torch.float64)
    ref, ref_map = naive_attention(x, m, causal)
    torch.testing.assert_close(m(x), ref, rtol=1e-5, atol=1e-10)  # SDPA
    out, aux = m(x, return_aux=True)  # explicit
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-10)
    torch.testing.assert_close(aux["attn"], ref_map, rtol=1e-5, atol=1e-10)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("train", [False, True])
def test_sdpa_path_equals_explicit_path(causal, train):
    torch.manual_seed(1)
    fused = Attention(32, num_heads=4, causal=causal).train(train)
    explicit = Attention(32, num_heads=4, causal=causal, fused=False).train(train)
    explicit.load_state_dict(fused.state_dict())
    x = torch.randn(3, 11, 32)
    out_fused = fused(x)
    out_aux, _ = fused(x, return_aux=True)
    torch.testing.assert_close(out_fused, out_aux, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out_fused, explicit(x), rtol=1e-5, atol=1e-6)


@pytest.mark.usefixtures("fast_path")
def test_short_sequences_train_through_the_explicit_map(monkeypatch):
    """Training on the CPU with N <= 64 takes the explicit map (faster there); longer sequences, inference and
    attention dropout take SDPA."""
    calls = []
    sdpa = F.scaled_dot_product_attention
    monkeypatch.setattr(
        F, "scaled_dot_product_attention", lambda *a, **kw: calls.append(a[0].shape[-2]) or sdpa(*a, **kw)
    )
    m = Attention(24, num_heads=3).train()
    short, long = torch.randn(2, 16, 24, requires_grad=True), torch.randn(2, 65, 24, requires_grad=True)
    m(short), m(long)
    assert calls == [65]  # SDPA for the long sequence only
    assert not Attention(24, 3, attn_drop=0.1).train()._explicit_trains_faster(short[:, None])
    assert m._explicit_trains_faster(short[:, None]) and not m._explicit_trains_faster(long[:, None])
    with torch.no_grad():
        assert not m._explicit_trains_faster(short[:, None])


@pytest.mark.parametrize("tokens", [7, 70])  # 7: the explicit map in training, 70: SDPA
@pytest.mark.parametrize("fused", [True, False])
def test_gradients_match_the_naive_equation(fused, tokens):
    """Input and weight gradients of both paths against autograd through the written-out equation (float64)."""
    torch.manual_seed(2)
    m = Attention(24, num_heads=3, fused=fused).double().train()
    x = torch.randn(2, tokens, 24, dtype=torch.float64, requires_grad=True)
    g = torch.randn(2, tokens, 24, dtype=torch.float64)
    m(x).backward(g)
    grads = [x.grad] + [p.grad for p in m.parameters()]
    x2 = x.detach().requires_grad_()
    params = {k: v.detach().requires_grad_() for k, v in m.state_dict().items()}
    naive = naive_attention_differentiable(x2, params, m.num_heads)
    naive.backward(g)
    for got, want in zip(grads, [x2.grad] + [params[k].grad for k, _ in m.named_parameters()]):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def naive_attention_differentiable(x, p, num_heads):
    c = x.shape[-1]
    hd = c // num_heads
    q, k, v = (x @ p["qkv.weight"].T + p["qkv.bias"]).split(c, dim=-1)
    heads = []
    for h in range(num_heads):
        sl = slice(h * hd, (h + 1) * hd)
        logits = q[..., sl] @ k[..., sl].transpose(1, 2) / hd**0.5
        e = torch.exp(logits - logits.amax(-1, keepdim=True))
        heads.append(e / e.sum(-1, keepdim=True) @ v[..., sl])
    return torch.cat(heads, -1) @ p["proj.weight"].T + p["proj.bias"]


def test_golden_plain_attention_from_deepvit_weights():
    """dvit_repo's ReAttention is MHSA until the head mix: its q/k/v/proj give the same softmax map (sanity)."""
    g = load_golden("deepvit_reattention.npz")
    m = Attention(32, num_heads=4).eval()
    m.load_state_dict({k: v for k, v in g.state().items() if k.split(".")[0] in ("qkv", "proj")})
    _, aux = m(g.input("x"), return_aux=True)
    w, b = g.param("reatten_matrix.weight")[:, :, 0, 0], g.param("reatten_matrix.bias")
    mixed = torch.einsum("gh,bhij->bgij", w, aux["attn"]) + b[:, None, None]
    bn = (mixed - g.buffer("var_norm.running_mean")[:, None, None]) / torch.sqrt(
        g.buffer("var_norm.running_var")[:, None, None] + 1e-5
    )
    assert_close_to_golden(
        bn * g.param("var_norm.weight")[:, None, None] + g.param("var_norm.bias")[:, None, None], g.output("attn")
    )


def test_aux_map_rows_sum_to_one_and_causal_map_is_lower_triangular():
    torch.manual_seed(2)
    x = torch.randn(2, 9, 16)
    _, aux = Attention(16, num_heads=2)(x, return_aux=True)
    assert aux["attn"].shape == (2, 2, 9, 9) and (aux["attn"] >= 0).all()
    torch.testing.assert_close(aux["attn"].sum(-1), torch.ones(2, 2, 9))
    _, aux = Attention(16, num_heads=2, causal=True)(x, return_aux=True)
    torch.testing.assert_close(aux["attn"].sum(-1), torch.ones(2, 2, 9))
    assert (aux["attn"].triu(1) == 0).all()


def test_causal_output_ignores_future_tokens():
    torch.manual_seed(3)
    m = Attention(16, num_heads=2, causal=True).eval()
    x = torch.randn(1, 8, 16)
    y = x.clone()
    y[:, 5:] = torch.randn(1, 3, 16)
    torch.testing.assert_close(m(x)[:, :5], m(y)[:, :5])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_map_is_stable_for_huge_logits(dtype):
    """Logits of ~1e4: the map is finite and is the softmax of the logits as this dtype's product gives them
    (in bf16 those differ from the exact ones by ~1e4 · 2^-8, which moves the softmax arbitrarily: the
    product's rounding is the dtype's, the softmax after it must add no more than the output's rounding)."""
    gen = torch.Generator().manual_seed(11)
    q = (torch.randn(1, 2, 6, 4, generator=gen) * 100).to(dtype)
    k = (torch.randn(1, 2, 6, 4, generator=gen) * 100).to(dtype)
    a = attention_map(q, k, scale=1.0)
    assert a.dtype == dtype and torch.isfinite(a).all()
    ref = (q @ k.transpose(-1, -2)).double().softmax(-1)
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(a.double(), ref, rtol=2 * eps, atol=2 * eps)
    torch.testing.assert_close(a.double().sum(-1), torch.ones(1, 2, 6, dtype=torch.float64), rtol=0, atol=8 * eps)


def test_bf16_autocast_paths_agree():
    torch.manual_seed(4)
    m = Attention(32, num_heads=4).eval()
    x = torch.randn(2, 10, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fused = m(x)
        explicit, aux = m(x, return_aux=True)
    assert aux["attn"].dtype == torch.bfloat16
    ref = m(x)
    for out in (fused, explicit):
        assert (out.float() - ref).abs().max() <= 0.03 * ref.abs().max()


def test_gradients_reach_every_parameter_on_both_paths():
    torch.manual_seed(5)
    for return_aux in (False, True):
        m = Attention(16, num_heads=2, attn_drop=0.1, proj_drop=0.1).train()
        out = m(torch.randn(2, 5, 16), return_aux=return_aux)
        (out[0] if return_aux else out).square().sum().backward()
        for name, p in m.named_parameters():
            assert p.grad is not None and p.grad.abs().sum() > 0, name


@pytest.mark.parametrize("bias", [True, False])
def test_head_mix_is_a_1x1_conv_over_heads(bias):
    torch.manual_seed(6)
    mix = HeadMix(3, 5, bias=bias)
    assert mix.weight.shape == (5, 3, 1, 1)  # Conv2d keys and shapes, as the official checkpoints
    a = torch.rand(2, 3, 7, 7)
    torch.testing.assert_close(mix(a), torch.nn.functional.conv2d(a, mix.weight, mix.bias))
    torch.testing.assert_close(mix(a.contiguous(memory_format=torch.channels_last)), mix(a))


def test_qk_scale_and_build():
    m = build("attention", 32, num_heads=4, qk_scale=0.5, qkv_bias=False)
    assert isinstance(m, Attention) and m.scale == 0.5 and m.qkv.bias is None
    assert build("attention", 32, num_heads=4).scale == pytest.approx(8**-0.5)
    with pytest.raises(ValueError, match="unknown mixer kind"):
        build("atention", 32)
    with pytest.raises(ValueError, match="unknown option"):
        build("attention", 32, heads=4)


def test_bad_input_raises():
    m = Attention(16, num_heads=2)
    with pytest.raises(ValueError, match=r"expected tokens of shape \(B, N, C=16\), got \(2, 5, 8\)"):
        m(torch.randn(2, 5, 8))
    with pytest.raises(ValueError, match="expected tokens of shape"):
        m(torch.randn(5, 16))
    with pytest.raises(ValueError, match="expected tokens of shape"):
        m([[0.0] * 16])
    with pytest.raises(ValueError, match="divisible"):
        Attention(16, num_heads=3)
    with pytest.raises(ValueError, match="dim must be positive"):
        Attention(0, num_heads=1)


def test_q_k_v_are_freed_before_the_projection_allocates(monkeypatch):
    """Without autograd the (B, N, 3C) projection is released as soon as the heads are attended: the output
    projection's buffer then takes its place (4 activation-sized buffers at the peak, not 5)."""
    m = Attention(32, 4).eval()
    alive: list[weakref.ref] = []
    heads, project = m.qkv_heads, m.project

    def recorded_heads(x):
        q, k, v = heads(x)
        alive.extend(weakref.ref(t) for t in (q, k, v))
        return q, k, v

    def checked_project(out):
        assert alive and all(r() is None for r in alive), "q, k or v still alive at the projection"
        return project(out)

    monkeypatch.setattr(m, "qkv_heads", recorded_heads)
    monkeypatch.setattr(m, "project", checked_project)
    with torch.inference_mode():
        out = m(torch.randn(2, 10, 32), TokenLayout.sequence())
    assert out.shape == (2, 10, 32)
