"""Faster / Mask R-CNN over vitlab backbones (vitlab.tasks.detection.rcnn, .fpn): the detector contract of
vitlab.tasks.detection.batch, on tiny synthetic batches.

torchvision's compiled ops do not load beside the CPU torch of the main environment, so the tests that build a
detector skip there; scripts/detection_check.sh runs them in an environment with a matching torch/torchvision
pair. The refusals (no torchvision, unknown kind) are checked everywhere.
"""

from __future__ import annotations

import math

import pytest
import torch

from vitlab.common.extras import MissingExtra
from vitlab.data.datasets import IMAGENET_MEAN, IMAGENET_STD
from vitlab.tasks.detection import rcnn
from vitlab.tasks.detection.batch import DetBatch
from vitlab.tasks.detection.rcnn import KINDS, build_rcnn

PROBLEM = rcnn.torchvision_problem()
needs_torchvision = pytest.mark.skipif(
    PROBLEM is not None,
    reason=f"torchvision's ops do not load here ({PROBLEM}); scripts/detection_check.sh runs these tests",
)
NUM_CLASSES = 3
PYRAMID, PLAIN = "pcpvt_mini", "deit_mini"  # two stages at strides 4, 8; four blocks at the patch stride 4


def make_batch(sizes, orig_sizes=None, masks=True, seed=0) -> DetBatch:
    """Rectangles of a colour per class on a dark noisy background, normalised as the data pipeline does, padded
    at the bottom and right to the largest image; targets in the pixels of ``sizes``."""
    g = torch.Generator().manual_seed(seed)
    colours = torch.tensor([[1.0, 0.2, 0.2], [0.2, 1.0, 0.2], [0.2, 0.2, 1.0]])
    mean, std = torch.tensor(IMAGENET_MEAN)[:, None, None], torch.tensor(IMAGENET_STD)[:, None, None]
    H, W = max(s[0] for s in sizes), max(s[1] for s in sizes)
    images, padding = torch.zeros(len(sizes), 3, H, W), torch.ones(len(sizes), H, W, dtype=torch.bool)
    targets = []
    for i, (h, w) in enumerate(sizes):
        img = 0.1 * torch.rand(3, h, w, generator=g)
        boxes, labels, ms = [], [], []
        for k in range(2):
            bw, bh = (int(torch.randint(12, 30, (1,), generator=g)) for _ in range(2))
            x0 = int(torch.randint(0, w - bw, (1,), generator=g))
            y0 = int(torch.randint(0, h - bh, (1,), generator=g))
            label = (i + k) % NUM_CLASSES
            m = torch.zeros(h, w, dtype=torch.uint8)
            m[y0 : y0 + bh, x0 : x0 + bw] = 1
            img[:, m.bool()] = colours[label][:, None]
            boxes.append([x0, y0, x0 + bw, y0 + bh])
            labels.append(label)
            ms.append(m)
        images[i, :, :h, :w] = (img - mean) / std
        padding[i, :h, :w] = False
        t = {"boxes": torch.tensor(boxes, dtype=torch.float32), "labels": torch.tensor(labels),
             "image_id": torch.tensor(i), "size": torch.tensor([h, w]),
             "orig_size": torch.tensor(orig_sizes[i] if orig_sizes else [h, w])}  # fmt: skip
        if masks:
            t["masks"] = torch.stack(ms)
        targets.append(t)
    return DetBatch(images, padding, targets)


# ------------------------------------------------------------------------------- refusals (every environment)
def test_no_torchvision_is_one_line(monkeypatch):
    monkeypatch.setattr(rcnn, "torchvision_problem", lambda: "ModuleNotFoundError: No module named 'torchvision'")
    with pytest.raises(MissingExtra) as e:
        build_rcnn(PYRAMID, "faster_rcnn", NUM_CLASSES)
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith("the R-CNN detectors need torchvision with its compiled ops (torchvision.ops.nms failed: ")
    assert "scripts/detection_check.sh" in msg and "vitlab[detection]" in msg


def test_no_torchvision_here_says_why():
    if PROBLEM is None:
        pytest.skip("torchvision's ops load here")
    with pytest.raises(MissingExtra, match=r"torchvision\.ops\.nms failed: "):
        build_rcnn(PYRAMID, "mask_rcnn", NUM_CLASSES)


def test_unknown_kind():
    with pytest.raises(ValueError, match=r"^R-CNN kind must be one of faster_rcnn, mask_rcnn, got 'retinanet'$"):
        build_rcnn(PYRAMID, "retinanet", NUM_CLASSES)


# --------------------------------------------------------------------------------------- with torchvision
@needs_torchvision
@pytest.mark.parametrize("backbone", [PYRAMID, PLAIN, "vit_16b_mini"])
def test_pyramid_levels(backbone):
    """Maps "0".."3" at strides 4..32 and "pool" at 64 from a 2-stage pyramid and from plain ViTs."""
    from vitlab.tasks.detection.fpn import DetectionBackbone

    net = DetectionBackbone(backbone, out_channels=16)
    feats = net(torch.randn(2, 3, 64, 96))
    assert list(feats) == ["0", "1", "2", "3", "pool"]
    for stride, f in zip((4, 8, 16, 32, 64), feats.values()):
        assert tuple(f.shape) == (2, 16, math.ceil(64 / stride), math.ceil(96 / stride))


