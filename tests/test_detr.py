"""DETR with a position-encoding switch (vitlab.tasks.detection.detr, .matcher, .position, .box_ops, .models):
box arithmetic against per-pair formulas, the Hungarian matching against brute force, the sine encoding against
a loop over DETR's formula, the mask-aware PEG, the set loss, predict's scaling, and a tiny DETR overfitting a
fixed batch. Backbones are the minis (pcpvt_mini: a pyramid, strides 4 and 8; deit_mini: a plain ViT, patch 4).
"""

from __future__ import annotations

import itertools
import math
import sys

import pytest
import torch

from vitlab.common.extras import MissingExtra
from vitlab.engine.optim import param_groups
from vitlab.tasks.detection.batch import DetBatch
from vitlab.tasks.detection.box_ops import (
    box_area,
    box_iou,
    cxcywh_to_xyxy,
    generalized_box_iou,
    xyxy_to_cxcywh,
)
from vitlab.tasks.detection.detr import DETR
from vitlab.tasks.detection.matcher import HungarianMatcher
from vitlab.tasks.detection.models import DETR_MINI, build_detector
from vitlab.tasks.detection.position import POSITIONS, LearnedPosition, PEGDetection, sine_position

NUM_CLASSES = 3
PYRAMID, PLAIN = "pcpvt_mini", "deit_mini"


def make_batch(sizes, orig_sizes=None, seed=0) -> DetBatch:
    """Two rectangles of a colour per class on a noisy background per image, zero-padded at the bottom and right
    to the largest image; targets in the pixels of ``sizes``."""
    g = torch.Generator().manual_seed(seed)
    colours = torch.tensor([[2.0, -1.0, -1.0], [-1.0, 2.0, -1.0], [-1.0, -1.0, 2.0]])
    H, W = max(s[0] for s in sizes), max(s[1] for s in sizes)
    images, padding = torch.zeros(len(sizes), 3, H, W), torch.ones(len(sizes), H, W, dtype=torch.bool)
    targets = []
    for i, (h, w) in enumerate(sizes):
        img, boxes, labels = 0.1 * torch.randn(3, h, w, generator=g), [], []
        for k in range(2):
            bw, bh = (int(torch.randint(12, 30, (1,), generator=g)) for _ in range(2))
            x0, y0 = int(torch.randint(0, w - bw, (1,), generator=g)), int(torch.randint(0, h - bh, (1,), generator=g))
            label = (i + k) % NUM_CLASSES
            img[:, y0 : y0 + bh, x0 : x0 + bw] = colours[label][:, None, None]
            boxes.append([x0, y0, x0 + bw, y0 + bh])
            labels.append(label)
        images[i, :, :h, :w], padding[i, :h, :w] = img, False
        targets.append({"boxes": torch.tensor(boxes, dtype=torch.float32), "labels": torch.tensor(labels),
                        "image_id": torch.tensor(i), "size": torch.tensor([h, w]),
                        "orig_size": torch.tensor(orig_sizes[i] if orig_sizes else [h, w])})  # fmt: skip
    return DetBatch(images, padding, targets)


# ------------------------------------------------------------------------------------------------- box_ops
def naive_iou_giou(a, b):
    ix = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    iy = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = ix * iy
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    hull = (max(a[2], b[2]) - min(a[0], b[0])) * (max(a[3], b[3]) - min(a[1], b[1]))
    return inter / union, inter / union - (hull - union) / hull


