"""Segmentation metrics from one confusion matrix ``M`` (K x K, rows the true class, columns the predicted one,
pixels labelled ``ignore_index`` left out), summed over a whole evaluation set before any ratio is taken:

    IoU_k   = M_kk / (sum_j M_kj + sum_i M_ik - M_kk)       (TP / (TP + FN + FP))
    mIoU    = mean of IoU_k over the classes with a non-empty union (a class absent from both the truth and
              the prediction has no IoU and does not count)
    aAcc    = sum_k M_kk / sum M                            (pixel accuracy)
    mAcc    = mean over classes present in the truth of M_kk / sum_j M_kj

The same sums serve point-cloud part segmentation (:mod:`vitlab.tasks.points.metrics`).
:func:`per_class_lines` writes the per-class IoU for a person, each class by its number and, where the data
names its classes (VOC's 21; ADE20K's from ``objectInfo150.csv``), its name.
"""

from __future__ import annotations

import torch
from torch import Tensor


def confusion(pred: Tensor, target: Tensor, num_classes: int, ignore_index: int = 255) -> Tensor:
    """The ``(K, K)`` int64 confusion matrix of integer predictions and targets of one shape."""
    if pred.shape != target.shape:
        raise ValueError(f"prediction {tuple(pred.shape)} and target {tuple(target.shape)} differ in shape")
    keep = target != ignore_index
    t, p = target[keep].long(), pred[keep].long()
    if t.numel() and (int(t.min()) < 0 or int(t.max()) >= num_classes):
        raise ValueError(
            f"target labels must lie in [0, {num_classes}) or be {ignore_index} (ignored), "
            f"got {int(t.min())}..{int(t.max())}"
        )
    return torch.bincount(t * num_classes + p, minlength=num_classes**2).reshape(num_classes, num_classes)


def iou_from_confusion(m: Tensor) -> dict[str, object]:
    """mIoU, per-class IoU (None where the class has an empty union), aAcc and mAcc (%) of a confusion matrix."""
    m = m.double()
    tp, truth, predicted = m.diagonal(), m.sum(1), m.sum(0)
    union = truth + predicted - tp
    iou = torch.where(union > 0, tp / union.clamp_min(1), torch.full_like(tp, float("nan")))
    acc = torch.where(truth > 0, tp / truth.clamp_min(1), torch.full_like(tp, float("nan")))
    valid, present = union > 0, truth > 0
    total = m.sum()
    return {
        "miou": 100 * iou[valid].mean().item() if valid.any() else float("nan"),
        "iou": [100 * v if v == v else None for v in iou.tolist()],
        "aacc": 100 * (tp.sum() / total).item() if total > 0 else float("nan"),
        "macc": 100 * acc[present].mean().item() if present.any() else float("nan"),
    }


class ConfusionMatrix:
    """A running confusion matrix over batches (on the device of the first batch)."""

    def __init__(self, num_classes: int, ignore_index: int = 255) -> None:
        self.num_classes, self.ignore_index = num_classes, ignore_index
        self.matrix: Tensor | None = None

    def add(self, pred: Tensor, target: Tensor) -> None:
        m = confusion(pred, target, self.num_classes, self.ignore_index)
        self.matrix = m if self.matrix is None else self.matrix + m

    def result(self) -> dict[str, object]:
        m = self.matrix if self.matrix is not None else torch.zeros(self.num_classes, self.num_classes)
        return iou_from_confusion(m.cpu())


def per_class_lines(iou: list[float | None], classes: list[str] | None = None) -> list[str]:
    """One line per class with an IoU (``iou`` as :func:`iou_from_confusion` gives it): its number, its name
    when ``classes`` names every class, the IoU (%)."""
    named = classes is not None and len(classes) == len(iou)
    width = max((len(c) for c in classes), default=0) if named else 0
    return [
        f"  class {k:3d}  {classes[k]:<{width}}  IoU {v:6.2f}" if named else f"  class {k:3d}  IoU {v:6.2f}"
        for k, v in enumerate(iou)
        if v is not None
    ]
