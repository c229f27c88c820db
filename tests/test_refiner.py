"""Refiner: golden vectors (official Refiner_ViT), the paper's equations with explicit loops, DLA identity,
ablation settings, TF-"same" padding, dtypes and bad input."""

from __future__ import annotations

import math

import pytest
import torch

import vitlab
from conftest import assert_close_to_golden, load_golden
from vitlab.interop import rename_keys
from vitlab.mixers import Attention, DistributedLocalAttention, RefinerAttention, build
from vitlab.mixers.refiner import SameDepthwiseConv2d

# ----------------------------------------------------------------------------- naive float64 reference


def naive_same_conv(maps: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Depth-wise k×k cross-correlation of (B, C, N, N) with w (C, k, k), TF-"same" zero padding, by loops."""
    n, k = maps.shape[-1], w.shape[-1]
    total = max((math.ceil(n / 1) - 1) * 1 + (k - 1) * 1 + 1 - n, 0)  # TF's formula, stride 1, dilation 1
    before = total // 2
    out = torch.zeros_like(maps)
    for i in range(n):
        for j in range(n):
            for a in range(k):
                for b in range(k):
                    ii, jj = i - before + a, j - before + b
                    if 0 <= ii < n and 0 <= jj < n:
                        out[:, :, i, j] += w[:, a, b] * maps[:, :, ii, jj]
    return out


def naive_head_mix(maps: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Ã^h = Σ_i W(h, i) A^i, head by head."""
    return torch.stack([sum(w[h, i] * maps[:, i] for i in range(maps.shape[1])) for h in range(w.shape[0])], 1)


def naive_refiner(x, m: RefinerAttention, attn_prev=None):
    """Paper form (no BN, no shortcut): expansion, DLA, reduction, then Σ_j A*_ij v_j per head; float64."""
    p = {k: v.double() for k, v in m.state_dict().items()}
    x = x.double()
    c, nh, s = x.shape[-1], m.num_heads, m.scale
    if m.share:
        v, a = x @ p["qkv.weight"].T + p["qkv.bias"], attn_prev.double()
    else:
        q, k, v = (x @ p["qkv.weight"].T + p["qkv.bias"]).split(c, dim=-1)
        hd = c // nh
        maps = []
        for h in range(nh):
            e = torch.exp(q[..., h * hd : (h + 1) * hd] @ k[..., h * hd : (h + 1) * hd].transpose(1, 2) * s)
            maps.append(e / e.sum(-1, keepdim=True))
        a = torch.stack(maps, 1)
        if m.residual_attention and attn_prev is not None:
            a = a + s * attn_prev.double()
    dla = m.refiner
    if dla.expand is not None:
        a = naive_head_mix(a, p["refiner.expand.0.weight"][:, :, 0, 0])
    if dla.local is not None:
        a = naive_same_conv(a, p["refiner.local.0.weight"][:, 0])
    if dla.reduce is not None:
        a = naive_head_mix(a, p["refiner.reduce.0.weight"][:, :, 0, 0])
    if m.share:
        a = a * s
    vh = c // a.shape[1]
    heads = [a[:, h] @ v[..., h * vh : (h + 1) * vh] for h in range(a.shape[1])]
    return torch.cat(heads, -1) @ p["proj.weight"].T + p["proj.bias"], a


def softmax_maps(b, h, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, h, n, n, generator=g, dtype=torch.float64).mul(2).softmax(-1)


# ----------------------------------------------------------------------------- golden vectors


def load_official(name: str, **kw) -> tuple[RefinerAttention, dict]:
    """An official ``Refined_Attention`` golden state, renamed by the checkpoint converter as block 0's mixer."""
    g = load_golden(name)
    m = RefinerAttention(32, num_heads=4, official_extras=True, **kw).eval()
    converted = rename_keys({f"blocks.0.attn.{k}": v for k, v in g.state().items()}, "refiner")
    prefix = "blocks.0.mixer."
    assert all(k.startswith(prefix) for k in converted)
    m.load_state_dict({k.removeprefix(prefix): v for k, v in converted.items()})
    return m, g


def test_golden_normal_block_with_residual_attention():
    m, g = load_official("refiner_attention.npz", residual_attention=True)
    x = g.input("x")
    out, aux = m(x, return_aux=True)
    assert_close_to_golden(out, g.output("x"))
    assert_close_to_golden(aux["attn"], g.output("attn"))
    assert aux["carry"] is aux["attn"]  # a normal block hands on its refined map
    out, aux = m(x, attn_prev=g.input("atten_prev"), return_aux=True)
    assert_close_to_golden(out, g.output("x_prev"))
    assert_close_to_golden(aux["attn"], g.output("attn_prev"))
    assert_close_to_golden(aux["carry"], g.output("attn_prev"))


def test_golden_shared_block():
    m, g = load_official("refiner_attention_shared.npz", share=True)
    prev = g.input("atten")
    out, aux = m(g.input("x"), attn_prev=prev, return_aux=True)
    assert_close_to_golden(out, g.output("x"))
    assert "carry" not in aux and torch.equal(prev, g.output("attn_next"))  # the incoming map goes on, unrefined
    torch.testing.assert_close(aux["attn"], m.adapt_bn(m.refiner(prev)) * m.scale)


# ----------------------------------------------------------------------------- paper equations, naive


PAPER_SETTINGS = [  # expansion, kernel, dla, reduction, residual_attention
    (3, 3, True, True, False),
    (1, 3, True, True, True),
    (2, 5, True, False, False),
    (4, 4, True, True, False),  # even kernel: asymmetric TF-"same" padding
    (6, 3, False, True, True),
]


@pytest.mark.parametrize(("r", "k", "dla", "reduction", "residual"), PAPER_SETTINGS)
def test_paper_form_matches_naive_loops(r, k, dla, reduction, residual):
    torch.manual_seed(r * 10 + k)
    m = (
        RefinerAttention(
            24, num_heads=2, expansion=r, kernel_size=k, dla=dla, reduction=reduction, residual_attention=residual
        )
        .double()
        .eval()
    )
    x = torch.randn(2, 6, 24, dtype=torch.float64)
    prev = softmax_maps(2, 2, 6)
    out, aux = m(x, attn_prev=prev, return_aux=True)
    ref, ref_map = naive_refiner(x, m, prev)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-10)
    torch.testing.assert_close(aux["attn"], ref_map, rtol=1e-5, atol=1e-10)
    assert aux["attn"].shape[1] == (2 if reduction else 2 * r)


