"""vitlab.interop.pretrained.load_model: one way from a name, a training checkpoint or a weights file to a model."""

from __future__ import annotations

import pytest
import torch

import vitlab
from vitlab.checkpoint import load_checkpoint, save_checkpoint
from vitlab.interop import save_weights
from vitlab.interop.pretrained import load_model

KWARGS = dict(img_size=28, in_chans=1, num_classes=10, patch_size=7)


def trained(seed: int = 0) -> torch.nn.Module:
    """A small deit_mini whose weights differ from any fresh init."""
    torch.manual_seed(seed)
    model = vitlab.create_model("deit_mini", **KWARGS)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model.eval()


def same_function(a: torch.nn.Module, b: torch.nn.Module) -> None:
    x = torch.randn(2, 1, 28, 28)
    with torch.no_grad():
        torch.testing.assert_close(a(x), b(x), rtol=0, atol=0)


@pytest.fixture
def run_dir(tmp_path):
    """A `vitlab train` output folder: last.pt with model and EMA weights, epoch 3."""
    model, ema = trained(0), trained(1)
    state = {"model_name": "deit_mini", "model_kwargs": KWARGS, "model": model.state_dict(), "epoch": 3}
    save_checkpoint({**state, "ema": {"module": ema.state_dict()}}, tmp_path / "last.pt")
    return tmp_path, model, ema


def test_name_only_is_a_random_init_in_eval_mode():
    torch.manual_seed(5)
    model = load_model("deit_mini", **KWARGS)
    torch.manual_seed(5)
    same_function(model, vitlab.create_model("deit_mini", **KWARGS).eval())
    assert not model.training and model.meta["weights"] == "random init"
    assert model.meta["input_size"] == (1, 28, 28) and model.num_classes == 10


def test_training_checkpoint_path_and_run_folder(run_dir):
    folder, model, ema = run_dir
    for where in (folder / "last.pt", folder, str(folder)):
        loaded = load_model(where)
        same_function(loaded, model)
        assert not loaded.training
        assert loaded.meta["weights"] == f"{folder / 'last.pt'} (vitlab checkpoint, epoch 3)"
    loaded = load_model(folder, ema=True)
    same_function(loaded, ema)
    assert loaded.meta["weights"].endswith("(vitlab checkpoint, epoch 3, EMA)")


def test_name_and_training_checkpoint(run_dir):
    folder, model, ema = run_dir
    same_function(load_model("deit_mini", folder / "last.pt"), model)
    same_function(load_model("deit_mini", folder, ema=True), ema)
    # an already read checkpoint, and overrides on top of the recorded constructor options
    loaded = load_model("deit_mini", load_checkpoint(folder), drop_path_rate=0.1)
    same_function(loaded, model)
    with pytest.raises(ValueError, match="holds a 'deit_mini' model, not 'cpvt_mini'; use --model deit_mini"):
        load_model("cpvt_mini", folder)
    with pytest.raises(ValueError, match="pass the weights only once"):
        load_model(folder, folder)


def test_name_and_safetensors(tmp_path):
    model = trained()
    path = save_weights(model, tmp_path / "w.safetensors")
    kwargs = {k: v for k, v in KWARGS.items() if k != "num_classes"}  # taken from head.weight
    loaded = load_model("deit_mini", path, **kwargs)
    same_function(loaded, model)
    assert loaded.num_classes == 10 and not loaded.training
    assert loaded.meta["weights"] == f"{path} (vitlab weights)"
    # a plain state dict from torch.save is read the same way
    torch.save(model.state_dict(), tmp_path / "w.pt")
    same_function(load_model("deit_mini", tmp_path / "w.pt", **kwargs), model)


