"""Checkpoint conversion: every whole-model golden through a real file, safe loading, safetensors, strict
reports, source detection, position-table resampling, EAMLP's official names and AFT's weight transfer."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import vitlab
from conftest import assert_close_to_golden, load_golden
from vitlab.interop import (
    DEIT_TO_AFT_EXCLUDE,
    LoadReport,
    detect_source,
    init_from,
    load_reference,
    load_weights,
    read_checkpoint,
    rename_keys,
    save_weights,
    transfer_deit_to_aftconv,
)
from vitlab.models import PyramidCPVT, VisionTransformer
from vitlab.models.t2t import T2TViT
from vitlab.models.tnt import TNT

# ------------------------------------------------------------------------ the goldens' small configurations
GOLD = dict(img_size=32, patch_size=8, num_classes=10, embed_dim=32, num_heads=4)
RE_ATTN = ("reattention", dict(transform_scale=True))
REFINER_MIXERS = [
    ("refiner", dict(refine=True, official_extras=True, residual_attention=True, expansion=3)),
    ("refiner", dict(share=True, official_extras=True)),
    ("refiner", dict(refine=False, residual_attention=True)),
    ("refiner", dict(share=True, official_extras=True)),
]
TNT_SMALL = dict(
    img_size=32, patch_size=8, num_classes=10, outer_dim=32, inner_dim=8, depth=2, outer_heads=4, inner_heads=2
)


def golden_model(file: str) -> torch.nn.Module:
    """vitlab model with the configuration the golden file's reference was built with."""
    if file == "refiner_model.npz":
        return VisionTransformer(
            **GOLD, depth=4, mlp_ratio=3, residual_scale=0.5, ls_init=(None, 1e-5), aux_head=True, mixer=REFINER_MIXERS
        )
    if file == "deepvit_model.npz":
        return VisionTransformer(
            **GOLD, depth=4, mlp_ratio=3, residual_scale=0.5, mixer=["attention", "attention", RE_ATTN, RE_ATTN]
        )
    if file.startswith("cpvt_deit"):
        cls = "cls" in file
        return VisionTransformer(
            **GOLD,
            depth=3,
            mlp_ratio=4,
            pos_embed="none",
            peg_at=(0,),
            class_token=cls,
            global_pool="token" if cls else "avg",
        )
    return TNT(**TNT_SMALL)


def reference_state(g) -> dict[str, torch.Tensor]:
    """The golden's reference state_dict as the reference saves it (BatchNorm counters are int64 there)."""
    return {k: v.long() if k.endswith("num_batches_tracked") else v for k, v in g.state().items()}


# (file, source, how the training script nested the weights)
GOLDEN_MODELS = [
    ("refiner_model.npz", "refiner", "model"),
    ("deepvit_model.npz", "deepvit", "state_dict+module"),
    ("cpvt_deit_cls_model.npz", "cpvt", None),
    ("cpvt_deit_gap_model.npz", "cpvt", "state_dict_ema"),
    ("tnt_model_huawei.npz", "tnt_huawei", None),
    ("tnt_model_timm.npz", "tnt_timm", "model"),
]


def write_checkpoint(state: dict, path: Path, nesting: str | None) -> Path:
    if nesting == "state_dict+module":  # DDP training: module. prefix, under state_dict, with other entries
        obj = {"state_dict": {f"module.{k}": v for k, v in state.items()}, "epoch": 3, "metric": 0.5}
    elif nesting:
        obj = {nesting: state, "epoch": 3}
    else:
        obj = state
    torch.save(obj, path)
    return path


