"""The speed and memory options of ``vitlab train``: gradient checkpointing through the model's own
``set_grad_checkpointing`` (timm's method), and the option combinations that cannot work, refused in one line."""

from __future__ import annotations

import pytest
import torch

from vitlab.checkpoint import load_checkpoint
from vitlab.cli import main as cli_main

TINY_RUN = [
    "--model", "deit_mini", "--model-arg", "patch_size=7", "--model-arg", "depth=2", "--model-arg", "embed_dim=32",
    "--train-limit", "64", "--holdout", "100", "--batch-size", "16", "--threads", "1", "--no-progress",
    "--epochs", "1", "--crop-padding", "0",
]  # fmt: skip


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err, err
    return err


def weights_after(tmp_path, name: str, *extra: str) -> dict[str, torch.Tensor]:
    assert cli_main(["train", *TINY_RUN, "--out", str(tmp_path / name), *extra]) == 0
    return load_checkpoint(tmp_path / name / "last.pt")["model"]


def test_grad_checkpointing_calls_the_models_method_and_trains_the_same_model(tmp_path, monkeypatch):
    """Stochastic depth on (the drop-path draws are replayed in the recomputation): the same weights, up to
    the order of float32 sums in the recomputed backward pass."""
    from vitlab.models import VisionTransformer

    calls = []
    original = VisionTransformer.set_grad_checkpointing

    def spy(self, enable: bool = True) -> None:
        calls.append(enable)
        original(self, enable)

    monkeypatch.setattr(VisionTransformer, "set_grad_checkpointing", spy)
    plain = weights_after(tmp_path, "plain", "--drop-path", "0.2")
    assert calls == []
    recomputed = weights_after(tmp_path, "ckpt", "--drop-path", "0.2", "--grad-checkpointing")
    assert calls == [True]
    assert max((plain[k] - recomputed[k]).abs().max().item() for k in plain) < 1e-5


def test_impossible_combinations_are_one_line(tmp_path, capsys, monkeypatch):
    import vitlab.models

    assert cli_main(["train", *TINY_RUN, "--fsdp", "--ema", "0.9", "--out", str(tmp_path / "a")]) == 2
    assert "--ema keeps a whole copy of the weights, which --fsdp does not" in one_line_error(capsys)
    without = vitlab.models.build_model("deit_mini", img_size=28, in_chans=1, num_classes=10, patch_size=7)
    monkeypatch.setattr(vitlab.models, "build_model", lambda name, **kw: torch.nn.Sequential(without))
    assert cli_main(["train", *TINY_RUN, "--grad-checkpointing", "--out", str(tmp_path / "b")]) == 2
    assert "cannot recompute its blocks (no set_grad_checkpointing)" in one_line_error(capsys)


def test_options_that_would_be_dropped_or_do_nothing_are_said(tmp_path, capsys):
    """--lr beside --base-lr (the run kept base_lr and dropped lr without a word) is refused; --fsdp in a single
    process (nothing to shard over) and --tf32 on the CPU (a GPU's matrix units) each warn in one line and train."""
    import warnings

    assert cli_main(["train", *TINY_RUN, "--lr", "0.01", "--base-lr", "0.001", "--out", str(tmp_path / "a")]) == 2
    assert "--lr and --base-lr both set the learning rate" in one_line_error(capsys)
    assert not (tmp_path / "a").exists()
    assert cli_main(["train", *TINY_RUN, "--teacher-timeout", "0", "--out", str(tmp_path / "a")]) == 2
    assert "argument --teacher-timeout: must be a number > 0, got '0'" in one_line_error(capsys)
    for flag, words in (
        ("--fsdp", "this run is a single process, so it trains the model unsharded"),
        ("--tf32", "it has no effect on this run's device (cpu)"),
    ):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert cli_main(["train", *TINY_RUN, flag, "--device", "cpu", "--out", str(tmp_path / flag[2:])]) == 0
        said = [str(w.message) for w in caught if flag in str(w.message)]
        assert len(said) == 1 and words in said[0] and "\n" not in said[0], [str(w.message) for w in caught]


def test_a_config_built_in_python_checks_its_types_as_a_recipe_does():
    """The type check lives in TrainConfig itself: a value of another type is one line however the config is
    built (recipe, flags, `vitlab study --config`, Python), never an AttributeError later."""
    from vitlab.engine.config import TrainConfig, TrainingError

    with pytest.raises(TrainingError, match=r"^auto_augment must be a string \(or null\), got 7$"):
        TrainConfig(auto_augment=7)
    with pytest.raises(TrainingError, match=r"lr must be a number, got '1e-3' \(a number as text"):
        TrainConfig(lr="1e-3")
