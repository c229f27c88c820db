"""The papers' ablation switches in layers and models (CPVT's PEG forms, BatchNorm blocks, TNT without position
encodings, T2T-ViT's Performer token layer), EANet's public conv module and Twins' PCPVT, against naive float64
forms and the goldens."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import vitlab
from conftest import assert_close_to_golden, load_golden
from vitlab.engine.optim import param_groups
from vitlab.interop import detect_source, load_reference
from vitlab.layers import Block, ExternalAttentionConv, PositionEncodingGenerator, TokenBatchNorm
from vitlab.mixers import Attention, TokenLayout
from vitlab.models import TNT, PyramidCPVT, T2TViT
from vitlab.models.t2t import TokenPerformerAttention

LAYOUT = TokenLayout((4, 5), 1)


def tokens(dim: int = 6, dtype=torch.float64) -> torch.Tensor:
    torch.manual_seed(0)
    return torch.randn(2, 21, dim, dtype=dtype)


def on_grid(x: torch.Tensor, fn) -> torch.Tensor:
    """x + fn(grid of the patch tokens), the class token unchanged (the PEG's form, written out)."""
    b, _, c = x.shape
    grid = x[:, 1:].transpose(1, 2).reshape(b, c, 4, 5)
    return torch.cat([x[:, :1], (grid + fn(grid)).flatten(2).transpose(1, 2)], 1)


def randomise(module: torch.nn.Module) -> None:
    with torch.no_grad():
        for p in module.parameters():
            p.normal_()


# ----------------------------------------------------------------------------- CPVT's PEG forms


def test_separable_peg_stacks_depthwise_and_pointwise_convs():
    peg = PositionEncodingGenerator(6, kind="separable", layers=2).double()
    randomise(peg)
    x = tokens()

    def stack(g):
        for dw, pw in zip(peg.proj[0::2], peg.proj[1::2]):
            g = F.conv2d(g, dw.weight, dw.bias, padding=1, groups=6)
            g = torch.einsum("oi,bihw->bohw", pw.weight[:, :, 0, 0], g) + pw.bias.view(1, -1, 1, 1)
        return g

    torch.testing.assert_close(peg(x, LAYOUT), on_grid(x, stack))
    # the paper's count: d·l·k² + l·d² weights (plus the biases PyTorch adds)
    weights = sum(p.numel() for n, p in peg.named_parameters() if n.endswith("weight"))
    assert weights == 6 * 2 * 9 + 2 * 6 * 6


def test_fc_peg_has_no_locality():
    peg = PositionEncodingGenerator(6, kind="fc", layers=12).double()
    randomise(peg)
    x = tokens()

    def stack(g):
        for layer in peg.proj:
            g = torch.einsum("oi,bihw->bohw", layer.weight[:, :, 0, 0], g) + layer.bias.view(1, -1, 1, 1)
        return g

    torch.testing.assert_close(peg(x, LAYOUT), on_grid(x, stack), rtol=1e-7, atol=1e-6)
    perm = torch.randperm(20) + 1  # token-wise: shuffling the patches shuffles the output the same way
    shuffled = torch.cat([x[:, :1], x[:, perm]], 1)
    torch.testing.assert_close(peg(shuffled, LAYOUT)[:, 1:], peg(x, LAYOUT)[:, perm])


@pytest.mark.parametrize("padding", ["circular", "replicate"])
def test_peg_without_zero_padding(padding):
    peg = PositionEncodingGenerator(6, kernel_size=3, padding=padding).double()
    randomise(peg)
    x = tokens()
    conv = peg.proj

    def naive(g):  # pad by hand (wrap around / repeat the border), then the convolution without padding
        if padding == "circular":
            g = torch.cat([g[..., -1:, :], g, g[..., :1, :]], -2)
            g = torch.cat([g[..., -1:], g, g[..., :1]], -1)
        else:
            g = torch.cat([g[..., :1, :], g, g[..., -1:, :]], -2)
            g = torch.cat([g[..., :1], g, g[..., -1:]], -1)
        return F.conv2d(g, conv.weight, conv.bias, groups=6)

    torch.testing.assert_close(peg(x, LAYOUT), on_grid(x, naive))
    if padding == "circular":  # no border to anchor on: a cyclic shift of the grid shifts the output alike
        grid = x[:, 1:].reshape(2, 4, 5, 6)
        shifted = torch.cat([x[:, :1], grid.roll(1, dims=2).reshape(2, 20, 6)], 1)
        out = peg(x, LAYOUT)[:, 1:].reshape(2, 4, 5, 6).roll(1, dims=2).reshape(2, 20, 6)
        torch.testing.assert_close(peg(shifted, LAYOUT)[:, 1:], out)


def test_frozen_peg_keeps_its_random_weights():
    model = vitlab.create_model("cpvt_peg0_frozen_mini", num_classes=3)
    peg = model.pegs["0"].proj
    before = peg.weight.clone()
    assert not peg.weight.requires_grad and not peg.bias.requires_grad and before.abs().sum() > 0
    trained = {id(p) for g in param_groups(model, 0.05) for p in g["params"]}
    assert id(peg.weight) not in trained
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.1)
    model(torch.randn(2, 3, 32, 32)).sum().backward()
    opt.step()
    assert torch.equal(peg.weight, before)