@pytest.mark.parametrize("file, source, nesting", GOLDEN_MODELS)
def test_whole_model_golden_through_a_file(file, source, nesting, tmp_path):
    g = load_golden(file)
    state = reference_state(g)
    path = write_checkpoint(state, tmp_path / "ref.pth", nesting)
    model = golden_model(file).eval()
    report = load_reference(model, path, source=source)
    assert report.ok and report.source == source
    used = len(report.matched) + len(report.dropped)
    assert used >= len(state) - sum(1 for k in state if k.endswith(".v.weight"))  # TNT's v is fused into qkv
    x = g.input("image")
    with torch.no_grad():
        assert_close_to_golden(model(x), g.output("logits"))
        feats = model.forward_features(x)
    expected = g.output("features")
    if expected.dim() == 2:  # DeepViT and Huawei TNT return the normed class token
        feats = model.forward_head(feats, pre_logits=True)
    assert_close_to_golden(feats, expected)
    # the same file with the source detected from its keys
    again = golden_model(file).eval()
    assert load_reference(again, path).source == source
    with torch.no_grad():
        assert torch.equal(again(x), model(x))


def test_reports_name_the_dropped_tensors():
    tnt = load_reference(TNT(**TNT_SMALL), reference_state(load_golden("tnt_model_huawei.npz")), "tnt_huawei")
    assert "outer_tokens" in tnt.dropped and "unused" in tnt.dropped["outer_tokens"]
    assert any("qk + v -> qkv" in n for n in tnt.notes)
    # Refined-ViT without its token-labelling head: aux_head is dropped, said so, and the rest still matches
    g = load_golden("refiner_model.npz")
    model = VisionTransformer(
        **GOLD, depth=4, mlp_ratio=3, residual_scale=0.5, ls_init=(None, 1e-5), mixer=REFINER_MIXERS
    ).eval()
    report = load_reference(model, reference_state(g), "refiner")
    assert report.ok and set(report.dropped) == {"aux_head.weight", "aux_head.bias"}
    assert "aux head" in str(report)
    with torch.no_grad():
        feats = model.forward_features(g.input("image"))
    assert_close_to_golden(feats, g.output("features"))  # the trunk does not depend on the aux head


GOLDEN_PCPVT = dict(
    img_size=32, patch_size=4, num_classes=10, embed_dims=[16, 32], num_heads=[1, 2], mlp_ratios=[2, 2], depths=[2, 2]
)


def test_pcpvt_golden_through_the_converter():
    g = load_golden("cpvt_v2_gap_model_twins.npz")
    assert detect_source(g.state()) == "twins_cpvtv2"
    model = PyramidCPVT(**GOLDEN_PCPVT, sr_ratios=[2, 1]).eval()
    report = load_reference(model, g.state(), "twins_cpvtv2")
    assert report.ok, str(report)
    with torch.no_grad():
        feats = model.forward_features(g.input("image"))
        assert_close_to_golden(model.forward_head(feats, pre_logits=True), g.output("features"))
        assert_close_to_golden(model.forward_head(feats), g.output("logits"))


def test_other_twins_pyramids_are_refused():
    """Twins-SVT / ALTGVT (timm blocks with a fused qkv) are not the CPVTV2 pyramid vitlab implements."""
    state = {"patch_embeds.0.proj.weight": torch.zeros(1), "blocks.0.0.attn.qkv.weight": torch.zeros(1)}
    with pytest.raises(ValueError, match="CPVTV2 pyramid"):
        detect_source(state)


