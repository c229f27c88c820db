"""The convolutional baselines (models/convnet.py, resnet.py, regnet.py, efficientnet.py; rows in models/zoo/cnn.py):
the reference implementations' exact sizes, the dilated ResNet, the stage pyramid of ``features_only``, the
reference names, the mini rows training, and the tools (``vitlab models``, ``analyze``, teachers) taking them.

Full-size models are built on the meta device only (no memory, no initialisation).
"""

from __future__ import annotations

import json

import pytest
import torch

import vitlab
from vitlab import cli as vitlab_cli
from vitlab.analysis import analyze
from vitlab.common.distributed import blocks_of
from vitlab.models.base import FeatureGetter, layer_ids
from vitlab.models.efficientnet import round_filters
from vitlab.models.regnet import regnet_stages
from vitlab.models.resnet import ResNet, resnet50

MINIS = ["resnet_mini", "regnety_mini", "efficientnet_mini"]
# the reference implementations' parameter counts at 1000 classes (torchvision's ResNets; pycls / timm's RegNetY;
# the TensorFlow reference's EfficientNet, timm's efficientnet_b*), and the figures the papers print
REFERENCE = {
    "resnet50": (25_557_032, 25.6),  # AFT Table 7, DeiT, TNT: 25.6M (He et al. Table 1 counts FLOPs only)
    "resnet101": (44_549_160, 44.5),
    "resnet152": (60_192_808, 60.2),  # TNT Table 4
    "regnety_040": (20_646_656, 20.6),  # RegNet paper / pycls model zoo
    "regnety_080": (39_180_068, 39.2),
    "regnety_160": (83_590_140, 83.6),  # DeiT's teacher, TNT Table 4
    "efficientnet_b0": (5_288_548, 5.3),  # EfficientNet Table 2
    "efficientnet_b1": (7_794_184, 7.8),
    "efficientnet_b2": (9_109_994, 9.2),  # the paper's 9.2M is not the reference code's 9.11M
    "efficientnet_b3": (12_233_232, 12.0),  # the paper prints 12M / 19M
    "efficientnet_b4": (19_341_616, 19.0),
}


def n_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def meta(name: str, **kw) -> torch.nn.Module:
    with torch.device("meta"):
        return vitlab.create_model(name, **kw)


def mini(name: str, **kw) -> torch.nn.Module:
    torch.manual_seed(0)
    return vitlab.create_model(name, num_classes=5, **kw)


# ------------------------------------------------------------------------------------------------ sizes
@pytest.mark.parametrize("name", list(REFERENCE))
def test_parameter_counts_are_the_reference_implementations(name):
    exact, paper = REFERENCE[name]
    model = meta(name)
    assert n_params(model) == exact
    unit = {"efficientnet_b3": 1.0, "efficientnet_b4": 1.0, "efficientnet_b2": 0.2}.get(name, 0.1)
    assert abs(exact / 1e6 - paper) <= unit / 2 + 1e-9  # the paper's figure is the count rounded
    assert vitlab.get_config(name).params_m == pytest.approx(exact / 1e6, abs=5e-4)


def test_regnet_generator_gives_the_papers_stages():
    """Widths from the linear-quantised generator, rounded to the group width (pycls' adjust), as timm builds."""
    assert regnet_stages(96, 31.41, 2.24, 22, 64) == [(128, 2, 64), (192, 6, 64), (512, 12, 64), (1088, 2, 64)]
    assert regnet_stages(192, 76.82, 2.19, 17, 56) == [(168, 2, 56), (448, 4, 56), (896, 10, 56), (2016, 1, 56)]
    assert regnet_stages(200, 106.23, 2.48, 18, 112) == [(224, 2, 112), (448, 4, 112), (1232, 11, 112), (3024, 1, 112)]
    model = meta("regnety_160")
    assert model.stage_channels == [224, 448, 1232, 3024] and model.depths == (2, 4, 11, 1)
    assert model.s3.b2.conv2.conv.groups == 1232 // 112 and model.s1.b1.se.fc1.out_channels == round(32 * 0.25)
    with pytest.raises(ValueError, match="4"):
        vitlab.models.regnet.RegNet(w0=16, wa=0.0, wm=2.0, depth=3, group_width=8)  # one stage only


