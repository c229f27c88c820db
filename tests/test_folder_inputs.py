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
    from vitlab.engine.loop import evaluate

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


def test_write_failures_are_one_line(tmp_path, capsys, monkeypatch):
    """`vitlab data shards` past the file-size limit: one line, no half shard and no buffer flushed at exit; any
    command whose write fails outside the atomic helpers (e.g. the run lock) too."""
    import errno
    import subprocess
    import sys

    root = make_folder(tmp_path / "src" / "train", per_class=4).parent
    make_folder(root / "val", per_class=1)
    code = ("import resource, sys; resource.setrlimit(resource.RLIMIT_FSIZE, (20000, 20000)); "
            "from vitlab.cli import main; sys.exit(main(sys.argv[1:]))")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code, "data", "shards", str(root), str(tmp_path / "w"),
                          "--shard-size", "100"], capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "file-size limit" in out.stderr, out.stderr
    assert not list((tmp_path / "w").glob("*.tar"))
    import vitlab.common.rundir as rundir

    def full(*args):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "run" / ".vitlab.lock"))

    monkeypatch.setattr(rundir.os, "pwrite", full)
    capsys.readouterr()
    assert cli_main(["data", "info", f"folder:{root}"]) == 0  # reads only
    assert cli_main(["train", "--data", "mnist", "--train-limit", "64", "--epochs", "1", "--out",
                     str(tmp_path / "run"), "--no-progress", "--threads", "1"]) == 2  # fmt: skip
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no space left" in err, err


def test_bench_data_reference_pipeline_replaces_a_truncated_jpeg(tmp_path):
    """The benchmark's reference pipeline meets a truncated JPEG: the next readable file takes its place."""
    from vitlab.bench.data import ReferenceDataset

    root = make_folder(tmp_path / "d")
    (root / "a" / "img0.jpg").write_bytes(_jpeg(5)[:60])
    src = open_source(f"folder:{root}", "all")
    bad = next(i for i in range(len(src)) if src.path(i).name == "img0.jpg" and src.path(i).parent.name == "a")
    x, label = ReferenceDataset(src, 8, src.mean, src.std)[bad]
    assert x.shape == (3, 8, 8) and label == src.read(bad + 1)[1]
