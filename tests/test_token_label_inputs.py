"""Token-label maps that do not fit the data: a map naming a class the data does not have is one line (it was
an "index out of bounds" error from deep inside the loss, and a device-side assert on a GPU)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vitlab.cli import main as cli_main
from vitlab.data import dense_targets
from vitlab.data.synth import synthesize


def test_dense_targets_refuse_a_class_outside_the_data():
    classes = torch.tensor([[[0, 2, 9]]])
    weights = torch.ones(1, 1, 3)
    with pytest.raises(ValueError, match=r"name class 9, but the data has 3 classes \(0\.\.2\)"):
        dense_targets(classes, weights, 3)
    with pytest.raises(ValueError, match="name class -1"):
        dense_targets(torch.tensor([[[-1, 0]]]), torch.ones(1, 1, 2), 3)
    assert dense_targets(classes, weights, 10)[0, 0, 9] == 1


def test_training_on_the_maps_of_a_teacher_of_other_classes_is_one_line(tmp_path, capsys):
    """Maps a 10-class teacher wrote (classes up to 9) beside a 3-class folder: `vitlab train --token-label`
    stops at the first batch with one line saying so."""
    data = tmp_path / "data"
    synthesize(data, num_classes=3, train_per_class=4, val_per_class=1, size=(32, 32))
    maps = np.zeros((2, 2, 4, 4), np.float16)
    maps[0] = [[[0.7]], [[0.3]]]
    maps[1] = [[[9]], [[1]]]
    for image in data.rglob("*.JPEG"):
        np.save(image.with_name(image.name + ".tl.npy"), maps)
    argv = ["train", "--model", "refiner_vit_mini", "--model-arg", "patch_size=8", "--model-arg", "aux_head=True",
            "--img-size", "32", "--data", f"folder:{data}", "--token-label", "--epochs", "1", "--batch-size", "4",
            "--threads", "1", "--no-progress", "--out", str(tmp_path / "run")]  # fmt: skip
    capsys.readouterr()
    assert cli_main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert "the token-label maps name class 9, but the data has 3 classes (0..2)" in err and "vitlab relabel" in err
