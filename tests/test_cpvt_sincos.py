"""CPVT's comparison of encoding strategies, the rows with a fixed 2-D sin-cos table: the table against its formula,
the table added before every block against a direct block-by-block trace, and the PEG + absolute encoding rows."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import vitlab
from vitlab.experiments.papers import STUDIES
from vitlab.layers import sincos_2d
from vitlab.mixers import TokenLayout
from vitlab.models import VisionTransformer, get_config


def direct_sincos(dim: int, h: int, w: int) -> torch.Tensor:
    """PE[(r, c), ·] = [sin(c ω_i), cos(c ω_i), sin(r ω_i), cos(r ω_i)]_{i < dim/4}, ω_i = 10000^(-i / (dim/4)),
    row-major positions: one scalar at a time."""
    quarter = dim // 4
    rows = []
    for r in range(h):
        for c in range(w):
            omega = [10000.0 ** (-i / quarter) for i in range(quarter)]
            rows.append(
                [math.sin(c * o) for o in omega]
                + [math.cos(c * o) for o in omega]
                + [math.sin(r * o) for o in omega]
                + [math.cos(r * o) for o in omega]
            )
    return torch.tensor(rows, dtype=torch.float32)


@pytest.mark.parametrize(("dim", "grid"), [(8, (2, 3)), (64, (8, 8)), (192, (14, 14))])
def test_the_fixed_table_is_the_2d_sincos_formula(dim, grid):
    torch.testing.assert_close(sincos_2d(dim, grid), direct_sincos(dim, *grid), rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="divisible by 4"):
        sincos_2d(6, grid)


def mini(name: str, **kw) -> VisionTransformer:
    torch.manual_seed(0)
    return vitlab.create_model(name, num_classes=3, **kw).double().eval()


def direct_trace(model: VisionTransformer, x: torch.Tensor, every_block: bool) -> tuple[torch.Tensor, list]:
    """x_0 = [cls | patches + S]; x_{j+1} = Block_j(x_j) (+ [0 | S] before every block j+1 >= 1); logits =
    head(norm(x_L)[:, 0]). Returns the logits and each block's output as the model reports it (with the next
    block's table)."""
    p = model.patch_embed.proj
    patches = F.conv2d(x, p.weight, p.bias, stride=p.stride).flatten(2).transpose(1, 2)
    grid = (x.shape[2] // p.stride[0], x.shape[3] // p.stride[1])
    table = sincos_2d(model.embed_dim, grid).double()
    tokens = torch.cat([model.cls_token.expand(len(x), -1, -1), patches + table], 1)
    layout, outputs = TokenLayout(grid, 1), []
    for j, block in enumerate(model.blocks):
        tokens = block(tokens, layout)
        if every_block and j + 1 < len(model.blocks):
            tokens = torch.cat([tokens[:, :1], tokens[:, 1:] + table], 1)
        outputs.append(tokens)
    return model.head(model.norm(tokens)[:, 0]), outputs


@pytest.mark.parametrize("size", [32, 48])
def test_the_sincos_table_is_added_before_every_block(size):
    model = mini("deit_sincos_every_block_mini")
    assert model.block_sincos == (1, 2, 3) and len(model.block_pos_embed) == 0 and model.pos_embed is None
    x = torch.randn(2, 3, size, size, dtype=torch.float64)
    expected, outputs = direct_trace(model, x, every_block=True)
    torch.testing.assert_close(model(x), expected, rtol=1e-10, atol=1e-10)
    got = model.forward_intermediates(x, intermediates_only=True)
    for ours, theirs in zip(got, outputs, strict=True):  # (B, C, h, w) maps of the patch tokens
        torch.testing.assert_close(ours.flatten(2).transpose(1, 2), theirs[:, 1:], rtol=1e-10, atol=1e-10)
    # once only (deit_sincos_mini, the same weights): the direct trace without the repeats, and another output
    once = mini("deit_sincos_mini")
    once.load_state_dict(model.state_dict())
    torch.testing.assert_close(once(x), direct_trace(once, x, every_block=False)[0], rtol=1e-10, atol=1e-10)
    assert not torch.allclose(once(x), model(x))


def test_the_per_block_sincos_has_no_parameters_and_survives_pruning():
    model = mini("deit_sincos_every_block_mini")
    count = sum(p.numel() for p in model.parameters())
    assert count == sum(p.numel() for p in mini("deit_sincos_mini").parameters())
    x = torch.randn(1, 3, 32, 32, dtype=torch.float64)
    before = model.forward_intermediates(x, indices=[0], intermediates_only=True)[0]
    model.prune_intermediate_layers(indices=[0])  # block 0's output carries block 1's table, as the learned ones
    assert model.block_sincos == (1,)
    assert torch.equal(model.forward_intermediates(x, indices=[0], intermediates_only=True)[0], before)
    with pytest.raises(ValueError, match="'learned' or 'sincos'"):
        VisionTransformer(
            img_size=8, patch_size=4, depth=2, embed_dim=8, num_heads=2, pos_embed="none", pos_embed_every_block=True
        )


@pytest.mark.parametrize(
    ("name", "encoding"),
    [("cpvt_peg0_le_mini", "learned"), ("cpvt_peg0_sincos_mini", "sincos"), ("cpvt_ti_peg0_le", "learned")],
)
def test_peg_plus_an_absolute_encoding(name, encoding):
    with torch.device("meta"):
        model = vitlab.create_model(name)
    assert sorted(model.pegs) == ["0"] and model.pos_embed_kind == encoding
    assert (model.pos_embed is not None) == (encoding == "learned")


def test_the_study_rows_and_their_figures():
    rows = {r.key: r for r in STUDIES.get("cpvt-pe-type").rows}
    assert (rows["peg_le"].small, rows["peg_le"].full, rows["peg_le"].paper["top1"]) == (
        "cpvt_peg0_le_mini",
        "cpvt_ti_peg0_le",
        72.9,
    )
    for key in ("peg_sincos", "sincos_every_block", "learned_every_block"):
        assert rows[key].paper["top1"] is None  # not given
    assert get_config("cpvt_ti_peg0_le").top1 == 72.9 and get_config("deit_tiny_sincos_every_block").top1 is None
    with torch.device("meta"):
        full = vitlab.create_model(rows["sincos_every_block"].full)
    assert full.block_sincos == tuple(range(1, 12))
