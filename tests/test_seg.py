"""Semantic segmentation (:mod:`vitlab.tasks.segmentation`, ``vitlab seg``): metrics and sliding windows against direct
implementations, the VOC / ADE20K readers on generated folders in the real layouts, the joint transform's
alignment of image and mask, the models over a pyramid and a plain ViT, and ``vitlab seg train`` learning,
resuming bit for bit and evaluating with sliding windows."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
import torch
from torch import nn

from vitlab.checkpoint import load_checkpoint
from vitlab.cli import main
from vitlab.tasks.segmentation import ConfusionMatrix, build_segmenter, iou_from_confusion, open_masks, predict
from vitlab.tasks.segmentation.data import JointTransform, SegLoader
from vitlab.tasks.segmentation.infer import window_starts
from vitlab.tasks.segmentation.metrics import confusion
from vitlab.tasks.segmentation.models import Head, plain_levels
from vitlab.tasks.segmentation.synth import make_mask_folder


@pytest.fixture(scope="module")
def voc(tmp_path_factory):
    return make_mask_folder(tmp_path_factory.mktemp("voc"), "voc", train=16, val=4, size=(32, 40), classes=4)


# --------------------------------------------------------------------------- metrics


def naive_iou(pred: np.ndarray, target: np.ndarray, k: int) -> tuple[list[float | None], float, float]:
    """Per-class IoU, mIoU and pixel accuracy by counting pixels one class at a time (float64)."""
    keep = target != 255
    p, t = pred[keep], target[keep]
    ious = []
    for c in range(k):
        inter, union = np.sum((p == c) & (t == c)), np.sum((p == c) | (t == c))
        ious.append(100.0 * inter / union if union else None)
    present = [v for v in ious if v is not None]
    return ious, float(np.mean(present)), 100.0 * np.mean(p == t)


def test_iou_equals_counting_pixels_class_by_class():
    g = torch.Generator().manual_seed(0)
    k = 6
    target = torch.randint(0, k - 1, (3, 17, 19), generator=g)  # class 5 never in the truth
    target[torch.rand(target.shape, generator=g) < 0.1] = 255
    pred = torch.randint(0, k - 2, target.shape, generator=g)  # ... nor predicted: no IoU, not averaged
    matrix = ConfusionMatrix(k)
    for i in range(3):  # summed over batches before the ratio
        matrix.add(pred[i], target[i])
    got = matrix.result()
    ious, miou, acc = naive_iou(pred.numpy(), target.numpy(), k)
    assert got["iou"][5] is None and ious[5] is None
    assert got["iou"][:5] == pytest.approx(ious[:5], abs=1e-9)
    assert got["miou"] == pytest.approx(miou, abs=1e-9) and got["aacc"] == pytest.approx(acc, abs=1e-9)


def test_confusion_refuses_labels_outside_the_classes():
    with pytest.raises(ValueError, match=r"lie in \[0, 3\)"):
        confusion(torch.zeros(4, dtype=torch.long), torch.tensor([0, 1, 3, 255]), 3)
    perfect = iou_from_confusion(confusion(torch.tensor([0, 1, 2]), torch.tensor([0, 1, 2]), 3))
    assert perfect["miou"] == 100.0


# --------------------------------------------------------------------------- sliding windows


@pytest.mark.parametrize(("size", "crop", "stride"), [(10, 6, 4), (6, 6, 2), (23, 8, 5), (9, 8, 8)])
def test_windows_cover_the_image_and_end_flush(size, crop, stride):
    starts = window_starts(size, crop, stride)
    assert starts[0] == 0 and starts[-1] == size - crop
    assert all(0 < b - a <= stride for a, b in itertools.pairwise(starts))
    covered = np.zeros(size, bool)
    for s in starts:
        covered[s : s + crop] = True
    assert covered.all()


class WindowMean(nn.Module):
    """Logits that depend on the whole window (each channel plus the window's mean): windows matter."""

    def forward(self, x):
        return torch.cat([x, x.mean((2, 3), keepdim=True).expand_as(x)], 1)


def test_slide_equals_the_mean_over_covering_windows():
    x = torch.randn(2, 3, 11, 14, dtype=torch.float64)
    crop, stride = 6, 4
    got = predict(WindowMean(), x, crop, "slide", stride, batch=3)
    want = torch.zeros(2, 6, 11, 14, dtype=torch.float64)
    for i in range(11):
        for j in range(14):
            outs = [
                WindowMean()(x[:, :, t : t + crop, s : s + crop])[:, :, i - t, j - s]
                for t in range(0, 11 - crop + 1)
                for s in range(0, 14 - crop + 1)
                if t in window_starts(11, crop, stride) and s in window_starts(14, crop, stride)
                and t <= i < t + crop and s <= j < s + crop
            ]  # fmt: skip
            want[:, :, i, j] = torch.stack(outs).mean(0)
    torch.testing.assert_close(got.double(), want)


def test_slide_pads_small_images_and_whole_resizes():
    x = torch.randn(1, 3, 5, 7)
    pointwise = nn.Conv2d(3, 4, 1)
    assert predict(pointwise, x, 8, "slide").shape == (1, 4, 5, 7)
    torch.testing.assert_close(predict(pointwise, x, 8, "slide"), pointwise(x))  # one padded window, cropped back
    assert predict(pointwise, x, 8, "whole").shape == (1, 4, 5, 7)
    with pytest.raises(ValueError, match="stride"):
        predict(pointwise, x, 8, "slide", stride=9)


# --------------------------------------------------------------------------- data


def test_voc_and_ade20k_layouts_read_back(voc, tmp_path):
    ds = open_masks(f"voc:{voc}", "train")
    image, mask = ds.load(0)
    assert (ds.layout, ds.num_classes, len(ds)) == ("voc", 21, 16)
    assert image.dtype == torch.uint8 and image.shape == (3, 32, 40) and mask.shape == (32, 40)
    assert set(mask.unique().tolist()) <= {0, 1, 2, 3, 255} and (mask == 255).any()  # VOC's border band
    ade = make_mask_folder(tmp_path / "ade", "ade20k", train=2, val=2, size=(24, 20), classes=3)
    val = open_masks(str(ade), "val")  # a bare root: the layout recognised by its folders
    _, m = val.load(0)
    from PIL import Image

    raw = torch.from_numpy(np.array(Image.open(val.items[0][1]))).long()
    assert val.layout == "ade20k" and val.num_classes == 150
    torch.testing.assert_close(m, torch.where(raw == 0, 255, raw - 1))  # 0 = "other" ignored, 1..150 -> 0..149


def test_bad_data_says_what_is_wrong(voc, tmp_path):
    with pytest.raises(ValueError, match="not a folder"):
        open_masks(str(tmp_path / "nothing"), "train")
    with pytest.raises(ValueError, match="not in the ade20k layout"):
        open_masks(f"ade20k:{voc}", "train")
    broken = make_mask_folder(tmp_path / "broken", "voc", train=1, val=1, size=(8, 8))
    from PIL import Image

    mask_path = broken / "SegmentationClass" / "train_00000.png"
    Image.new("RGB", (8, 8)).save(mask_path)
    with pytest.raises(ValueError, match="one-channel PNG"):
        open_masks(str(broken), "train").load(0)
    (broken / "ImageSets" / "Segmentation" / "val.txt").unlink()
    with pytest.raises(FileNotFoundError, match=r"val\.txt"):
        open_masks(str(broken), "val")


def test_joint_transform_keeps_image_and_mask_aligned():
    mask = torch.randint(0, 5, (20, 30))
    mask[0, :] = 255
    image = (mask * 10).clamp(max=250).to(torch.uint8).expand(3, -1, -1).clone()  # the mask written into the pixels
    for seed in range(6):
        img, m = JointTransform(20, (1.0, 1.0), hflip=0.5)(image, mask, torch.Generator().manual_seed(seed))
        assert img.shape == (3, 20, 20) and m.shape == (20, 20)
        torch.testing.assert_close(img[0].long(), (m * 10).clamp(max=250))
    # short side 40 x 0.5 = the image's own 20: not resized, padded to 40 x 40 (ignored, black), not moved
    img, m = JointTransform(40, (0.5, 0.5), hflip=0.0)(image, mask, torch.Generator().manual_seed(0))
    assert torch.equal(m[:20, :30], mask) and (m[:, 30:] == 255).all() and (m[20:] == 255).all()
    assert (img[:, :, 30:] == 0).all() and (img[:, 20:] == 0).all()


def test_seg_loader_batches_follow_the_seed_and_resume(voc):
    ds = open_masks(str(voc), "train")
    a = SegLoader(ds, 4, 24, seed=3)
    a.set_epoch(1)
    batches = list(a)
    b = SegLoader(ds, 4, 24, seed=3)
    b.set_epoch(1, start_batch=2)
    for (x1, y1), (x2, y2) in zip(batches[2:], b):
        torch.testing.assert_close(x1, x2)
        assert torch.equal(y1, y2)
    assert batches[0][0].shape == (4, 3, 24, 24) and batches[0][1].dtype == torch.int64


# --------------------------------------------------------------------------- models


@pytest.mark.parametrize(("backbone", "head"), [("pcpvt_mini", "ea"), ("deit_mini", "plain"), ("deit_mini", "ea")])
def test_segmenter_gives_logits_at_the_input_size(backbone, head):
    net = build_segmenter(backbone, num_classes=21, img_size=32, head=head, channels=16).eval()
    assert net(torch.randn(2, 3, 32, 32)).shape == (2, 21, 32, 32)


def test_heads_differ_by_the_external_attention_block():
    ea, plain = Head(16, 5, "ea", memory_size=8), Head(16, 5, "plain")
    assert any(type(m).__name__ == "ExternalAttentionConv" for m in ea.modules())
    assert not any(type(m).__name__ == "ExternalAttentionConv" for m in plain.modules())
    softmax = Head(16, 5, "ea", memory_size=8, ea_norm="softmax")
    assert [m.ea.memory_norm for m in softmax.modules() if hasattr(m, "ea")] == ["softmax"]
    with pytest.raises(ValueError, match="head must be one of"):
        Head(16, 5, "fcn")
    assert plain_levels(12) == [2, 5, 8, 11] and plain_levels(2) == [0, 1]


# --------------------------------------------------------------------------- vitlab seg


RUN = ["--model", "pcpvt_mini", "--img-size", "32", "--batch-size", "4", "--threads", "1", "--no-progress",
       "--device", "cpu", "--model-arg", "channels=16", "--model-arg", "memory_size=8"]  # fmt: skip


def majority_miou(ds) -> float:
    """mIoU of answering the most frequent class everywhere: the chance level to beat."""
    masks = [ds.load(i)[1] for i in range(len(ds))]
    counts = torch.bincount(torch.cat([m[m != 255] for m in masks]), minlength=ds.num_classes)
    matrix = ConfusionMatrix(ds.num_classes)
    for m in masks:
        matrix.add(torch.full_like(m, int(counts.argmax())), m)
    return matrix.result()["miou"]


def test_seg_train_learns_resumes_bit_identically_and_evaluates(voc, tmp_path, capsys, monkeypatch):
    """A run stopped just after a mid-epoch checkpoint (step 18 of 24, inside epoch 5), then resumed, ends with
    the weights of an uninterrupted run, bit for bit; the held-out mIoU beats the majority-class answer."""
    import vitlab.engine.loop as engine

    args = [*RUN, "--data", f"voc:{voc}", "--lr", "1e-2", "--warmup-epochs", "0.25", "--epochs", "6"]
    assert main(["seg", "train", *args, "--out", str(tmp_path / "a")]) == 0
    save_position = engine.save_position

    def save_then_stop(run, epoch, tally):
        save_position(run, epoch, tally)
        if run.step == 18:
            raise KeyboardInterrupt

    monkeypatch.setattr(engine, "save_position", save_then_stop)
    assert main(["seg", "train", *args, "--save-every", "2", "--out", str(tmp_path / "b")]) == 130
    monkeypatch.setattr(engine, "save_position", save_position)
    assert load_checkpoint(tmp_path / "b" / "last.pt")["step"] == 18
    assert main(["seg", "train", *args, "--save-every", "2", "--out", str(tmp_path / "b"), "--resume"]) == 0
    a, b = load_checkpoint(tmp_path / "a" / "last.pt"), load_checkpoint(tmp_path / "b" / "last.pt")
    for k, v in a["model"].items():
        assert torch.equal(v, b["model"][k]), k
    log_a, log_b = (json.loads((tmp_path / x / "log.json").read_text()) for x in "ab")
    assert [r["train_acc"] for r in log_a] == [r["train_acc"] for r in log_b]  # the pixel sums resumed too
    rows = json.loads((tmp_path / "a" / "log.json").read_text())
    assert rows[-1]["val_miou"] > majority_miou(open_masks(str(voc), "val")) + 20  # measured: 60 vs 21
    capsys.readouterr()
    out_json = tmp_path / "eval.json"
    assert main(["seg", "eval", str(tmp_path / "a" / "best.pt"), "--data", str(voc), "--stride", "8",
                 "--json", str(out_json)]) == 0  # fmt: skip
    printed = capsys.readouterr().out
    assert "mIoU" in printed and "background" in printed  # VOC's class names beside the per-class IoU
    assert json.loads(out_json.read_text())["n"] == 4


def test_seg_cli_refuses_what_it_cannot_do(voc, tmp_path, capsys):
    assert main(["seg", "train", *RUN, "--data", str(tmp_path), "--out", str(tmp_path / "x")]) == 2
    assert "not in the voc, ade20k or cityscapes layout" in capsys.readouterr().err
    assert main(["seg", "train", *RUN, "--data", str(voc), "--mixup", "0.8", "--out", str(tmp_path / "x")]) == 2
    assert "does not take --mixup" in capsys.readouterr().err


def test_segmentation_studies_pass_their_switch_to_the_small_rows(capsys):
    from vitlab.experiments.papers import STUDIES
    from vitlab.experiments.reproduce import variants

    memory = variants(STUDIES.get("ea-seg-memory"), "small")
    assert [v.model_args["memory_size"] for v in memory] == [8, 32, 64, 256]
    assert STUDIES.get("ea-seg-memory").rows[2].paper == {"miou": 77.4}
    attention = STUDIES.get("ea-seg-attention")
    assert [v.model_args["head"] for v in variants(attention, "small")] == ["ea", "ea", "sa", "sa_dn", "plain"]
    full = variants(attention, "full")  # EANet: a dilated ResNet-50 with the head on its last stage
    assert {v.model for v in full} == {"resnet50"} and all(v.model_args["decoder"] == "eanet" for v in full)
    assert {v.model for v in variants(attention, "small")} == {"resnet_mini"}
    assert [v.model for v in variants(STUDIES.get("ea-seg-eanet"), "full")] == ["resnet50", "resnet101"]
    assert main(["study", "ea-seg-head"]) == 2  # the default data is MNIST: one line asking for a mask folder
    assert "give --data voc:ROOT" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("name", ["ea-seg-head", "ea-seg-norm", "ea-seg-memory", "ea-seg-attention", "ea-seg-eanet"])
def test_segmentation_studies_end_to_end(name, voc, tmp_path):
    from vitlab.experiments.papers import STUDIES

    out = tmp_path / name
    assert main(["study", name, "--data", f"voc:{voc}", "--seeds", "1", "--epochs", "1", "--out", str(out)]) == 0
    rows = json.loads((out / "table.json").read_text())["rows"]
    assert [r["row"] for r in rows] == [r.label for r in STUDIES.get(name).rows]
    assert all(0 <= r["miou"] <= 100 for r in rows) and "mIoU" in (out / "table.md").read_text()


@pytest.mark.slow
def test_seg_train_under_torchrun_ddp(voc, tmp_path):
    """Two gloo processes: the global batch of 4 split over them, the pixel sums all-reduced, rank 0 evaluates
    and writes."""
    import os
    import subprocess
    import sys

    out = tmp_path / "ddp"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "vitlab.cli",
           "seg", "train", *RUN, "--data", str(voc), "--epochs", "1", "--out", str(out)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "on 2 processes (DDP)" in proc.stdout
    row = json.loads((out / "log.json").read_text())[0]
    assert 0 <= row["val_miou"] <= 100 and 0 <= row["train_acc"] <= 100 and row["step"] == 4  # 16 images / 4
