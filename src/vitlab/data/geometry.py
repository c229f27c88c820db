"""Crop geometry: RandomResizedCrop's box sampler and the evaluation crop, for batches and single images.

Training (RandomResizedCrop, Szegedy et al. 2015 as torchvision and timm define it): a box of area
``U(scale) * H * W`` and aspect ``w / h`` log-uniform in ``ratio`` (ten tries, then the whole image cut to the
nearest allowed aspect ratio, centred); then a horizontal flip with probability ``hflip``.

Evaluation (timm's ``crop_pct`` rule): resize the shorter side to ``floor(img_size / crop_pct)`` (the longer
side keeps the aspect, ``int(scale_size * long / short)``), then cut the centred ``img_size`` crop at
``round((H_r - img_size) / 2)``; ``crop_mode="squash"`` resizes both sides to the scale size first. With
``crop_pct > 1`` (Refined-ViT-L evaluates at 1.13) the resized side is shorter than the crop: as timm's
``CenterCrop`` (torchvision's) does, that side is padded with zeros, ``(img_size - H_r) // 2`` before and the
rest after, i.e. the crop starts at the negative offset ``-((img_size - H_r) // 2)``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from .augment import uniform


def _per_sample(v: int | Tensor) -> int | Tensor:
    """An image side for every sample: a scalar, or a ``(n,)`` tensor as a column against the tries."""
    return v if isinstance(v, int) else v.long().view(-1, 1)


def sample_boxes(
    n: int,
    height: int | Tensor,
    width: int | Tensor,
    scale: Sequence[float],
    ratio: Sequence[float],
    g: torch.Generator | None,
    attempts: int = 10,
    strict: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Boxes of area ``U(scale) * H * W`` and aspect ``w / h`` log-uniform in ``ratio``, as in
    torchvision's RandomResizedCrop / timm's RandomErasing: ``attempts`` tries per sample at once, first
    one that fits wins (``strict``: strictly smaller than the image, as timm's erasing asks). ``height`` and
    ``width`` are one size for all or ``(n,)`` tensors (images of different sizes).
    Returns ``(top, left, h, w, ok)`` as long tensors and a bool mask of success.
    """
    H, W = _per_sample(height), _per_sample(width)
    area = H * W * (scale[0] + (scale[1] - scale[0]) * uniform(n * attempts, g).view(n, attempts))
    lo, hi = math.log(ratio[0]), math.log(ratio[1])
    aspect = torch.exp(lo + (hi - lo) * uniform(n * attempts, g).view(n, attempts))
    w = torch.sqrt(area * aspect).round().long()
    h = torch.sqrt(area / aspect).round().long()
    fits = (w > 0) & (h > 0) & ((w < W) & (h < H) if strict else (w <= W) & (h <= H))
    first = fits.int().argmax(1, keepdim=True)  # first True (or 0 when none)
    h, w, ok = h.gather(1, first)[:, 0], w.gather(1, first)[:, 0], fits.any(1)
    top = (uniform(n, g) * (height - h + 1).clamp(min=1)).long()
    left = (uniform(n, g) * (width - w + 1).clamp(min=1)).long()
    return top, left, h, w, ok