# ------------------------------------------------------------------------------------------ safe loading
class Exploit:
    """Unpickling this runs ``exec`` with code that writes a file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({str(self.marker)!r}, 'w').write('pwned')",)


def test_pickled_code_is_refused_without_running(tmp_path):
    marker = tmp_path / "marker"
    path = tmp_path / "evil.pth"
    torch.save({"model": {"head.weight": torch.zeros(2, 2)}, "payload": Exploit(marker)}, path)
    with pytest.raises(ValueError, match="refusing to load"):
        load_reference(vitlab.create_model("deit_mini"), path, source="timm_vit")
    with pytest.raises(ValueError, match="refusing to load"):
        read_checkpoint(path)
    assert not marker.exists(), "loading ran code from the file"
    # the file really is an exploit: an unrestricted unpickler runs it
    torch.load(path, weights_only=False)
    assert marker.read_text() == "pwned"


def test_training_checkpoint_with_args_namespace_loads(tmp_path):
    """timm/DeiT training checkpoints store argparse.Namespace args next to the weights: allowed (no code)."""
    import argparse

    model = vitlab.create_model("deit_mini")
    timm_names = {k.replace(".mixer.", ".attn."): v for k, v in model.state_dict().items()}
    path = tmp_path / "train.pth.tar"
    torch.save({"state_dict": timm_names, "args": argparse.Namespace(lr=1e-3), "epoch": 1}, path)
    other = vitlab.create_model("deit_mini")
    assert load_reference(other, path).source == "timm_vit"
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), other.state_dict().values()))


def test_bad_files(tmp_path):
    with pytest.raises(FileNotFoundError):
        read_checkpoint(tmp_path / "nope.pth")
    junk = tmp_path / "junk.pth"
    junk.write_bytes(b"not a checkpoint at all")
    with pytest.raises(ValueError, match="cannot read"):
        read_checkpoint(junk)
    torch.save({"epoch": 3, "optimizer": {"lr": 0.1}}, tmp_path / "no_weights.pth")
    with pytest.raises(ValueError, match="found no tensors"):
        read_checkpoint(tmp_path / "no_weights.pth")
    torch.save({"a": torch.zeros(1), "b": "text"}, tmp_path / "mixed.pth")
    with pytest.raises(ValueError, match="not tensors: b"):
        read_checkpoint(tmp_path / "mixed.pth")


# ------------------------------------------------------------------------------------------- safetensors
def test_safetensors_round_trip(tmp_path):
    torch.manual_seed(0)
    model = vitlab.create_model("refiner_vit_mini", num_classes=7).eval()
    with torch.no_grad():  # non-trivial BatchNorm statistics
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.normal_()
                m.running_var.uniform_(0.5, 2)
                m.num_batches_tracked.fill_(12)
    path = save_weights(model, tmp_path / "sub" / "w.safetensors")
    assert path.exists() and [p.name for p in path.parent.iterdir()] == ["w.safetensors"]  # no temporary left
    state = load_weights(path)
    ref = model.state_dict()
    assert state.keys() == ref.keys()
    assert all(torch.equal(state[k], ref[k]) and state[k].dtype == ref[k].dtype for k in ref)
    other = vitlab.create_model("refiner_vit_mini", num_classes=7).eval()
    report = load_reference(other, path)  # vitlab's own names, detected
    assert report.source == "vitlab" and report.ok
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(other(x), model(x))


def test_safetensors_shared_tensors(tmp_path):
    w = torch.randn(4, 4)
    path = save_weights({"a": w, "b": w, "c": w[1:]}, tmp_path / "shared.safetensors")
    out = load_weights(path)
    assert torch.equal(out["a"], w) and torch.equal(out["b"], w) and torch.equal(out["c"], w[1:])


# ------------------------------------------------------------------------------------------ strict reports
def timm_deit_mini_state(**kw) -> dict[str, torch.Tensor]:
    torch.manual_seed(1)
    model = vitlab.create_model("deit_mini", **kw)
    return {k.replace(".mixer.", ".attn."): v.clone() for k, v in model.state_dict().items()}


def test_strict_errors_list_every_problem():
    state = timm_deit_mini_state()
    state.pop("blocks.2.norm1.weight")
    state["blocks.0.attn.extra"] = torch.zeros(3)
    state["head.weight"] = torch.zeros(5, 64)
    model = vitlab.create_model("deit_mini")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError) as err:
        load_reference(model, state, source="timm_vit")
    msg = str(err.value)
    assert "1 missing, 1 unexpected, 1 shape mismatches" in msg.splitlines()[0]
    for needle in (
        "blocks.2.norm1.weight",
        "blocks.0.mixer.extra",
        "head.weight: checkpoint (5, 64) vs model (1000, 64)",
    ):
        assert needle in msg
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items()), "strict failure changed the model"
    # non-strict loads what fits and reports the rest
    report = load_reference(model, state, source="timm_vit", strict=False)
    assert not report.ok and report.missing == ["blocks.2.norm1.weight"]
    assert report.unexpected == ["blocks.0.mixer.extra"] and report.mismatched[0][0] == "head.weight"
    assert torch.equal(model.state_dict()["blocks.3.mixer.qkv.weight"], state["blocks.3.attn.qkv.weight"])
    assert torch.equal(model.state_dict()["head.weight"], before["head.weight"])
    data = json.loads(report.to_json())
    assert data["ok"] is False and data["missing"] == ["blocks.2.norm1.weight"]


def test_report_folds_numbered_keys():
    report = LoadReport("timm_vit", missing=[f"blocks.{i}.mixer.qkv.weight" for i in range(12)] + ["norm.weight"])
    text = str(report)
    assert "blocks.{0-11}.mixer.qkv.weight" in text and "norm.weight" in text and "missing" in text


def test_unknown_source_and_fusion_errors():
    with pytest.raises(ValueError, match="unknown checkpoint source 'tnt_legacy'"):
        rename_keys({}, "tnt_legacy")
    with pytest.raises(ValueError, match="value projection"):
        rename_keys({"blocks.0.inner_attn.qk.weight": torch.zeros(4, 2)}, "tnt_huawei")


@pytest.mark.parametrize(
    "file, source",
    [
        ("refiner_model.npz", "refiner"),
        ("deepvit_model.npz", "deepvit"),
        ("cpvt_deit_cls_model.npz", "cpvt"),
        ("cpvt_deit_gap_model.npz", "cpvt"),
        ("tnt_model_huawei.npz", "tnt_huawei"),
        ("tnt_model_timm.npz", "tnt_timm"),
        ("cpvt_peg.npz", "twins_peg"),
    ],
)
def test_detect_source_on_goldens(file, source):
    assert detect_source(load_golden(file).state()) == source


def test_detect_source_other_cases():
    state = timm_deit_mini_state()
    assert detect_source(state) == "timm_vit"
    assert detect_source(timm_deit_mini_state(dist_token=True)) == "deit"
    assert detect_source(vitlab.create_model("tnt_mini").state_dict()) == "vitlab"
    stem = {"patch_embed.conv1.weight": 0, "patch_embed.conv3.weight": 0, "blocks.0.attn.qkv.weight": 0}
    assert detect_source(stem) == "refiner"
    assert detect_source({"patch_embed.conv1.weight": 0, "blocks.0.attn.qkv.weight": 0}) == "deepvit"
    with pytest.raises(ValueError, match="pass the source explicitly"):
        detect_source({"encoder.layer.0.weight": torch.zeros(1)})


# ------------------------------------------------------------------------------ official stems and DeiT
BN = ("weight", "bias", "running_mean", "running_var", "num_batches_tracked")


def official_keys(model: str) -> list[str]:
    """The state_dict keys of the official Refiner_ViT_S (refined_transformer.py: PatchEmbed_cnn conv1-3/bn1-3,
    shared odd blocks with DLA + adapt_bn, Mlp.scale_channel, token-labelling aux_head) and deepvit_S
    (deep_vision_transformer.py: PatchEmbed_CNN conv1-2/bn1-2, ReAttention in the last 5 blocks)."""
    convs = 3 if model == "refiner_vit_s" else 2
    keys = ["cls_token", "pos_embed", "patch_embed.proj.weight", "patch_embed.proj.bias"]
    for i in range(1, convs + 1):
        keys += [f"patch_embed.conv{i}.weight"] + [f"patch_embed.bn{i}.{leaf}" for leaf in BN]
    for b in range(16):
        p = f"blocks.{b}."
        keys += [
            p + k
            for k in (
                "norm1.weight",
                "norm1.bias",
                "attn.qkv.weight",
                "attn.qkv.bias",
                "attn.proj.weight",
                "attn.proj.bias",
                "norm2.weight",
                "norm2.bias",
                "mlp.fc1.weight",
                "mlp.fc1.bias",
                "mlp.fc2.weight",
                "mlp.fc2.bias",
            )
        ]
        if model == "refiner_vit_s":
            keys.append(p + "mlp.scale_channel")
            if b % 2:  # share=True blocks refine the previous map
                for conv, bn in (("conv_exp", "bn1"), ("depth_sep_conv", "bn2"), ("conv_pro", "bn3")):
                    keys += [f"{p}attn.DLA.{conv}.weight"] + [f"{p}attn.DLA.{bn}.{leaf}" for leaf in BN]
                keys += [f"{p}attn.adapt_bn.{leaf}" for leaf in BN]
        elif b >= 11:  # deepvit_S: apply_transform [False] * 11 + [True] * 5
            keys += [p + "attn.reatten_matrix.weight", p + "attn.reatten_matrix.bias"]
            keys += [f"{p}attn.var_norm.{leaf}" for leaf in BN]
    keys += ["norm.weight", "norm.bias", "head.weight", "head.bias"]
    return keys + (["aux_head.weight", "aux_head.bias"] if model == "refiner_vit_s" else [])


@pytest.mark.parametrize("name, source", [("refiner_vit_s", "refiner"), ("deepvit_s", "deepvit")])
def test_official_key_sets_map_to_registered_models(name, source):
    """Every tensor of the released Refined-ViT-S / DeepViT-S layout has its place (CNN stems included)."""
    with torch.device("meta"):
        model = vitlab.create_model(name)
    official = dict.fromkeys(official_keys(name), torch.zeros(1))
    assert detect_source(official) == source
    ours = set(model.state_dict())
    converted = set(rename_keys(official, source))
    assert converted - ours == ({"aux_head.weight", "aux_head.bias"} if source == "refiner" else set())
    assert ours - converted == set()
    with torch.device("meta"):
        with_aux = vitlab.create_model(name, aux_head=True) if source == "refiner" else model
    assert set(with_aux.state_dict()) == converted


def test_deit_distilled_checkpoint_and_resampled_position_table():
    """A DeiT distilled 32 px checkpoint into a 48 px model: the table is resampled bicubically and reported."""
    torch.manual_seed(0)
    src = vitlab.create_model("deit_tiny_distilled_patch16_224", img_size=32, num_classes=4, dynamic_img_size=True)
    src.eval()
    state = {k.replace(".mixer.", ".attn."): v for k, v in src.state_dict().items()}
    big = vitlab.create_model("deit_tiny_distilled_patch16_224", img_size=48, num_classes=4).eval()
    report = load_reference(big, {"model": state}, source="deit")
    ((key, old, new, how),) = report.resampled
    assert (key, old, new) == ("pos_embed", (1, 6, 192), (1, 11, 192)) and "2x2 -> 3x3" in how
    x = torch.randn(2, 3, 48, 48)
    with torch.no_grad():
        torch.testing.assert_close(big(x), src(x))  # the same bicubic resampling the dynamic model does


def test_cpvt_pegs_follow_block_order():
    """A checkpoint with one PEG (`pos_block`) into a model whose single PEG sits after block 1."""
    g = load_golden("cpvt_deit_cls_model.npz")
    model = VisionTransformer(**GOLD, depth=3, pos_embed="none", peg_at=(1,))
    load_reference(model, g.state(), source="cpvt")
    assert torch.equal(model.pegs["1"].proj.weight, g.param("pos_block.proj.0.weight"))


# --------------------------------------------------------------------------------------------- EAMLP
def eamlp_official_state(model: T2TViT, token_golden, block_golden) -> dict[str, torch.Tensor]:
    """An official EAMLP state_dict (EANet EAMLP/models: T2T_module attention1/2, transformer_block Attention)
    with random values, except token layer 1 (token_transformer.py spelling: q_linear, linear_1 = M_k,
    linear_2 = M_v) and block 0's attention (trans_dims, linear_0, linear_1, proj), which hold golden values."""
    gen = torch.Generator().manual_seed(0)
    ours = model.state_dict()

    def rand(key):
        return torch.randn(ours[key].shape, generator=gen)

    state = {"cls_token": rand("cls_token"), "pos_embed": torch.zeros(1, 17, 32)}
    for i in (1, 2):
        t, o = f"tokens_to_token.attention{i}.", f"tokens_to_token.layers.{i - 1}."
        for part in (
            "norm1.weight",
            "norm1.bias",
            "norm2.weight",
            "norm2.bias",
            "mlp.fc1.weight",
            "mlp.fc1.bias",
            "mlp.fc2.weight",
            "mlp.fc2.bias",
            "attn.proj.weight",
            "attn.proj.bias",
            "attn.q_linear.weight",
            "attn.q_linear.bias",
        ):
            state[t + part] = rand(o + part)
    # token layer 2 in the models' default token_performer.py spelling
    a = "tokens_to_token.attention2.attn."
    state[a + "linear_0.weight"] = rand("tokens_to_token.layers.1.attn.mk.weight")
    state[a + "linear_1.weight"] = rand("tokens_to_token.layers.1.attn.mv.weight")
    state[a + "linear_1.bias"] = rand("tokens_to_token.layers.1.attn.mv.bias")
    for k, v in token_golden.state().items():  # q_linear, linear_1, linear_2, proj
        state["tokens_to_token.attention1.attn." + k] = v
    state["tokens_to_token.project.weight"] = rand("tokens_to_token.project.weight")
    state["tokens_to_token.project.bias"] = rand("tokens_to_token.project.bias")
    for b in range(len(model.blocks)):
        for part in (
            "norm1.weight",
            "norm1.bias",
            "norm2.weight",
            "norm2.bias",
            "mlp.fc1.weight",
            "mlp.fc1.bias",
            "mlp.fc2.weight",
            "mlp.fc2.bias",
        ):
            state[f"blocks.{b}.{part}"] = rand(f"blocks.{b}.{part}")
        for off, ours_name in (("trans_dims", "query"), ("linear_0", "mk"), ("linear_1", "mv"), ("proj", "proj")):
            for leaf in ("weight", "bias"):
                state[f"blocks.{b}.attn.{off}.{leaf}"] = (
                    block_golden.param(f"{off}.{leaf}") if b == 0 else rand(f"blocks.{b}.mixer.{ours_name}.{leaf}")
                )
    for k in ("norm.weight", "norm.bias", "head.weight", "head.bias"):
        state[k] = rand(k)
    return state