def test_efficientnet_compound_scaling():
    assert [round_filters(32, w) for w in (1.0, 1.1, 1.2, 1.4)] == [32, 32, 40, 48]  # the stems
    assert [round_filters(1280, w) for w in (1.0, 1.1, 1.2, 1.4)] == [1280, 1408, 1536, 1792]  # the heads
    b3, b4 = meta("efficientnet_b3"), meta("efficientnet_b4")
    assert b3.stage_channels == [24, 32, 48, 96, 136, 232, 384] and b3.depths == (2, 3, 3, 5, 5, 6, 2)
    assert b4.stage_channels == [24, 32, 56, 112, 160, 272, 448] and b4.depths == (2, 4, 4, 6, 6, 8, 2)
    assert b4.pretrained_cfg["input_size"] == (3, 380, 380) and b4.pretrained_cfg["pool_size"] == (12, 12)
    assert b4.drop_rate == 0.4 and b4.blocks[0][0].se.conv_reduce.out_channels == 48 // 4
    # drop connect grows as 0.2 i / n over the n blocks (the last one's rate below 0.2)
    b0 = meta("efficientnet_b0")
    rates = [getattr(b.drop_path, "p", 0.0) for stage in b0.blocks for b in stage]
    assert rates[0] == 0.0 and rates[-1] == 0.0  # no shortcut: no drop connect (stage 7's block widens)
    assert max(rates) == pytest.approx(0.2 * 14 / 16)


# ----------------------------------------------------------------------------------------- the ResNets
def test_resnet50_has_torchvisions_names_and_shapes():
    state = meta("resnet50").state_dict()
    expected = {"conv1.weight", *(f"bn1.{b}" for b in ("weight", "bias", "running_mean", "running_var"))}
    for i, blocks in enumerate((3, 4, 6, 3), 1):
        for j in range(blocks):
            for k in (1, 2, 3):
                expected |= {f"layer{i}.{j}.conv{k}.weight", f"layer{i}.{j}.bn{k}.weight", f"layer{i}.{j}.bn{k}.bias"}
                expected |= {f"layer{i}.{j}.bn{k}.running_mean", f"layer{i}.{j}.bn{k}.running_var"}
        expected |= {f"layer{i}.0.downsample.0.weight", f"layer{i}.0.downsample.1.weight"}
        expected |= {f"layer{i}.0.downsample.1.bias", f"layer{i}.0.downsample.1.running_mean"}
        expected |= {f"layer{i}.0.downsample.1.running_var"}
    expected |= {"fc.weight", "fc.bias"}
    assert {k for k in state if not k.endswith("num_batches_tracked")} == expected  # torchvision's resnet50
    shapes = {"conv1.weight": (64, 3, 7, 7), "layer1.0.downsample.0.weight": (256, 64, 1, 1),
              "layer2.0.conv2.weight": (128, 128, 3, 3), "layer4.2.conv3.weight": (2048, 512, 1, 1),
              "fc.weight": (1000, 2048)}  # fmt: skip
    assert {k: tuple(state[k].shape) for k in shapes} == shapes
    assert meta("resnet50").layer2[0].conv2.stride == (2, 2)  # "v1.5": the stride on the 3x3


def test_old_names_still_build_the_resnet50():
    with torch.device("meta"):
        model = resnet50(num_classes=7, in_chans=1)
    assert isinstance(model, ResNet) and n_params(model) == n_params(meta("resnet50", num_classes=7, in_chans=1))
    with pytest.raises(ValueError, match="num_classes"):
        resnet50(num_classes=0)


