"""The timm plug-in and the Hugging Face Trainer adapter.

timm and transformers cannot be installed beside this project's CPU torch, so both are exercised through
stand-ins that follow their documented behaviour: the timm registry as timm 1.0 implements it (a model name
splits at its first dot into architecture and pretrained tag; ``create_model`` drops None options and calls
the architecture's entry point with ``pretrained``, ``pretrained_cfg`` (the tag) and
``pretrained_cfg_overlay``; ``register_model`` reads the entry point's module's ``default_cfgs``; the
pretrained configs are a dataclass that refuses unknown fields), and the Trainer's calling convention
(batch columns filtered by ``forward``'s parameters, ``model(**batch)``, the loss from ``outputs["loss"]``,
predictions from the other entries).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import inspect
import os
import sys
import types
from collections import deque
from typing import Any

import pytest
import torch

import vitlab
from vitlab.common.extras import MissingExtra
from vitlab.interop import timm as timm_plugin
from vitlab.interop.hf import TrainerModel


@dataclasses.dataclass
class PretrainedCfg:  # timm 1.0's fields; an unknown key is a TypeError, as there
    url: Any = None
    file: Any = None
    state_dict: Any = None
    hf_hub_id: Any = None
    hf_hub_filename: Any = None
    source: Any = None
    architecture: Any = None
    tag: Any = None
    custom_load: bool = False
    input_size: tuple = (3, 224, 224)
    test_input_size: Any = None
    min_input_size: Any = None
    fixed_input_size: bool = False
    interpolation: str = "bicubic"
    crop_pct: float = 0.875
    test_crop_pct: Any = None
    crop_mode: str = "center"
    mean: tuple = (0.485, 0.456, 0.406)
    std: tuple = (0.229, 0.224, 0.225)
    num_classes: int = 1000
    label_offset: Any = None
    label_names: Any = None
    label_descriptions: Any = None
    pool_size: Any = None
    test_pool_size: Any = None
    first_conv: Any = None
    classifier: Any = None
    license: Any = None
    description: Any = None
    origin_url: Any = None
    paper_name: Any = None
    paper_ids: Any = None
    notes: Any = None


def timm_standin() -> types.SimpleNamespace:
    """A minimal timm registry: register_model, generate_default_cfgs, create_model, list_models,
    resolve_data_config."""
    entrypoints: dict[str, Any] = {}
    tags: dict[str, list[str]] = {}
    cfgs: dict[str, PretrainedCfg] = {}

    def split(name: str) -> tuple[str, str]:
        arch, _, tag = name.partition(".")
        return arch, tag

    def generate_default_cfgs(table: dict[str, dict]) -> dict[str, dict]:
        out: dict[str, dict] = {}
        for name, cfg in table.items():
            arch, tag = split(name)
            entry = out.setdefault(arch, {"tags": deque(), "cfgs": {}})
            default, tag = tag.endswith("*"), tag.rstrip("*")  # a tag ending in '*' is the default, first
            entry["tags"].appendleft(tag) if default else entry["tags"].append(tag)
            entry["cfgs"][tag] = PretrainedCfg(**cfg)
        return out

    def register_model(fn):
        arch = fn.__name__
        entrypoints[arch] = fn
        default = getattr(sys.modules[fn.__module__], "default_cfgs", {}).get(arch)
        for tag in default["tags"] if default else ():
            cfgs[f"{arch}.{tag}"] = dataclasses.replace(default["cfgs"][tag], architecture=arch, tag=tag)
            tags.setdefault(arch, []).append(f"{arch}.{tag}")
        return fn

    def create_model(name, pretrained=False, pretrained_cfg=None, pretrained_cfg_overlay=None, **kwargs):
        kwargs = {k: v for k, v in kwargs.items() if v is not None}
        arch, tag = split(name)
        if arch not in entrypoints:
            raise RuntimeError(f"Unknown model ({arch})")
        return entrypoints[arch](
            pretrained=pretrained,
            pretrained_cfg=pretrained_cfg or tag or None,
            pretrained_cfg_overlay=pretrained_cfg_overlay,
            **kwargs,
        )

    def list_models(pattern="*", include_tags=False):
        names = [n for a in entrypoints for n in (tags.get(a, [a]) if include_tags else [a])]
        return sorted(fnmatch.filter(names, pattern))

    def resolve_data_config(args=None, model=None):
        cfg = dict(getattr(model, "pretrained_cfg", {}))
        keys = ("input_size", "interpolation", "mean", "std", "crop_pct", "crop_mode")
        return {k: cfg.get(k, getattr(PretrainedCfg, k)) for k in keys}

    return types.SimpleNamespace(
        register_model=register_model,
        generate_default_cfgs=generate_default_cfgs,
        create_model=create_model,
        list_models=list_models,
        resolve_data_config=resolve_data_config,
        cfgs=cfgs,
    )


@pytest.fixture
def timm(monkeypatch):
    monkeypatch.setattr(timm_plugin, "default_cfgs", {})  # a fresh registration for each stand-in
    standin = timm_standin()
    names = timm_plugin.register(standin)
    assert timm_plugin.register(standin) == names  # twice: nothing more
    return standin


def test_every_model_is_registered_with_its_config(timm):
    listed = timm.list_models("vitlab*", include_tags=True)
    assert listed == sorted(f"vitlab.{n}" for n in vitlab.list_models()) and timm.list_models("vitlab*") == ["vitlab"]
    refiner = timm.cfgs["vitlab.refiner_vit_s"]
    assert (refiner.crop_pct, refiner.mean, refiner.input_size) == (0.9, (0.5, 0.5, 0.5), (3, 224, 224))
    assert refiner.first_conv == "patch_embed.stem.0" and "83.6" in refiner.notes[0]  # its CNN stem sees the image
    deit = timm.cfgs["vitlab.deit_small_distilled_patch16_224"]
    assert deit.classifier == ("head", "head_dist") and deit.origin_url.endswith("649709d9.pth")
    assert timm.cfgs["vitlab.tnt_mini"].input_size == (3, 32, 32)


def test_timm_create_model_and_a_train_step(timm):
    # what timm's train.py passes: unset options are None and dropped by timm before the entry point
    model = timm.create_model(
        "vitlab.tnt_mini", pretrained=False, num_classes=10, drop_rate=0.0, drop_path_rate=0.1, global_pool=None
    )
    assert isinstance(model, vitlab.models.TNT) and model.num_classes == 10
    data = timm.resolve_data_config({}, model=model)
    assert data["input_size"] == (3, 32, 32)  # the model's own size, not timm's default 224
    model.set_grad_checkpointing(True)
    x = torch.randn(4, *data["input_size"])
    loss = torch.nn.functional.cross_entropy(model(x), torch.tensor([0, 1, 2, 3]))
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())
    feats = timm.create_model("vitlab.deit_mini", features_only=True, out_indices=(1, 3))
    assert [tuple(f.shape) for f in feats(torch.randn(1, 3, 32, 32))] == [(1, 64, 8, 8)] * 2


def test_timm_pretrained_reads_local_files_only(timm, tmp_path, monkeypatch):
    monkeypatch.setenv("VITLAB_WEIGHTS", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="never downloads"):
        timm.create_model("vitlab.deit_mini", pretrained=True)
    trained = vitlab.create_model("deit_mini", num_classes=4)
    trained.save_pretrained(tmp_path / "run")
    # train.py --pretrained-path: pretrained_cfg_overlay=dict(file=..., num_classes=-1)
    model = timm.create_model(
        "vitlab.deit_mini", pretrained=True, pretrained_cfg_overlay={"file": str(tmp_path / "run")}
    )
    assert torch.equal(model.head.weight, trained.head.weight)
    with pytest.raises(ValueError, match="unknown model 'no_such'"):
        timm.create_model("vitlab.no_such")


def test_register_without_timm_is_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "timm", None)
    monkeypatch.setitem(sys.modules, "timm.models", None)
    monkeypatch.setattr(timm_plugin, "default_cfgs", {})
    with pytest.raises(MissingExtra, match=r"the timm plug-in needs timm .*pip install timm"):
        timm_plugin.register()


# ------------------------------------------------------------------------------- Hugging Face Trainer
def trainer_step(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, tuple]:
    """What transformers.Trainer does with a batch: keep the columns forward() names, call model(**batch),
    take the loss from outputs["loss"] and the predictions from the other entries."""
    accepted = set(inspect.signature(model.forward).parameters)
    outputs = model(**{k: v for k, v in batch.items() if k in accepted})
    loss = outputs["loss"] if isinstance(outputs, dict) else outputs[0]
    logits = tuple(v for k, v in outputs.items() if k != "loss")
    return loss, logits


def test_trainer_adapter():
    torch.manual_seed(0)
    model = vitlab.create_model("deit_mini", num_classes=3)
    wrapped = TrainerModel(model, label_smoothing=0.1)
    assert wrapped.main_input_name == "pixel_values"
    x, y = torch.randn(4, 3, 32, 32), torch.tensor([0, 2, 1, 0])
    batch = {"pixel_values": x, "labels": y, "image_id": torch.arange(4)}  # an extra column is filtered out
    loss, (logits,) = trainer_step(wrapped, batch)
    torch.testing.assert_close(logits, model(x))
    torch.testing.assert_close(loss, torch.nn.functional.cross_entropy(model(x), y, label_smoothing=0.1))
    loss.backward()
    assert model.head.weight.grad is not None
    soft = torch.softmax(torch.randn(4, 3), 1)  # Mixup / CutMix targets
    loss_soft, _ = trainer_step(wrapped, {"pixel_values": x, "labels": soft})
    torch.testing.assert_close(loss_soft, -(soft * model(x).log_softmax(1)).sum(1).mean())
    assert list(wrapped(pixel_values=x)) == ["logits"]
    wrapped.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert model.grad_checkpointing and wrapped.is_gradient_checkpointing
    wrapped.gradient_checkpointing_disable()
    assert not model.grad_checkpointing


def test_trainer_adapter_saves_a_model_folder(tmp_path):
    model = vitlab.create_model("aft_simple_mini", num_classes=3).eval()
    TrainerModel(model).save_pretrained(tmp_path / "out", safe_serialization=True)
    again = vitlab.from_pretrained(tmp_path / "out")
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(again(x), model(x))


def test_trainer_adapter_takes_newer_transformers_options():
    model = vitlab.create_model("deit_mini", num_classes=3)
    wrapped = TrainerModel(model)
    # transformers 5 passes more than gradient_checkpointing_kwargs
    wrapped.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False}, every_n_layers=1)
    assert model.grad_checkpointing


def test_what_the_trainer_saves_loads_back(tmp_path):
    """The Trainer writes model.state_dict() of a non-transformers model to model.safetensors (checkpoints and
    save_model()); the callback adds config.json; vitlab reads either form back with identical logits."""
    from safetensors.torch import save_file

    from vitlab.interop.hf import save_folder

    torch.manual_seed(0)
    model = vitlab.create_model("deit_mini", num_classes=3).eval()
    wrapped = TrainerModel(model)
    state = wrapped.state_dict()
    assert state.keys() == model.state_dict().keys()  # no "model." prefix
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        expected = model(x)
    save_file({k: v.contiguous() for k, v in state.items()}, tmp_path / "model.safetensors")  # the Trainer's save
    from_weights = vitlab.create_model("deit_mini", checkpoint_path=tmp_path).eval()
    save_folder(wrapped, tmp_path)
    from_folder = vitlab.from_pretrained(tmp_path)
    with torch.no_grad():
        assert torch.equal(from_weights(x), expected) and torch.equal(from_folder(x), expected)
    # resuming: the Trainer loads the file back into its model; a plain wrapper's prefixed keys work too
    fresh = TrainerModel(vitlab.create_model("deit_mini", num_classes=3))
    fresh.load_state_dict({f"model.{k}": v for k, v in state.items()})
    assert all(torch.equal(v, state[k]) for k, v in fresh.state_dict().items())
    with pytest.raises(ValueError, match="needs the Trainer's model to be a vitlab TrainerModel"):
        save_folder(model, tmp_path / "other")


def test_timm_reads_vitlab_folders_and_hub_configs(timm, tmp_path):
    """timm's local-dir: loader reads config.json (architecture, model_args, pretrained_cfg) and calls the
    entry point with the folder as pretrained_cfg["file"]; timm's own hub export names the architecture
    vitlab.<name> and keeps the tag."""
    import json

    trained = vitlab.create_model("deit_mini", num_classes=4)
    trained.save_pretrained(tmp_path / "run")
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    cfg = {**config["pretrained_cfg"], "file": str(tmp_path / "run"), "source": "local-dir"}
    kwargs = {**config["model_args"], "pretrained_model_args": config["model_args"]}
    model = timm.create_model(config["architecture"], pretrained=True, pretrained_cfg=cfg, **kwargs)
    assert torch.equal(model.head.weight, trained.head.weight)
    assert model.pretrained_cfg["architecture"] == "vitlab.deit_mini" and model.pretrained_cfg["tag"] == "deit_mini"
    hub_cfg = {k: v for k, v in model.pretrained_cfg.items() if k != "architecture"}  # as timm's save_for_hf
    assert timm_plugin._model_name(hub_cfg) == "deit_mini"
    meta = timm.create_model("vitlab.deit_mini", device="meta", dtype=torch.float64)
    assert meta.head.weight.device.type == "meta" and meta.head.weight.dtype == torch.float64
    assert isinstance(timm.create_model("vitlab"), vitlab.models.VisionTransformer)  # the default tag: DeiT-Ti


def save_for_hf_layout(model: torch.nn.Module, folder, model_args: dict | None = None) -> dict:
    """What timm 1.0's ``save_for_hf(model, folder)`` writes, by hand (timm is not installed): the weights as
    ``pytorch_model.bin`` (its default, ``torch.save`` of the state_dict) and ``config.json`` with the
    architecture, classes and features at the top, model_args only when given, and the pretrained_cfg without
    its source entries and nulls (``filter_pretrained_cfg(remove_source=True, remove_null=True)``)."""
    import json

    folder.mkdir(parents=True)
    torch.save(model.state_dict(), folder / "pytorch_model.bin")
    source = ("file", "url", "hf_hub_id", "hf_hub_filename", "source")
    cfg = {k: v for k, v in model.pretrained_cfg.items() if v is not None and k not in source}
    config = {"architecture": cfg.pop("architecture"), "num_classes": model.num_classes,
              "num_features": model.num_features, "global_pool": model.global_pool}  # fmt: skip
    if model_args:
        config["model_args"] = model_args
    config["pretrained_cfg"] = cfg
    (folder / "config.json").write_text(json.dumps(config, default=list))
    return config


def timm_local_dir(timm, folder, **kwargs):
    """``timm.create_model("local-dir:FOLDER", pretrained=True)``: timm reads config.json (the top-level
    num_classes into the pretrained_cfg, ``file`` the folder) and calls the architecture with model_args."""
    import json

    config = json.loads((folder / "config.json").read_text())
    cfg = {**config["pretrained_cfg"], "file": str(folder), "source": "local-dir", "num_classes": config["num_classes"]}
    args = config.get("model_args", {})
    return timm.create_model(config["architecture"], pretrained=True, pretrained_cfg=cfg, **args, **kwargs)


def test_a_folder_timms_save_for_hf_writes_loads_back(timm, tmp_path):
    """timm's default save_for_hf writes pytorch_model.bin (a pickle): it loads through local-dir: and through
    vitlab.create_model(checkpoint_path=...), read with torch.load(weights_only=True); a pickle that asks to
    run code is refused."""
    torch.manual_seed(0)
    trained = timm.create_model("vitlab.deit_mini", num_classes=5)
    save_for_hf_layout(trained, tmp_path / "hf")
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        expected = trained.eval()(x)
        for model in (
            timm_local_dir(timm, tmp_path / "hf"),
            vitlab.create_model("deit_mini", checkpoint_path=tmp_path / "hf"),
        ):
            assert model.num_classes == 5 and torch.equal(model.eval()(x), expected)
    # a model built with other options: save_for_hf(model_args=...) records them
    deeper = timm.create_model("vitlab.deit_mini", num_classes=2, depth=1)
    save_for_hf_layout(deeper, tmp_path / "hf1", model_args=dict(deeper.model_kwargs))
    loaded = timm_local_dir(timm, tmp_path / "hf1")
    assert len(loaded.blocks) == 1 and torch.equal(loaded.head.weight, deeper.head.weight)
    # nothing in pytorch_model.bin runs
    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    torch.save({"head.weight": Evil()}, tmp_path / "hf" / "pytorch_model.bin")
    for load in (lambda: timm_local_dir(timm, tmp_path / "hf"),
                 lambda: vitlab.create_model("deit_mini", checkpoint_path=tmp_path / "hf")):  # fmt: skip
        with pytest.raises(ValueError, match="asks to run code and vitlab will not load it") as e:
            load()
        assert "\n" not in str(e.value) and not marker.exists()


def test_train_py_pretrained_path_head_marker_is_not_kept(timm, tmp_path):
    """timm's train.py --pretrained-path passes pretrained_cfg_overlay={"file": ..., "num_classes": -1}: the
    weights load, the head follows --num-classes, and the -1 is not saved with the model."""
    trained = vitlab.create_model("deit_mini", num_classes=4)
    trained.save_pretrained(tmp_path / "m")
    model = timm.create_model("vitlab.deit_mini", pretrained=True, num_classes=7,
                              pretrained_cfg_overlay={"file": str(tmp_path / "m"), "num_classes": -1})  # fmt: skip
    assert model.num_classes == 7 and torch.equal(model.blocks[0].norm1.weight, trained.blocks[0].norm1.weight)
    assert model.pretrained_cfg["num_classes"] != -1
    model.save_pretrained(tmp_path / "again")
    assert vitlab.from_pretrained(tmp_path / "again").num_classes == 7