def test_peg_options_reach_the_model_and_bad_options_are_clear():
    model = vitlab.create_model("cpvt_peg0_sep4_mini")
    assert len(model.pegs["0"].proj) == 8
    with pytest.raises(ValueError, match="kind must be one of"):
        PositionEncodingGenerator(6, kind="dilated")
    with pytest.raises(ValueError, match="odd"):
        PositionEncodingGenerator(6, kernel_size=4)


# ----------------------------------------------------------------------------- BatchNorm blocks (EAMLP)


def test_token_batch_norm_normalises_over_batch_and_tokens():
    torch.manual_seed(1)
    bn = TokenBatchNorm(6).double().train()
    randomise(bn)
    x = tokens()
    flat = x.reshape(-1, 6)
    ref = (x - flat.mean(0)) / torch.sqrt(flat.var(0, unbiased=False) + 1e-5) * bn.weight + bn.bias
    torch.testing.assert_close(bn(x), ref)


@pytest.mark.parametrize("scale", [1.0, 0.5])
def test_block_with_batch_norm(scale):
    torch.manual_seed(2)
    mixer = Attention(6, num_heads=2).double()
    blk = Block(6, mixer, mlp_ratio=2, norm="batch", residual_scale=scale).double().train()
    x = tokens()
    h = x + mixer(blk.norm1(scale * x)) / scale
    ref = h + blk.mlp(blk.norm2(scale * h)) / scale
    torch.testing.assert_close(blk(x, TokenLayout()), ref)
    assert isinstance(blk.norm1, TokenBatchNorm) and isinstance(blk.norm2, TokenBatchNorm)
    model = vitlab.create_model("eamlp_bn_mini")
    assert all(isinstance(b.norm1, TokenBatchNorm) for b in model.blocks)
    assert isinstance(model.norm, torch.nn.LayerNorm)  # Decision E4: the blocks only
    with pytest.raises(ValueError, match="norm must be one of"):
        Block(6, mixer, norm="group")


# ----------------------------------------------------------------------------- TNT without position encodings


@pytest.mark.parametrize("patch_pos, pixel_pos", [(False, True), (True, False), (False, False)])
def test_tnt_without_position_encodings(patch_pos, pixel_pos):
    torch.manual_seed(3)
    kw = dict(
        img_size=16, patch_size=8, outer_dim=16, inner_dim=4, depth=2, outer_heads=2, inner_heads=2, num_classes=5
    )
    full = TNT(**kw).eval()
    ablated = TNT(**kw, patch_pos=patch_pos, pixel_pos=pixel_pos).eval()
    ablated.load_state_dict({k: v for k, v in full.state_dict().items() if k in ablated.state_dict()})
    with torch.no_grad():  # the same as the full model with the removed tables at zero
        if not patch_pos:
            full.pos_embed.zero_()
        if not pixel_pos:
            full.inner_pos.zero_()
        x = torch.randn(2, 3, 16, 16)
        torch.testing.assert_close(ablated(x), full(x))
    removed = (0 if patch_pos else 5 * 16) + (0 if pixel_pos else 4 * 4)
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert count(full) - count(ablated) == removed
    assert ablated.no_weight_decay() <= {n for n, _ in ablated.named_parameters()}
    if not patch_pos:  # nothing ties the model to its grid any more
        assert ablated(torch.randn(1, 3, 24, 24)).shape == (1, 5)