# token layer 1 takes 2 * 4 * 4 = 32 features to 16 (the golden's dims); blocks are 32 wide with 2 heads
EAMLP_SMALL = dict(
    img_size=32,
    in_chans=2,
    num_classes=10,
    embed_dim=32,
    depth=2,
    num_heads=2,
    mlp_ratio=2,
    token_dim=16,
    soft_split=((4, 4, 0), (3, 2, 1), (3, 1, 1)),
)


def test_eamlp_official_names():
    token_g, block_g = load_golden("ea_token_eamlp.npz"), load_golden("ea_multihead_eamlp.npz")
    model = T2TViT(**EAMLP_SMALL).eval()
    state = eamlp_official_state(model, token_g, block_g)
    assert detect_source(state) == "eamlp"
    report = load_reference(model, state, source="eamlp")
    assert report.ok and set(report.dropped) == {"pos_embed"}
    assert len(report.matched) == len(state) - 1
    with torch.no_grad():
        tok = model.tokens_to_token.layers[0].attn(token_g.input("x"))
        assert_close_to_golden(tok, token_g.output("x"))
        mix = model.blocks[0].mixer(block_g.input("x"))
        assert_close_to_golden(mix, block_g.output("x"))
        # the performer spelling of token layer 2: linear_0 = M_k (no bias), linear_1 = M_v
        mem = model.tokens_to_token.layers[1].attn
        assert torch.equal(mem.mk.weight, state["tokens_to_token.attention2.attn.linear_0.weight"])
        assert torch.equal(mem.mv.bias, state["tokens_to_token.attention2.attn.linear_1.bias"])
        assert model(torch.randn(2, 2, 32, 32)).shape == (2, 10)