def test_iou_and_giou_match_the_per_pair_formula():
    g = torch.Generator().manual_seed(0)
    lo = torch.rand(6, 2, generator=g) * 50
    rand = torch.cat([lo, lo + 1 + torch.rand(6, 2, generator=g) * 30], 1)
    special = torch.tensor([[0.0, 0, 10, 10], [20, 20, 30, 40], [2, 2, 5, 5], [0, 0, 10, 10], [10, 0, 20, 10]])
    a, b = torch.cat([rand, special]), torch.cat([special, rand])  # disjoint, nested, identical, touching pairs
    iou, giou = box_iou(a, b), generalized_box_iou(a, b)
    for i, j in itertools.product(range(len(a)), range(len(b))):
        want_iou, want_giou = naive_iou_giou(a[i].tolist(), b[j].tolist())
        assert iou[i, j].item() == pytest.approx(want_iou, abs=1e-6)
        assert giou[i, j].item() == pytest.approx(want_giou, abs=1e-6)
    n = len(rand)  # a[n + k] is special[k], b[k] is special[k]
    assert giou[n, 0].item() == pytest.approx(1.0) and giou[n + 3, 0].item() == pytest.approx(1.0)  # identical
    assert iou[n + 2, 0].item() == pytest.approx(9 / 100)  # nested: (3 * 3) / (10 * 10), the hull is the outer
    assert giou[n + 2, 0].item() == pytest.approx(9 / 100)
    assert iou[n + 3, 4].item() == 0 and giou[n + 3, 4].item() == pytest.approx(0.0)  # touching: hull = union
    assert giou[n, 1].item() == pytest.approx(-(40 * 30 - 100 - 200) / (40 * 30))  # disjoint: IoU 0, GIoU < 0


def test_box_formats_round_trip_and_area():
    xyxy = torch.tensor([[1.0, 2.0, 5.0, 10.0], [0.0, 0.0, 0.5, 0.25]])
    assert torch.allclose(xyxy_to_cxcywh(xyxy), torch.tensor([[3.0, 6.0, 4.0, 8.0], [0.25, 0.125, 0.5, 0.25]]))
    assert torch.allclose(cxcywh_to_xyxy(xyxy_to_cxcywh(xyxy)), xyxy)
    assert torch.allclose(box_area(xyxy), torch.tensor([32.0, 0.125]))


# ------------------------------------------------------------------------------------------------- matcher
def random_outputs(B, N, seed=0, aux=0):
    g = torch.Generator().manual_seed(seed)

    def make():
        return {"pred_logits": torch.randn(B, N, NUM_CLASSES + 1, generator=g),
                "pred_boxes": torch.rand(B, N, 4, generator=g) * 0.5 + 0.1}  # fmt: skip

    out = make()
    if aux:
        out["aux_outputs"] = [make() for _ in range(aux)]
    return out