def test_shared_paper_form_matches_naive_loops():
    torch.manual_seed(5)
    m = RefinerAttention(24, num_heads=3, share=True).double().eval()
    assert m.qkv.out_features == 24  # values only
    x, prev = torch.randn(2, 5, 24, dtype=torch.float64), softmax_maps(2, 3, 5)
    out, aux = m(x, attn_prev=prev, return_aux=True)
    ref, ref_map = naive_refiner(x, m, prev)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-10)
    torch.testing.assert_close(aux["attn"], ref_map, rtol=1e-5, atol=1e-10)
    assert "carry" not in aux  # the caller's map goes on


@pytest.mark.parametrize("k", [3, 5, 4])
def test_dla_is_attention_over_locally_aggregated_values(k):
    """Refiner §2.3: with a kernel along the key axis only, Σ_j A*_ij v_j = Σ_j A_ij Σ_a w_a v_{j-a+⌊k/2⌋}."""
    torch.manual_seed(k)
    h, n, d = 3, 7, 4
    dla = DistributedLocalAttention(h, expansion=1, kernel_size=k, reduction=False).double()
    w = torch.randn(h, k, dtype=torch.float64)
    centre = (k - 1) // 2  # TF-"same" offset; = ⌊k/2⌋ for odd k
    with torch.no_grad():
        dla.local[0].weight.zero_()
        dla.local[0].weight[:, 0, centre, :] = w  # non-zero only along the key axis
    a, v = softmax_maps(2, h, n, seed=k), torch.randn(2, h, n, d, dtype=torch.float64)
    lhs = dla(a) @ v
    v_pad = torch.nn.functional.pad(v, (0, 0, k, k))  # zero outside the sequence
    local_v = torch.stack(  # Σ_a w_a v_{j-a+centre}, per head
        [sum(w[None, :, ai, None] * v_pad[:, :, k + j - ai + centre] for ai in range(k)) for j in range(n)], 2
    )
    torch.testing.assert_close(lhs, a @ local_v, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5])
def test_same_depthwise_conv_matches_tf_same_loops(k):
    torch.manual_seed(k)
    conv = SameDepthwiseConv2d(3, k).double()
    x = torch.randn(2, 3, 6, 6, dtype=torch.float64)
    y = conv(x)
    assert y.shape == x.shape
    torch.testing.assert_close(y, naive_same_conv(x, conv.weight[:, 0]), rtol=1e-10, atol=1e-12)


