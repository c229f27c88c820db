"""Segmentation data: JPEG images with PNG class masks in the PASCAL VOC and ADE20K folder layouts.

Layouts (``--data voc:ROOT``, ``ade20k:ROOT``, or a bare ``ROOT`` recognised by its folders)::

    voc     ROOT/JPEGImages/<id>.jpg  ROOT/SegmentationClass/<id>.png  ROOT/ImageSets/Segmentation/{train,val}.txt
            21 classes (background + 20); mask values are class indices (palette PNG), 255 = ignored (object
            borders, "difficult")
    ade20k  ROOT/images/{training,validation}/<name>.jpg  ROOT/annotations/{training,validation}/<name>.png
            150 classes; mask value 0 ("other") is ignored and 1..150 become 0..149 (the benchmark's rule)

Training samples are augmented jointly (:class:`JointTransform`): the image and its mask resized by one random
factor (short side = crop x U(0.5, 2.0); bilinear for the image, nearest for the mask), padded to the crop
(image 0, mask 255), cropped at one random place, flipped together, the image normalised by the ImageNet
statistics. :class:`SegLoader` draws every batch's augmentation from the engine's per-batch generator, so a
resumed run sees the batches an uninterrupted one would.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from ...common.options import Validated
from ...data import BatchLoader
from ...data.datasets import IMAGENET_MEAN, IMAGENET_STD
from ...engine.dense import IGNORE_INDEX

LAYOUTS = {"voc": 21, "ade20k": 150}  # layout -> classes
SPLITS = {"voc": {"train": "train", "val": "val"}, "ade20k": {"train": "training", "val": "validation"}}
SPEC_HELP = "voc:<root> (PASCAL VOC layout), ade20k:<root> (ADEChallengeData2016 layout), or a bare root"


def detect_layout(root: Path) -> str | None:
    if (root / "JPEGImages").is_dir() and (root / "SegmentationClass").is_dir():
        return "voc"
    if (root / "images").is_dir() and (root / "annotations").is_dir():
        return "ade20k"
    return None


def parse_mask_spec(text: str) -> tuple[str, Path]:
    """``voc:ROOT`` / ``ade20k:ROOT`` / ``ROOT`` -> (layout, root); ValueError saying what is wrong."""
    kind, sep, rest = text.partition(":")
    layout, root = (kind, Path(rest)) if sep and kind in LAYOUTS else (None, Path(text))
    if not root.is_dir():
        raise ValueError(f"segmentation data {text!r}: {root} is not a folder; give {SPEC_HELP}")
    found = detect_layout(root)
    if found is None or (layout is not None and found != layout):
        want = layout or "voc or ade20k"
        raise ValueError(
            f"segmentation data {text!r}: {root} is not in the {want} layout (VOC: JPEGImages/ and "
            "SegmentationClass/; ADE20K: images/ and annotations/)"
        )
    return found, root


def _checked_spec(text: str) -> str:
    parse_mask_spec(text)
    return text


#: argparse type of ``vitlab seg --data``: the text, once it names a readable layout
mask_spec = Validated(_checked_spec, "segmentation data")


def pairs(layout: str, root: Path, split: str) -> list[tuple[Path, Path]]:
    """(image, mask) paths of ``split`` ("train" or "val") in the layout's order."""
    if split not in SPLITS[layout]:
        raise ValueError(f"split must be train or val, got {split!r}")
    if layout == "voc":
        listing = root / "ImageSets" / "Segmentation" / f"{split}.txt"
        if not listing.is_file():
            raise FileNotFoundError(f"{listing} is missing: the VOC layout lists each split's image ids there")
        ids = [line.split()[0] for line in listing.read_text().splitlines() if line.strip()]
        return [(root / "JPEGImages" / f"{i}.jpg", root / "SegmentationClass" / f"{i}.png") for i in ids]
    sub = SPLITS[layout][split]
    images = sorted((root / "images" / sub).glob("*.jpg"))
    return [(p, root / "annotations" / sub / f"{p.stem}.png") for p in images]


