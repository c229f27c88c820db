"""One data road: ``--data`` parsed once into a :class:`DataSpec`, and every tool reaching the data factory."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch

import vitlab.data.factory as factory
from vitlab.cli import main as cli_main
from vitlab.data import DataSpec, open_source
from vitlab.data.spec import STREAMING, parse_data

TINY = ["--model", "deit_mini", "--model-arg", "patch_size=7", "--model-arg", "depth=1", "--model-arg", "embed_dim=32"]


def _tree(root, classes=("b", "a"), per_class=3, size=(12, 10)):
    from PIL import Image

    for i, name in enumerate(classes):
        (root / name).mkdir(parents=True)
        for k in range(per_class):
            Image.new("RGB", size, (40 * i, 100, 20 * k)).save(root / name / f"{k}.png")
    return root


# --------------------------------------------------------------------------- the parse


@pytest.mark.parametrize(
    ("text", "kind", "path"),
    [
        ("mnist", "mnist", ""),
        ("MNIST", "mnist", ""),
        ("mnist:", "mnist", ""),
        ("cifar10:/data/cifar", "cifar10", "/data/cifar"),
        ("mnist:/data/mnist", "mnist-idx", "/data/mnist"),
        ("mnist-idx:/data/mnist", "mnist-idx", "/data/mnist"),
        ("folder:/data/imagenet", "folder", "/data/imagenet"),
        ("folder:C:/data", "folder", "C:/data"),
        ("wds:/shards/train-{000000..000009}.tar", "wds", "/shards/train-{000000..000009}.tar"),
        (" folder:/x ", "folder", "/x"),
    ],
)
def test_parse_good_specs(text, kind, path):
    spec = DataSpec.parse(text)
    assert (spec.kind, spec.path) == (kind, path)
    assert str(spec) == text and DataSpec.parse(spec) is spec
    assert spec.streaming == (kind in STREAMING)
    assert spec.native_shape == {"mnist": (1, 28), "mnist-idx": (1, 28), "cifar10": (3, 32)}.get(kind, (3, None))


def test_a_bare_folder_is_known_by_its_contents(tmp_path):
    _tree(tmp_path / "images")
    (tmp_path / "cifar").mkdir()
    (tmp_path / "cifar" / "test_batch").write_bytes(b"")
    (tmp_path / "idx" / "raw").mkdir(parents=True)
    (tmp_path / "idx" / "raw" / "t10k-images-idx3-ubyte").write_bytes(b"")
    for name, kind in (("images", "folder"), ("cifar", "cifar10"), ("idx", "mnist-idx")):
        spec = DataSpec.parse(str(tmp_path / name))
        assert (spec.kind, spec.path, str(spec)) == (kind, str(tmp_path / name), str(tmp_path / name))
    # the same data in other words compares equal; the text given is kept for the records
    assert DataSpec.parse(str(tmp_path / "images")) == DataSpec.parse(f"folder:{tmp_path / 'images'}")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", r"^the dataset spec is empty; use 'mnist', 'cifar10:<folder>'"),
        ("   ", r"^the dataset spec is empty; use"),
        ("imagenet:/x", r"^unknown dataset 'imagenet:/x' \(not a known kind, nor an existing folder\); use 'mnist'"),
        ("no/such/folder", r"^unknown dataset 'no/such/folder' \(not a known kind, nor an existing folder\)"),
        ("cifar10", r"^dataset 'cifar10' needs a path: write cifar10:/path/to/data$"),
        ("cifar10:", r"^dataset 'cifar10:' needs a path: write cifar10:/path/to/data$"),
        ("mnist-idx:", r"^dataset 'mnist-idx:' needs a path: write mnist-idx:/path/to/data$"),
        ("folder:", r"^dataset 'folder:' needs a path: write folder:/path/to/data$"),
        ("wds:", r"^dataset 'wds:' needs a path: write wds:/path/to/data$"),
        (3, r"^a dataset spec is text such as 'mnist' or 'folder:/data', got int$"),
    ],
)
def test_parse_bad_specs_are_one_line(text, message):
    with pytest.raises(ValueError, match=message) as e:
        DataSpec.parse(text)
    assert "\n" not in str(e.value)


def test_a_spec_built_directly_is_checked_too():
    with pytest.raises(ValueError, match=r"^unknown dataset 'imagenet'"):
        DataSpec("imagenet", "/x")
    with pytest.raises(ValueError, match=r"^dataset 'folder' needs a path: write folder:/path/to/data$"):
        DataSpec("folder")
    assert str(DataSpec("folder", "/x")) == "folder:/x" and str(DataSpec("mnist")) == "mnist"


def test_check_names_a_missing_folder_or_a_file(tmp_path):
    (tmp_path / "file").write_bytes(b"x")
    with pytest.raises(FileNotFoundError, match=r"^image folder .*nope does not exist; point to a folder"):
        parse_data(f"folder:{tmp_path / 'nope'}")
    with pytest.raises(ValueError, match=r"CIFAR-10 path .*file is a file; expected the folder holding"):
        parse_data(f"cifar10:{tmp_path / 'file'}")
    with pytest.raises(FileNotFoundError, match=r"shard folder .* does not exist.*vitlab data shards"):
        parse_data(f"wds:{tmp_path / 'nope'}")
    assert parse_data(f"wds:{tmp_path}/x-{{0..3}}.tar").kind == "wds"  # a pattern is checked when opened
    assert parse_data("mnist") == DataSpec("mnist")


def test_every_data_option_parses_with_the_one_parser(capsys):
    for argv in (
        ["train", "--data", "imagenet:/x"],
        ["eval", "x.pt", "--data", "imagenet:/x"],
        ["analyze", "deit_mini", "--data", "imagenet:/x"],
        ["compare", "--data", "imagenet:/x"],
        ["study", "cpvt-padding", "--data", "imagenet:/x"],
        ["data", "info", "imagenet:/x"],
    ):
        assert cli_main(argv) == 2, argv
        err = capsys.readouterr().err
        assert "argument" in err and "unknown dataset 'imagenet:/x'" in err, argv


# --------------------------------------------------------------------------- every tool reaches the factory


@pytest.fixture
def opened(monkeypatch) -> list[tuple[str, str]]:
    """Every (kind, split) the data factory's open_source opens, whichever tool calls it."""
    calls: list[tuple[str, str]] = []
    real = factory.open_source

    def spy(spec, split="train", **kw):
        calls.append((DataSpec.parse(spec).kind, split))
        return real(spec, split, **kw)

    monkeypatch.setattr(factory, "open_source", spy)
    for module in ("vitlab.data", "vitlab.engine.data", "vitlab.analysis.inputs", "vitlab.experiments.reproduce"):
        mod = __import__(module, fromlist=["open_source"])
        if hasattr(mod, "open_source"):
            monkeypatch.setattr(mod, "open_source", spy)
    return calls