@needs_torchvision
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("backbone", [PYRAMID, PLAIN])
def test_train_losses_reach_backbone(backbone, kind):
    torch.manual_seed(0)
    model = build_rcnn(backbone, kind, NUM_CLASSES).train()
    batch = make_batch([(64, 80), (56, 72)])
    # a box of zero width (a crop's leftover) is left out, not refused as torchvision would
    t = batch.targets[1]
    t["boxes"] = torch.cat([t["boxes"], torch.tensor([[10.0, 10.0, 10.0, 30.0]])])
    t["labels"] = torch.cat([t["labels"], torch.tensor([0])])
    t["masks"] = torch.cat([t["masks"], torch.zeros(1, 56, 72, dtype=torch.uint8)])
    total, parts = model.loss(batch, model(batch))
    expected = {"loss_classifier", "loss_box_reg", "loss_objectness", "loss_rpn_box_reg"}
    assert set(parts) == expected | ({"loss_mask"} if kind == "mask_rcnn" else set())
    assert total.ndim == 0 and torch.isfinite(total)
    assert all(torch.isfinite(v) and not v.requires_grad for v in parts.values())
    assert torch.allclose(total.detach(), sum(parts.values()))
    total.backward()
    net = model.net.backbone.body.features.model
    stem = net.get_submodule(net.first_conv)  # the layer that sees the image: the gradient went all the way
    grads = [p.grad for p in stem.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert sum(g.abs().sum() for g in grads) > 0
    with pytest.raises(ValueError, match="evaluation-mode forward"):
        model.predict(batch, model(batch))


@needs_torchvision
def test_mask_rcnn_needs_masks():
    model = build_rcnn(PYRAMID, "mask_rcnn", NUM_CLASSES).train()
    batch = make_batch([(64, 80)], masks=False)
    with pytest.raises(ValueError, match="mask_rcnn trains on instance masks"):
        model(batch)


@needs_torchvision
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("backbone", [PYRAMID, PLAIN])
def test_predict_in_original_pixels(backbone, kind):
    """Detections in the resized frame, scaled by orig_size / size per axis (not the same on both), clipped to
    the image's own size, not the padded batch's; labels 0..C-1; masks pasted at the original size."""
    torch.manual_seed(0)
    model = build_rcnn(backbone, kind, NUM_CLASSES, box_score_thresh=0.0).eval()
    sizes, origs = [(64, 80), (48, 56)], [(128, 200), (96, 84)]
    batch = make_batch(sizes, origs)
    with torch.no_grad():
        out = model(batch)
        preds = model.predict(batch, out)
    with pytest.raises(ValueError, match="training-mode forward"):
        model.loss(batch, out)
    assert len(preds) == 2
    for det, pred, (h, w), (oh, ow) in zip(out["detections"], preds, sizes, origs):
        n = len(pred["boxes"])
        assert n > 0
        assert det["boxes"][:, 2].max() <= w and det["boxes"][:, 3].max() <= h  # the padding is no image
        scale = torch.tensor([ow / w, oh / h, ow / w, oh / h])
        torch.testing.assert_close(pred["boxes"], det["boxes"] * scale)
        bx, by = pred["boxes"][:, 0::2], pred["boxes"][:, 1::2]
        assert (bx >= 0).all() and (bx <= ow).all() and (by >= 0).all() and (by <= oh).all()
        assert pred["labels"].dtype == torch.long and pred["labels"].min() >= 0 and pred["labels"].max() < NUM_CLASSES
        torch.testing.assert_close(pred["labels"], det["labels"] - 1)
        assert pred["scores"].shape == (n,)
        if kind == "faster_rcnn":
            assert "masks" not in pred
            continue
        masks = pred["masks"]
        assert masks.shape == (n, oh, ow) and masks.dtype == torch.float32
        assert masks.min() >= 0 and masks.max() <= 1
        # each mask lies in its box (torchvision pastes a 28x28 mask into the box grown by 1/28 a side)
        ys, xs = torch.arange(oh)[:, None], torch.arange(ow)[None, :]
        for m, (x0, y0, x1, y1) in zip(masks, pred["boxes"].tolist()):
            gx, gy = (x1 - x0) / 14 + 2, (y1 - y0) / 14 + 2
            outside = (xs < x0 - gx) | (xs > x1 + gx) | (ys < y0 - gy) | (ys > y1 + gy)
            assert (m[outside] == 0).all()


@needs_torchvision
@pytest.mark.parametrize("backbone,kind", [(PYRAMID, "mask_rcnn"), (PLAIN, "faster_rcnn")])
def test_overfits_a_tiny_batch(backbone, kind):
    torch.manual_seed(0)
    model = build_rcnn(backbone, kind, NUM_CLASSES).train()
    batch = make_batch([(64, 80), (64, 80)], seed=1)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.0)
    losses = []
    for _ in range(40):
        total, _ = model.loss(batch, model(batch))
        opt.zero_grad()
        total.backward()
        opt.step()
        losses.append(total.item())
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < 0.5 * first, f"loss {first:.3f} -> {last:.3f}"
    # and it finds what it learnt: every object by a confident detection of its class (its mask too)
    from torchvision.ops import box_iou

    model.eval()
    with torch.no_grad():
        preds = model.predict(batch, model(batch))
    for pred, target in zip(preds, batch.targets):
        iou = box_iou(target["boxes"], pred["boxes"])
        hit = (iou > 0.5) & (target["labels"][:, None] == pred["labels"][None]) & (pred["scores"][None] > 0.3)
        assert hit.any(1).all(), f"targets {target['boxes'].tolist()} {target['labels'].tolist()}, got {pred}"
        if kind == "mask_rcnn":
            for k, j in enumerate((iou * hit).argmax(1).tolist()):
                m, gt = pred["masks"][j] > 0.5, target["masks"][k].bool()
                assert (m & gt).sum() / (m | gt).sum() > 0.5