@dataclass
class MaskDataset:
    """Image-mask pairs of one split; :meth:`load` decodes one as ``uint8 (3, H, W)`` and ``int64 (H, W)`` with
    the layout's labels (0..K-1, or 255 ignored)."""

    items: list[tuple[Path, Path]]
    layout: str
    num_classes: int
    mean: tuple[float, ...] = IMAGENET_MEAN
    std: tuple[float, ...] = IMAGENET_STD
    source: str = ""
    extra: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.items)

    @property
    def in_chans(self) -> int:
        return 3

    def load(self, i: int) -> tuple[Tensor, Tensor]:
        from PIL import Image

        image_path, mask_path = self.items[i]
        for p in (image_path, mask_path):
            if not p.is_file():
                raise FileNotFoundError(f"{p} is missing (listed in the {self.layout} split)")
        with Image.open(image_path) as im:
            image = torch.from_numpy(np.array(im.convert("RGB"))).permute(2, 0, 1).contiguous()
        with Image.open(mask_path) as m:
            if m.mode not in ("P", "L"):
                raise ValueError(f"{mask_path}: a mask must be a one-channel PNG of class indices, got mode {m.mode}")
            mask = torch.from_numpy(np.asarray(m, dtype=np.uint8).astype(np.int64))
        if mask.shape != image.shape[1:]:
            raise ValueError(f"{mask_path}: mask {tuple(mask.shape)} and image {tuple(image.shape[1:])} differ in size")
        if self.layout == "ade20k":  # 0 = "other", not scored; classes 1..150 -> 0..149
            mask = torch.where(mask == 0, IGNORE_INDEX, mask - 1)
        bad = (mask != IGNORE_INDEX) & (mask >= self.num_classes)
        if bad.any():
            raise ValueError(
                f"{mask_path}: label {int(mask[bad].max())} is outside the {self.num_classes} classes of {self.layout}"
            )
        return image, mask


def open_masks(text: str, split: str) -> MaskDataset:
    """The ``split`` ("train" / "val") of the segmentation data ``text`` (:func:`parse_mask_spec`)."""
    layout, root = parse_mask_spec(text)
    items = pairs(layout, root, split)
    if not items:
        raise ValueError(f"segmentation data {text!r}: the {split} split has no images")
    return MaskDataset(items, layout, LAYOUTS[layout], source=str(root))


def normalize(image: Tensor, mean, std) -> Tensor:
    """``uint8 (..., 3, H, W)`` -> float, scaled to [0, 1] and standardised per channel."""
    m = torch.tensor(mean, device=image.device).view(-1, 1, 1)
    s = torch.tensor(std, device=image.device).view(-1, 1, 1)
    return (image.float() / 255 - m) / s


@dataclass(frozen=True)
class JointTransform:
    """The training augmentation of an image and its mask together (module docstring)."""

    crop: int
    scale_range: tuple[float, float] = (0.5, 2.0)
    hflip: float = 0.5

    def __call__(self, image: Tensor, mask: Tensor, g: torch.Generator) -> tuple[Tensor, Tensor]:
        lo, hi = self.scale_range
        u = torch.rand(4, generator=g).tolist()
        h, w = mask.shape
        factor = self.crop * (lo + (hi - lo) * u[0]) / min(h, w)
        size = (max(1, round(h * factor)), max(1, round(w * factor)))
        img = F.interpolate(image[None].float(), size, mode="bilinear", align_corners=False)[0]
        msk = F.interpolate(mask[None, None].float(), size, mode="nearest")[0, 0].long()
        ph, pw = max(self.crop - size[0], 0), max(self.crop - size[1], 0)
        img = F.pad(img, (0, pw, 0, ph), value=0.0)
        msk = F.pad(msk, (0, pw, 0, ph), value=IGNORE_INDEX)
        top = int(u[1] * (msk.shape[0] - self.crop + 1))
        left = int(u[2] * (msk.shape[1] - self.crop + 1))
        img = img[:, top : top + self.crop, left : left + self.crop]
        msk = msk[top : top + self.crop, left : left + self.crop]
        if u[3] < self.hflip:
            img, msk = img.flip(-1), msk.flip(-1)
        return img.round().clamp(0, 255).to(torch.uint8), msk


class SegLoader(BatchLoader):
    """:class:`~vitlab.data.BatchLoader` over a :class:`MaskDataset`: batches of ``crop x crop`` training pairs
    ``(float (B, 3, crop, crop), int64 (B, crop, crop))``, augmented by :class:`JointTransform` from the
    engine's per-batch generator (same sharding, order and resume position as every vitlab loader)."""

    def __init__(self, dataset: MaskDataset, batch_size: int, crop: int, seed: int = 0, rank: int = 0,
                 world_size: int = 1, device: torch.device | str | None = None,
                 scale_range: tuple[float, float] = (0.5, 2.0), hflip: float = 0.5) -> None:  # fmt: skip
        super().__init__(dataset, batch_size, shuffle=True, drop_last=True, seed=seed, rank=rank,
                         world_size=world_size, device=device)  # fmt: skip
        self.joint = JointTransform(crop, scale_range, hflip)

    def _batch(self, idx: Tensor, g: torch.Generator) -> tuple[Tensor, Tensor]:
        images, masks = [], []
        for i in idx.tolist():
            image, mask = self.joint(*self.dataset.load(i), g)
            images.append(image)
            masks.append(mask)
        x, y = torch.stack(images), torch.stack(masks)
        if self.device is not None:
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        return normalize(x, self.dataset.mean, self.dataset.std), y