def test_train_eval_and_analyze_open_their_data_through_the_factory(opened, tmp_path):
    run = [*TINY, "--train-limit", "64", "--holdout", "100", "--batch-size", "32", "--epochs", "1"]
    run += ["--threads", "1", "--no-progress", "--device", "cpu", "--data", "mnist", "--out", str(tmp_path / "r")]
    assert cli_main(["train", *run]) == 0
    assert opened == [("mnist", "train"), ("mnist", "val")]
    opened.clear()
    assert cli_main(["eval", str(tmp_path / "r"), "--threads", "1", "--device", "cpu"]) == 0
    assert opened == [("mnist", "val")]
    opened.clear()
    out = str(tmp_path / "a")
    argv = ["analyze", "deit_mini", "--in-chans", "1", "--img-size", "28", "--data", "mnist", "--num-images", "2"]
    assert cli_main([*argv, "--what", "collapse", "--device", "cpu", "--out", out]) == 0
    assert opened == [("mnist", "test")]


def test_study_and_relabel_open_their_data_through_the_factory(opened, tmp_path):
    from vitlab.distill.relabel import image_files
    from vitlab.engine.config import TrainConfig
    from vitlab.experiments.reproduce import heldout_images

    plan = SimpleNamespace(configs={"row": TrainConfig(data="mnist", holdout=100)}, img_size=28)
    assert heldout_images(plan).shape == (64, 1, 28, 28)
    assert opened == [("mnist", "val")]
    opened.clear()
    root = tmp_path / "imgs"
    _tree(root / "train")
    _tree(root / "val", per_class=1)
    files = image_files(root)
    assert opened == [("folder", "train"), ("folder", "val")] and len(files) == 8


def test_folder_means_one_thing_in_train_eval_and_analyze(tmp_path):
    """The held-out part of a flat folder: the same classes, order and files for training's evaluation and
    `vitlab eval` of its checkpoint; analyze looks at the same folder's first images."""
    from vitlab.analysis.inputs import load_images
    from vitlab.engine.config import TrainConfig
    from vitlab.engine.data import load_data
    from vitlab.engine.evaluate import _eval_split

    root = _tree(tmp_path / "flat", classes=("dog", "cat", "eel"), per_class=5)
    spec = DataSpec.parse(f"folder:{root}")
    held = load_data(TrainConfig(data=str(spec), holdout=3), "test")
    evaluated = open_source(spec, _eval_split(spec, {"data": str(spec)}), holdout=3)
    assert held.classes == evaluated.classes == ["cat", "dog", "eel"]
    assert [held.path(i) for i in range(len(held))] == [evaluated.path(i) for i in range(len(evaluated))]
    # a bare folder is the same data as folder: (and is read by the same streaming source)
    assert _eval_split(DataSpec.parse(str(root)), {"data": str(spec)}) == "val"
    model = SimpleNamespace(meta={"input_size": (3, 16, 16), "mean": (0.5,) * 3, "std": (0.5,) * 3})
    images, x, what = load_images(model, data=str(spec), num_images=4)
    assert images.shape == x.shape == (4, 3, 16, 16) and "4 images" in what
    first = torch.tensor((40, 100, 0)).view(3, 1, 1) / 255  # cat/0.png (class order: sorted names)
    assert (images[0] - first).abs().max() <= 1 / 255 + 1e-6


