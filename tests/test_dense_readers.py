"""The VOC, ADE20K, ModelNet40 and ShapeNet-Part readers against hostile and misplaced files: ids that leave the
dataset folder, damaged or non-image files, named pipes, HDF5 links, virtual datasets and decompression bombs,
non-finite points, labels out of range; the folder an archive unpacks to; class names beside per-class IoU.
Every refusal is one line naming the file; nothing blocks on a pipe."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from hangs import unblocked
from vitlab.cli import main
from vitlab.data.safe_files import DataFileError
from vitlab.tasks.points import open_points
from vitlab.tasks.points.synth import make_modelnet40, make_shapenet_part
from vitlab.tasks.segmentation import open_masks
from vitlab.tasks.segmentation.data import VOC_CLASSES
from vitlab.tasks.segmentation.infer import evaluate_segmentation
from vitlab.tasks.segmentation.metrics import per_class_lines
from vitlab.tasks.segmentation.synth import make_mask_folder

try:
    import h5py
except ImportError:  # the ModelNet40 tests need it (vitlab[points]); the others do not
    h5py = None

needs_fifo = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="named pipes")
needs_h5py = pytest.mark.skipif(h5py is None, reason="h5py (vitlab[points]) is not installed")


def voc(tmp_path: Path, name: str = "voc") -> Path:
    return make_mask_folder(tmp_path / name, "voc", train=2, val=1, size=(8, 10), classes=3)


def ade(tmp_path: Path, name: str = "ade") -> Path:
    return make_mask_folder(tmp_path / name, "ade20k", train=2, val=1, size=(8, 10), classes=3)


def modelnet(tmp_path: Path, name: str = "mn") -> Path:
    return make_modelnet40(tmp_path / name, train=4, test=2, points=8, classes=3)


def one_line(excinfo, *parts: str) -> str:
    """The refusal's message, checked to be one line holding each of ``parts``."""
    text = str(excinfo.value)
    assert "\n" not in text, text
    for p in parts:
        assert p in text, (p, text)
    return text


def write_h5(path: Path, **datasets) -> Path:
    path.unlink(missing_ok=True)
    with h5py.File(path, "w") as h5:
        for name, value in datasets.items():
            if callable(value):
                value(h5, name)
            else:
                h5.create_dataset(name, data=value)
    return path


GOOD_POINTS = np.random.default_rng(0).normal(size=(4, 8, 3)).astype(np.float32)
GOOD_LABELS = np.array([[0], [1], [2], [3]], np.uint8)


# --------------------------------------------------------------------------- 1. names that leave the dataset