@pytest.mark.parametrize("output_stride, strides", [(32, [4, 8, 16, 32]), (16, [4, 8, 16, 16]), (8, [4, 8, 8, 8])])
def test_dilated_resnet_keeps_the_parameters_and_the_resolution(output_stride, strides):
    model = meta("resnet50", output_stride=output_stride)
    assert n_params(model) == REFERENCE["resnet50"][0]
    assert model.feature_info.reduction() == strides and model.reduction == strides[-1]
    with torch.device("meta"):
        maps = model.forward_intermediates(torch.empty(2, 3, 224, 224), intermediates_only=True)
    assert [tuple(m.shape) for m in maps] == [
        (2, c, 224 // s, 224 // s) for c, s in zip((256, 512, 1024, 2048), strides)
    ]
    if output_stride == 8:  # DeepLab: stages 3 and 4 at stride 1, dilation 2 and 4 (the first block: the previous)
        assert all(b.conv2.stride == (1, 1) for b in [*model.layer3, *model.layer4])
        assert [b.conv2.dilation[0] for b in model.layer3] == [1, 2, 2, 2, 2, 2]
        assert [b.conv2.dilation[0] for b in model.layer4] == [2, 4, 4]
        assert model.layer3[0].downsample[0].stride == (1, 1)
    assert vitlab.get_config("resnet50_d8").kwargs["output_stride"] == 8
    with pytest.raises(ValueError, match="output_stride"):
        ResNet(output_stride=4)


def test_dilated_resnet_runs_at_stride_8():
    torch.manual_seed(0)
    model = ResNet((1, 1, 2, 2), (4, 4, 4, 4), stem_width=8, output_stride=8, num_classes=3).eval()
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        maps = model.forward_intermediates(x, intermediates_only=True)
        assert [m.shape[-1] for m in maps] == [16, 8, 8, 8] and model(x).shape == (2, 3)


# ---------------------------------------------------------------------------------- the stage pyramid
def test_features_only_is_the_c2_c5_pyramid():
    """What the segmentation decoder and the detection backbone read: build_model(..., features_only=True)."""
    with torch.device("meta"):
        feats = vitlab.models.build_model("resnet50", features_only=True, out_indices=(0, 1, 2, 3), output_stride=8)
        out = feats.eval()(torch.empty(1, 3, 64, 64))
    assert isinstance(feats, FeatureGetter)
    assert feats.feature_info.channels() == [256, 512, 1024, 2048] and feats.feature_info.reduction() == [4, 8, 8, 8]
    assert feats.feature_info.module_name() == ["layer1", "layer2", "layer3", "layer4"]
    assert isinstance(feats.model.fc, torch.nn.Identity)
    assert [tuple(o.shape) for o in out] == [(1, 256, 16, 16), (1, 512, 8, 8), (1, 1024, 8, 8), (1, 2048, 8, 8)]
    default = meta("regnety_160", features_only=True)  # timm's default: the last three
    assert default.out_indices == [1, 2, 3] and default.feature_info.module_name() == ["s2", "s3", "s4"]
    eff = meta("efficientnet_b0", features_only=True, out_indices=(1, 2, 4, 6))
    assert eff.feature_info.reduction() == [4, 8, 16, 32] and eff.feature_info.channels() == [24, 40, 112, 320]


@pytest.mark.parametrize("name", MINIS)
def test_stages_are_the_blocks(name):
    """Each stage's map equals the last block of the stage in the per-block trace; pruning keeps the stages asked
    for and drops the layers after them; FSDP's units are the residual blocks, each called on its own."""
    model = mini(name).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        final, stages = model.forward_intermediates(x)
        trace = model.forward_trace(x)
        nlc = model.forward_intermediates(x, indices=1, output_fmt="NLC", intermediates_only=True)
        early = model.forward_intermediates(x, indices=[0], stop_early=True, intermediates_only=True)
        assert torch.equal(final, model.forward_features(x)) and torch.equal(final, trace["features"])
    ends = [sum(model.depths[: i + 1]) - 1 for i in range(len(model.depths))]
    assert len(stages) == len(model.feature_info) == len(model.blocks) == len(ends)
    assert len(trace["tokens"]) == sum(model.depths) and all(a == {} for a in trace["aux"])
    for t, i, f in zip(stages, ends, model.feature_info):
        assert t.shape == (2, f["num_chs"], -(-32 // f["reduction"]), -(-32 // f["reduction"]))
        assert torch.equal(t.flatten(2).transpose(1, 2), trace["tokens"][i])
    assert torch.equal(nlc[0], trace["tokens"][-1]) and torch.equal(early[0], stages[0])
    assert trace["layout"].grid == tuple(model.grid) and trace["layout"].num_prefix == 0
    assert len(blocks_of(model)) == sum(model.depths)
    feats = FeatureGetter(model, out_indices=(0, 1)).eval()
    with torch.no_grad():
        out = feats(x)
    assert [torch.equal(o, s) for o, s in zip(out, stages[:2])] == [True, True]
    assert len(feats.model.blocks) == 2 and not any(k.startswith(("fc", "head.fc", "classifier", "conv_head"))
                                                     for k in feats.model.state_dict())  # fmt: skip
    with pytest.raises(ValueError, match="prefix tokens"):
        model.forward_intermediates(x, return_prefix_tokens=True)


# ---------------------------------------------------------------------------------------- the contract
@pytest.mark.parametrize("name", MINIS)
def test_minis_train_on_mnist_sized_images(name):
    torch.manual_seed(0)
    model = vitlab.create_model(name, num_classes=10, in_chans=1, img_size=28).train()
    x, y = torch.randn(4, 1, 28, 28), torch.randint(0, 10, (4,))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(3):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    assert model.pretrained_cfg["input_size"] == (1, 28, 28) and model.pretrained_cfg["num_classes"] == 10


@pytest.mark.parametrize("name, first, classifier", [("resnet_mini", "conv1", "fc"), ("regnety_mini", "stem.conv",
                         "head.fc"), ("efficientnet_mini", "conv_stem", "classifier")])  # fmt: skip
def test_heads_pools_and_groups(name, first, classifier):
    model = mini(name).eval()
    cfg = model.pretrained_cfg
    assert cfg["first_conv"] == first and cfg["classifier"] == classifier and not model.no_weight_decay()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        tokens = model.forward_features(x)  # (B, H·W, C), as every vitlab classifier
        assert tokens.shape == (2, model.grid[0] * model.grid[1], model.num_features)
        model.reset_classifier(0, "max")
        assert torch.equal(model(x), tokens.amax(1))
        model.reset_classifier(3, "")
        assert model(x).shape == (2, tokens.shape[1], 3) and model.get_classifier().out_features == 3
    layers = layer_ids(dict(model.named_parameters()), model.group_matcher())
    assert layers[f"{first}.weight"] == 0 and layers[f"{classifier}.weight"] == max(layers.values())
    assert max(layers.values()) == sum(model.depths) + 1  # stem, each residual block, head
    coarse = layer_ids(dict(model.named_parameters()), model.group_matcher(coarse=True))
    assert max(coarse.values()) == len(model.depths) + 1  # stem, each stage, head
    if name == "efficientnet_mini":  # the 1x1 head convolution learns with the last block
        assert layers["conv_head.weight"] == layers["blocks.6.0.conv_pwl.weight"]


def test_grad_checkpointing_changes_nothing_but_memory():
    results = []
    for ckpt in (False, True):
        torch.manual_seed(0)
        model = vitlab.create_model("resnet_mini", num_classes=5, drop_path_rate=0.2).double().train()
        model.set_grad_checkpointing(ckpt)
        torch.manual_seed(5)
        model(torch.randn(2, 3, 32, 32, dtype=torch.float64)).square().mean().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        results.append((grads, {n: b.clone() for n, b in model.named_buffers()}))
    (g0, b0), (g1, b1) = results
    for k in g0:
        torch.testing.assert_close(g1[k], g0[k], msg=k)
    for k in b0:
        torch.testing.assert_close(b1[k], b0[k], msg=k)


def test_any_input_size_and_set_input_size():
    model = mini("resnet_mini").eval()
    for size in (24, 40):
        with torch.no_grad():
            assert model(torch.randn(1, 3, size, size)).shape == (1, 5)
    model.set_input_size(40)
    assert model.pretrained_cfg["input_size"] == (3, 40, 40) and model.pretrained_cfg["pool_size"] == (5, 5)
    assert model.model_kwargs["img_size"] == 40
    with pytest.raises(ValueError, match="no patch size"):
        model.set_input_size(patch_size=4)


# ------------------------------------------------------------------------------------------ the tools
def test_registered_and_listed(capsys):
    for family, names in (("resnet*", ["resnet101", "resnet101_d8", "resnet152", "resnet50", "resnet50_d8",
                                       "resnet_mini"]), ("regnety_*", ["regnety_040", "regnety_080", "regnety_160",
                                                                       "regnety_mini"])):  # fmt: skip
        assert vitlab.list_models(family) == names
    assert vitlab.list_models("efficientnet_*") == [*(f"efficientnet_b{i}" for i in range(5)), "efficientnet_mini"]
    cfg = vitlab.get_config("regnety_160")
    assert cfg.paper.startswith("Radosavovic et al. 2020") and "DeiT" in cfg.notes and cfg.top1 == 80.4
    assert vitlab.get_config("resnet50").weights_url.endswith("resnet50-0676ba61.pth")
    assert vitlab_cli.main(["models", "resnet50", "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["params_m"] == 25.557 and abs(row["gmacs"] - 4.09) < 0.01


def test_analyze_puts_a_cnn_beside_a_vit(tmp_path):
    """Feature evolution compares a CNN's consecutive blocks of one shape (null where a stage downsamples); the
    analyses that read attention maps say in one line why they do not apply."""
    torch.manual_seed(0)
    images = torch.rand(2, 3, 32, 32)
    lines: list[str] = []
    results = {}
    for name in ("resnet_mini", "deit_mini"):
        model = vitlab.create_model(name, num_classes=10, **({"zero_init_residual": False} if "resnet" in name else {}))
        report = analyze(model.eval(), images, images, ["evolution", "attention"], tmp_path / name, log=lines.append)
        results[name] = (report, json.loads((tmp_path / name / "evolution.json").read_text()))
    report, evolution = results["resnet_mini"]
    sims = evolution["similarity"]  # 8 blocks, two per stage: stages 2-4 start with a shape change
    assert len(sims) == 7 and [i for i, s in enumerate(sims) if s is None] == [1, 3, 5]
    assert all(0 < s < 1 for s in sims if s is not None)
    assert report["analyses"]["attention"]["skipped"].startswith("no block computes a self-attention map")
    assert len(results["deit_mini"][1]["similarity"]) == 3 and None not in results["deit_mini"][1]["similarity"]
    assert any(line.startswith("attention  skipped:") for line in lines)
    assert (tmp_path / "resnet_mini" / "evolution.png").is_file()


@pytest.mark.parametrize("name", MINIS)
def test_minis_teach_as_torchscript(name, tmp_path):
    from vitlab.distill.teacher import load_teacher

    model = vitlab.create_model(name, num_classes=10, in_chans=1, img_size=28).eval()
    path = tmp_path / f"{name}.ts"
    torch.jit.script(model).save(str(path))
    teacher = load_teacher(path)
    x = torch.randn(3, 1, 28, 28)
    with torch.no_grad():
        torch.testing.assert_close(teacher(x), model(x))