# --------------------------------------------------------------------------- damaged shards and manifests


@pytest.fixture
def shards(tmp_path):
    from vitlab.data.shard_writer import write_shards

    _tree(tmp_path / "src" / "train", per_class=4)
    _tree(tmp_path / "src" / "val", per_class=2)
    write_shards(tmp_path / "src", tmp_path / "sh", shard_size=4)
    return tmp_path / "sh"


def _train_argv(data: str, out) -> list[str]:
    return ["train", *TINY, "--data", data, "--batch-size", "2", "--epochs", "1", "--img-size", "14",
            "--threads", "1", "--no-progress", "--device", "cpu", "--out", str(out)]  # fmt: skip


@pytest.mark.parametrize("damage", ["truncated", "random"])
def test_a_damaged_shard_is_one_line_from_train(shards, tmp_path, capsys, damage):
    """`head -c 5000` of a shard, or random bytes, named by shards.json (no header scan at open): one line
    naming the shard and the fix, from the training loop's DataLoader worker too."""
    import random

    shard = shards / "train-000000.tar"
    data = shard.read_bytes()
    shard.write_bytes(data[:5000] if damage == "truncated" else random.Random(0).randbytes(len(data)))
    for workers in ("0", "1"):
        assert cli_main([*_train_argv(f"wds:{shards}", tmp_path / "run"), "--workers", workers]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "Traceback" not in err, err
        assert f"shard {shard} " in err and "truncated, damaged or not a tar file" in err, err
        assert "write the shard again (vitlab data shards)" in err, err
    # the same shard through a brace pattern: its headers are scanned when opened
    (tmp_path / "alone").mkdir()
    shard.rename(tmp_path / "alone" / "x-0.tar")
    assert cli_main(["data", "info", f"wds:{tmp_path / 'alone'}/x-{{0..0}}.tar"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "x-0.tar is not a readable tar file" in err, err


def _manifest_error(shards, meta) -> str:
    import json

    (shards / "shards.json").write_text(meta if isinstance(meta, str) else json.dumps(meta))
    with pytest.raises(ValueError) as e:
        open_source(f"wds:{shards}", "train")
    message = str(e.value)
    assert "\n" not in message and str(shards / "shards.json") in message, message
    return message


def test_every_manifest_field_is_checked(shards):
    import json

    good = json.loads((shards / "shards.json").read_text())
    train = good["splits"]["train"]
    cases = [
        ({k: v for k, v in good.items() if k != "splits"}, r"'splits' must be an object such as"),
        ({**good, "splits": [train]}, r"'splits' must be an object"),
        ({**good, "splits": {"train": [train]}}, r"split 'train' must be an object"),
        ({**good, "splits": {"train": {"counts": train["counts"]}}}, r"'shards' must be a non-empty list"),
        ({**good, "splits": {"train": {**train, "shards": "train-000000.tar"}}}, r"'shards' must be a non-empty"),
        ({**good, "splits": {"train": {**train, "counts": ["4", 4]}}}, r"'counts' must be a list of sample counts"),
        ({**good, "splits": {"train": {**train, "counts": [4, -1]}}}, r"'counts' must be a list of sample counts"),
        ({**good, "splits": {"train": {**train, "counts": [4, 2.5]}}}, r"'counts' must be a list of sample counts"),
        ({**good, "splits": {"train": {**train, "counts": [4]}}}, r"'counts' must have one entry per shard \(2\)"),
        ({**good, "splits": {"train": {**train, "counts": [4, 10**12]}}}, r"lists 1000000000000 samples for .* hold"),
        ({**good, "splits": {"train": {**train, "shards": ["../x.tar", *train["shards"][1:]]}}}, r"outside the"),
        ({**good, "splits": {"train": {**train, "shards": ["/etc/passwd", *train["shards"][1:]]}}}, r"absolute"),
        ({**good, "classes": "a,b"}, r"'classes' must be a non-empty list of class names"),
        ({**good, "classes": ["a", "a"]}, r"'classes' must name each class once"),
        ({**good, "format": "zip"}, r"'format' must be \"webdataset\""),
        ([good], r"the manifest must be a JSON object"),
        ("{not json", r"is not valid JSON"),
    ]
    for meta, message in cases:
        got = _manifest_error(shards, meta)
        assert re.search(message, got), (message, got)
        assert "re-write" not in got and "vitlab data shards" in got, got