def test_voc_ids_that_leave_the_dataset_are_refused(tmp_path):
    root = voc(tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    (root / "JPEGImages" / "train_00000.jpg").rename(outside / "secret.jpg")
    (root / "SegmentationClass" / "train_00000.png").rename(outside / "secret.png")
    listing = root / "ImageSets" / "Segmentation" / "train.txt"
    for bad in ("../../outside/secret", str(outside / "secret")):  # climbing out, and an absolute id
        listing.write_text(f"{bad}\ntrain_00001\n")
        with pytest.raises(DataFileError) as e:
            open_masks(f"voc:{root}", "train").load(0)
        one_line(e, str(listing), "line 1")
    listing.write_text("../SegmentationClass/train_00001\n")  # inside the root, but not an image of JPEGImages/
    with pytest.raises(DataFileError, match="outside the dataset folder"):
        open_masks(f"voc:{root}", "train")


def test_shapenet_entries_that_leave_the_dataset_are_refused(tmp_path):
    root = make_shapenet_part(tmp_path / "sp", per_split=2, points=16, categories=2)
    secret = tmp_path / "secret.txt"
    np.savetxt(secret, np.zeros((4, 7)), fmt="%.1f")
    listing = root / "train_test_split" / "shuffled_train_file_list.json"
    listing.write_text('["shape_data/../secret"]')  # root/../secret.txt
    with pytest.raises(DataFileError) as e:
        open_points(f"shapenetpart:{root}", "train")
    one_line(e, str(listing), "entry 0")


# --------------------------------------------------------------------------- 2. damaged images and masks, pipes


@pytest.mark.parametrize("layout", ["voc", "ade20k"])
def test_damaged_images_and_masks_are_one_line_naming_the_file(tmp_path, layout):
    root = voc(tmp_path) if layout == "voc" else ade(tmp_path)
    ds = open_masks(f"{layout}:{root}", "train")
    image, mask = ds.items[0]
    mask.write_bytes(mask.read_bytes()[:-24])  # truncated inside the pixel data
    with pytest.raises(DataFileError) as e:
        ds.load(0)
    one_line(e, str(mask), "re-extract")
    image2 = ds.items[1][0]
    image2.write_text("not a picture\n")
    with pytest.raises(DataFileError) as e:
        ds.load(1)
    one_line(e, str(image2), "not an image")
    image.write_bytes(image.read_bytes()[:200])  # a truncated JPEG
    with pytest.raises(DataFileError) as e:
        ds.load(0)
    one_line(e, str(image))


@needs_fifo
@pytest.mark.parametrize(("layout", "which"), [("voc", 0), ("voc", 1), ("ade20k", 0), ("ade20k", 1)])
def test_a_named_pipe_as_image_or_mask_is_refused_without_blocking(tmp_path, layout, which):
    root = voc(tmp_path) if layout == "voc" else ade(tmp_path)
    ds = open_masks(f"{layout}:{root}", "train")
    path = ds.items[0][which]
    path.unlink()
    os.mkfifo(path)
    with pytest.raises(DataFileError) as e:
        unblocked(lambda: ds.load(0), path)
    one_line(e, str(path), "named pipe")


def test_seg_train_on_a_damaged_mask_ends_in_one_line(tmp_path, capsys):
    root = make_mask_folder(tmp_path / "voc", "voc", train=4, val=1, size=(16, 16), classes=3)
    for png in (root / "SegmentationClass").glob("train_*.png"):
        png.write_bytes(png.read_bytes()[:60])
    args = ["seg", "train", "--data", f"voc:{root}", "--model", "pcpvt_mini", "--img-size", "16", "--batch-size",
            "2", "--epochs", "1", "--threads", "1", "--no-progress", "--device", "cpu", "--model-arg", "channels=8",
            "--out", str(tmp_path / "run")]  # fmt: skip
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "VOC mask" in err and "cannot be decoded" in err, err


# --------------------------------------------------------------------------- 3. ModelNet40 / ShapeNet-Part HDF5 and text


@needs_h5py
@needs_fifo
def test_modelnet40_named_pipe_part_is_refused_without_blocking(tmp_path, capsys):
    root = modelnet(tmp_path)
    part = root / "ply_data_train0.h5"
    part.unlink()
    os.mkfifo(part)
    with pytest.raises(DataFileError) as e:
        unblocked(lambda: open_points(f"modelnet40:{root}", "train"), part)
    one_line(e, str(part), "named pipe")
    args = ["points", "train", "--data", f"modelnet40:{root}", "--epochs", "1", "--no-progress", "--device", "cpu",
            "--out", str(tmp_path / "run")]  # fmt: skip
    assert unblocked(lambda: main(args), part) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "named pipe" in err, err


def external_link(h5, name):
    h5[name] = h5py.ExternalLink("other.h5", "/data")


def soft_link(h5, name):
    h5.create_dataset("real", data=GOOD_POINTS)
    h5[name] = h5py.SoftLink("/real")


def virtual(source: str):
    def make(h5, name):
        layout = h5py.VirtualLayout((4, 8, 3), np.float32)
        layout[:] = h5py.VirtualSource(source, "data", shape=(4, 8, 3))
        h5.create_virtual_dataset(name, layout, fillvalue=0)

    return make


def external_storage(h5, name):
    h5.create_dataset(name, shape=(4, 8, 3), dtype="f4", external=[("raw.bin", 0, 4 * 8 * 3 * 4)])


def never_written(h5, name):
    h5.create_dataset(name, shape=(4, 8, 3), dtype="f4", chunks=(1, 8, 3), compression="gzip")


@needs_h5py
@pytest.mark.parametrize(
    ("data", "says"),
    [
        (external_link, "external link"),
        (soft_link, "soft link"),
        (virtual("missing.h5"), "virtual dataset"),  # its source missing: it would train on zeros
        (virtual("other.h5"), "virtual dataset"),  # its source there: it would read another file
        (external_storage, "external storage"),
        (never_written, "never"),
        (np.array([[[b"a", b"b", b"c"]]] * 4), "not numbers"),
        (np.full((4, 8, 3), np.nan, np.float32), "NaN or infinite"),
        (np.full((4, 8, 3), 1e300), "NaN or infinite"),  # beyond float32
        (np.zeros((4, 8, 2), np.float32), "(M, N, 3)"),
    ],
)
def test_modelnet40_part_must_hold_its_own_finite_points(tmp_path, data, says):
    root = modelnet(tmp_path)
    write_h5(root / "other.h5", data=GOOD_POINTS)
    (root / "raw.bin").write_bytes(GOOD_POINTS.tobytes())
    part = write_h5(root / "ply_data_train0.h5", data=data, label=GOOD_LABELS)
    with pytest.raises(DataFileError) as e:
        open_points(f"modelnet40:{root}", "train")
    one_line(e, str(part), says)


@needs_h5py
def test_modelnet40_strings_name_the_file(tmp_path):
    root = modelnet(tmp_path)
    dt = h5py.string_dtype()
    part = write_h5(root / "ply_data_train0.h5", data=GOOD_POINTS,
                    label=lambda h5, n: h5.create_dataset(n, data=np.array(["a", "b", "c", "d"], dtype=object),
                                                          dtype=dt))  # fmt: skip
    with pytest.raises(DataFileError) as e:
        open_points(f"modelnet40:{root}", "train")
    one_line(e, str(part), "'label'", "not numbers")


@needs_h5py
@pytest.mark.parametrize("label", [0.5, -1, 40, np.nan])
def test_modelnet40_labels_are_whole_classes_0_to_39(tmp_path, label):
    root = modelnet(tmp_path)
    labels = np.array([[0], [1], [label], [3]], np.float64)
    part = write_h5(root / "ply_data_train0.h5", data=GOOD_POINTS, label=labels)
    with pytest.raises(DataFileError) as e:
        open_points(f"modelnet40:{root}", "train")
    one_line(e, str(part), "entry 2", "0..39")


@needs_h5py
def test_modelnet40_decompression_bomb_is_refused_before_reading(tmp_path, monkeypatch):
    import vitlab.tasks.points.data as points_data

    root = modelnet(tmp_path)

    def bomb(h5, name):  # 10 KB on disk; as the reader would hold it, 1.5 MiB (with the default bound: GiBs)
        h5.create_dataset(name, shape=(64, 2048, 3), dtype="f4", chunks=(64, 2048, 3), compression="gzip",
                          compression_opts=9)  # fmt: skip
        h5[name][...] = 0

    part = write_h5(root / "ply_data_train0.h5", data=bomb, label=np.zeros((64, 1), np.uint8))
    assert part.stat().st_size < 64 << 10
    monkeypatch.setattr(points_data, "PART_LIMIT", 1 << 20, raising=False)
    with pytest.raises(DataFileError) as e:
        open_points(f"modelnet40:{root}", "train")
    one_line(e, str(part), "unpacks to", "VITLAB_MAX_UNPACKED_BYTES")


@needs_h5py
def test_modelnet40_bomb_of_gigabytes_is_refused_at_the_default_bound(tmp_path):
    root = modelnet(tmp_path)

    def bomb(h5, name):  # 4.7 GiB of float32 declared, nothing written: refused on its shape alone
        h5.create_dataset(name, shape=(200_000, 2048, 3), dtype="f4", chunks=(16, 2048, 3), compression="gzip")

    part = write_h5(root / "ply_data_train0.h5", data=bomb, label=np.zeros((200_000, 1), np.uint8))
    with pytest.raises(DataFileError) as e:
        open_points(f"modelnet40:{root}", "train")
    one_line(e, str(part), "unpacks to 4687 MiB")


@needs_h5py
def test_modelnet40_damaged_and_non_hdf5_parts_name_the_file(tmp_path):
    root = modelnet(tmp_path)
    part = root / "ply_data_train0.h5"
    part.write_bytes(part.read_bytes()[:-100])
    with pytest.raises(DataFileError) as e:
        open_points(f"modelnet40:{root}", "train")
    one_line(e, str(part), "HDF5")
    part.write_text("hello\n")
    with pytest.raises(DataFileError) as e:
        open_points(f"modelnet40:{root}", "train")
    one_line(e, str(part), "HDF5")


@pytest.mark.parametrize(
    ("mutate", "says"),
    [
        (lambda rows: rows.__setitem__((3, 0), np.nan), "NaN or infinite"),
        (lambda rows: rows.__setitem__((3, -1), 2.5), "not 0..49"),
        (lambda rows: rows.__setitem__((3, -1), 50), "not 0..49"),
        (lambda rows: rows.__setitem__((3, -1), -1), "not 0..49"),
    ],
)
def test_shapenet_points_are_finite_and_parts_whole_ids(tmp_path, mutate, says):
    root = make_shapenet_part(tmp_path / "sp", per_split=2, points=16, categories=2)
    shape = next((root / "02691156").glob("train*.txt"))
    rows = np.loadtxt(shape, ndmin=2)
    mutate(rows)
    np.savetxt(shape, rows, fmt="%.5f")
    with pytest.raises(DataFileError) as e:
        open_points(f"shapenetpart:{root}", "train")
    one_line(e, str(shape), says)


def test_shapenet_categories_beyond_the_16_are_refused(tmp_path):
    root = make_shapenet_part(tmp_path / "sp", per_split=2, points=16, categories=2)
    listing = root / "synsetoffset2category.txt"
    listing.write_text(listing.read_text() + "Extra\t09999999\n")  # a 17th category: label 16 of 16 classes
    (root / "09999999").mkdir()
    np.savetxt(root / "09999999" / "x.txt", np.zeros((4, 7)), fmt="%.1f")
    (root / "train_test_split" / "shuffled_train_file_list.json").write_text('["shape_data/09999999/x"]')
    with pytest.raises(DataFileError) as e:
        open_points(f"shapenetpart:{root}", "train")
    one_line(e, str(listing), "17 synsets")


# --------------------------------------------------------------------------- 4. the folder an archive unpacks to


def test_voc_and_ade20k_are_read_from_the_folder_their_archive_unpacks_to(tmp_path):
    make_mask_folder(tmp_path / "v" / "VOCdevkit" / "VOC2012", "voc", train=2, val=1, size=(8, 10), classes=3)
    make_mask_folder(tmp_path / "a" / "ADEChallengeData2016", "ade20k", train=2, val=1, size=(8, 10), classes=3)
    assert len(open_masks(f"voc:{tmp_path / 'v'}", "train")) == 2
    assert len(open_masks(f"voc:{tmp_path / 'v' / 'VOCdevkit'}", "val")) == 1
    assert len(open_masks(f"ade20k:{tmp_path / 'a'}", "train")) == 2
    assert open_masks(str(tmp_path / "a"), "val").layout == "ade20k"  # a bare root too
    with pytest.raises(ValueError) as e:
        open_masks(f"voc:{tmp_path / 'a'}", "train")
    one_line(e, "not in the voc layout", "JPEGImages/", "VOCdevkit/VOC2012/")
    with pytest.raises(ValueError) as e:
        open_masks(f"ade20k:{tmp_path / 'v'}", "train")
    one_line(e, "not in the ade20k layout", "ADEChallengeData2016/")


@needs_h5py
def test_modelnet40_is_read_from_its_archive_folder_and_follows_its_file_lists(tmp_path):
    inner = make_modelnet40(tmp_path / "mn" / "modelnet40_ply_hdf5_2048", train=4, test=2, points=8, classes=3)
    assert len(open_points(f"modelnet40:{tmp_path / 'mn'}", "train")) == 4
    # a part the official list does not name is not read; one it names is, by its name inside the folder
    write_h5(inner / "ply_data_train1.h5", data=GOOD_POINTS, label=GOOD_LABELS)
    assert len(open_points(f"modelnet40:{inner}", "train")) == 4
    (inner / "train_files.txt").write_text(
        "data/modelnet40_ply_hdf5_2048/ply_data_train0.h5\ndata/modelnet40_ply_hdf5_2048/ply_data_train1.h5\n"
    )
    assert len(open_points(f"modelnet40:{inner}", "train")) == 8
    (inner / "train_files.txt").write_text("../../elsewhere/ply_data_train0.h5\n")
    with pytest.raises(DataFileError) as e:
        open_points(f"modelnet40:{inner}", "train")
    one_line(e, "train_files.txt line 1", "outside the dataset folder")
    (inner / "train_files.txt").unlink()  # no list: the parts found by name
    assert len(open_points(f"modelnet40:{inner}", "train")) == 8
    with pytest.raises(ValueError) as e:
        open_points(f"modelnet40:{tmp_path}", "train")
    one_line(e, "not in the modelnet40 layout", "modelnet40_ply_hdf5_2048/")


def test_shapenet_part_is_read_from_the_folder_holding_it(tmp_path):
    name = "shapenetcore_partanno_segmentation_benchmark_v0_normal"
    make_shapenet_part(tmp_path / "sp" / name, per_split=2, points=16, categories=2)
    assert len(open_points(f"shapenetpart:{tmp_path / 'sp'}", "val")) == 2


# --------------------------------------------------------------------------- 5. class names beside per-class IoU


class Constant(nn.Module):
    def __init__(self, k: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, k, 1)

    def forward(self, x):
        return self.conv(x)


def test_voc_and_ade20k_name_their_classes_beside_the_per_class_iou(tmp_path):
    ds = open_masks(f"voc:{voc(tmp_path)}", "val")
    assert ds.classes == list(VOC_CLASSES) and len(VOC_CLASSES) == 21
    result = evaluate_segmentation(Constant(21).eval(), ds, 8, torch.device("cpu"))
    assert result["classes"] == list(VOC_CLASSES)
    lines = per_class_lines(result["iou"], result["classes"])
    assert lines and all(len(line.split()) == 5 for line in lines)
    assert lines[0].split()[:3] == ["class", "0", "background"]

    root = ade(tmp_path)
    assert open_masks(f"ade20k:{root}", "val").classes is None  # no table: the classes by number
    rows = ["Idx,Ratio,Train,Val,Name", "1,0.15,11664,1172,wall", "2,0.10,6046,612,building;edifice"]
    rows += [f"{k},0.0,1,1,thing{k};other" for k in range(3, 151)]
    (root / "objectInfo150.csv").write_text("\n".join(rows) + "\n")
    names = open_masks(f"ade20k:{root}", "val").classes
    assert names[:3] == ["wall", "building", "thing3"] and len(names) == 150
    iou = [None] * 150
    iou[1] = 50.0
    assert per_class_lines(iou, names) == ["  class   1  building  IoU  50.00"]
    assert per_class_lines(iou) == ["  class   1  IoU  50.00"]
    (root / "objectInfo150.csv").write_text("Idx,Name\n1,wall\n")  # not the table: numbers, no error
    assert open_masks(f"ade20k:{root}", "val").classes is None