def test_eamlp_registered_config_takes_official_key_set():
    """eamlp_7's tensors are exactly the official T2t_vit_7 (performer tokens, EA blocks) key set, renamed."""
    with torch.device("meta"):
        model = vitlab.create_model("eamlp_7")
    official = []
    for i in (1, 2):
        t = f"tokens_to_token.attention{i}."
        official += [
            t + p
            for p in (
                "norm1.weight",
                "norm1.bias",
                "attn.q_linear.weight",
                "attn.q_linear.bias",
                "attn.linear_0.weight",
                "attn.linear_1.weight",
                "attn.linear_1.bias",
                "attn.proj.weight",
                "attn.proj.bias",
                "norm2.weight",
                "norm2.bias",
                "mlp.fc1.weight",
                "mlp.fc1.bias",
                "mlp.fc2.weight",
                "mlp.fc2.bias",
            )
        ]
    official += ["tokens_to_token.project.weight", "tokens_to_token.project.bias", "cls_token", "pos_embed"]
    for b in range(7):
        official += [
            f"blocks.{b}.{p}"
            for p in (
                "norm1.weight",
                "norm1.bias",
                "attn.trans_dims.weight",
                "attn.trans_dims.bias",
                "attn.linear_0.weight",
                "attn.linear_0.bias",
                "attn.linear_1.weight",
                "attn.linear_1.bias",
                "attn.proj.weight",
                "attn.proj.bias",
                "norm2.weight",
                "norm2.bias",
                "mlp.fc1.weight",
                "mlp.fc1.bias",
                "mlp.fc2.weight",
                "mlp.fc2.bias",
            )
        ]
    official += ["norm.weight", "norm.bias", "head.weight", "head.bias"]
    assert sorted(rename_keys(dict.fromkeys(official, torch.zeros(1)), "eamlp")) == sorted(model.state_dict())