def resized_crop_boxes(
    n: int,
    height: int | Tensor,
    width: int | Tensor,
    scale: Sequence[float],
    ratio: Sequence[float],
    g: torch.Generator | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """RandomResizedCrop's boxes ``(top, left, h, w)``: :func:`sample_boxes`, and where all ten tries fail,
    torchvision's fallback: the whole image cut to the nearest allowed aspect ratio, centred."""
    top, left, h, w, ok = sample_boxes(n, height, width, scale, ratio, g)
    hh, ww = (torch.as_tensor(v, dtype=torch.float64).expand(n) for v in (height, width))
    lo, hi = ratio
    fw = torch.where(ww / hh > hi, torch.round(hh * hi), ww).long()
    fh = torch.where(ww / hh < lo, torch.round(ww / lo), hh).long()
    h, w = torch.where(ok, h, fh), torch.where(ok, w, fw)
    top, left = torch.where(ok, top, (hh.long() - fh) // 2), torch.where(ok, left, (ww.long() - fw) // 2)
    return top, left, h, w


INTERPOLATIONS = ("bicubic", "bilinear", "nearest")
CROP_MODES = ("center", "squash")
DEFAULT_CROP_PCT = 0.875
MAX_CROP_PCT = 2.0  # beyond it the padding would exceed the picture


@dataclass(frozen=True)
class Box:
    """A crop of an image of ``size = (H, W)`` in its pixel coordinates (floats), and whether it is mirrored."""

    top: float
    left: float
    height: float
    width: float
    size: tuple[int, int]
    flip: bool = False


@dataclass(frozen=True)
class CropSpec:
    """What the per-sample stage does: ``train`` (RandomResizedCrop + flip) or evaluation (resize + centre crop)."""

    size: tuple[int, int]
    train: bool = True
    scale: tuple[float, float] = (0.08, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)
    hflip: float = 0.5
    crop_pct: float = DEFAULT_CROP_PCT
    crop_mode: str = "center"
    interpolation: str = "bicubic"
    channels: int = 3

    def __post_init__(self) -> None:
        if self.interpolation not in INTERPOLATIONS:
            raise ValueError(f"interpolation must be one of {INTERPOLATIONS}, got {self.interpolation!r}")
        if self.crop_mode not in CROP_MODES:
            raise ValueError(f"crop_mode must be one of {CROP_MODES}, got {self.crop_mode!r}")
        if not 0 < self.crop_pct <= MAX_CROP_PCT:
            raise ValueError(f"crop_pct must be in (0, {MAX_CROP_PCT}], got {self.crop_pct}")
        if not (0 < self.scale[0] <= self.scale[1] <= 1 and 0 < self.ratio[0] <= self.ratio[1]):
            raise ValueError(f"need 0 < scale <= 1 and 0 < ratio ascending, got {self.scale}, {self.ratio}")
        if self.channels not in (1, 3):
            raise ValueError(f"channels must be 1 or 3, got {self.channels}")


def train_boxes(sizes: Sequence[tuple[int, int]], spec: CropSpec, g: torch.Generator) -> list[Box]:
    """RandomResizedCrop's boxes and the flips for images of ``sizes`` ((H, W) each), drawn in one go."""
    n = len(sizes)
    hw = torch.tensor(sizes, dtype=torch.long).view(n, 2)
    top, left, h, w = resized_crop_boxes(n, hw[:, 0], hw[:, 1], spec.scale, spec.ratio, g)
    flips = (uniform(n, g) < spec.hflip).tolist()
    rows = torch.stack([top, left, h, w], 1).tolist()
    return [Box(*row, size=tuple(size), flip=f) for row, size, f in zip(rows, sizes, flips)]


def train_box(size: tuple[int, int], spec: CropSpec, g: torch.Generator) -> Box:
    """One image's RandomResizedCrop box and flip."""
    return train_boxes([size], spec, g)[0]


def _centre_offset(resized: int, crop: int) -> int:
    """Where the centred crop starts along one side: ``round((resized - crop) / 2)``, or, for a side shorter
    than the crop, minus the zero padding torchvision's ``CenterCrop`` puts before it."""
    return round((resized - crop) / 2.0) if resized >= crop else -((crop - resized) // 2)


def eval_geometry(size: tuple[int, int], spec: CropSpec) -> tuple[tuple[int, int], tuple[int, int]]:
    """(resized (H_r, W_r), crop offset (top, left)) of the evaluation transform for an image of ``size``; a
    negative offset is zero padding (``crop_pct > 1``)."""
    (h, w), (th, tw) = size, spec.size
    scale_size = math.floor(max(th, tw) / spec.crop_pct)
    if spec.crop_mode == "squash":
        rh = rw = scale_size
    elif h <= w:  # torchvision Resize(int): the shorter side becomes scale_size
        rh, rw = scale_size, int(scale_size * w / h)
    else:
        rh, rw = int(scale_size * h / w), scale_size
    return (rh, rw), (_centre_offset(rh, th), _centre_offset(rw, tw))


def cut_crop(x: Tensor, offset: tuple[int, int], size: tuple[int, int]) -> Tensor:
    """``x[..., top : top + h, left : left + w]`` with ``offset = (top, left)`` from :func:`eval_geometry`;
    where an offset is negative the missing rows/columns are zeros (torchvision's ``CenterCrop`` padding)."""
    (top, left), (h, w) = offset, size
    pads = []
    for start, length, full in ((left, w, x.shape[-1]), (top, h, x.shape[-2])):  # F.pad: last axis first
        pads += [max(0, -start), max(0, start + length - full)]
    if any(pads):
        x = torch.nn.functional.pad(x, pads)
    top, left = max(top, 0), max(left, 0)
    return x[..., top : top + h, left : left + w]


def eval_box(size: tuple[int, int], spec: CropSpec) -> Box:
    """The evaluation crop as a box of the original image (what the resize + centre crop keep)."""
    (rh, rw), (top, left) = eval_geometry(size, spec)
    sy, sx = size[0] / rh, size[1] / rw
    return Box(top * sy, left * sx, spec.size[0] * sy, spec.size[1] * sx, size)


def boxes_statistics(boxes: Sequence[Box]) -> dict[str, np.ndarray]:
    """Area fraction, log aspect and relative centre of boxes: what the sampler tests compare."""
    a = np.array([(b.top, b.left, b.height, b.width, *b.size) for b in boxes], dtype=np.float64)
    top, left, h, w, H, W = a.T
    return {
        "area": h * w / (H * W),
        "log_aspect": np.log(w / h),
        "cy": (top + h / 2) / H,
        "cx": (left + w / 2) / W,
    }