# ----------------------------------------------------------------------------- T2T-ViT's Performer token layer


def test_performer_token_attention_is_favor_plus():
    torch.manual_seed(4)
    m = TokenPerformerAttention(12, 8).double()
    x = torch.randn(2, 9, 12, dtype=torch.float64)
    k, q, v = F.linear(x, m.kqv.weight, m.kqv.bias).chunk(3, -1)
    w = m.w.double()
    assert w.shape == (4, 8) and torch.allclose(w @ w.T, 4.0 * torch.eye(4, dtype=torch.float64), atol=1e-5)

    def phi(u):  # exp(w·u - |u|²/2) / sqrt(m), feature by feature
        return torch.stack([torch.exp((u * w[i]).sum(-1) - (u * u).sum(-1) / 2) for i in range(4)], -1) / 2.0

    qp, kp = phi(q), phi(k)
    y = torch.empty_like(v)
    for t in range(9):
        den = (qp[:, t] * kp.sum(1)).sum(-1, keepdim=True)
        num = sum((qp[:, t] * kp[:, s]).sum(-1, keepdim=True) * v[:, s] for s in range(9))
        y[:, t] = num / (den + 1e-8)
    ref = v + F.linear(y, m.proj.weight, m.proj.bias)
    torch.testing.assert_close(m(x), ref, rtol=1e-6, atol=1e-7)
    assert "w" in m.state_dict() and not any(n == "w" for n, _ in m.named_parameters())
    model = T2TViT(
        img_size=32, embed_dim=16, depth=1, num_heads=2, token_dim=8, token_mixer="performer", mixer="attention"
    )
    assert type(model.tokens_to_token.layers[0].attn) is TokenPerformerAttention


# ----------------------------------------------------------------------------- EANet's module for CNN feature maps


def test_eanet_module_golden_on_the_public_class():
    """EANet ``External_attention``: ReLU(x + BN(conv2(EA(conv1(x))))), loaded through the converter."""
    g = load_golden("ea_single_eanet.npz")
    assert detect_source(g.state()) == "eanet"
    c = g.input("x").shape[1]
    m = ExternalAttentionConv(c, memory_size=g.param("linear_0.weight").shape[0]).eval()
    report = load_reference(m, g.state(), "eanet")
    assert report.ok, str(report)
    with torch.no_grad():
        assert_close_to_golden(m(g.input("x")), g.output("x"))


def test_eanet_module_init_and_input_checks():
    m = ExternalAttentionConv(16)
    assert torch.equal(m.ea.mv.weight, m.ea.mk.weight.T) and m.ea.memory_size == 64
    assert abs(m.conv1.weight.std().item() - math.sqrt(2 / 16)) < 0.1
    assert m(torch.randn(2, 16, 3, 5)).shape == (2, 16, 3, 5)
    with pytest.raises(ValueError, match="feature map"):
        m(torch.randn(2, 8, 3, 5))


# ----------------------------------------------------------------------------- Twins PCPVT (CPVT-v2)


def test_pcpvt_structure_and_sizes():
    model = vitlab.create_model("pcpvt_mini", num_classes=4)
    inter = model.forward_trace(torch.randn(2, 3, 32, 32))
    assert [t.shape[1] for t in inter["tokens"]] == [64, 64, 16, 16]  # 8x8 then 4x4 tokens
    assert inter["features"].shape == (2, 16, 64) and inter["aux"][0]["attn"].shape == (2, 1, 64, 16)
    assert model.no_weight_decay() == {n for n, _ in model.named_parameters() if n.startswith("pegs.")}
    assert model(torch.randn(1, 3, 48, 48)).shape == (1, 4)  # no position table: other sizes run
    assert model(torch.randn(1, 3, 40, 40)).shape == (1, 4)
    with pytest.raises(ValueError, match="divisible by sr_ratio=2"):
        model(torch.randn(1, 3, 36, 36))  # a 9x9 first-stage grid
    with pytest.raises(ValueError, match="multiple of 8"):
        vitlab.create_model("pcpvt_mini", img_size=36)
    with pytest.raises(ValueError, match="one entry per stage"):
        PyramidCPVT(depths=(1, 1), embed_dims=(8,))
