"""Model zoo: registry, parameter counts, the model API on every registered model, goldens of the ViT family."""

from __future__ import annotations

import io

import pytest
import torch

import vitlab
from conftest import assert_close_to_golden, load_golden
from vitlab.interop import rename_keys
from vitlab.layers import PositionEncodingGenerator
from vitlab.mixers import TokenLayout
from vitlab.models import VisionTransformer, get_config

ALL = vitlab.list_models()
MINI = vitlab.list_models("*_mini")


def n_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# ----------------------------------------------------------------------------------------------- registry
def test_registry_lists_every_family():
    assert sorted(ALL) == ALL
    for family in ("deit", "vit_16b", "deepvit", "refiner_vit", "cpvt", "aft_full", "aft_conv"):
        assert any(n.startswith(family) for n in ALL), family
    assert vitlab.list_models("cpvt_*") == [n for n in ALL if n.startswith("cpvt_")]


def test_unknown_model_names_closest():
    with pytest.raises(ValueError, match="deit_small_patch16_224"):
        vitlab.create_model("deit_smal_patch16_224")


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(embed_dim=65), "divisible by num_heads"),
        (dict(img_size=30), "not divisible by the patch size"),
        (dict(no_such_option=1), "unknown option"),
    ],
)
def test_impossible_overrides_are_clear_errors(overrides, match):
    with pytest.raises(ValueError, match=match):
        vitlab.create_model("deit_mini", **overrides)


@pytest.mark.parametrize("name", [n for n in ALL if get_config(n).params_m])
def test_parameter_count_matches_spec(name):
    """Every full-size config within 1 % of its target count, docs/models.md (meta device: no memory, no init cost)."""
    with torch.device("meta"):
        model = vitlab.create_model(name)
    target = get_config(name).params_m * 1e6
    assert abs(n_params(model) - target) <= 0.01 * target, (n_params(model) / 1e6, target / 1e6)


# -------------------------------------------------------------------------------------- model API, small
def small_input(name: str, batch: int = 2) -> tuple[torch.nn.Module, torch.Tensor]:
    """The mini configs at their own size; full configs at the smallest sensible input (2x2 patch grid; a CNN's
    last map 2x2, so that BatchNorm sees more than one value per channel in training at batch 1)."""
    cfg = get_config(name)
    if name.endswith("_mini"):
        model = vitlab.create_model(name, num_classes=5)
        size = cfg.input_size[1]
    else:
        size = 64 if cfg.arch in ("resnet", "regnet", "efficientnet") else 32
        model = vitlab.create_model(name, num_classes=5, img_size=size)
    return model, torch.randn(batch, 3, size, size)


@pytest.mark.parametrize("name", MINI)
def test_mini_forward_backward_every_parameter(name):
    torch.manual_seed(0)
    model, x = small_input(name)
    model.train()
    out = model(x)
    assert out.shape == (2, 5) and torch.isfinite(out).all()
    out.square().mean().backward()
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    assert not [n for n, p in params if p.grad is None], "parameters outside the graph"
    # some gradients are zero by design at init (AFT-conv's kernel while its gain gamma = 0): take one step
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    model.zero_grad()
    model(x).square().mean().backward()
    # re-attention's head-mix bias feeds a batch-statistics BatchNorm, whose mean subtraction cancels it: its
    # gradient is exactly 0 in training (the fused head mix + BatchNorm computes it so; autograd gave rounding)
    missing = [n for n, p in params if not p.grad.any() and not n.endswith("reatten_matrix.bias")]
    assert not missing, f"no gradient after one step: {missing}"


@pytest.mark.parametrize("name", MINI)
def test_mini_api(name, tmp_path):
    torch.manual_seed(0)
    model, x = small_input(name)
    model.eval()
    with torch.no_grad():
        a, b = model(x), model(x)
    assert torch.equal(a, b), "eval must be deterministic"
    feats = model.forward_features(x)
    assert feats.shape[0] == 2 and feats.shape[-1] == model.num_features
    assert model.forward_head(feats, pre_logits=True).shape == (2, model.num_features)
    assert torch.allclose(model.forward_head(feats), a, atol=1e-6)
    # state_dict round trip through a file
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    buf.seek(0)
    other, _ = small_input(name)
    other.load_state_dict(torch.load(buf, weights_only=True))
    other.eval()
    with torch.no_grad():
        assert torch.equal(other(x), a)
    model.reset_classifier(7)
    with torch.no_grad():
        assert model(x).shape == (2, 7)
    assert model.no_weight_decay() <= {n for n, _ in model.named_parameters()}


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in ALL if not n.endswith("_mini")])
def test_full_configs_run_at_small_input(name):
    """Every full-size configuration builds and runs forward + backward (at a 2x2 patch grid)."""
    torch.manual_seed(0)
    model, x = small_input(name, batch=1)
    out = model(x)
    assert out.shape == (1, 5) and torch.isfinite(out).all()
    out.sum().backward()


