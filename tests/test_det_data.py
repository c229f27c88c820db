"""The COCO reader, its augmentation, batches and loader (vitlab.tasks.detection.data) and the generated set."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from hangs import unblocked
from vitlab.common.extras import MissingExtra
from vitlab.data.safe_files import DataFileError
from vitlab.tasks.detection.coco_format import rle_counts
from vitlab.tasks.detection.data import (
    DetLoader,
    DetTransform,
    collate,
    default_max_size,
    detr_scales,
    hflip,
    open_coco,
    resize,
    resized_shape,
)
from vitlab.tasks.detection.synth import make_coco_folder, rle_runs, rle_string

mask_api = pytest.importorskip("pycocotools.mask")  # vitlab[detection]
# pycocotools' compiled decoder predates numpy 2's copy keyword: a warning of theirs, not of vitlab's
pytestmark = pytest.mark.filterwarnings("ignore:__array__ implementation doesn't accept a copy:DeprecationWarning")
ONE_LINE = (ValueError, FileNotFoundError)


@pytest.fixture(scope="module")
def coco(tmp_path_factory) -> Path:
    return make_coco_folder(tmp_path_factory.mktemp("coco") / "set", train=12, val=6, size=(48, 64), classes=3)


@pytest.fixture
def copy(coco, tmp_path) -> Path:
    """A fresh copy of the generated set, for a test to damage."""
    return Path(shutil.copytree(coco, tmp_path / "set"))


def instances(root: Path, split: str = "train") -> dict:
    return json.loads((root / "annotations" / f"instances_{split}2017.json").read_text())


def rewrite(root: Path, edit, split: str = "train") -> None:
    doc = instances(root, split)
    edit(doc)
    (root / "annotations" / f"instances_{split}2017.json").write_text(json.dumps(doc))


def one_line(excinfo) -> str:
    message = str(excinfo.value)
    assert message and "\n" not in message, message
    return message


# --------------------------------------------------------------------------- the reader


def test_reader_round_trips_boxes_labels_masks_and_leaves_crowds_out(coco):
    for split in ("train", "val"):
        ds, doc = open_coco(f"coco:{coco}", split), instances(coco, split)
        assert ds.cat_ids == [1, 3, 7] and ds.classes == ["rectangle_0", "ellipse_1", "triangle_2"]
        assert ds.num_classes == 3 and ds.masks and ds.annotation_file.name == f"instances_{split}2017.json"
        assert ds.image_ids == [im["id"] for im in doc["images"]]
        kinds = {"crowd": 0, "polygon": 0, "rle": 0}
        for i in range(len(ds)):
            image, target = ds[i]
            h, w = doc["images"][i]["height"], doc["images"][i]["width"]
            assert image.dtype == torch.uint8 and image.shape == (3, h, w)
            assert target["size"].tolist() == target["orig_size"].tolist() == [h, w]
            anns = [a for a in doc["annotations"] if a["image_id"] == ds.image_ids[i]]
            for a in anns:
                kinds["crowd" if a["iscrowd"] else "polygon" if isinstance(a["segmentation"], list) else "rle"] += 1
            kept = [a for a in anns if not a["iscrowd"]]
            assert int(target["image_id"]) == ds.image_ids[i]
            assert target["labels"].tolist() == [ds.cat_ids.index(a["category_id"]) for a in kept]
            want = torch.tensor([[x, y, x + bw, y + bh] for x, y, bw, bh in (a["bbox"] for a in kept)]).reshape(-1, 4)
            assert torch.allclose(target["boxes"], want.float())
            assert target["masks"].shape == (len(kept), h, w) and target["masks"].dtype == torch.uint8
            for box, mask in zip(target["boxes"], target["masks"]):
                ys, xs = np.nonzero(mask.numpy())
                from_mask = torch.tensor([xs.min(), ys.min(), xs.max() + 1, ys.max() + 1], dtype=torch.float32)
                assert (from_mask - box).abs().max() <= 1.0, (from_mask, box)
        assert all(kinds.values()), kinds  # every mask format and crowds, in both splits


def test_boxes_without_masks_and_degenerate_boxes_dropped(copy):
    def edit(doc):
        doc["annotations"][0]["bbox"][2] = 0.0  # zero width: no area, left out as DETR does
        doc["annotations"][0]["iscrowd"] = 0

    rewrite(copy, edit)
    ds = open_coco(f"coco:{copy}", "train", masks=False)
    assert not ds.masks and "masks" not in ds[0][1]
    first = instances(copy)["annotations"][0]
    plain = [a for a in instances(copy)["annotations"] if a["image_id"] == first["image_id"] and not a["iscrowd"]]
    assert len(ds.target(ds.image_ids.index(first["image_id"]))["boxes"]) == len(plain) - 1


def test_missing_pycocotools_is_one_line_naming_the_extra(coco, monkeypatch):
    monkeypatch.setitem(sys.modules, "pycocotools.mask", None)  # import fails as if not installed
    with pytest.raises(MissingExtra, match=r"vitlab\[detection\]"):
        open_coco(f"coco:{coco}", "val")
    assert len(open_coco(f"coco:{coco}", "val", masks=False)[0][1]["boxes"]) >= 1


HOSTILE = {
    "dotdot name": (lambda d: d["images"][0].update(file_name="../x.jpg"), "outside the dataset folder"),
    "absolute name": (lambda d: d["images"][0].update(file_name="/etc/passwd"), "absolute path"),
    "unknown category": (lambda d: d["annotations"][0].update(category_id=2), "category id 2"),
    "unknown image": (lambda d: d["annotations"][0].update(image_id=999999), "image id 999999"),
    "negative width": (lambda d: d["annotations"][0]["bbox"].__setitem__(2, -3.0), "negative width"),
    "nan box": (lambda d: d["annotations"][0]["bbox"].__setitem__(1, float("nan")), "finite"),
    "short box": (lambda d: d["annotations"][0].update(bbox=[1, 2, 3]), "four finite numbers"),
    "duplicate image": (lambda d: d["images"].append(dict(d["images"][0])), "appears twice"),
    "duplicate category": (lambda d: d["categories"].append(dict(d["categories"][0])), "appears twice"),
    "no annotations": (lambda d: d.pop("annotations"), "no annotations list"),
    "no categories": (lambda d: d.update(categories=[]), "no categories"),
    "string id": (lambda d: d["images"][0].update(id="7"), "integer id"),
    "list image id": (lambda d: d["annotations"][0].update(image_id=[1]), "image id"),
    "iscrowd 2": (lambda d: d["annotations"][0].update(iscrowd=2), "iscrowd"),
    "newline name": (lambda d: d["images"][0].update(file_name="a\nb.jpg"), "control character"),
    "huge image": (lambda d: d["images"][0].update(height=10**6, width=10**6), "pixels"),
    "huge number": (lambda d: d["annotations"][0]["bbox"].__setitem__(0, 10**400), "four finite numbers"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_annotation_files_are_one_line_at_open(copy, case):
    edit, match = HOSTILE[case]
    rewrite(copy, edit)
    with pytest.raises(DataFileError) as e:
        open_coco(f"coco:{copy}", "train")
    assert match in one_line(e)


@pytest.mark.parametrize(
    "content",
    [b"", b"{", b"[1, 2]", b"\xff\xfe not utf-8", b"[" * 100_000 + b"]" * 100_000, b'{"images": 3}'],
    ids=["empty", "truncated", "list", "binary", "deep", "wrong-type"],
)
def test_malformed_annotation_file_is_one_line(copy, content):
    (copy / "annotations" / "instances_train2017.json").write_bytes(content)
    with pytest.raises(DataFileError) as e:
        open_coco(f"coco:{copy}", "train")
    one_line(e)


def test_missing_folder_file_and_bad_spec_are_one_line(copy, tmp_path):
    for spec in (f"voc:{copy}", "coco:", f"coco:{tmp_path / 'nowhere'}"):
        with pytest.raises(ValueError) as e:
            open_coco(spec, "train")
        one_line(e)
    with pytest.raises(ValueError):
        open_coco(f"coco:{copy}", "test")
    (copy / "annotations" / "instances_val2017.json").unlink()
    with pytest.raises(FileNotFoundError) as e:
        open_coco(f"coco:{copy}", "val")
    one_line(e)


SAMPLE_DAMAGE = {
    "rle runs": (lambda a: a.update(segmentation={"size": [48, 64], "counts": [5, 10]}), "cover"),
    "rle size": (lambda a: a.update(segmentation={"size": [4, 4], "counts": [16]}), "size [48, 64]"),
    "rle string": (lambda a: a.update(segmentation={"size": [48, 64], "counts": "0a~"}), "RLE string"),
    "negative run": (lambda a: a.update(segmentation={"size": [48, 64], "counts": [3072 + 5, -5]}), "cover"),
    "far polygon": (lambda a: a.update(segmentation=[[0, 0, 1e9, 0, 1e9, 1e9]]), "far outside"),
    "odd polygon": (lambda a: a.update(segmentation=[[0, 0, 10, 0, 10]]), "even-length"),
    "no segmentation": (lambda a: a.pop("segmentation"), "no segmentation"),
}


@pytest.mark.parametrize("case", sorted(SAMPLE_DAMAGE))
def test_damaged_masks_are_one_line_when_read(copy, case):
    edit, match = SAMPLE_DAMAGE[case]

    def first_plain(doc):
        edit(next(a for a in doc["annotations"] if not a["iscrowd"]))

    rewrite(copy, first_plain)
    ds = open_coco(f"coco:{copy}", "train")
    first = next(a for a in instances(copy)["annotations"] if not a["iscrowd"])
    with pytest.raises(DataFileError) as e:
        ds.target(ds.image_ids.index(first["image_id"]))
    assert match in one_line(e)


def test_degenerate_polygons_become_an_empty_mask(copy):
    rewrite(copy, lambda d: next(a for a in d["annotations"] if not a["iscrowd"]).update(segmentation=[[1, 2, 3, 4]]))
    ds = open_coco(f"coco:{copy}", "train")
    first = next(a for a in instances(copy)["annotations"] if not a["iscrowd"])
    assert int(ds.target(ds.image_ids.index(first["image_id"]))["masks"][0].sum()) == 0


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="named pipes need POSIX")
def test_named_pipes_are_refused_without_blocking(copy):
    ds = open_coco(f"coco:{copy}", "train")
    image = ds.images[0]["path"]
    image.unlink()
    os.mkfifo(image)
    with pytest.raises(DataFileError) as e:
        unblocked(lambda: ds[0], image)
    assert "named pipe" in one_line(e)
    ann = copy / "annotations" / "instances_val2017.json"
    ann.unlink()
    os.mkfifo(ann)
    with pytest.raises(DataFileError) as e:
        unblocked(lambda: open_coco(f"coco:{copy}", "val"), ann)
    assert "named pipe" in one_line(e)


@pytest.mark.parametrize("content", [b"", b"not an image", None], ids=["empty", "text", "other-size"])
def test_damaged_images_are_one_line(copy, content):
    ds = open_coco(f"coco:{copy}", "train")
    path = ds.images[0]["path"]
    if content is None:
        from PIL import Image

        Image.new("RGB", (10, 10)).save(path, format="JPEG")
    else:
        path.write_bytes(content)
    with pytest.raises(DataFileError) as e:
        ds[0]
    one_line(e)


# --------------------------------------------------------------------------- RLE and the generated set


def test_rle_string_codec_matches_pycocotools():
    rng = np.random.default_rng(0)
    for _ in range(200):
        h, w = (int(v) for v in rng.integers(1, 30, 2))
        mask = rng.random((h, w)) < rng.random()
        ref = mask_api.encode(np.asfortranarray(mask.astype(np.uint8)))["counts"].decode()
        assert rle_string(rle_runs(mask)) == ref
        assert rle_counts(ref) == rle_runs(mask)
    with pytest.raises(ValueError):
        rle_counts("0a")  # ends inside a count ("a" continues)


def test_synth_is_deterministic(tmp_path):
    a, b = make_coco_folder(tmp_path / "a", 4, 2, seed=3), make_coco_folder(tmp_path / "b", 4, 2, seed=3)
    files = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    assert len(files) == 2 + 6
    assert all((a / f).read_bytes() == (b / f).read_bytes() for f in files)
    c = make_coco_folder(tmp_path / "c", 4, 2, seed=4)
    assert instances(a) != instances(c)


# --------------------------------------------------------------------------- transforms and batches


def test_detr_scales_and_resized_shape():
    assert detr_scales(800) == tuple(range(480, 801, 32)) and default_max_size(800) == 1333
    for h in range(5, 200, 7):
        for w in range(5, 200, 11):
            for size, cap in ((32, None), (64, 100), (100, 120)):
                nh, nw = resized_shape(h, w, size, cap)
                if cap is None or max(h, w) * size <= cap * min(h, w):
                    assert min(nh, nw) == size
                else:
                    assert max(nh, nw) <= cap and min(nh, nw) < size
                assert (nh <= nw if h < w else nh >= nw) if h != w else nh == nw
                assert abs(nh / nw - h / w) <= max(1 / nw, 1 / nh) * (h / w + 1)  # aspect kept to a pixel


def test_flip_maps_boxes_and_masks_exactly(coco):
    ds = open_coco(f"coco:{coco}", "train")
    for i in range(len(ds)):
        image, target = ds[i]
        w = image.shape[-1]
        flipped, out = hflip(image, target)
        for k, (x0, y0, x1, y1) in enumerate(target["boxes"].tolist()):
            assert out["boxes"][k].tolist() == [w - x1, y0, w - x0, y1]
            ys, xs = np.nonzero(target["masks"][k].numpy())
            fys, fxs = np.nonzero(out["masks"][k].numpy())
            assert sorted(zip(fys, fxs)) == sorted(zip(ys, w - 1 - xs))
        assert torch.equal(flipped[:, :, 0], image[:, :, -1])


def test_resize_scales_boxes_and_masks(coco):
    ds = open_coco(f"coco:{coco}", "train")
    image, target = ds[0]  # 48 x 64
    out_image, out = resize(image, target, 72, None)
    assert out_image.shape == (3, 72, 96) and out_image.dtype == torch.uint8
    assert out["size"].tolist() == [72, 96] and out["orig_size"].tolist() == [48, 64]
    assert torch.allclose(out["boxes"], target["boxes"] * 1.5)
    assert out["masks"].shape == (len(target["boxes"]), 72, 96)
    assert torch.equal(out["masks"][:, ::3, ::3], target["masks"][:, ::2, ::2])  # nearest: exact on the grid
    capped_image, capped = resize(image, target, 72, 80)
    assert capped_image.shape == (3, 60, 80) and capped["size"].tolist() == [60, 80]


def test_random_transform_follows_the_generator(coco):
    ds = open_coco(f"coco:{coco}", "train")
    t = DetTransform((32, 40, 48, 56), 100, hflip=0.5)
    runs = [[t(*ds[i], torch.Generator().manual_seed(s)) for i in range(3)] for s in (5, 5)]
    for (a_im, a_t), (b_im, b_t) in zip(*runs):
        assert torch.equal(a_im, b_im) and torch.equal(a_t["boxes"], b_t["boxes"])
    sizes = {tuple(t(*ds[0], torch.Generator().manual_seed(s))[1]["size"].tolist()) for s in range(40)}
    assert {min(s) for s in sizes} == {32, 40, 48, 56}
    with pytest.raises(ValueError):
        t(*ds[0])  # a random transform without a generator


def test_collate_pads_bottom_right_and_marks_exactly_the_pad(coco):
    ds = open_coco(f"coco:{coco}", "train")
    samples = [resize(*ds[0], 40, None), resize(*ds[1], 48, None), ds[2]]  # 40x53, 48x64, 48x64
    for divisor, (hh, ww) in ((1, (48, 64)), (32, (64, 64))):
        batch = collate(samples, size_divisor=divisor)
        assert batch.images.shape == (3, 3, hh, ww) and batch.padding.shape == (3, hh, ww) and len(batch) == 3
        for k, (image, target) in enumerate(samples):
            h, w = image.shape[1:]
            assert target["size"].tolist() == [h, w]
            want = torch.ones(hh, ww, dtype=torch.bool)
            want[:h, :w] = False
            assert torch.equal(batch.padding[k], want)
            assert (batch.images[k][:, want] == 0).all()
            mean = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1)
            std = torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1)
            assert torch.allclose(batch.images[k, :, :h, :w], (image.float() / 255 - mean) / std)
            assert batch.targets[k] is target


# --------------------------------------------------------------------------- the loader


def batches(loader, n=None):
    out = []
    for batch, targets in loader:
        assert targets is batch.targets
        out.append(
            (batch.images.clone(), batch.padding.clone(), [{k: v.clone() for k, v in t.items()} for t in targets])
        )
        if n is not None and len(out) == n:
            break
    return out


def same(a, b) -> bool:
    return all(
        torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) and len(x[2]) == len(y[2])
        and all(t.keys() == u.keys() and all(torch.equal(t[k], u[k]) for k in t) for t, u in zip(x[2], y[2]))
        for x, y in zip(a, b)
    ) and len(a) == len(b)  # fmt: skip


@pytest.mark.parametrize("workers", [0, 2])
def test_loader_is_deterministic_and_resumes_mid_epoch(coco, workers):
    """The same batches with decoding threads as without (each batch comes from its own generator)."""
    ds = open_coco(f"coco:{coco}", "train")

    def loader(w: int = workers):
        return DetLoader(ds, 3, 48, seed=7, scales=(32, 40, 48), max_size=80, size_divisor=16, workers=w)

    first, again = loader(), loader()
    first.set_epoch(1)
    again.set_epoch(1)
    reference = batches(first)
    assert len(reference) == len(first) == 4
    assert same(reference, batches(again))
    plain = loader(0)
    plain.set_epoch(1)
    assert same(reference, batches(plain))
    images, _, targets = reference[0]
    assert images.shape[-1] % 16 == 0 and all("masks" in t and t["labels"].dtype == torch.int64 for t in targets)
    other = loader()
    other.set_epoch(2)
    assert not same(reference, batches(other))

    interrupted = loader()
    interrupted.set_epoch(1)
    assert same(batches(interrupted, 2), reference[:2])
    state = interrupted.state_dict()
    resumed = loader()
    resumed.load_state_dict(state)
    assert same(batches(resumed), reference[2:])


def test_loader_shards_disjoint_images_over_ranks(coco):
    ds = open_coco(f"coco:{coco}", "train", masks=False)
    seen = []
    for rank in (0, 1):
        loader = DetLoader(ds, 2, 32, seed=1, rank=rank, world_size=2)
        loader.set_epoch(0)
        ids = [int(t["image_id"]) for _, targets in loader for t in targets]
        assert len(ids) == len(set(ids)) == 6
        seen.append(set(ids))
    assert not seen[0] & seen[1]