def test_plain_weights_errors(tmp_path):
    path = save_weights(trained(), tmp_path / "w.safetensors")
    with pytest.raises(ValueError, match=r"--ema needs a checkpoint written by `vitlab train`; .* holds plain weights"):
        load_model("deit_mini", path, ema=True, **KWARGS)
    with pytest.raises(ValueError, match="does not fit") as e:
        load_model("cpvt_mini", path, **KWARGS)
    assert "check the model name and --img-size / --in-chans / --num-classes" in str(e.value)
    assert "\n" not in str(e.value)
    with pytest.raises(FileNotFoundError, match="not found"):
        load_model("deit_mini", tmp_path / "missing.safetensors")
    with pytest.raises(FileNotFoundError, match="not found"):
        load_model(tmp_path / "missing.pt")
    with pytest.raises(ValueError, match="not a vitlab checkpoint"):
        load_model(path)  # plain weights say nothing about the model: a name is needed
    with pytest.raises(ValueError, match="unknown model 'deit_mimi'; did you mean one of the closest: deit_mini"):
        load_model("deit_mimi")
    with pytest.raises(ValueError, match="--ema needs a checkpoint"):
        load_model("deit_mini", ema=True)


# ------------------------------------------------------------------------------------------ checksum, NaN weights
def test_checksum_written_and_verified(run_dir, tmp_path):
    folder, model, _ = run_dir
    ckpt = load_checkpoint(folder)
    assert ckpt["version"] == 2 and ckpt["checksum"]["algo"] == "crc32"
    assert len(ckpt["checksum"]["tensors"]) == 2 * len(model.state_dict())  # model and EMA weights
    # the same contents saved again carry the same checksum; a changed tensor or value another one
    raw = torch.load(folder / "last.pt", weights_only=True)
    for key, value, same in (("epoch", 3, True), ("epoch", 4, False)):
        save_checkpoint({**raw, key: value}, tmp_path / "again.pt")
        again = load_checkpoint(tmp_path / "again.pt")["checksum"]
        assert (again == ckpt["checksum"]) is same
    # a file whose contents changed after saving: one line naming the first tensor that differs
    bias = raw["model"]["head.bias"]
    raw["model"]["head.bias"] = bias + 1
    torch.save(raw, tmp_path / "edited.pt")
    for load in (load_checkpoint, load_model):
        with pytest.raises(
            ValueError, match=r"edited\.pt is corrupt: tensor model/head\.bias differs from the checksum"
        ):
            load(tmp_path / "edited.pt")
    raw["model"]["head.bias"] = bias
    raw["epoch"] = 9
    torch.save(raw, tmp_path / "epoch.pt")
    with pytest.raises(ValueError, match=r"is corrupt: its recorded values .* differ"):
        load_checkpoint(tmp_path / "epoch.pt")
    del raw["checksum"]
    torch.save(raw, tmp_path / "dropped.pt")
    with pytest.raises(ValueError, match="is corrupt: its checksum is missing"):
        load_checkpoint(tmp_path / "dropped.pt")


def test_checkpoints_without_checksum_still_load(run_dir, tmp_path):
    """Version 1 (before checksums) and checkpoints edited by other tools and re-saved without one."""
    folder, model, _ = run_dir
    raw = torch.load(folder / "last.pt", weights_only=True)
    del raw["checksum"]
    raw["version"] = 1
    torch.save(raw, tmp_path / "v1.pt")
    same_function(load_model(tmp_path / "v1.pt"), model)


def test_non_finite_weights_warn_with_their_names(tmp_path):
    from vitlab.checkpoint.safeload import NonFiniteWeightsWarning

    model = trained()
    state = model.state_dict()
    state["head.weight"][0, 0] = float("nan")
    state["pos_embed"][0, 0, 0] = float("inf")
    save_checkpoint({"model_name": "deit_mini", "model_kwargs": KWARGS, "model": state}, tmp_path / "nan.pt")
    with pytest.warns(
        NonFiniteWeightsWarning,
        match=r"nan\.pt holds non-finite values \(NaN or inf\) in .*model/pos_embed.*model/head\.weight",
    ):
        load_model(tmp_path / "nan.pt")
    path = save_weights(state, tmp_path / "nan.safetensors")
    kwargs = {k: v for k, v in KWARGS.items() if k != "num_classes"}
    with pytest.warns(
        NonFiniteWeightsWarning, match=r"nan\.safetensors holds non-finite values .* in head\.weight, pos_embed"
    ):
        load_model("deit_mini", path, **kwargs)