def test_intermediates_explicit_path_matches_sdpa():
    torch.manual_seed(0)
    model, x = small_input("deit_mini")
    model.eval()
    with torch.no_grad():
        fast = model.forward_features(x)
        inter = model.forward_trace(x)
    assert torch.allclose(inter["features"], fast, atol=1e-5)
    assert len(inter["tokens"]) == len(model.blocks)
    attn = inter["aux"][0]["attn"]
    assert attn.shape == (2, 2, 65, 65)
    assert torch.allclose(attn.sum(-1), torch.ones(()), atol=1e-5)


# ---------------------------------------------------------------------------------- variable resolution
def test_learned_table_needs_explicit_resampling():
    model = vitlab.create_model("deit_mini", num_classes=3)
    with pytest.raises(ValueError, match="dynamic_img_size"):
        model(torch.randn(1, 3, 48, 48))
    dyn = vitlab.create_model("deit_mini", num_classes=3, dynamic_img_size=True)
    assert dyn(torch.randn(1, 3, 48, 48)).shape == (1, 3)


@pytest.mark.parametrize("name", ["cpvt_mini", "cpvt_gap_mini", "aft_conv_mini"])
def test_position_free_models_run_at_any_size(name):
    model = vitlab.create_model(name, num_classes=3).eval()
    for size in (16, 32, 48, 28):
        assert model(torch.randn(1, 3, size, size)).shape == (1, 3)


def test_distilled_heads():
    model = vitlab.create_model("deit_tiny_distilled_patch16_224", img_size=32, num_classes=4)
    x = torch.randn(2, 3, 32, 32)
    model.distilled_training = True
    model.train()
    cls, dist = model(x)
    assert cls.shape == dist.shape == (2, 4) and not torch.equal(cls, dist)
    model.eval()
    with torch.no_grad():
        feats = model.forward_features(x)
        expected = (model.head(feats[:, 0]) + model.head_dist(feats[:, 1])) / 2
        assert torch.allclose(model(x), expected, atol=1e-6)


# -------------------------------------------------------------------------------------------- goldens
def test_peg_golden():
    g = load_golden("cpvt_peg.npz")
    peg = PositionEncodingGenerator(32)
    peg.load_state_dict(rename_keys(g.state(), "twins_peg"))
    assert_close_to_golden(peg(g.input("x"), TokenLayout((4, 4), 0)), g.output("x"))
    # a class token in front is skipped by the conv and comes back unchanged
    cls = torch.randn(2, 1, 32)
    out = peg(torch.cat([cls, g.input("x")], 1), TokenLayout((4, 4), 1))
    assert torch.equal(out[:, :1], cls)
    assert_close_to_golden(out[:, 1:], g.output("x"))


@pytest.mark.parametrize("file, cls_token", [("cpvt_deit_cls_model.npz", True), ("cpvt_deit_gap_model.npz", False)])
def test_cpvt_model_golden(file, cls_token):
    g = load_golden(file)
    model = VisionTransformer(
        img_size=32,
        patch_size=8,
        num_classes=10,
        embed_dim=32,
        depth=3,
        num_heads=4,
        mlp_ratio=4,
        pos_embed="none",
        peg_at=(0,),
        class_token=cls_token,
        global_pool="token" if cls_token else "avg",
    ).eval()
    model.load_state_dict(rename_keys(g.state(), "cpvt"))
    with torch.no_grad():
        assert_close_to_golden(model(g.input("image")), g.output("logits"))
        assert_close_to_golden(model.forward_features(g.input("image")), g.output("features"))


def test_deepvit_model_golden():
    g = load_golden("deepvit_model.npz")
    re_attn = ("reattention", dict(transform_scale=True))
    model = VisionTransformer(
        img_size=32,
        patch_size=8,
        num_classes=10,
        embed_dim=32,
        depth=4,
        num_heads=4,
        mlp_ratio=3,
        residual_scale=0.5,
        mixer=["attention", "attention", re_attn, re_attn],
    ).eval()
    model.load_state_dict(rename_keys(g.state(), "deepvit"))
    with torch.no_grad():
        assert_close_to_golden(model(g.input("image")), g.output("logits"))
        feats = model.forward_head(model.forward_features(g.input("image")), pre_logits=True)
        assert_close_to_golden(feats, g.output("features"))


def test_refiner_model_golden():
    """Official Refiner_ViT: block 0 refines its own map, blocks 1/3 share, block 2 adds the carried map."""
    g = load_golden("refiner_model.npz")
    normal = dict(refine=False, residual_attention=True)
    mixers = [
        ("refiner", dict(refine=True, official_extras=True, residual_attention=True, expansion=3)),
        ("refiner", dict(share=True, official_extras=True)),
        ("refiner", normal),
        ("refiner", dict(share=True, official_extras=True)),
    ]
    model = VisionTransformer(
        img_size=32,
        patch_size=8,
        num_classes=10,
        embed_dim=32,
        depth=4,
        num_heads=4,
        mlp_ratio=3,
        residual_scale=0.5,
        ls_init=(None, 1e-5),
        aux_head=True,
        mixer=mixers,
    ).eval()
    model.load_state_dict(rename_keys(g.state(), "refiner"))
    with torch.no_grad():
        assert_close_to_golden(model(g.input("image")), g.output("logits"))
        assert_close_to_golden(model.forward_features(g.input("image")), g.output("features"))
