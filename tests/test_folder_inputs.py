"""Image folders as users leave them: an empty class folder, a named pipe among the images, unreadable images in
evaluation, two images of one stem, through the folder source, the loaders and `vitlab relabel`."""

from __future__ import annotations

import io
import os
import threading
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch import nn

from vitlab.cli import main as cli_main
from vitlab.data import create_loader, create_transform, open_source


def _jpeg(value: int, size=(20, 16)) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.full((size[1], size[0], 3), value, np.uint8)).save(buf, "JPEG")
    return buf.getvalue()


def make_folder(root: Path, per_class: int = 3, classes=("a", "b")) -> Path:
    for c, name in enumerate(classes):
        (root / name).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            (root / name / f"img{i}.jpg").write_bytes(_jpeg(40 * c + 10 * i))
    return root


def test_an_empty_class_folder_is_one_line(tmp_path, capsys):
    root = make_folder(tmp_path / "d")
    (root / "a0_empty").mkdir()
    with pytest.raises(ValueError, match=r"class folder .*a0_empty holds no images") as e:
        open_source(f"folder:{root}", "train")
    assert "\n" not in str(e.value)
    assert cli_main(["data", "info", f"folder:{root}"]) != 0
    assert capsys.readouterr().err.count("\n") == 1


def test_a_named_pipe_among_the_images_is_skipped_not_read(tmp_path):
    """A FIFO named like an image is not listed (reading it would block forever): the folder source, hence
    training, evaluation and `vitlab relabel`, never opens it."""
    root = make_folder(tmp_path / "d")
    os.mkfifo(root / "a" / "pipe.jpg")
    src = open_source(f"folder:{root}", "all")
    assert len(src) == 6 and all(src.path(i).name != "pipe.jpg" for i in range(len(src)))
    done = threading.Event()

    def read_all():
        loader = create_loader(src, create_transform(8), 4, is_training=False)
        assert sum(len(y) for _, y in loader) == 6
        done.set()

    worker = threading.Thread(target=read_all, daemon=True)
    worker.start()
    worker.join(60)
    assert done.is_set()


def test_evaluation_skips_and_counts_an_unreadable_image_never_substitutes(tmp_path):
    """A truncated and a garbage file in the held-out data: evaluation sees each readable image once and counts
    the two it skipped (training still fills its batch from the next readable file)."""
    root = make_folder(tmp_path / "d", per_class=4)
    (root / "a" / "img1.jpg").write_bytes(b"not an image")
    (root / "b" / "img2.jpg").write_bytes(_jpeg(90)[:40])
    src = open_source(f"folder:{root}", "all")
    loader = create_loader(src, create_transform(8), 3, is_training=False, max_bad_fraction=0.5)
    with pytest.warns(UserWarning, match="unreadable image skipped"):
        labels = [int(v) for _, y in loader for v in y]
    assert Counter(labels) == Counter({0: 3, 1: 3}) and len(loader.bad_files) == 2
    from vitlab.train.engine import evaluate

    class Constant(nn.Module):
        def forward(self, x):
            return torch.zeros(len(x), 2)

    with pytest.warns(UserWarning):
        result = evaluate(Constant(), create_loader(src, create_transform(8), 3, is_training=False,
                                                    max_bad_fraction=0.5), torch.device("cpu"))  # fmt: skip
    assert result["n"] == 6 and result["skipped"] == 2
    train = create_loader(src, create_transform(8, True), 4, is_training=True, max_bad_fraction=0.5)
    with pytest.warns(UserWarning):
        assert all(len(y) == 4 for _, y in train)


class DenseConv(nn.Module):
    """Class scores (3 classes) at every location of a 4 x 4 grid (24-px input)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 6, stride=6)

    def forward(self, x):
        return self.conv(x)


def test_relabel_gives_every_image_its_own_map_and_skips_unreadable_ones(tmp_path, capsys):
    """`a.JPEG` and `a.png` get a map each (named by the whole file name, as the loader reads them); a garbage
    image is skipped, warned and counted, as training does; the exit status is 0."""
    root = make_folder(tmp_path / "d", per_class=2)
    Image.new("RGB", (20, 16), (200, 10, 10)).save(root / "a" / "img0.png")
    (root / "b" / "broken.jpg").write_bytes(b"garbage")
    teacher = tmp_path / "dense.pt2"
    torch.export.save(torch.export.export(DenseConv().eval(), (torch.randn(2, 3, 24, 24),)), teacher)
    capsys.readouterr()
    with pytest.warns(UserWarning, match="unreadable image skipped"):
        assert cli_main(["relabel", str(teacher), str(root), "--top-k", "2", "--threads", "1"]) == 0
    assert "wrote 5 dense maps" in capsys.readouterr().out
    maps = sorted(p.name for p in root.rglob("*.tl.npy"))
    assert maps == ["img0.jpg.tl.npy", "img0.jpg.tl.npy", "img0.png.tl.npy", "img1.jpg.tl.npy", "img1.jpg.tl.npy"]
    src = open_source(f"folder:{root}", "all")
    assert {src.dense_path(i).name for i in range(len(src))} >= {"img0.png.tl.npy", "img0.jpg.tl.npy"}
