"""The speed and memory options of ``vitlab train``: gradient checkpointing through the model's own
``set_grad_checkpointing``, and the option combinations that cannot work, refused in one line."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import vitlab
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


def with_recomputed_blocks(model: torch.nn.Module) -> torch.nn.Module:
    """A model given timm's ``set_grad_checkpointing``: each block, when enabled, keeps only its input for the
    backward pass and recomputes its activations there (the RNG state of drop-path is replayed)."""

    class Recomputed(type(model)):
        def set_grad_checkpointing(self, enable: bool = True) -> None:
            self.calls = [*getattr(self, "calls", []), enable]
            for block in self.blocks:
                own = type(block).forward.__get__(block)
                block.forward = partial(checkpoint, own, use_reentrant=False) if enable else own

    model.__class__ = Recomputed
    return model


def test_grad_checkpointing_calls_the_models_method_and_trains_the_same_model(tmp_path, monkeypatch):
    """Stochastic depth on (drop-path draws replayed in the recomputation): the same weights, up to the
    order of float32 sums in the recomputed backward pass."""
    import vitlab.models

    made = []
    original = vitlab.models.create_model

    def create(name, **kw):
        made.append(with_recomputed_blocks(original(name, **kw)))
        return made[-1]

    monkeypatch.setattr(vitlab.models, "create_model", create)
    plain = weights_after(tmp_path, "plain", "--drop-path", "0.2")
    recomputed = weights_after(tmp_path, "ckpt", "--drop-path", "0.2", "--grad-checkpointing")
    assert getattr(made[0], "calls", []) == [] and made[1].calls == [True]
    assert max((plain[k] - recomputed[k]).abs().max().item() for k in plain) < 1e-5


@pytest.mark.skipif(
    not hasattr(vitlab.create_model("deit_mini"), "set_grad_checkpointing"),
    reason="the models' set_grad_checkpointing is not on this branch yet",
)
def test_grad_checkpointing_of_the_models_trains_the_same_model(tmp_path):
    plain = weights_after(tmp_path, "plain", "--drop-path", "0.2")
    recomputed = weights_after(tmp_path, "ckpt", "--drop-path", "0.2", "--grad-checkpointing")
    assert max((plain[k] - recomputed[k]).abs().max().item() for k in plain) < 1e-5


def test_impossible_combinations_are_one_line(tmp_path, capsys, monkeypatch):
    import vitlab.models

    assert cli_main(["train", *TINY_RUN, "--fsdp", "--ema", "0.9", "--out", str(tmp_path / "a")]) == 2
    assert "--ema keeps a whole copy of the weights, which --fsdp does not" in one_line_error(capsys)
    without = vitlab.models.create_model("deit_mini", img_size=28, in_chans=1, num_classes=10, patch_size=7)
    monkeypatch.setattr(vitlab.models, "create_model", lambda name, **kw: torch.nn.Sequential(without))
    assert cli_main(["train", *TINY_RUN, "--grad-checkpointing", "--out", str(tmp_path / "b")]) == 2
    assert "cannot recompute its blocks (no set_grad_checkpointing)" in one_line_error(capsys)