# ----------------------------------------------------------------------------------------- weight transfer
def test_deit_to_aftconv_transfer_copies_exactly_the_allowed_tensors(tmp_path):
    torch.manual_seed(0)
    deit = vitlab.create_model("deit_mini", num_classes=10)
    with torch.no_grad():
        for p in deit.parameters():
            p.add_(torch.randn_like(p))  # every source tensor differs from any fresh init
    path = tmp_path / "deit.pth"
    torch.save({"model": {k.replace(".mixer.", ".attn."): v for k, v in deit.state_dict().items()}}, path)
    model = vitlab.create_model("aft_conv_mini", num_classes=10)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    report = transfer_deit_to_aftconv(model, path)
    after = model.state_dict()
    src = deit.state_dict()
    changed = {k for k in after if not torch.equal(after[k], before[k])}
    copied = {k for k in after if k in src and not k.endswith("qkv.weight") and not k.endswith("qkv.bias")}
    qkv = {k for k in after if k.endswith((".mixer.qkv.weight", ".mixer.qkv.bias"))}
    assert changed == copied | qkv
    for k in copied:
        assert torch.equal(after[k], src[k]), k
    dim, heads = 64, model.blocks[0].mixer.num_heads
    for k in qkv:
        assert torch.equal(after[k][dim + heads :], src[k][2 * dim :]), k  # V rows <- DeiT's v rows
        assert torch.equal(after[k][: dim + heads], before[k][: dim + heads]), k  # Q and K rows untouched
    for i in range(4):  # AFT's own bias parameters keep their initialisation
        for name in ("w", "gamma", "beta"):
            assert f"blocks.{i}.mixer.{name}" not in changed
    assert set(report.excluded) == {"pos_embed", "cls_token"}
    assert set(report.missing) == {f"blocks.{i}.mixer.{n}" for i in range(4) for n in ("w", "gamma", "beta")}
    out = model(torch.randn(2, 3, 32, 32))
    assert out.shape == (2, 10) and torch.isfinite(out).all()
    out.sum().backward()  # and trains
    # the same through the generic --init-from entry point
    again = vitlab.create_model("aft_conv_mini", num_classes=10)
    init_from(again, path)
    assert all(torch.equal(again.state_dict()[k], after[k]) for k in copied)
    assert all(torch.equal(again.state_dict()[k][dim + heads :], after[k][dim + heads :]) for k in qkv)
    assert DEIT_TO_AFT_EXCLUDE[0] == r"^pos_embed$"


