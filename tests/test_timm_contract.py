"""timm's model contract, method for method, on every registered model (timm's own test style).

The small ``*_mini`` models run the whole battery with real numbers (forward, backward, intermediates in
each format, features_only, reset_classifier with each pool; TorchScript tracing and ONNX of every one of
them are in test_export.py, torch.compile here in the slow suite); every full-size model gets the
structural checks on the meta device (no memory, no initialisation), and its forward/backward battery on
the meta device in the slow suite.
"""

from __future__ import annotations

import re

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import vitlab
from vitlab import create_model
from vitlab.data import resolve_data_config
from vitlab.engine.optim import WarmupCosine, param_groups_layer_decay
from vitlab.layers.recompute import recomputed
from vitlab.models.base import FeatureGetter, feature_take_indices, layer_ids, pool_tokens
from vitlab.tasks.lm import CausalLM

MINI = vitlab.list_models("*_mini")
# architectures whose "blocks" are stages of their own widths and strides: PCPVT (test_pyramid_features) and the
# CNNs (tests/test_cnn_baselines.py)
STAGED = ("pyramid", "resnet", "regnet", "efficientnet")
# models whose blocks all see one token sequence
PLAIN = [n for n in MINI if vitlab.get_config(n).arch not in STAGED]
FULL = vitlab.list_models(exclude_filters="*_mini")
PYRAMIDS = [n for n in FULL if vitlab.get_config(n).arch in STAGED]


def mini(name: str, **kw) -> torch.nn.Module:
    torch.manual_seed(0)
    return create_model(name, num_classes=5, **kw)


def image(model: torch.nn.Module, batch: int = 2) -> torch.Tensor:
    return torch.randn(batch, *model.pretrained_cfg["input_size"], generator=torch.Generator().manual_seed(1))


# ------------------------------------------------------------------------------------------- the battery
@pytest.mark.parametrize("name", MINI)
def test_forward_backward(name):
    model = mini(name).train()
    x = image(model)
    out = model(x)
    assert out.shape == (2, 5) and torch.isfinite(out).all()
    out.logsumexp(1).mean().backward()
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    missing = [n for n, p in trainable if p.grad is None or not torch.isfinite(p.grad).all()]
    assert not missing, f"parameters without a finite gradient: {missing}"
    # frozen parameters (CPVT's frozen PEG ablation) stay out of autograd
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)


@pytest.mark.parametrize("name", PLAIN)
def test_forward_intermediates_match_the_trace(name):
    model = mini(name).eval()
    x = image(model)
    n, p = len(model.blocks), model.num_prefix
    with torch.no_grad():
        trace = model.forward_trace(x, return_aux=False)
        final, inter = model.forward_intermediates(x)  # NCHW, every block
        nlc = model.forward_intermediates(x, indices=[0, -1], output_fmt="NLC", intermediates_only=True)
        normed = model.forward_intermediates(x, indices=1, norm=True, stop_early=True, intermediates_only=True)
        with_prefix = model.forward_intermediates(x, indices=2, output_fmt="NLC", return_prefix_tokens=True)[1]
        assert torch.equal(final, trace["features"]) and torch.equal(final, model.forward_features(x))
    gh, gw = trace["layout"].grid
    assert len(inter) == n
    for got, tokens in zip(inter, trace["tokens"]):
        assert got.shape == (2, model.num_features, gh, gw)
        torch.testing.assert_close(got.flatten(2).transpose(1, 2), tokens[:, p:], rtol=0, atol=0)
    torch.testing.assert_close(nlc[0], trace["tokens"][0][:, p:], rtol=0, atol=0)
    torch.testing.assert_close(nlc[1], trace["tokens"][-1][:, p:], rtol=0, atol=0)
    torch.testing.assert_close(normed[0], model.norm(trace["tokens"][-1])[:, p:].transpose(1, 2).reshape(2, -1, gh, gw))
    for (patches, prefix), tokens in zip(with_prefix, trace["tokens"][-2:]):
        assert torch.equal(prefix, tokens[:, :p]) and torch.equal(patches, tokens[:, p:])
    with pytest.raises(ValueError, match="output_fmt"):
        model.forward_intermediates(x, output_fmt="NHWC")
    with pytest.raises(ValueError, match="out of range"):
        model.forward_intermediates(x, indices=[n])