def test_even_kernel_pads_the_extra_zero_after():
    conv = SameDepthwiseConv2d(1, 2)
    with torch.no_grad():
        conv.weight.zero_()
        conv.weight[0, 0, 1, 1] = 1.0  # picks in[i + 1, j + 1]: padding 0 before, 1 after
    x = torch.arange(16.0).view(1, 1, 4, 4)
    expected = torch.zeros_like(x)
    expected[..., :3, :3] = x[..., 1:, 1:]
    assert torch.equal(conv(x), expected)


# ----------------------------------------------------------------------------- official extras, structure


def test_official_extras_structure_and_expansion_one_skips_expand():
    dla = DistributedLocalAttention(4, expansion=3, official_extras=True)
    kinds = [type(mod).__name__ for mod in (*dla.expand, *dla.local, *dla.reduce)]
    assert kinds == [
        "HeadMix",
        "BatchNorm2d",
        "ReLU6",
        "SameDepthwiseConv2d",
        "BatchNorm2d",
        "ReLU6",
        "HeadMix",
        "BatchNorm2d",
    ]
    assert DistributedLocalAttention(4, expansion=1, official_extras=True).expand is None
    m = RefinerAttention(32, 4)
    assert m.adapt_bn is None and all(not isinstance(mod, torch.nn.BatchNorm2d) for mod in m.modules())
    assert RefinerAttention(32, 4, official_extras=True).adapt_bn is not None
    assert RefinerAttention(32, 4, adapt_bn=True).adapt_bn is not None


def test_official_extras_identity_shortcut():
    torch.manual_seed(0)
    dla = DistributedLocalAttention(2, official_extras=True).eval()
    with torch.no_grad():
        dla.reduce[1].weight.zero_()
        dla.reduce[1].bias.zero_()  # the refining branch now outputs 0
    a = softmax_maps(1, 2, 5).float()
    torch.testing.assert_close(dla(a), a)


def test_without_refinement_is_plain_attention():
    torch.manual_seed(1)
    att = Attention(32, num_heads=4).eval()
    m = RefinerAttention(32, num_heads=4, refine=False, residual_attention=True).eval()
    m.load_state_dict(att.state_dict())
    x = torch.randn(2, 9, 32)
    out, aux = m(x, return_aux=True)
    torch.testing.assert_close(out, att(x))
    prev = softmax_maps(2, 4, 9).float()
    _, aux_prev = m(x, attn_prev=prev, return_aux=True)
    torch.testing.assert_close(aux_prev["attn"], aux["attn"] + m.scale * prev)  # residual attention


# ----------------------------------------------------------------------------- ablations, gradients


def check_runs_and_trains(m: RefinerAttention, dim: int, heads: int) -> None:
    m.train()
    x, prev = torch.randn(2, 6, dim), softmax_maps(2, heads, 6).float()
    out, aux = m(x, attn_prev=prev, return_aux=True)
    assert out.shape == x.shape and torch.isfinite(out).all()
    assert aux.get("carry", prev) is (prev if m.share else aux["attn"])
    out.square().sum().backward()
    vanishing = zero_by_construction(m)
    scale = max(p.grad.abs().max().item() for p in m.parameters() if p.grad is not None)
    for name, p in m.named_parameters():
        assert p.grad is not None, name
        if name in vanishing:  # zero up to rounding: compared with the largest gradient, not with 0
            assert p.grad.abs().max() <= 1e-4 * scale, name
        else:
            assert p.grad.abs().sum() > 0, name


def zero_by_construction(m: RefinerAttention) -> set[str]:
    """Parameters whose gradient vanishes identically: with the official extras the reduction's BatchNorm
    shift reaches the train-mode ``adapt_bn`` through the identity shortcut as a per-head constant, and
    BatchNorm subtracts every per-channel constant."""
    refiner = m.refiner
    if refiner is None or not refiner.residual or refiner.reduce is None or m.adapt_bn is None or not m.training:
        return set()
    return {"refiner.reduce.1.bias"}


@pytest.mark.parametrize("r", [1, 2, 3, 4, 6])
@pytest.mark.parametrize("dla", [True, False])
@pytest.mark.parametrize("reduction", [True, False])
def test_every_ablation_builds_runs_and_trains(r, dla, reduction):
    torch.manual_seed(r)
    m = RefinerAttention(48, num_heads=2, expansion=r, dla=dla, reduction=reduction, residual_attention=True)
    check_runs_and_trains(m, 48, 2)


@pytest.mark.parametrize("r", [1, 3, 6])
@pytest.mark.parametrize("share", [False, True])
@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_official_extras_and_kernel_sizes_train(r, share, k):
    torch.manual_seed(k)
    m = RefinerAttention(
        24,
        num_heads=2,
        expansion=r,
        kernel_size=k,
        official_extras=True,
        share=share,
        residual_attention=True,
        attn_drop=0.1,
        proj_drop=0.1,
    )
    check_runs_and_trains(m, 24, 2)