def test_transfer_needs_an_aft_model_and_attention_blocks():
    with pytest.raises(ValueError, match="AFT mixers"):
        transfer_deit_to_aftconv(vitlab.create_model("deit_mini"), timm_deit_mini_state())
    refiner = {
        k.replace(".mixer.", ".attn."): v for k, v in vitlab.create_model("refiner_vit_mini").state_dict().items()
    }
    with pytest.raises(ValueError, match="value rows"):  # shared refiner blocks have a (C, C) values-only qkv
        transfer_deit_to_aftconv(vitlab.create_model("aft_conv_mini"), refiner, source="timm_vit")


def test_init_from_skips_what_does_not_fit():
    """Fine-tuning start: another head size and another input size; the head keeps its init."""
    state = timm_deit_mini_state()
    model = vitlab.create_model("deit_mini", num_classes=5, img_size=48)
    head = model.head.weight.clone()
    report = init_from(model, state, exclude=[r"^norm\."])
    assert [m[0] for m in report.mismatched] == ["head.weight", "head.bias"]
    assert report.resampled[0][0] == "pos_embed" and report.excluded == ["norm.weight", "norm.bias"]
    assert torch.equal(model.head.weight, head)
    assert torch.equal(model.blocks[1].mixer.qkv.weight, state["blocks.1.attn.qkv.weight"])


