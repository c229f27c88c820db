"""Segmentation inference on images of any size with a model trained on ``crop x crop`` inputs, and the
evaluation of a model over a held-out split.

``whole``: the image resized to ``crop x crop`` (bilinear), one forward, the logits resized back.
``slide``: windows ``crop x crop`` every ``stride`` pixels (the last window of a row or column flush with the
image's edge; an image smaller than the crop padded with zeros at the bottom and right), every pixel's logits
the mean over the windows that cover it:

    logits(p) = (1 / |W(p)|) sum_{w in W(p)} f(x_w)(p - offset_w)

``msflip``: multi-scale and flip testing (mmsegmentation's ``aug_test``; the scales of EANet's own test script).
The image resized (bilinear) by each factor s of ``scales``, predicted with sliding windows as above (one padded
window where it is smaller than the crop), and, with ``flip``, its mirror image too (the logits mirrored back);
each set of logits resized to the image's own size and turned into probabilities; their mean over the scales and
flips is the prediction:

    P(p) = (1 / (|scales| (1 + flip))) sum_s sum_{t in {id, mirror}} softmax(Up(t(slide(t(Resize_s(x))))))(p)

:func:`predict` returns ``log P``: its argmax is the prediction, and the cross-entropy of ``log P`` as logits
is ``-log P`` of the true class (P sums to 1 over the classes). EANet's script adds the raw logits of the scales
instead; averaging probabilities, as mmsegmentation does, keeps a scale with large logits from outvoting the rest.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ...common.device import autocast
from .data import IGNORE_INDEX, MaskDataset, normalize
from .metrics import ConfusionMatrix

INFER_MODES = ("slide", "whole", "msflip")
#: msflip's default factors: EANet's test scales (and mmsegmentation's multi-scale test)
MS_SCALES = (0.5, 0.75, 1.0, 1.25, 1.5, 1.75)


def window_starts(size: int, crop: int, stride: int) -> list[int]:
    """The offsets of the windows along one side of ``size`` pixels (>= crop): every ``stride``, the last flush."""
    n = max(size - crop + stride - 1, 0) // stride + 1
    return sorted({min(i * stride, size - crop) for i in range(n)})


def check_scales(scales: tuple[float, ...] | list[float]) -> tuple[float, ...]:
    """``scales`` as a tuple of positive finite factors; ValueError otherwise."""
    out = tuple(float(s) for s in scales)
    if not out or not all(0 < s < float("inf") for s in out):
        raise ValueError(f"scales must be one or more positive factors, got {list(scales)}")
    return out


def resize(x: Tensor, size: tuple[int, int]) -> Tensor:
    return x if tuple(x.shape[-2:]) == tuple(size) else F.interpolate(x, size, mode="bilinear", align_corners=False)


def predict(model: nn.Module, image: Tensor, crop: int, mode: str = "slide", stride: int | None = None,
            batch: int = 8, scales: tuple[float, ...] = MS_SCALES, flip: bool = True) -> Tensor:  # fmt: skip
    """Float logits ``(B, K, H, W)`` of normalised images ``(B, 3, H, W)`` (``msflip``: log-probabilities; module
    docstring); ``stride`` defaults to two thirds of the crop; ``batch`` windows go through the model at once;
    ``scales`` and ``flip`` are used by ``msflip`` only."""
    if mode not in INFER_MODES:
        raise ValueError(f"mode must be one of {', '.join(INFER_MODES)}, got {mode!r}")
    h, w = image.shape[-2:]
    if mode == "whole":
        x = F.interpolate(image, (crop, crop), mode="bilinear", align_corners=False)
        return F.interpolate(model(x).float(), (h, w), mode="bilinear", align_corners=False)
    stride = stride or max(1, crop * 2 // 3)
    if not 1 <= stride <= crop:
        raise ValueError(f"stride must lie in [1, crop={crop}], got {stride}")
    if mode == "msflip":
        return multi_scale_flip(model, image, crop, stride, batch, check_scales(scales), flip)
    return slide(model, image, crop, stride, batch)


def multi_scale_flip(model: nn.Module, image: Tensor, crop: int, stride: int, batch: int,
                     scales: tuple[float, ...], flip: bool) -> Tensor:  # fmt: skip
    """``log P`` of the module docstring's ``msflip``."""
    h, w = image.shape[-2:]
    total = None
    for s in scales:
        x = resize(image, (max(1, round(h * s)), max(1, round(w * s))))
        for mirrored in (False, True) if flip else (False,):
            logits = slide(model, x.flip(-1) if mirrored else x, crop, stride, batch)
            logits = logits.flip(-1) if mirrored else logits
            probs = resize(logits, (h, w)).softmax(1)  # resized as logits, then normalised (mmsegmentation)
            total = probs if total is None else total + probs
    mean = total / (len(scales) * (1 + flip))
    return mean.clamp_min(torch.finfo(mean.dtype).tiny).log()  # a class no view gives any chance: finite, not -inf


def slide(model: nn.Module, image: Tensor, crop: int, stride: int, batch: int) -> Tensor:
    """The module docstring's ``slide``: logits ``(B, K, H, W)`` averaged over the windows covering each pixel."""
    b, _, h, w = image.shape
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
                          limit: int | None = None, scales: tuple[float, ...] = MS_SCALES,
                          flip: bool = True) -> dict[str, object]:  # fmt: skip
    """mIoU, per-class IoU, aAcc, mAcc (%) of ``model`` over ``dataset`` at each image's own size (one image at
    a time), the mean cross-entropy over the labelled pixels, images/s; ``classes``, the class names, when the
    data names them. ``scales`` / ``flip``: those of ``msflip``."""
    was_training = model.training
    model.eval()
    matrix = ConfusionMatrix(dataset.num_classes, IGNORE_INDEX)
    loss_sum, pixels, t0 = 0.0, 0, time.perf_counter()
    n = len(dataset) if limit is None else min(limit, len(dataset))
    for i in range(n):
        image, mask = dataset.load(i)
        x = normalize(image[None].to(device), dataset.mean, dataset.std)
        with autocast(device, dtype):
            logits = predict(model, x, crop, mode, stride, scales=scales, flip=flip)
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
