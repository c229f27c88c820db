"""Models with weights in one call: ``vitlab.create_model(pretrained=, checkpoint_path=)``, model folders
(``save_pretrained`` / ``from_pretrained``), the local weights folder, and the tools that honour how a
checkpoint's model was built (convert, export, analyze, eval).

The official checkpoints are built from the golden vectors' reference weights (Refined-ViT, DeepViT, TNT,
in their small reference configurations), from official-layout state dicts (EAMLP) and from a timm-layout
DeiT; the slow suite repeats it at full size with random official-layout weights.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import vitlab
from conftest import assert_close_to_golden, load_golden
from test_convert import (
    EAMLP_SMALL,
    GOLD,
    RE_ATTN,
    REFINER_MIXERS,
    TNT_SMALL,
    eamlp_official_state,
    official_keys,
    reference_state,
    write_checkpoint,
)
from vitlab.checkpoint import save_checkpoint
from vitlab.cli import main as cli_main
from vitlab.common.io import write_safetensors_atomic
from vitlab.interop import rename_key
from vitlab.interop.pretrained import find_weights, weights_dir
from vitlab.models import build_model

# (registered model, golden file, options giving the golden's small configuration, source, nesting)
OFFICIAL = [
    (
        "refiner_vit_s",
        "refiner_model.npz",
        dict(GOLD, stem_channels=(), depth=4, aux_head=True, mixer=REFINER_MIXERS),
        "refiner",
        "model",
    ),
    (
        "deepvit_s",
        "deepvit_model.npz",
        dict(GOLD, stem_channels=(), depth=4, mixer=["attention", "attention", RE_ATTN, RE_ATTN]),
        "deepvit",
        "state_dict+module",
    ),
    ("tnt_s_patch16_224", "tnt_model_huawei.npz", dict(TNT_SMALL), "tnt_huawei", None),
]


def same_logits(a: torch.nn.Module, b: torch.nn.Module, x: torch.Tensor) -> None:
    with torch.no_grad():
        assert torch.equal(a.eval()(x), b.eval()(x))


def timm_deit_state(name: str, **kw) -> dict[str, torch.Tensor]:
    """A timm-layout DeiT state_dict (timm's names: ``attn`` for vitlab's ``mixer``) with random values."""
    torch.manual_seed(1)
    return {k.replace(".mixer.", ".attn."): v for k, v in build_model(name, **kw).state_dict().items()}


# ------------------------------------------------------------------------------- official checkpoints
@pytest.mark.parametrize("name, file, kw, source, nesting", OFFICIAL)
def test_official_checkpoint_through_create_model_and_from_pretrained(name, file, kw, source, nesting, tmp_path):
    g = load_golden(file)
    path = write_checkpoint(reference_state(g), tmp_path / "official.pth", nesting)
    model = vitlab.create_model(name, checkpoint_path=path, **kw)
    assert model.training and model.meta["weights"] == f"{path} ({source} weights)"
    x = g.input("image")
    with torch.no_grad():
        assert_close_to_golden(model.eval()(x), g.output("logits"))
    model.save_pretrained(tmp_path / "folder")
    again = vitlab.from_pretrained(tmp_path / "folder")
    assert not again.training and again.model_name == name and again.pretrained_cfg == model.pretrained_cfg
    same_logits(again, model, x)
    same_logits(vitlab.create_model(name, checkpoint_path=tmp_path / "folder"), model, x)


def test_eamlp_official_checkpoint(tmp_path):
    model = build_model("eamlp_14", **EAMLP_SMALL)
    state = eamlp_official_state(model, load_golden("ea_token_eamlp.npz"), load_golden("ea_multihead_eamlp.npz"))
    torch.save({"state_dict_ema": state}, tmp_path / "eamlp.pth")
    loaded = vitlab.create_model("eamlp_14", checkpoint_path=tmp_path / "eamlp.pth", **EAMLP_SMALL)
    assert loaded.meta["weights"].endswith("(eamlp weights)")
    token = state["tokens_to_token.attention1.attn.q_linear.weight"]
    assert torch.equal(loaded.tokens_to_token.layers[0].attn.q_linear.weight, token)
    loaded.save_pretrained(tmp_path / "folder")
    same_logits(vitlab.from_pretrained(tmp_path / "folder"), loaded, torch.randn(2, 2, 32, 32))


def test_timm_deit_checkpoint(tmp_path):
    state = timm_deit_state("deit_mini", num_classes=10)
    torch.save({"model": state, "epoch": 3}, tmp_path / "timm.pth.tar")
    model = vitlab.create_model("deit_mini", checkpoint_path=tmp_path / "timm.pth.tar")
    assert model.num_classes == 10 and model.meta["weights"].endswith("(timm_vit weights)")
    assert torch.equal(model.blocks[1].mixer.qkv.weight, state["blocks.1.attn.qkv.weight"])
    model.save_pretrained(tmp_path / "folder")
    same_logits(vitlab.from_pretrained(tmp_path / "folder"), model, torch.randn(2, 3, 32, 32))


@pytest.mark.slow
def test_full_size_official_checkpoints(tmp_path):
    """DeiT-S in timm's layout and Refined-ViT-S / DeepViT-S in the official layouts (random values), at full
    size: create_model(checkpoint_path=...) and from_pretrained give identical logits."""
    x = torch.randn(1, 3, 224, 224)
    cases = {"deit_small_patch16_224": timm_deit_state("deit_small_patch16_224")}
    for name, source in (("refiner_vit_s", "refiner"), ("deepvit_s", "deepvit")):
        own = build_model(name, aux_head=True) if source == "refiner" else build_model(name)
        own_state = own.state_dict()
        gen = torch.Generator().manual_seed(0)
        cases[name] = {}
        for key in official_keys(name):
            ours = own_state[rename_key(key, source)]
            value = ours.clone() if key.endswith("num_batches_tracked") else torch.randn(ours.shape, generator=gen)
            cases[name][key] = value.abs() + 0.5 if key.endswith("running_var") else value * 0.05
    for name, state in cases.items():
        torch.save({"model": state}, tmp_path / f"{name}.pth")
        model = vitlab.create_model(name, checkpoint_path=tmp_path / f"{name}.pth").eval()
        model.save_pretrained(tmp_path / name)
        same_logits(vitlab.from_pretrained(tmp_path / name), model, x)


# ----------------------------------------------------------------------------------- weights folder
def test_pretrained_reads_the_local_weights_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("VITLAB_WEIGHTS", str(tmp_path))
    with pytest.raises(FileNotFoundError) as err:
        vitlab.create_model("deit_mini", pretrained=True)
    msg = str(err.value)
    assert str(tmp_path) in msg and "deit_mini.safetensors" in msg and "deit_mini/" in msg and "never downloads" in msg
    assert "\n" not in msg
    with pytest.raises(FileNotFoundError, match=r"deit_small_patch16_224-cd65a155\.pth.*dl\.fbaipublicfiles\.com"):
        find_weights("deit_small_patch16_224")
    (tmp_path / "deit_small_patch16_224-cd65a155.pth").write_bytes(b"")
    assert find_weights("deit_small_patch16_224") == tmp_path / "deit_small_patch16_224-cd65a155.pth"

    torch.manual_seed(0)
    trained = build_model("deit_mini", num_classes=10)
    write_safetensors_atomic(trained.state_dict(), tmp_path / "deit_mini.safetensors")
    loaded = vitlab.create_model("deit_mini", pretrained=True)  # the classes come from the weights
    same_logits(loaded, trained, torch.randn(2, 3, 32, 32))
    trained.save_pretrained(tmp_path / "deit_mini")  # a model folder is preferred
    assert vitlab.create_model("deit_mini", pretrained=True).meta["weights"].endswith("(vitlab model folder)")


def test_weights_dir_defaults_to_the_user_cache(monkeypatch, tmp_path):
    monkeypatch.delenv("VITLAB_WEIGHTS", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert weights_dir() == tmp_path / "vitlab" / "weights"
    with pytest.raises(FileNotFoundError, match="user cache"):
        vitlab.create_model("tnt_mini", pretrained=True)


def test_new_head_overlay_file_and_features(tmp_path):
    torch.manual_seed(0)
    trained = build_model("cpvt_mini", num_classes=10)
    trained.save_pretrained(tmp_path / "cpvt")
    tuned = vitlab.create_model("cpvt_mini", checkpoint_path=tmp_path / "cpvt", num_classes=3, drop_path_rate=0.1)
    assert tuned.num_classes == 3 and tuned.head.out_features == 3 and tuned.training
    kept = {k: v for k, v in trained.state_dict().items() if not k.startswith("head.")}
    assert all(torch.equal(tuned.state_dict()[k], v) for k, v in kept.items())
    assert tuned.pretrained_cfg["num_classes"] == 3
    # timm's way to name a local file (train.py --pretrained-path)
    local = vitlab.create_model("cpvt_mini", pretrained=True, pretrained_cfg_overlay={"file": str(tmp_path / "cpvt")})
    same_logits(local, trained, torch.randn(2, 3, 32, 32))
    feats = vitlab.create_model("cpvt_mini", checkpoint_path=tmp_path / "cpvt", features_only=True, out_indices=[1])
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        expected = trained.eval().forward_intermediates(x, indices=[1], intermediates_only=True)
        assert torch.equal(feats.eval()(x)[0], expected[0])
    with pytest.raises(ValueError, match="not both"):
        vitlab.create_model("cpvt_mini", pretrained=True, checkpoint_path=tmp_path / "cpvt")
    with pytest.raises(ValueError, match="holds a 'cpvt_mini' model, not 'deit_mini'"):
        vitlab.create_model("deit_mini", checkpoint_path=tmp_path / "cpvt")


# ------------------------------------------------------------------------------------- model folders
def test_folder_round_trip_keeps_the_build(tmp_path):
    torch.manual_seed(0)
    model = build_model("refiner_vit_mini", num_classes=4, img_size=28, in_chans=1, drop_path_rate=0.1)
    model.set_input_size(24)
    model.reset_classifier(6, "avg")
    model.save_pretrained(tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert config["model_args"] == {
        "num_classes": 6,
        "img_size": 24,
        "in_chans": 1,
        "drop_path_rate": 0.1,
        "global_pool": "avg",
    }
    assert config["pretrained_cfg"]["input_size"] == [1, 24, 24]
    card = (tmp_path / "m" / "README.md").read_text()
    assert "refiner_vit_mini" in card and "from_pretrained" in card and "1 x 24 x 24" in card
    again = vitlab.from_pretrained(tmp_path / "m", drop_path_rate=0.0)
    same_logits(again, model, torch.randn(2, 1, 24, 24))
    with pytest.raises(ValueError, match="was built from its class"):
        vitlab.models.VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=1, num_heads=2).save_pretrained(
            tmp_path / "x"
        )


def test_folder_loading_runs_no_code_and_says_what_is_wrong(tmp_path):
    build_model("deit_mini").save_pretrained(tmp_path / "m")
    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return (Path.touch, (marker,))

    torch.save({"blocks.0.norm1.weight": Evil()}, tmp_path / "m" / "model.safetensors")
    with pytest.raises(ValueError) as err:
        vitlab.from_pretrained(tmp_path / "m")
    assert not marker.exists() and "\n" not in str(err.value)
    config = tmp_path / "m" / "config.json"
    data = json.loads(config.read_text())
    config.write_text(json.dumps({**data, "format": "something-else"}))
    with pytest.raises(ValueError, match="not a vitlab model config"):
        vitlab.from_pretrained(tmp_path / "m")
    build_model("deit_mini").save_pretrained(tmp_path / "m")
    config.write_text(json.dumps({**data, "model_args": {"embed_dim": 32}}))
    with pytest.raises(ValueError, match="does not fit the model"):
        vitlab.from_pretrained(tmp_path / "m")
    with pytest.raises(FileNotFoundError, match=r"no config\.json"):
        vitlab.from_pretrained(tmp_path)


# ---------------------------------------------------------------------------------------- the tools
def mnist_checkpoint(folder: Path, name: str = "deit_mini", data: str = "mnist") -> tuple[Path, torch.nn.Module]:
    """A `vitlab train` checkpoint of a 1-channel 28 px model (what a default MNIST run writes)."""
    torch.manual_seed(0)
    kw = dict(img_size=28, in_chans=1, num_classes=10)
    model = build_model(name, **kw)
    config = {"data": data, "holdout": 200}
    path = folder / "last.pt"
    save_checkpoint(
        {"model_name": name, "model_kwargs": kw, "model": model.state_dict(), "epoch": 1, "step": 1, "config": config},
        path,
    )
    return path, model


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli_main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_convert_vitlab_checkpoint_keeps_its_build(tmp_path, capsys):
    path, model = mnist_checkpoint(tmp_path)
    code, out, err = run_cli(capsys, "convert", str(path), "--format", "folder", "--out", str(tmp_path / "f"))
    assert code == 0, err
    loaded = vitlab.from_pretrained(tmp_path / "f")
    assert loaded.pretrained_cfg["input_size"] == (1, 28, 28) and loaded.pretrained_cfg["data"] == "mnist"
    assert loaded.pretrained_cfg["mean"] == (0.1307,) and loaded.pretrained_cfg["crop_pct"] == 1.0
    same_logits(loaded, model, torch.randn(2, 1, 28, 28))
    code, out, err = run_cli(capsys, "convert", str(path), "--out", str(tmp_path / "w.safetensors"), "--json")
    assert code == 0 and json.loads(out)["model_kwargs"] == {"img_size": 28, "in_chans": 1, "num_classes": 10}
    code, out, err = run_cli(capsys, "convert", str(path), "--model", "tnt_mini")
    assert code == 2 and "holds a 'deit_mini' model, not 'tnt_mini'" in err


def test_convert_official_to_a_folder(tmp_path, capsys):
    g = load_golden("tnt_model_huawei.npz")
    src = write_checkpoint(reference_state(g), tmp_path / "tnt.pth", None)
    code, _, err = run_cli(capsys, "convert", str(src), "--model", "tnt_s_patch16_224", "--format", "folder")
    assert code != 0 and "does not fit" in err  # the full-size TNT-S cannot hold the small golden weights
    code, _, err = run_cli(capsys, "convert", str(src), "--format", "folder")
    assert code == 2 and "--model" in err


def test_export_never_resizes_silently(tmp_path, capsys):
    path, _ = mnist_checkpoint(tmp_path)
    code, _out, err = run_cli(capsys, "export", str(path), "--format", "torchscript", "--out", str(tmp_path / "m.pt"))
    assert code == 0, err
    assert torch.jit.load(str(tmp_path / "m.pt"))(torch.randn(1, 1, 28, 28)).shape == (1, 10)
    code, _, err = run_cli(capsys, "export", str(path), "--out", str(tmp_path / "m.onnx"), "--img-size", "32")
    assert code == 2 and "built for 28x28" in err and "fixed-length position table" in err and err.count("\n") == 1
    assert not (tmp_path / "m.onnx").exists()
    cpvt, _ = mnist_checkpoint(tmp_path / "cpvt", "cpvt_mini")  # a PEG model takes any size as built
    code, _, err = run_cli(
        capsys, "export", str(cpvt), "--format", "torchscript", "--out", str(tmp_path / "c.pt"), "--img-size", "32"
    )
    assert code == 0, err


def test_missing_optional_dependency_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "onnxscript", None)  # as if not installed
    code, _, err = run_cli(capsys, "export", "deit_mini", "--out", str(tmp_path / "m.onnx"))
    assert code == 2 and err.count("\n") == 1 and "pip install 'vitlab[export]'" in err and "onnxscript" in err


def test_analyze_reads_the_checkpoint_data(tmp_path, capsys, data_dir):
    torch.manual_seed(0)
    kw = dict(num_classes=10)
    model = build_model("deit_mini", **kw)
    spec = f"cifar10:{data_dir / 'cifar10' / 'cifar-10-batches-py-first1017'}"
    path = tmp_path / "c.pt"
    save_checkpoint(
        {
            "model_name": "deit_mini",
            "model_kwargs": kw,
            "model": model.state_dict(),
            "epoch": 1,
            "step": 1,
            "config": {"data": spec},
        },
        path,
    )
    code, out, err = run_cli(
        capsys,
        "analyze",
        "deit_mini",
        "--checkpoint",
        str(path),
        "--what",
        "evolution",
        "--num-images",
        "2",
        "--out",
        str(tmp_path / "a"),
    )
    assert code == 0, err
    assert f"on {spec} (test)" in out


def test_eval_with_weights_uses_the_model_data_config(tmp_path, capsys):
    path, _ = mnist_checkpoint(tmp_path)
    code, _, err = run_cli(capsys, "convert", str(path), "--format", "folder", "--out", str(tmp_path / "f"))
    assert code == 0, err  # the folder records the data, its held-out part and normalisation
    code, _out, err = run_cli(capsys, "eval", str(path), "--json", str(tmp_path / "a.json"))
    assert code == 0, err
    code, _, err = run_cli(
        capsys, "eval", "deit_mini", "--weights", str(tmp_path / "f"), "--json", str(tmp_path / "b.json")
    )
    assert code == 0, err
    a, b = (json.loads((tmp_path / f).read_text())[0] for f in ("a.json", "b.json"))
    assert (a["top1"], a["loss"], a["n"]) == (b["top1"], b["loss"], b["n"])  # the same model, data and transform
    code, _, err = run_cli(capsys, "eval", "deit_mini", "--weights", str(tmp_path / "f"), "--ema")
    assert code == 2 and "--ema needs" in err
    code, _, err = run_cli(capsys, "eval", "deit_mini")
    assert code == 2 and "--weights" in err


def test_eval_of_official_weights_on_an_image_folder(tmp_path, capsys):
    """`vitlab eval MODEL --weights W --data folder:...`: every image resized to size / crop_pct, centre-cropped
    and normalised as the model's pretrained_cfg says (here a crop of 0.5 and mean = std = 0.5)."""
    from vitlab.data import create_transform, resolve_data_config
    from vitlab.data.synth import synthesize

    synthesize(tmp_path / "imgs", num_classes=3, train_per_class=1, val_per_class=3, size=(48, 40))
    torch.manual_seed(0)
    overlay = {"crop_pct": 0.5, "mean": (0.5,) * 3, "std": (0.5,) * 3, "interpolation": "bicubic"}
    model = build_model("deit_mini", num_classes=3, pretrained_cfg_overlay=overlay).eval()
    model.save_pretrained(tmp_path / "w")
    spec = f"folder:{tmp_path / 'imgs'}"
    code, _, err = run_cli(
        capsys,
        "eval",
        "deit_mini",
        "--weights",
        str(tmp_path / "w"),
        "--data",
        spec,
        "--json",
        str(tmp_path / "r.json"),
        "--batch-size",
        "4",
    )
    assert code == 0, err
    (row,) = json.loads((tmp_path / "r.json").read_text())
    tf = create_transform(**resolve_data_config(model), is_training=False)
    files = sorted((tmp_path / "imgs" / "val").rglob("*.JPEG"))
    labels = torch.tensor([int(f.parent.name[1:]) for f in files])
    with torch.no_grad():
        logits = model(torch.stack([tf(f) for f in files]))
    assert row["n"] == 9 and row["top1"] == pytest.approx(100 * float((logits.argmax(1) == labels).float().mean()))
    assert row["loss"] == pytest.approx(float(torch.nn.functional.cross_entropy(logits, labels)), rel=1e-5)