def random_targets(counts, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [{"labels": torch.randint(0, NUM_CLASSES, (m,), generator=g),
             "boxes": torch.rand(m, 4, generator=g) * 0.5 + 0.1} for m in counts]  # fmt: skip


def test_cost_is_the_papers_formula():
    out, [t] = random_outputs(1, 4), random_targets([3])
    cost = HungarianMatcher().cost(out["pred_logits"][0], out["pred_boxes"][0], t["labels"], t["boxes"])
    prob = out["pred_logits"][0].softmax(-1)
    for i, j in itertools.product(range(4), range(3)):
        b, bt = out["pred_boxes"][0, i], t["boxes"][j]
        _, giou = naive_iou_giou(cxcywh_to_xyxy(b).tolist(), cxcywh_to_xyxy(bt).tolist())
        want = -prob[i, t["labels"][j]] + 5 * (b - bt).abs().sum() - 2 * giou
        assert cost[i, j].item() == pytest.approx(want.item(), abs=1e-5)


@pytest.mark.parametrize("seed", range(4))
def test_matching_has_the_least_total_cost(seed):
    counts = [3, 5, 1, 0]
    out, targets = random_outputs(len(counts), 5, seed), random_targets(counts, seed + 10)
    matcher = HungarianMatcher()
    for i, ((q, j), t) in enumerate(zip(matcher(out["pred_logits"], out["pred_boxes"], targets), targets)):
        m = len(t["labels"])
        assert len(q) == len(j) == m and len(set(q.tolist())) == m and sorted(j.tolist()) == list(range(m))
        cost = matcher.cost(out["pred_logits"][i], out["pred_boxes"][i], t["labels"], t["boxes"])
        got = cost[q, j].sum().item()
        best = min(sum(cost[p[k], k].item() for k in range(m)) for p in itertools.permutations(range(5), m))
        assert got == pytest.approx(best, abs=1e-5)


# ------------------------------------------------------------------------------------------------ position
def loop_sine(mask, dim, T=10000.0, eps=1e-6):
    B, H, W = mask.shape
    F_ = dim // 2
    out = torch.zeros(B, dim, H, W, dtype=torch.float64)
    for b, i, j in itertools.product(range(B), range(H), range(W)):
        col_valid = sum(not mask[b, r, j] for r in range(H))
        row_valid = sum(not mask[b, i, c] for c in range(W))
        y = sum(not mask[b, r, j] for r in range(i + 1)) / (col_valid + eps) * 2 * math.pi
        x = sum(not mask[b, i, c] for c in range(j + 1)) / (row_valid + eps) * 2 * math.pi
        for k in range(F_):
            f = math.sin if k % 2 == 0 else math.cos
            out[b, k, i, j] = f(y / T ** (2 * (k // 2) / F_))
            out[b, F_ + k, i, j] = f(x / T ** (2 * (k // 2) / F_))
    return out


def test_sine_encoding_is_detrs_formula_with_padding():
    mask = torch.zeros(2, 4, 5, dtype=torch.bool)
    mask[1, 3:] = True
    mask[1, :, 3:] = True
    got = sine_position(mask, 16)
    assert got.shape == (2, 16, 4, 5)
    assert torch.allclose(got.double(), loop_sine(mask, 16), atol=1e-5)
    # an image's encoding does not depend on its batch's padding: image 1 alone, unpadded, is the same
    assert torch.allclose(got[1, :, :3, :3], sine_position(torch.zeros(1, 3, 3, dtype=torch.bool), 16)[0], atol=1e-5)


def test_learned_encoding_layout_and_limit():
    pe = LearnedPosition(8)
    out = pe(torch.zeros(2, 3, 4, dtype=torch.bool))
    assert out.shape == (2, 8, 3, 4)
    assert torch.equal(out[1, :4, 2, 3], pe.col.weight[3]) and torch.equal(out[0, 4:, 2, 3], pe.row.weight[2])
    with pytest.raises(ValueError, match="pos=sine") as e:
        pe(torch.zeros(1, 51, 4, dtype=torch.bool))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("train", [True, False])
def test_peg_keeps_padding_and_ignores_padded_values(train):
    torch.manual_seed(0)
    peg = PEGDetection(6).train(train)
    with torch.no_grad():
        peg.proj[1].weight.uniform_(0.5, 1.5), peg.proj[1].bias.uniform_(-0.5, 0.5)
        peg.proj[1].running_mean.uniform_(-0.5, 0.5)
    x, mask = torch.randn(2, 6, 5, 7), torch.zeros(2, 5, 7, dtype=torch.bool)
    mask[0, 3:], mask[1, :, 4:] = True, True
    y = peg(x, mask)
    assert torch.equal(y[mask[:, None].expand_as(y)], x[mask[:, None].expand_as(x)])  # padded: the input
    assert not torch.allclose(y[~mask[:, None].expand_as(y)], x[~mask[:, None].expand_as(x)])
    x2 = torch.where(mask[:, None], 100 * torch.randn_like(x), x)  # other values at padded positions only
    y2 = peg(x2, mask)
    keep = ~mask[:, None].expand_as(y)
    assert torch.allclose(y2[keep], y[keep], atol=1e-6)
    assert torch.allclose(peg(x), x + peg.proj(x))  # without a mask: CPVT's x + proj(x)


# ---------------------------------------------------------------------------------------------------- loss
def mini(backbone=PYRAMID, **kw) -> DETR:
    torch.manual_seed(0)
    return build_detector(backbone, num_classes=NUM_CLASSES, **kw)


def perfect_outputs(model, batch, slots):
    """Logits strongly on each target's class in ``slots`` and on "no object" elsewhere, boxes exact."""
    B, N = len(batch), model.num_queries
    logits = torch.full((B, N, NUM_CLASSES + 1), -20.0)
    logits[..., -1] = 20.0
    boxes = torch.rand(B, N, 4) * 0.3 + 0.2
    for b, t in enumerate(model.normalised_targets(batch)):
        for k, (label, box) in enumerate(zip(t["labels"], t["boxes"])):
            logits[b, slots[k], -1], logits[b, slots[k], label] = -20.0, 20.0
            boxes[b, slots[k]] = box
    return {"pred_logits": logits, "pred_boxes": boxes}


def test_perfect_prediction_has_near_zero_loss():
    model, batch = mini(), make_batch([(64, 64), (48, 56)])
    out = perfect_outputs(model, batch, slots=[7, 2])
    out["aux_outputs"] = [dict(out)]
    total, parts = model.loss(batch, out)
    assert parts["loss_bbox"] < 1e-5 and parts["loss_giou"] < 1e-5 and parts["loss_ce"] < 1e-3
    assert parts["class_error"] == 0 and total < 1e-2
    assert set(parts) == {"loss_ce", "loss_bbox", "loss_giou", "class_error"}


def test_loss_is_invariant_to_the_order_of_queries():
    model, batch = mini(dec_layers=2), make_batch([(64, 64), (48, 56)])
    out = random_outputs(2, model.num_queries, seed=3, aux=1)
    perm = torch.randperm(model.num_queries, generator=torch.Generator().manual_seed(0))
    shuffled = {k: v[:, perm] for k, v in out.items() if k != "aux_outputs"}
    shuffled["aux_outputs"] = [{k: v[:, perm] for k, v in a.items()} for a in out["aux_outputs"]]
    (t1, p1), (t2, p2) = model.loss(batch, out), model.loss(batch, shuffled)
    assert t1.item() == pytest.approx(t2.item(), rel=1e-6)
    assert all(p1[k].item() == pytest.approx(p2[k].item(), rel=1e-6) for k in p1)
    aux_only = model.loss(batch, {**out, "aux_outputs": []})[0]
    assert t1 > aux_only  # the auxiliary layer adds its own matched loss


def test_images_without_objects():
    model, batch = mini(dec_layers=2), make_batch([(64, 64), (48, 56)])
    for t in batch.targets:
        t["boxes"], t["labels"] = t["boxes"][:0], t["labels"][:0]
    total, parts = model.loss(batch, model(batch))
    assert torch.isfinite(total) and parts["loss_bbox"] == 0 and parts["loss_giou"] == 0 and parts["loss_ce"] > 0
    total.backward()  # every query learns "no object"


def test_gradient_reaches_the_backbone_and_every_part():
    model, batch = mini(), make_batch([(64, 64), (48, 56)])
    total, _ = model.loss(batch, model(batch))
    total.backward()
    for prefix in ("backbone.", "input_proj.", "transformer.encoder.", "transformer.decoder.", "query.", "box_head."):
        grads = [p.grad for n, p in model.named_parameters() if n.startswith(prefix)]
        assert grads and any(g is not None and g.abs().sum() > 0 for g in grads), prefix


def test_predict_scales_to_the_original_size():
    model = mini()
    batch = make_batch([(64, 64), (48, 56)], orig_sizes=[(128, 128), (24, 28)])
    preds = model.predict(batch, perfect_outputs(model, batch, slots=[7, 2]))
    for p, t, scale in zip(preds, batch.targets, (2.0, 0.5)):
        assert p["boxes"].shape == (model.num_queries, 4) and p["labels"].max() < NUM_CLASSES
        assert torch.all(p["scores"][:-1] >= p["scores"][1:])  # best first
        n = len(t["labels"])
        assert torch.allclose(p["scores"][:n], torch.ones(n), atol=1e-4)
        got = sorted(zip(p["boxes"][:n].tolist(), p["labels"][:n].tolist()))
        want = sorted(zip((t["boxes"] * scale).tolist(), t["labels"].tolist()))
        for (gb, gl), (wb, wl) in zip(got, want):
            assert gl == wl and gb == pytest.approx(wb, abs=1e-3)
        h, w = (float(v) for v in t["orig_size"])
        assert p["boxes"][:, 0::2].max() <= w and p["boxes"][:, 1::2].max() <= h and p["boxes"].min() >= 0


# ------------------------------------------------------------------------------------------- model, switches
@pytest.mark.parametrize("backbone", [PYRAMID, PLAIN])
@pytest.mark.parametrize("pos", POSITIONS)
def test_every_position_switch_runs(backbone, pos):
    model = mini(backbone, pos=pos, dec_layers=3, enc_layers=2)
    batch = make_batch([(50, 70), (40, 44)])  # not multiples of 32: the model pads them
    out = model(batch)
    B, N = 2, DETR_MINI["num_queries"]
    assert out["pred_logits"].shape == (B, N, NUM_CLASSES + 1) and out["pred_boxes"].shape == (B, N, 4)
    assert len(out["aux_outputs"]) == 2 and out["aux_outputs"][0]["pred_boxes"].shape == (B, N, 4)
    assert out["pred_boxes"].min() >= 0 and out["pred_boxes"].max() <= 1
    assert (model.position is None) == (pos in ("peg", "none")) and (model.transformer.peg is None) == (pos != "peg")
    model.eval()
    with torch.no_grad():
        preds = model.predict(batch, model(batch))
    assert [len(p["boxes"]) for p in preds] == [N, N]


def test_backbone_trains_at_a_tenth_of_the_rate():
    model = mini(backbone_lr_scale=0.1)
    groups = param_groups(model, 1e-4)
    backbone = {id(p) for n, p in model.named_parameters() if n.startswith("backbone.")}
    for g in groups:
        ids = {id(p) for p in g["params"]}
        assert ids <= backbone if g.get("lr_scale") == 0.1 else not ids & backbone


def test_frozen_batchnorm_stays_frozen():
    model = build_detector("lambda_mini", num_classes=2, frozen_bn=True).train()
    norms = [m for m in model.backbone.modules() if isinstance(m, torch.nn.BatchNorm2d | torch.nn.BatchNorm1d)]
    assert norms and all(not m.training and not any(p.requires_grad for p in m.parameters()) for m in norms)
    assert model.transformer.training


@pytest.mark.slow  # ~3-7 s on one thread; over a minute with 2 threads on busy shared cores
def test_overfits_a_fixed_batch():
    model = mini(dropout=0.0, dec_layers=2)
    batch = make_batch([(64, 64), (48, 64)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    losses = []
    for _ in range(60):
        total, _ = model.loss(batch, model(batch))
        opt.zero_grad()
        total.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)  # DETR's clipping
        opt.step()
        losses.append(total.item())
    assert losses[-1] < 0.3 * losses[0]


# ------------------------------------------------------------------------------------------------ refusals
@pytest.mark.parametrize(
    "kw, match",
    [
        ({"detector": "yolo"}, "detector must be one of detr, faster_rcnn, mask_rcnn"),
        ({"pos": "rope"}, "pos must be one of sine, learned, peg, none"),
        ({"num_classes": 0}, "num_classes >= 1"),
        ({"pos": "peg", "peg_layer": 1}, "peg_layer"),
        ({"d_model": 30}, "divisible by nhead"),
        ({"pos": "sine", "d_model": 30, "nhead": 6}, "divisible by 4"),
    ],
)
def test_build_detector_errors_are_one_line(kw, match):
    kw = {"num_classes": NUM_CLASSES, **kw}
    with pytest.raises(ValueError, match=match) as e:
        build_detector(PYRAMID, **kw)
    assert "\n" not in str(e.value)


def test_missing_rcnn_module_is_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "vitlab.tasks.detection.rcnn", None)  # the import fails
    with pytest.raises(MissingExtra) as e:
        build_detector(PYRAMID, "faster_rcnn", num_classes=NUM_CLASSES)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("the R-CNN detectors need torchvision: run scripts/detection_check.sh")


def test_mini_sizes_are_defaults_only():
    assert mini().num_queries == DETR_MINI["num_queries"]
    assert mini(num_queries=7).num_queries == 7
