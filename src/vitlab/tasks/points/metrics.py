"""Point-cloud metrics.

Classification: overall accuracy ``OA = correct / shapes`` and mean-class accuracy ``mAcc = mean_k correct_k /
shapes_k`` over the classes present.

Part segmentation (ShapeNet-Part's protocol): a shape's prediction is the argmax over its own category's parts
only; for each part p of that category ``IoU_p = |pred = p and truth = p| / |pred = p or truth = p|``, taken as
1 where the part is in neither; the shape's mIoU is the mean over its category's parts. Instance mIoU is the
mean over shapes, category mIoU the mean over categories of their shapes' mean.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .data import part_ranges


def classification_accuracy(pred: Tensor, target: Tensor, num_classes: int) -> dict[str, float]:
    """OA and mAcc (%) of class predictions ``(M,)`` against targets ``(M,)``."""
    correct = pred == target
    per_class = torch.zeros(num_classes, dtype=torch.float64).index_add_(0, target, correct.double())
    count = torch.bincount(target, minlength=num_classes).double()
    present = count > 0
    return {
        "oa": 100 * correct.double().mean().item(),
        "macc": 100 * (per_class[present] / count[present]).mean().item(),
    }


def part_predictions(logits: Tensor, category: Tensor) -> Tensor:
    """Argmax of ``logits (M, N, 50)`` over each shape's own category's parts."""
    mask = torch.full_like(logits[:, 0], float("-inf"))
    for c, parts in enumerate(part_ranges()):
        mask[category == c, parts.start : parts.stop] = 0.0
    return (logits + mask[:, None]).argmax(-1)


def shape_mious(pred: Tensor, parts: Tensor, category: Tensor) -> Tensor:
    """Per shape: the mean over its category's parts of the part IoU (1 where a part is in neither)."""
    ranges, out = part_ranges(), []
    for p, t, c in zip(pred, parts, category.tolist()):
        ious = []
        for part in ranges[c]:
            union = ((p == part) | (t == part)).sum().item()
            ious.append(1.0 if union == 0 else ((p == part) & (t == part)).sum().item() / union)
        out.append(sum(ious) / len(ious))
    return torch.tensor(out, dtype=torch.float64)


def part_miou(pred: Tensor, parts: Tensor, category: Tensor) -> dict[str, float]:
    """Instance mIoU and category mIoU (%) of part predictions ``(M, N)``."""
    per_shape = shape_mious(pred, parts, category)
    cats = [per_shape[category == c].mean() for c in category.unique()]
    return {"instance_miou": 100 * per_shape.mean().item(), "category_miou": 100 * torch.stack(cats).mean().item()}
