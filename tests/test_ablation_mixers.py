"""The papers' ablation switches in the token mixers, each against a naive float64 form of what the paper (or
docs/semantics.md, where the paper is vague) says it computes; the defaults stay the goldens' functions."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from test_aft import GRID, assert_rel, naive_conv_paper, randomise_conv
from test_external import naive_double_norm
from test_refiner import naive_head_mix, naive_same_conv
from vitlab.mixers import (
    AFTConv,
    Attention,
    DistributedLocalAttention,
    DoubleNormAttention,
    DropAttention,
    ExternalAttention,
    MultiHeadExternalAttention,
    PEGQKAttention,
    RelPos2dAttention,
    SpatialReductionAttention,
    TemperatureAttention,
    TokenLayout,
    build,
)
from vitlab.mixers.refiner import kernel_mask
from vitlab.models import VisionTransformer

LAYOUT = TokenLayout(grid=(3, 4), num_prefix=1)  # N = 13


def naive_attention(q, k, v, s, bias=None):
    """softmax over keys of ``s q kᵀ + bias``, entry by entry (float64), times V: (B, H, N, d)."""
    logits = torch.einsum("bhid,bhjd->bhij", q.double(), k.double()) * s
    if bias is not None:
        logits = logits + bias
    e = torch.exp(logits - logits.amax(-1, keepdim=True))
    return (e / e.sum(-1, keepdim=True)) @ v.double()


def heads(m: Attention, x: torch.Tensor, source: torch.Tensor | None = None):
    """q, k, v (B, H, N, d) of an Attention's fused qkv, float64; q, k from ``source`` when given."""
    c, h = m.dim, m.num_heads
    w, b = m.qkv.weight.double(), m.qkv.bias.double()
    qkv = F.linear(x.double(), w, b)
    if source is not None:
        qkv = torch.cat([F.linear(source.double(), w[: 2 * c], b[: 2 * c]), qkv[..., 2 * c :]], -1)
    return [t.view(x.shape[0], -1, h, c // h).transpose(1, 2) for t in qkv.split(c, -1)]


def out_proj(m, y):
    """``proj(merge_heads(y))`` in float64."""
    b, h, n, d = y.shape
    return F.linear(y.transpose(1, 2).reshape(b, n, h * d), m.proj.weight.double(), m.proj.bias.double())


# ----------------------------------------------------------------------------- Refiner Table 4: kernel constraints


def naive_key_grid_conv(maps, w, grid, prefix):
    """Decision R4's constrained DLA, entry by entry: every query's map row over the patch keys is an image,
    convolved with w (C, k, k), zero outside the image; a prefix key's entry times the centre tap."""
    _, c, n, _ = maps.shape
    (gh, gw), k = grid, w.shape[-1]
    out = torch.zeros_like(maps)
    for ch in range(c):
        out[:, ch, :, :prefix] = w[ch, k // 2, k // 2] * maps[:, ch, :, :prefix]
        for key in range(prefix, n):
            r, col = divmod(key - prefix, gw)
            for a in range(k):
                for bb in range(k):
                    rr, cc = r + a - k // 2, col + bb - k // 2
                    if 0 <= rr < gh and 0 <= cc < gw:
                        out[:, ch, :, key] += w[ch, a, bb] * maps[:, ch, :, prefix + rr * gw + cc]
    return out


@pytest.mark.parametrize("constraint", ["none", "spatial", "rowcol"])
def test_refiner_kernel_constraint_sets_the_kernels_span(constraint):
    torch.manual_seed(0)
    k = 3
    dla = DistributedLocalAttention(2, expansion=2, kernel_size=k, kernel_constraint=constraint).double()
    maps = torch.rand(2, 2, 13, 13, dtype=torch.float64)
    raw = dla.local[0].parametrizations.weight.original if constraint == "rowcol" else dla.local[0].weight
    mask = kernel_mask(k, constraint).double()
    a = naive_head_mix(maps, dla.expand[0].weight[:, :, 0, 0].double())
    w = (raw * mask)[:, 0].detach()
    a = naive_same_conv(a, w) if constraint == "none" else naive_key_grid_conv(a, w, LAYOUT.grid, 1)
    ref = naive_head_mix(a, dla.reduce[0].weight[:, :, 0, 0].double())
    torch.testing.assert_close(dla(maps, layout=LAYOUT), ref, rtol=1e-10, atol=1e-12)
    assert int(mask.sum()) == {"none": k * k, "spatial": k * k, "rowcol": 2 * k - 1}[constraint]
    if constraint == "rowcol":  # the masked taps do not exist for the forward nor for the gradient
        dla(maps, layout=LAYOUT).sum().backward()
        assert (raw.grad[:, 0][:, mask == 0] == 0).all() and raw.grad[:, 0][:, mask == 1].abs().sum() > 0
        with torch.no_grad():
            raw[:, 0][:, mask == 0] += 10.0
        torch.testing.assert_close(dla(maps, layout=LAYOUT), ref, rtol=1e-10, atol=1e-12)
    if constraint != "none":  # the constrained kernels need the grid and an odd size
        with pytest.raises(ValueError, match="image grid"):
            dla(maps)
        with pytest.raises(ValueError, match="odd kernel_size"):
            DistributedLocalAttention(2, kernel_size=4, kernel_constraint=constraint)


def test_refiner_row_column_is_inside_spatial():
    """Decision R4: the cross is the square kernel with its off-axis taps at 0 (same function)."""
    torch.manual_seed(0)
    rowcol = DistributedLocalAttention(2, expansion=2, kernel_constraint="rowcol").double()
    spatial = DistributedLocalAttention(2, expansion=2, kernel_constraint="spatial").double()
    state = {k.replace("parametrizations.weight.original", "weight"): v for k, v in rowcol.state_dict().items()}
    state["local.0.weight"] = state["local.0.weight"] * kernel_mask(3, "rowcol").double()
    spatial.load_state_dict(state)
    maps = torch.rand(2, 2, 13, 13, dtype=torch.float64)
    torch.testing.assert_close(spatial(maps, layout=LAYOUT), rowcol(maps, layout=LAYOUT))


def test_refiner_constraint_inference_fold_and_state_dict():
    torch.manual_seed(1)
    m = build("refiner", 16, num_heads=4, kernel_constraint="rowcol", official_extras=True).eval()
    x = torch.randn(2, 13, 16)
    with torch.enable_grad():
        slow = m(x.requires_grad_(), LAYOUT)  # the module path (autograd on)
    with torch.no_grad():
        fast = m(x, LAYOUT)  # inference: the folded path does not apply to the keys' grid, the same function
    torch.testing.assert_close(fast, slow.detach(), rtol=1e-5, atol=1e-6)
    other = build("refiner", 16, num_heads=4, kernel_constraint="rowcol", official_extras=True).eval()
    other.load_state_dict(m.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(other(x, LAYOUT), fast)
    with pytest.raises(ValueError, match="patch grid"):
        m(x)
    with pytest.raises(ValueError, match="kernel_constraint"):
        build("refiner", 16, num_heads=4, kernel_constraint="diagonal")
    assert "parametrizations" not in "".join(build("refiner", 16, num_heads=4).state_dict())  # default unchanged


# ----------------------------------------------------------------------------- external attention: softmax only


def test_ea_softmax_only_is_double_norm_without_the_l1_step():
    torch.manual_seed(2)
    m = ExternalAttention(12, memory_size=5, norm="softmax").double()
    x = torch.randn(2, 7, 12, dtype=torch.float64)
    out, aux = m(x, return_aux=True)
    logits = x @ m.mk.weight.T
    e = torch.exp(logits - logits.amax(1, keepdim=True))
    alpha = e / e.sum(1, keepdim=True)  # over the tokens, for each slot; no ℓ1 over the slots
    torch.testing.assert_close(aux["memory_attn"], alpha)
    torch.testing.assert_close(out, alpha @ m.mv.weight.T)
    assert not torch.allclose(alpha, naive_double_norm(logits))
    with pytest.raises(ValueError, match="norm"):
        ExternalAttention(12, norm="l2")


def test_multi_head_ea_softmax_only_in_training_and_inference():
    torch.manual_seed(3)
    dim, heads_, s = 12, 3, 4
    m = MultiHeadExternalAttention(dim, num_heads=heads_, coef=2, memory_size=s, norm="softmax").double().eval()
    x = torch.randn(2, 6, dim, dtype=torch.float64)
    t = x @ m.query.weight.T + m.query.bias
    d = dim // heads_
    outs = []
    for h in range(heads_ * 2):
        logits = t[..., h * d : (h + 1) * d] @ m.mk.weight.T + m.mk.bias
        e = torch.exp(logits - logits.amax(1, keepdim=True))
        outs.append((e / e.sum(1, keepdim=True)) @ m.mv.weight.T + m.mv.bias)
    ref = torch.cat(outs, -1) @ m.proj.weight.T + m.proj.bias
    with torch.no_grad():
        torch.testing.assert_close(m(x), ref)  # inference (no autograd)
    torch.testing.assert_close(m(x.requires_grad_()), ref)  # training path


def test_plain_external_in_a_multi_head_model_is_single_head():
    model = VisionTransformer(img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=4, mixer="external")
    assert all(type(b.mixer) is ExternalAttention for b in model.blocks)
    assert model(torch.randn(1, 3, 16, 16)).shape == (1, 1000)
    assert type(build("external", 32, num_heads=4)) is MultiHeadExternalAttention  # explicit: the multi-head one


# ----------------------------------------------------------------------------- AFT Tables 10 and 12


def test_aft_conv_without_reparameterisation_uses_the_raw_kernel():
    torch.manual_seed(4)
    m = AFTConv(24, num_heads=4, kernel_size=3, reparam=False).double()
    with torch.no_grad():
        m.w.normal_(0, 0.7)
    assert m.gamma is None and m.beta is None and m.no_weight_decay() == {"w"}
    assert torch.equal(m.position_bias(), m.w.float())
    x = torch.randn(2, 21, 24, dtype=torch.float64)
    q, k, v = m.qkv(x).split([24, 4, 24], -1)
    y = naive_conv_paper(q, k, v, m.w, GRID.grid, GRID.num_prefix)
    assert_rel(m(x, GRID), F.linear(y, m.proj.weight, m.proj.bias), 1e-6)
    assert sum(p.numel() for p in m.parameters()) == sum(p.numel() for p in AFTConv(24, 4, 3).parameters()) - 8


def test_aft_conv_without_query_drops_the_gate_and_its_projection():
    torch.manual_seed(5)
    m = AFTConv(24, num_heads=4, kernel_size=3, query=False).double()
    randomise_conv(m)
    x = torch.randn(2, 21, 24, dtype=torch.float64)
    k, v = m.qkv(x).split([4, 24], -1)
    y = naive_conv_paper(torch.full_like(v, math.inf), k, v, m.position_bias(), GRID.grid, 1)  # σ(+inf) = 1
    assert_rel(m(x, GRID), F.linear(y, m.proj.weight, m.proj.bias), 1e-6)
    full = AFTConv(24, 4, 3)
    assert sum(p.numel() for p in full.parameters()) - sum(p.numel() for p in m.parameters()) == 24 * 24 + 24
    assert m.extra_flops(2, 21, GRID) == full.extra_flops(2, 21, GRID) - 4 * 2 * 21 * 24


# ----------------------------------------------------------------------------- attention variants


def test_learnable_temperature_divides_each_heads_logits():
    torch.manual_seed(6)
    m = TemperatureAttention(16, num_heads=4).double()
    with torch.no_grad():
        m.log_temperature.copy_(torch.tensor([0.0, 0.5, -0.7, 1.2]))
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    q, k, v = heads(m, x)
    tau = torch.tensor([0.0, 0.5, -0.7, 1.2], dtype=torch.float64).exp().view(1, 4, 1, 1)
    ref = out_proj(m, naive_attention(q / tau, k, v, m.scale))
    torch.testing.assert_close(m(x), ref)
    out, aux = m(x, return_aux=True)
    torch.testing.assert_close(out, ref)  # the explicit path is the same function
    torch.testing.assert_close(aux["attn"].sum(-1), torch.ones(2, 4, 5, dtype=torch.float64))
    assert m.no_weight_decay() == {"log_temperature"}


def test_scheduled_temperature_follows_the_training_steps():
    torch.manual_seed(7)
    m = TemperatureAttention(8, num_heads=2, temperature="scheduled", temperature_end=0.25, temperature_steps=4)
    x = torch.randn(1, 3, 8)
    assert torch.allclose(m.temperature(), torch.ones(2))
    m.train()
    for step in range(1, 7):
        m(x)
        assert int(m.steps_done) == step
        assert torch.allclose(m.temperature(), torch.full((2,), 1.0 - 0.75 * min(step, 4) / 4))
    m.eval()
    m(x)
    assert int(m.steps_done) == 6  # evaluation does not advance the schedule
    assert "steps_done" in m.state_dict()  # resumed runs continue the schedule
    q, k, v = heads(m, x)
    with torch.no_grad():
        torch.testing.assert_close(m(x).double(), out_proj(m, naive_attention(q / 0.25, k, v, m.scale)))


def test_drop_attention_drops_entries_and_renormalises_rows():
    torch.manual_seed(8)
    m = DropAttention(16, num_heads=2, drop_prob=0.3).double().train()
    x = torch.randn(2, 6, 16, dtype=torch.float64)
    torch.manual_seed(123)
    out = m(x)
    torch.manual_seed(123)
    keep = torch.rand(2, 2, 6, 6, dtype=torch.float64) >= 0.3  # the module's one draw
    q, k, v = heads(m, x)
    logits = torch.einsum("bhid,bhjd->bhij", q, k) * m.scale
    a = torch.softmax(logits, -1) * keep
    total = a.sum(-1, keepdim=True)
    a = torch.where(total == 0, torch.softmax(logits, -1), a / total.clamp_min(1e-300))
    torch.testing.assert_close(out, out_proj(m, a @ v))
    plain = Attention(16, num_heads=2).double().eval()
    plain.load_state_dict(m.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(m.eval()(x), plain(x))  # evaluation: plain attention
    with pytest.raises(ValueError, match="drop probability"):
        DropAttention(16, drop_prob=1.0)


def test_double_norm_self_attention():
    torch.manual_seed(9)
    m = DoubleNormAttention(16, num_heads=2).double()
    x = torch.randn(2, 7, 16, dtype=torch.float64)
    q, k, v = heads(m, x)
    logits = torch.einsum("bhid,bhjd->bhij", q, k) * m.scale
    ref = torch.empty_like(logits)
    for j in range(7):  # softmax over the queries i of column j
        col = logits[..., :, j]
        ref[..., :, j] = torch.exp(col - col.amax(-1, keepdim=True)) / torch.exp(col - col.amax(-1, keepdim=True)).sum(
            -1, keepdim=True
        )
    ref = ref / (1e-9 + ref.sum(-1, keepdim=True))  # ℓ1 over the keys
    out, aux = m(x, return_aux=True)
    torch.testing.assert_close(aux["attn"], ref)
    torch.testing.assert_close(out, out_proj(m, ref @ v))


def naive_relative_bias(m: RelPos2dAttention, q, layout):
    """s · q_i · (r^row[clip(Δy)] + r^col[clip(Δx)]) pair by pair; s · q_i · r^prefix where a prefix token is in."""
    b, h, n, _ = q.shape
    p, gw, kmax = layout.num_prefix, layout.grid[1], m.max_distance
    bias = torch.empty(b, h, n, n, dtype=torch.float64)
    for i in range(n):
        for j in range(n):
            if i < p or j < p:
                r = m.rel_prefix.double()
            else:
                (yi, xi), (yj, xj) = divmod(i - p, gw), divmod(j - p, gw)
                dy, dx = max(-kmax, min(kmax, yj - yi)), max(-kmax, min(kmax, xj - xi))
                r = m.rel_row[dy + kmax].double() + m.rel_col[dx + kmax].double()
            bias[:, :, i, j] = (q[:, :, i] * r).sum(-1) * m.scale
    return bias


@pytest.mark.parametrize("max_distance", [1, 5])
def test_relative_position_attention(max_distance):
    torch.manual_seed(10)
    m = RelPos2dAttention(16, num_heads=2, max_distance=max_distance).double()
    with torch.no_grad():
        for t in (m.rel_row, m.rel_col, m.rel_prefix):
            t.normal_()
    x = torch.randn(2, 13, 16, dtype=torch.float64)
    q, k, v = heads(m, x)
    ref = out_proj(m, naive_attention(q, k, v, m.scale, naive_relative_bias(m, q, LAYOUT)))
    torch.testing.assert_close(m(x, LAYOUT), ref)
    out, aux = m(x, LAYOUT, return_aux=True)
    torch.testing.assert_close(out, ref)
    expected = naive_attention(q, k, v, m.scale, naive_relative_bias(m, q, LAYOUT))
    torch.testing.assert_close(aux["attn"] @ v, expected)
    with pytest.raises(ValueError, match="patch grid"):
        m(x)


def test_peg_on_queries_and_keys_only():
    torch.manual_seed(11)
    m = PEGQKAttention(8, num_heads=2).double()
    x = torch.randn(2, 13, 8, dtype=torch.float64)
    prefix, grid = x[:, :1], x[:, 1:].transpose(1, 2).reshape(2, 8, 3, 4)
    conv = F.conv2d(grid, m.peg.weight.double(), m.peg.bias.double(), padding=1, groups=8)
    positioned = torch.cat([prefix, (grid + conv).flatten(2).transpose(1, 2)], 1)
    q, k, v = heads(m, x, source=positioned)
    torch.testing.assert_close(m(x, LAYOUT), out_proj(m, naive_attention(q, k, v, m.scale)))
    with torch.no_grad():  # without the conv it is plain attention (the same qkv, proj)
        m.peg.weight.zero_()
        m.peg.bias.zero_()
    plain = Attention(8, num_heads=2).double()
    plain.load_state_dict({k: t for k, t in m.state_dict().items() if not k.startswith("peg.")})
    torch.testing.assert_close(m(x, LAYOUT), plain(x, LAYOUT))


@pytest.mark.parametrize("sr", [1, 2])
def test_spatial_reduction_attention(sr):
    torch.manual_seed(12)
    m = SpatialReductionAttention(8, num_heads=2, qkv_bias=True, sr_ratio=sr).double()
    layout = TokenLayout((4, 6), 0)
    x = torch.randn(2, 24, 8, dtype=torch.float64)
    kv_in = x
    if sr > 1:
        grid = x.transpose(1, 2).reshape(2, 8, 4, 6)
        red = F.conv2d(grid, m.sr.weight, m.sr.bias, stride=sr).flatten(2).transpose(1, 2)
        kv_in = F.layer_norm(red, (8,), m.norm.weight, m.norm.bias, 1e-5)
    q = F.linear(x, m.q.weight, m.q.bias).view(2, -1, 2, 4).transpose(1, 2)
    k, v = (t.view(2, -1, 2, 4).transpose(1, 2) for t in F.linear(kv_in, m.kv.weight, m.kv.bias).chunk(2, -1))
    assert k.shape[2] == 24 // sr**2
    ref = out_proj(m, naive_attention(q, k, v, m.scale))
    torch.testing.assert_close(m(x, layout), ref)
    torch.testing.assert_close(m(x, layout, return_aux=True)[0], ref)
    if sr > 1:
        with pytest.raises(ValueError, match="divisible by sr_ratio"):
            m(torch.randn(1, 15, 8, dtype=torch.float64), TokenLayout((3, 5), 0))