# ---------------------------------------------------------------------------------------------------- CLI
def vitlab_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "vitlab.cli", *args], capture_output=True, text=True, timeout=300)


def test_cli_convert(tmp_path):
    g = load_golden("tnt_model_timm.npz")
    src = write_checkpoint(reference_state(g), tmp_path / "tnt_timm.pth", "model")
    # tnt_mini has another shape: a clear strict failure after the report, nothing written
    out = vitlab_cli(
        "convert", str(src), "--model", "tnt_mini", "--source", "tnt_timm", "--out", str(tmp_path / "x.safetensors")
    )
    assert out.returncode == 2 and "shape mismatches" in out.stdout
    assert out.stderr.strip().count("\n") == 0 and "--no-strict" in out.stderr
    assert not (tmp_path / "x.safetensors").exists()
    # a registered model that fits: write, then load the safetensors file back through the library
    state = timm_deit_mini_state(num_classes=3)
    torch.save({"model": state}, tmp_path / "deit.pth")
    dst = tmp_path / "deit.safetensors"
    out = vitlab_cli("convert", str(tmp_path / "deit.pth"), "--model", "deit_mini", "--out", str(dst), "--json")
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    assert info["ok"] and info["source"] == "timm_vit" and info["num_classes"] == 3 and info["out"] == str(dst)
    weights = load_weights(dst)
    assert torch.equal(weights["blocks.0.mixer.qkv.weight"], state["blocks.0.attn.qkv.weight"])
    bad = vitlab_cli("convert", str(tmp_path / "missing.pth"), "--model", "deit_mini")
    assert bad.returncode == 2 and "not found" in bad.stderr and bad.stderr.strip().count("\n") == 0