def test_build_and_contract():
    m = build("refiner", 32, num_heads=4, expansion=2, kernel_size=5, official_extras=True, share=True)
    assert isinstance(m, RefinerAttention) and m.uses_attn_prev and m.refiner.expansion == 2
    assert m.refiner.local[0].kernel_size == (5, 5)
    x = torch.randn(1, 4, 32)
    assert m(x, attn_prev=softmax_maps(1, 4, 4).float()).shape == x.shape


# ----------------------------------------------------------------------------- dtypes, bad input


@pytest.mark.parametrize("share", [False, True])
@pytest.mark.parametrize("train", [False, True])
def test_bf16_autocast(share, train):
    torch.manual_seed(2)
    m = RefinerAttention(32, num_heads=4, official_extras=True, share=share, residual_attention=True).train(train)
    x, prev = torch.randn(2, 9, 32), softmax_maps(2, 4, 9).float()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, aux = m(x, attn_prev=prev, return_aux=True)
    assert torch.isfinite(out).all() and aux["attn"].dtype == torch.bfloat16
    m.eval()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = m(x, attn_prev=prev).float()
    ref = m(x, attn_prev=prev)
    assert (low - ref).abs().max() <= 0.05 * ref.abs().max()


def test_bad_input_raises():
    m = RefinerAttention(32, num_heads=4)
    with pytest.raises(ValueError, match="expected tokens of shape"):
        m(torch.randn(2, 5, 16))
    with pytest.raises(ValueError, match=r"attn_prev must be .* \(2, 4, 5, 5\)"):
        m(torch.randn(2, 5, 32), attn_prev=torch.rand(2, 4, 6, 6))
    with pytest.raises(ValueError, match="pass attn_prev"):
        RefinerAttention(32, num_heads=4, share=True)(torch.randn(2, 5, 32))
    with pytest.raises(ValueError, match="needs refine=True"):
        RefinerAttention(32, num_heads=4, share=True, refine=False)
    with pytest.raises(ValueError, match=r"attn_prev must be .* \(2, 4, 5, 5\), got \(2, 8, 5, 5\)"):
        RefinerAttention(32, num_heads=4, residual_attention=True)(
            torch.randn(2, 5, 32), attn_prev=torch.rand(2, 8, 5, 5)
        )
    with pytest.raises(ValueError, match="divisible"):
        RefinerAttention(32, num_heads=4, expansion=3, reduction=False)  # 32 % 12
    with pytest.raises(ValueError, match="expansion must be a positive integer"):
        RefinerAttention(32, num_heads=4, expansion=0)
    with pytest.raises(ValueError, match="kernel_size must be a positive integer"):
        DistributedLocalAttention(4, kernel_size=2.5)
    with pytest.raises(ValueError, match="identity shortcut"):
        DistributedLocalAttention(4, expansion=2, reduction=False, official_extras=True)
    with pytest.raises(ValueError, match=r"expected attention maps \(B, H=4, N, N\)"):
        DistributedLocalAttention(4)(torch.rand(2, 3, 5, 5))


def test_released_block_pattern_carries_maps_as_the_official_code():
    """Normal (residual) -> shared -> normal: block 2 adds s·(block 0's map), the shared block passes it on."""
    torch.manual_seed(6)
    normal = RefinerAttention(32, 4, refine=False, residual_attention=True).eval()
    shared = RefinerAttention(32, 4, share=True, official_extras=True).eval()
    x = torch.randn(2, 9, 32)
    _, aux0 = normal(x, return_aux=True)
    _, aux1 = shared(x, attn_prev=aux0["carry"], return_aux=True)
    assert "carry" not in aux1  # the map goes on from the block before
    _, aux2 = normal(x, attn_prev=aux0["carry"], return_aux=True)
    torch.testing.assert_close(aux2["attn"], aux0["attn"] + normal.scale * aux0["carry"])


def test_blocks_without_the_reduction_stack():
    """Table 3 without the reduction: each block hands its rH maps on; the next block (which does not read them)
    takes them, and the model trains."""
    model = vitlab.create_model(
        "refiner_16b", img_size=32, num_classes=3, depth=2, mixer=("refiner", {"expansion": 4, "reduction": False})
    )
    out = model.forward_trace(torch.randn(2, 3, 32, 32), return_aux=True)
    assert [aux["attn"].shape[1] for aux in out["aux"]] == [48, 48]  # 12 heads x 4, no reduction
    model(torch.randn(2, 3, 32, 32)).sum().backward()