@pytest.mark.parametrize("name", PLAIN)
def test_features_only(name):
    model = mini(name).eval()
    depth = len(model.blocks)
    x = image(model)
    with torch.no_grad():
        expected = model.forward_intermediates(x, indices=[1, 2], intermediates_only=True)
    feats = FeatureGetter(model, out_indices=(1, 2)).eval()  # what create_model(features_only=True) returns
    with torch.no_grad():
        out = feats(x)
    assert [tuple(o.shape) for o in out] == [tuple(e.shape) for e in expected]
    for o, e in zip(out, expected):
        torch.testing.assert_close(o, e, rtol=0, atol=0)
    info = feats.feature_info
    assert info.channels() == [model.num_features] * 2 and info.module_name() == ["blocks.1", "blocks.2"]
    assert all(x.shape[-1] // r == o.shape[-1] for r, o in zip(info.reduction(), out))
    assert len(feats.model.blocks) == 3 and isinstance(feats.model.head, torch.nn.Identity)
    default = create_model(name, features_only=True)
    assert isinstance(default, FeatureGetter) and default.out_indices == list(range(depth - 3, depth))


def test_pyramid_features():
    """PCPVT's features are its stages (timm's Twins): each at its own width and stride, equal to the last
    block of the stage in the per-block trace; features_only keeps the stages asked for."""
    model = mini("pcpvt_mini").eval()
    x = image(model)
    with torch.no_grad():
        trace = model.forward_trace(x, return_aux=False)
        final, stages = model.forward_intermediates(x)
        nlc = model.forward_intermediates(x, indices=1, output_fmt="NLC", intermediates_only=True)
    ends = [sum(model.depths[: i + 1]) - 1 for i in range(len(model.depths))]
    info = model.feature_info
    assert torch.equal(final, trace["features"]) and len(stages) == len(info) == len(model.blocks)
    for t, i, f in zip(stages, ends, info):
        n, c = trace["tokens"][i].shape[1:]
        assert t.shape == (2, f["num_chs"], x.shape[-2] // f["reduction"], x.shape[-1] // f["reduction"])
        assert c == f["num_chs"] and n == t.shape[2] * t.shape[3]
        assert torch.equal(t.flatten(2).transpose(1, 2), trace["tokens"][i])
    assert torch.equal(nlc[0], trace["tokens"][ends[-1]])
    feats = FeatureGetter(model, out_indices=(0,)).eval()
    with torch.no_grad():
        (out,) = feats(x)
    assert torch.equal(out, stages[0]) and len(feats.model.blocks) == 1 and len(feats.model.pegs) == 1
    with pytest.raises(ValueError, match="no prefix tokens"):
        model.forward_intermediates(x, return_prefix_tokens=True)


@pytest.mark.parametrize("name", MINI)
def test_reset_classifier_and_pools(name):
    model = mini(name).eval()
    x = image(model)
    with torch.no_grad():
        feats = model.forward_features(x)
        p = model.num_prefix
        naive = {
            "avg": feats[:, p:].mean(1),
            "max": feats[:, p:].max(1).values,
            "avgmax": (feats[:, p:].mean(1) + feats[:, p:].max(1).values) / 2,
        }
        if p:
            naive["token"] = feats[:, 0]
        for pool, pooled in naive.items():
            model.reset_classifier(0, pool)
            torch.testing.assert_close(model.forward_head(feats), pooled)
            model.reset_classifier(7, pool)
            assert model.forward_head(feats).shape == (2, 7)
            torch.testing.assert_close(model.forward_head(feats, pre_logits=True), pooled)
        model.reset_classifier(0, "avg")
        torch.testing.assert_close(model(x), naive["avg"])  # the whole forward pools as forward_head
        model.reset_classifier(0, "")
        assert torch.equal(model(x), feats)  # no pooling, no head: the tokens
        model.reset_classifier(3)
        assert model(x).shape == (2, feats.shape[1], 3) and model.get_classifier().out_features == 3
    with pytest.raises(ValueError, match="global_pool must be one of"):
        model.reset_classifier(3, "mean")
    assert model.model_kwargs == {"num_classes": 3, "global_pool": ""}  # what save_pretrained writes


@pytest.mark.parametrize("name", MINI)
def test_pretrained_cfg_and_names(name):
    model = mini(name)
    cfg = model.pretrained_cfg
    state = model.state_dict()
    classifiers = cfg["classifier"] if isinstance(cfg["classifier"], tuple) else (cfg["classifier"],)
    assert all(f"{c}.weight" in state for c in classifiers)
    assert cfg["input_size"][0] == state[f"{cfg['first_conv']}.weight"].shape[1] // _per_channel(model)
    assert cfg["num_classes"] == 5 and model.default_cfg is cfg
    assert set(model.no_weight_decay()) <= set(dict(model.named_parameters()))
    assert cfg == resolve_data_config(model) | {k: v for k, v in cfg.items() if k not in resolve_data_config(model)}


def _per_channel(model) -> int:
    """Input features of the first layer per image channel (T2T's first layer sees k x k windows)."""
    return model.tokens_to_token.soft_split[0][0] ** 2 if hasattr(model, "tokens_to_token") else 1


@pytest.mark.parametrize("name", ["deit_mini", "tnt_mini", "eamlp_mini"])
@pytest.mark.slow
def test_compiled_matches_eager(name):
    model = mini(name).eval()
    x = image(model)
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(model, backend="aot_eager")(x), model(x))


@pytest.mark.parametrize("name", FULL)
def test_full_size_structure_on_meta(name):
    with torch.device("meta"):
        model = create_model(name)
    cfg, state = model.pretrained_cfg, model.state_dict()
    assert cfg["architecture"] == name and cfg["num_classes"] == 1000
    assert cfg["input_size"] == (3, *model.img_size) == vitlab.get_config(name).input_size
    classifiers = cfg["classifier"] if isinstance(cfg["classifier"], tuple) else (cfg["classifier"],)
    assert all(f"{c}.weight" in state for c in classifiers) and f"{cfg['first_conv']}.weight" in state
    if name in PYRAMIDS:  # one feature per stage, the last stage's grid at the model's reduction
        assert len(model.feature_info) == len(model.depths)
    else:
        assert len(model.feature_info) == len(model.blocks)
        groups = layer_ids(dict(model.named_parameters()), model.group_matcher())
        assert max(groups.values()) == len(model.blocks) + 1  # stem, blocks (the last with the final norm), head
    assert all(g == -(-s // model.reduction) for g, s in zip(model.grid, model.img_size))  # a CNN: any size


@pytest.mark.slow
@pytest.mark.parametrize("name", FULL)
def test_full_size_battery_on_meta(name):
    with torch.device("meta"):
        model = create_model(name)
        x = torch.empty(2, *model.pretrained_cfg["input_size"])
        final, inter = model.forward_intermediates(x, indices=2)
        info = model.feature_info[-2]  # a block's (a pyramid's: a stage's) output before the last one
        assert final.shape[-1] == model.num_features and inter[0].shape[1] == info["num_chs"]
        assert inter[0].shape[2:] == tuple(-(-s // info["reduction"]) for s in model.img_size)  # CNNs: ceil
        model(x).sum().backward()
        assert all(p.grad is not None for p in model.parameters())
        feats = create_model(name, features_only=True)
        assert [o.shape[1] for o in feats(x)] == feats.feature_info.channels()


# ------------------------------------------------------------------------------- gradient checkpointing
def _step(model: torch.nn.Module, x: torch.Tensor, checkpointing: bool) -> tuple[dict, dict, int]:
    model.set_grad_checkpointing(checkpointing)
    calls = []
    hook = model.blocks[0].register_forward_pre_hook(lambda *_: calls.append(1))  # recomputation may stop early
    torch.manual_seed(5)  # dropout / drop-path draws
    out = model(x)
    (out.float().square().mean() if out.dtype.is_floating_point else out).backward()
    hook.remove()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return grads, {n: b.clone() for n, b in model.named_buffers()}, len(calls)


@pytest.mark.parametrize(
    "name, kw",
    [
        ("refiner_vit_mini", dict(stem_channels=(8, 8))),  # BatchNorm in the refiner and the stem; chained maps
        ("deepvit_mini", {}),  # BatchNorm in re-attention
        ("tnt_mini", {}),  # (inner, outer) through each block
        ("eamlp_mini", {}),
        ("cpvt_mini", {}),  # PEG between blocks
    ],
)
def test_grad_checkpointing_changes_nothing_but_memory(name, kw):
    """Gradients, BatchNorm statistics and random draws are those without checkpointing; blocks run twice."""
    results = []
    for ckpt in (False, True):
        torch.manual_seed(0)
        model = create_model(name, num_classes=5, drop_path_rate=0.2, **kw).double().train()
        results.append(_step(model, image(model).double(), ckpt))
    (g0, b0, calls0), (g1, b1, calls1) = results
    assert (calls0, calls1) == (1, 2)  # checkpointing recomputes the block in backward
    assert g0.keys() == g1.keys() and len(g0) == sum(1 for _ in model.parameters())
    for k in g0:
        torch.testing.assert_close(g1[k], g0[k], msg=k)
    for k in b0:
        torch.testing.assert_close(b1[k], b0[k], msg=k)
    counters = [v for k, v in b1.items() if k.endswith("num_batches_tracked")]
    assert all(int(c) == 1 for c in counters)  # each BatchNorm saw the batch once


def test_plain_checkpoint_would_count_batchnorm_twice():
    """Why the recomputation hides BatchNorm buffers: without it the running statistics move twice."""
    bn = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4)).train()
    x = torch.randn(8, 4, requires_grad=True)
    checkpoint(bn, x, use_reentrant=False).sum().backward()
    assert int(bn[1].num_batches_tracked) == 2
    bn[1].reset_running_stats()
    recomputed(bn, bn, x).sum().backward()
    assert int(bn[1].num_batches_tracked) == 1


def test_grad_checkpointing_causal_lm():
    results = []
    for ckpt in (False, True):
        torch.manual_seed(0)
        lm = CausalLM(vocab_size=16, max_len=12, dim=16, depth=2, mixer="aft_simple", dropout=0.1).double().train()
        lm.set_grad_checkpointing(ckpt)
        torch.manual_seed(3)
        lm.loss(torch.randint(0, 16, (2, 12), generator=torch.Generator().manual_seed(0))).backward()
        results.append({n: p.grad.clone() for n, p in lm.named_parameters()})
    for k in results[0]:
        torch.testing.assert_close(results[1][k], results[0][k], msg=k)


def test_no_checkpointing_without_autograd():
    model = mini("deepvit_mini").eval()
    model.set_grad_checkpointing()
    x = image(model)
    with torch.no_grad():
        y = model(x)
    model.set_grad_checkpointing(False)
    with torch.no_grad():
        assert torch.equal(model(x), y)


# ---------------------------------------------------------------------------- layer-wise learning rates
def test_group_matcher_layers():
    model = mini("cpvt_mini")
    layers = layer_ids(dict(model.named_parameters()), model.group_matcher())
    assert layers["patch_embed.proj.weight"] == layers["cls_token"] == 0
    for i in range(4):
        assert layers[f"blocks.{i}.mixer.qkv.weight"] == i + 1
    assert layers["pegs.2.proj.weight"] == layers["blocks.2.norm1.weight"] == 3  # the PEG after block 2
    assert layers["norm.weight"] == 4 and layers["head.weight"] == 5  # timm: the final norm joins the last block
    tnt = mini("tnt_mini")
    tnt_layers = layer_ids(dict(tnt.named_parameters()), tnt.group_matcher())
    assert tnt_layers["proj.fc.weight"] == tnt_layers["inner_pos"] == 0 and tnt_layers["blocks.0.proj.fc.weight"] == 1


def test_layer_decay_learning_rates():
    model = mini("deit_mini")
    groups = param_groups_layer_decay(model, weight_decay=0.05, layer_decay=0.5)
    opt = torch.optim.AdamW(groups, lr=1.0)
    sched = WarmupCosine(opt, lr=1e-3, total_steps=10)
    scale_of = {id(p): g["lr_scale"] for g in groups for p in g["params"]}
    params = dict(model.named_parameters())
    assert scale_of[id(params["head.weight"])] == 1.0 and scale_of[id(params["norm.weight"])] == 0.5
    assert scale_of[id(params["blocks.3.mlp.fc1.weight"])] == 0.5  # the last block learns with the final norm
    assert scale_of[id(params["patch_embed.proj.weight"])] == 0.5**5
    lr_of = {id(p): g["lr"] for g in opt.param_groups for p in g["params"]}
    assert lr_of[id(params["blocks.0.mlp.fc1.weight"])] == pytest.approx(sched.current_lr * 0.5**4)
    decayed = {id(p) for g in groups if g["weight_decay"] > 0 for p in g["params"]}
    assert id(params["pos_embed"]) not in decayed and id(params["blocks.0.mlp.fc1.weight"]) in decayed
    assert sum(len(g["params"]) for g in groups) == len(params)


# ------------------------------------------------------------------------------------------- input size
@pytest.mark.parametrize("name", ["deit_mini", "tnt_mini", "tnt_no_pos_mini", "eamlp_mini", "aft_full_mini"])
def test_set_input_size_matches_a_model_built_there(name):
    model = mini(name).eval()
    reference = mini(name, **({"dynamic_img_size": True} if "dynamic_img_size" in _args(name) else {})).eval()
    reference.load_state_dict(model.state_dict())
    for m in reference.modules():  # AFT-full: resample its position biases to the token count
        if isinstance(getattr(m, "resample", None), bool):
            m.resample = True
    model.set_input_size(48)
    x = torch.randn(2, model.in_chans, 48, 48)
    with torch.no_grad():
        torch.testing.assert_close(model(x), reference(x))
    assert model.pretrained_cfg["input_size"] == (model.in_chans, 48, 48) and model.model_kwargs["img_size"] == 48
    with pytest.raises(ValueError, match="patch size"):
        model.set_input_size(patch_size=7)


def _args(name: str) -> set[str]:
    import inspect

    from vitlab.models.registry import architecture

    return set(inspect.signature(architecture(vitlab.get_config(name).arch)).parameters)


# ---------------------------------------------------------------------------------------------- helpers
def test_list_models_filters():
    assert vitlab.list_models(["deit_mini", "tnt_*"], exclude_filters=["*_s_*", "tnt_*mini"]) == [
        "deit_mini",
        "tnt_b_patch16_224",
        "tnt_ti_patch16_224",
    ]
    assert vitlab.list_models("cpvt_*", exclude_filters=("*_gap*", "cpvt_*_mini")) == [
        "cpvt_b",
        "cpvt_mini",
        "cpvt_s",
        "cpvt_ti",
        "cpvt_ti_peg0",
        "cpvt_ti_peg0_le",
        "cpvt_ti_peg0_sincos",
    ]
    assert vitlab.list_models() == vitlab.list_models("") == sorted(vitlab.list_models())


def test_take_indices_and_pools_follow_timm():
    assert feature_take_indices(12, None) == (list(range(12)), 11)
    assert feature_take_indices(12, 3) == ([9, 10, 11], 11)
    assert feature_take_indices(12, [-1, 2]) == ([11, 2], 11)
    x = torch.randn(2, 5, 3)
    assert torch.equal(pool_tokens(x, "", 1), x) and torch.equal(pool_tokens(x, "token", 1), x[:, 0])
    assert torch.equal(pool_tokens(x, "max", 2), x[:, 2:].amax(1))


def test_resolve_data_config():
    cfg = resolve_data_config(create_model("refiner_vit_mini"))
    assert cfg == {
        "input_size": (3, 32, 32),
        "interpolation": "bilinear",
        "mean": (0.485, 0.456, 0.406),
        "std": (0.229, 0.224, 0.225),
        "crop_pct": 1.0,
        "crop_mode": "center",
    }
    with torch.device("meta"):
        refiner = create_model("refiner_vit_s")
    cfg = resolve_data_config({}, model=refiner)  # timm's calling convention
    assert cfg["crop_pct"] == 0.9 and cfg["mean"] == (0.5, 0.5, 0.5) and cfg["input_size"] == (3, 224, 224)
    assert resolve_data_config({"img_size": 288, "crop_pct": None}, model=refiner)["input_size"] == (3, 288, 288)
    grey = create_model("deit_mini", in_chans=1, img_size=28)
    cfg = resolve_data_config(grey)
    assert cfg["input_size"] == (1, 28, 28) and len(cfg["mean"]) == 1
    assert cfg["mean"][0] == pytest.approx(0.299 * 0.485 + 0.587 * 0.456 + 0.114 * 0.406)

    class Other:  # any object with a pretrained_cfg (a timm model): attributes only, no vitlab model needed
        def __init__(self) -> None:
            self.pretrained_cfg = {"input_size": (3, 64, 64), "mean": (0.5,), "std": (0.5,)}

    cfg = resolve_data_config(Other())
    assert cfg["mean"] == (0.5, 0.5, 0.5) and cfg["crop_pct"] == 0.875 and cfg["interpolation"] == "bicubic"
    with pytest.raises(ValueError, match="mean"):
        resolve_data_config({"mean": (0.1, 0.2)}, model=Other())


def test_overlay_and_unknown_keys():
    model = create_model("deit_mini", pretrained_cfg_overlay={"crop_pct": 0.95, "mean": (0.5, 0.5, 0.5)})
    assert model.pretrained_cfg["crop_pct"] == 0.95 and model.meta["mean"] == (0.5, 0.5, 0.5)
    with pytest.raises(ValueError, match=re.escape("unknown key(s) crop")):
        create_model("deit_mini", pretrained_cfg_overlay={"crop": 0.9})


# ------------------------------------------------------------------------ timm's PretrainedCfg and factory
def test_pretrained_cfg_has_timms_fields():
    from vitlab.models.registry import TIMM_CFG_KEYS

    deit, cpvt = mini("deit_mini"), mini("cpvt_mini")
    for model in (deit, cpvt):
        cfg = model.pretrained_cfg
        assert set(TIMM_CFG_KEYS) <= set(cfg) and cfg["tag"] == model.model_name and cfg["license"] is None
        with torch.no_grad():
            tokens = model.forward_features(image(model))
        assert tokens.shape[1] - model.num_prefix == cfg["pool_size"][0] * cfg["pool_size"][1]
    # a learned table built for one grid: timm must feed its own size; PEG models take any multiple of 4 px
    assert deit.pretrained_cfg["fixed_input_size"] and not cpvt.pretrained_cfg["fixed_input_size"]
    assert not mini("deit_mini", dynamic_img_size=True).pretrained_cfg["fixed_input_size"]
    deit.set_input_size(48)
    assert deit.pretrained_cfg["pool_size"] == (12, 12)


def test_features_only_follows_timms_factory():
    feats = create_model("deit_mini", features_only=True, feature_cls="getter", out_indices=2)
    assert feats.default_cfg is feats.pretrained_cfg and feats.default_cfg["input_size"] == (3, 32, 32)
    assert len(feats(torch.randn(1, 3, 32, 32))) == 2
    with pytest.raises(ValueError, match=r"feature_cls='hook'.*'getter'"):
        create_model("deit_mini", features_only=True, feature_cls="hook")
    with pytest.raises(TypeError, match=r"unknown option.*not_a_model_arg"):  # timm's contract: a TypeError
        create_model("deit_mini", not_a_model_arg=1)


def test_distilled_pre_logits_average_both_tokens():
    model = mini("deit_mini", dist_token=True).eval()
    with torch.no_grad():
        feats = model.forward_features(image(model))
        pre = model.forward_head(feats, pre_logits=True)
        torch.testing.assert_close(pre, (feats[:, 0] + feats[:, 1]) / 2)
        logits = (model.head(feats[:, 0]) + model.head_dist(feats[:, 1])) / 2
        torch.testing.assert_close(model.forward_head(feats), logits)
        model.reset_classifier(0)
        torch.testing.assert_close(model.forward_head(feats), pre)  # no head: the pre-logits


def _cubic(t: float, a: float = -0.5) -> float:
    t = abs(t)
    if t <= 1:
        return (a + 2) * t**3 - (a + 3) * t**2 + 1
    return a * t**3 - 5 * a * t**2 + 8 * a * t - 4 * a if t < 2 else 0.0


def _antialiased_weights(n_in: int, n_out: int) -> torch.Tensor:
    """Naive antialiased bicubic resampling matrix (n_out, n_in): the kernel a = -0.5 widened by the
    downscaling factor, centred on each output pixel's centre, normalised over the input pixels it reaches."""
    scale = n_in / n_out
    support = max(scale, 1.0)
    w = torch.zeros(n_out, n_in, dtype=torch.float64)
    for i in range(n_out):
        centre = (i + 0.5) * scale
        for j in range(n_in):
            w[i, j] = _cubic((j + 0.5 - centre) / support)
        w[i] /= w[i].sum()
    return w


@pytest.mark.parametrize("old, new", [((4, 4), (6, 5)), ((6, 6), (3, 4))])
def test_position_table_resampling_is_antialiased_as_timm(old, new):
    from vitlab.layers import resample_pos_embed

    table = torch.randn(1, 1 + old[0] * old[1], 5, dtype=torch.float64)
    out = resample_pos_embed(table, new, old, num_prefix=1)
    grid = table[0, 1:].reshape(*old, 5)
    naive = torch.einsum(
        "ih,jw,hwc->ijc", _antialiased_weights(old[0], new[0]), _antialiased_weights(old[1], new[1]), grid
    )
    torch.testing.assert_close(out[0, 1:], naive.reshape(-1, 5).to(out.dtype), rtol=1e-5, atol=1e-5)
    assert torch.equal(out[:, :1], table[:, :1])


# ------------------------------------------------------------------------ pretrained weights, other channels
@pytest.fixture
def saved_deit(tmp_path):
    torch.manual_seed(0)
    model = create_model("deit_mini", num_classes=4).eval()
    model.save_pretrained(tmp_path / "deit")
    return model, tmp_path / "deit"


def test_pretrained_weights_for_other_channel_counts(saved_deit):
    model, folder = saved_deit
    x = torch.randn(2, 3, 32, 32)
    grey = create_model("deit_mini", checkpoint_path=folder, in_chans=1).eval()
    w = model.patch_embed.proj.weight
    torch.testing.assert_close(grey.patch_embed.proj.weight, w.sum(1, keepdim=True))
    six = create_model("deit_mini", checkpoint_path=folder, in_chans=6).eval()
    naive = torch.stack([w[:, c % 3] * 3 / 6 for c in range(6)], 1)
    torch.testing.assert_close(six.patch_embed.proj.weight, naive)
    with torch.no_grad():  # what the RGB model computed for (g, g, g) and for x
        torch.testing.assert_close(grey(x[:, :1]), model(x[:, :1].expand(-1, 3, -1, -1)))
        torch.testing.assert_close(six(torch.cat([x, x], 1)), model(x))
    assert grey.pretrained_cfg["input_size"] == (1, 32, 32) and len(grey.pretrained_cfg["std"]) == 1
    assert six.model_kwargs["in_chans"] == 6 and "adapted to 6 channels" in six.meta["weights"]


def test_channel_adaptation_refused_where_more_than_the_first_layer_depends_on_it(tmp_path):
    create_model("t2t_vit_mini").save_pretrained(tmp_path / "t2t")
    with pytest.raises(ValueError, match=r"cannot adapt the weights to 1 input channels: besides .*norm1"):
        create_model("t2t_vit_mini", checkpoint_path=tmp_path / "t2t", in_chans=1)


def test_model_folder_is_timms_hub_layout(saved_deit):
    import json

    from vitlab.models.folder import read_config

    model, folder = saved_deit
    config = json.loads((folder / "config.json").read_text())
    assert config["architecture"] == "vitlab.deit_mini" and config["num_classes"] == 4
    assert config["model_args"] == {"num_classes": 4} and config["num_features"] == model.num_features
    assert "top1" in config["vitlab_cfg"] and "top1" not in config["pretrained_cfg"]
    assert read_config(folder)["pretrained_cfg"] == {**model.pretrained_cfg}
    # a folder of an earlier vitlab: model_kwargs, every entry in pretrained_cfg
    old = {**config, "model_kwargs": config.pop("model_args"), "pretrained_cfg": config.pop("vitlab_cfg")}
    (folder / "config.json").write_text(json.dumps(old))
    assert read_config(folder)["model_kwargs"] == {"num_classes": 4}