def test_python_m_vitlab():
    proc = subprocess.run(
        [sys.executable, "-m", "vitlab", "models", "deit_mini", "--no-macs"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0 and "deit_mini" in proc.stdout, proc.stderr


def _tamper(config: dict, change) -> dict:
    config = json.loads(json.dumps(config))
    change(config)
    return config


TAMPERED_CONFIGS = {
    "version '2'": (lambda c: c.update(version="2"), r"version must be an integer format version"),
    "version null": (lambda c: c.update(version=None), r"version must be an integer format version"),
    "num_classes 'ten'": (lambda c: c.update(num_classes="ten"), r": num_classes must be an integer >= 0, got 'ten'"),
    "num_classes 10.5": (lambda c: c.update(num_classes=10.5), r": num_classes must be an integer >= 0, got 10\.5"),
    "num_classes 7": (lambda c: c.update(num_classes=7), r"num_classes must be the num_classes of model_args \(3\)"),
    "model_args num_classes 'ten'": (
        lambda c: c["model_args"].update(num_classes="ten"),
        r"model_args\.num_classes must be an integer >= 0, got 'ten'",
    ),
    "model_args num_classes 10.5": (
        lambda c: c["model_args"].update(num_classes=10.5),
        r"model_args\.num_classes must be an integer >= 0, got 10\.5",
    ),
    "pretrained_cfg_overlay in model_args": (
        lambda c: c["model_args"].update(pretrained_cfg_overlay={"crop_pct": 0.9}),
        r"model_args\.pretrained_cfg_overlay must be absent \(a keyword of the build",
    ),
    "unknown model_args key": (
        lambda c: c["model_args"].update(colour="red"),
        r"model_args do not build deit_mini \(deit_mini: unknown option\(s\) colour",
    ),
    "crop_pct 0": (lambda c: c["pretrained_cfg"].update(crop_pct=0), r"pretrained_cfg\.crop_pct must be a number in"),
    "crop_pct 'a'": (lambda c: c["pretrained_cfg"].update(crop_pct="a"), r"crop_pct must be a number in \(0, 2\.0\]"),
    "input_size": (lambda c: c["pretrained_cfg"].update(input_size=[3, 32]), r"input_size must be \[channels"),
    "interpolation": (lambda c: c["pretrained_cfg"].update(interpolation="magic"), r"interpolation must be one of"),
    "model_args list": (lambda c: c.update(model_args=[1]), r"model_args, pretrained_cfg and vitlab_cfg objects"),
}


@pytest.mark.parametrize("case", sorted(TAMPERED_CONFIGS))
def test_a_tampered_model_folder_is_one_line_everywhere(tmp_path, capsys, case):
    change, message = TAMPERED_CONFIGS[case]
    build_model("deit_mini", num_classes=3, depth=1).save_pretrained(tmp_path / "m")
    config = tmp_path / "m" / "config.json"
    config.write_text(json.dumps(_tamper(json.loads(config.read_text()), change)))
    with pytest.raises(ValueError, match=message) as e:
        vitlab.from_pretrained(tmp_path / "m")
    assert "\n" not in str(e.value) and str(config) in str(e.value)
    for argv in (["eval", str(tmp_path / "m"), "--data", "mnist"], ["convert", str(tmp_path / "m"), "--json"]):
        code, _, err = run_cli(capsys, *argv, "--device", "cpu") if argv[0] == "eval" else run_cli(capsys, *argv)
        assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, (argv, err)
        assert re.search(message, err), (argv, err)


def test_weights_of_another_kind_than_the_model_are_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    build_model("deit_mini", num_classes=3, depth=1).save_pretrained(tmp_path / "m")
    weights = tmp_path / "m" / "model.safetensors"
    state = load_file(weights)
    state["head.weight"] = state["head.weight"].round().long()
    save_file(state, weights)
    with pytest.raises(ValueError, match=r"model\.safetensors: tensor head\.weight is torch\.int64 \(integer\), but the "
                                         r"model's head\.weight is torch\.float32 \(floating point\)") as e:  # fmt: skip
        vitlab.from_pretrained(tmp_path / "m")
    assert "\n" not in str(e.value)
    state["head.weight"] = state["head.weight"].to(torch.bfloat16)  # another precision: a cast keeps it
    save_file(state, weights)
    assert vitlab.from_pretrained(tmp_path / "m").head.weight.dtype == torch.float32
    # integer buffers that are integers in the model too (BatchNorm's counters) load
    build_model("eamlp_bn_mini", num_classes=3).save_pretrained(tmp_path / "bn")
    loaded = vitlab.from_pretrained(tmp_path / "bn").state_dict()
    assert loaded["blocks.0.norm1.num_batches_tracked"].dtype == torch.int64
