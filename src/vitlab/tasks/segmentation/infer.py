"""Segmentation inference on images of any size with a model trained on ``crop x crop`` inputs, and the
evaluation of a model over a held-out split.

``whole``: the image resized to ``crop x crop`` (bilinear), one forward, the logits resized back.
``slide``: windows ``crop x crop`` every ``stride`` pixels (the last window of a row or column flush with the
image's edge; an image smaller than the crop padded with zeros at the bottom and right), every pixel's logits
the mean over the windows that cover it:

    logits(p) = (1 / |W(p)|) sum_{w in W(p)} f(x_w)(p - offset_w)
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ...common.device import autocast
from .data import IGNORE_INDEX, MaskDataset, normalize
from .metrics import ConfusionMatrix

INFER_MODES = ("slide", "whole")


def window_starts(size: int, crop: int, stride: int) -> list[int]:
    """The offsets of the windows along one side of ``size`` pixels (>= crop): every ``stride``, the last flush."""
    n = max(size - crop + stride - 1, 0) // stride + 1
    return sorted({min(i * stride, size - crop) for i in range(n)})


def predict(model: nn.Module, image: Tensor, crop: int, mode: str = "slide", stride: int | None = None,
            batch: int = 8) -> Tensor:  # fmt: skip
    """Float logits ``(B, K, H, W)`` of normalised images ``(B, 3, H, W)`` (module docstring); ``stride``
    defaults to two thirds of the crop; ``batch`` windows go through the model at once."""
    if mode not in INFER_MODES:
        raise ValueError(f"mode must be one of {', '.join(INFER_MODES)}, got {mode!r}")
    b, _, h, w = image.shape
    if mode == "whole":
        x = F.interpolate(image, (crop, crop), mode="bilinear", align_corners=False)
        return F.interpolate(model(x).float(), (h, w), mode="bilinear", align_corners=False)
    stride = stride or max(1, crop * 2 // 3)
    if not 1 <= stride <= crop:
        raise ValueError(f"stride must lie in [1, crop={crop}], got {stride}")
    x = F.pad(image, (0, max(crop - w, 0), 0, max(crop - h, 0)))
    hp, wp = x.shape[-2:]
    boxes = [(t, le) for t in window_starts(hp, crop, stride) for le in window_starts(wp, crop, stride)]
    total, count = None, torch.zeros(1, 1, hp, wp, device=image.device)
    for i in range(0, len(boxes), batch):
        part = boxes[i : i + batch]
        windows = torch.cat([x[:, :, t : t + crop, le : le + crop] for t, le in part])
        out = model(windows).float().reshape(len(part), b, -1, crop, crop)
        if total is None:
            total = torch.zeros(b, out.shape[2], hp, wp, device=image.device)
        for (t, le), logits in zip(part, out):
            total[:, :, t : t + crop, le : le + crop] += logits
            count[:, :, t : t + crop, le : le + crop] += 1
    return (total / count)[:, :, :h, :w]


@torch.no_grad()
def evaluate_segmentation(model: nn.Module, dataset: MaskDataset, crop: int, device: torch.device,
                          mode: str = "slide", stride: int | None = None, dtype: torch.dtype | None = None,
                          limit: int | None = None) -> dict[str, object]:  # fmt: skip
    """mIoU, per-class IoU, aAcc, mAcc (%) of ``model`` over ``dataset`` at each image's own size (one image at
    a time), the mean cross-entropy over the labelled pixels, images/s; ``classes``, the class names, when the
    data names them."""
    was_training = model.training
    model.eval()
    matrix = ConfusionMatrix(dataset.num_classes, IGNORE_INDEX)
    loss_sum, pixels, t0 = 0.0, 0, time.perf_counter()
    n = len(dataset) if limit is None else min(limit, len(dataset))
    for i in range(n):
        image, mask = dataset.load(i)
        x = normalize(image[None].to(device), dataset.mean, dataset.std)
        with autocast(device, dtype):
            logits = predict(model, x, crop, mode, stride)
        target = mask[None].to(device)
        matrix.add(logits.argmax(1), target)
        labelled = int((target != IGNORE_INDEX).sum())
        if labelled:
            loss_sum += F.cross_entropy(logits, target, ignore_index=IGNORE_INDEX, reduction="sum").item()
            pixels += labelled
    model.train(was_training)
    result = matrix.result()
    result.update(loss=loss_sum / max(pixels, 1), n=n, img_s=n / (time.perf_counter() - t0))
    if getattr(dataset, "classes", None) is not None:
        result["classes"] = list(dataset.classes)
    return result
