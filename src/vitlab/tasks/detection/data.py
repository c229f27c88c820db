"""Detection data: images with instance boxes and masks in the official COCO layout, DETR's augmentation, and the
engine's batches.

Layout (``--data coco:ROOT``)::

    ROOT/annotations/instances_{train2017,val2017}.json    images, annotations, categories (COCO's format)
    ROOT/{train2017,val2017}/<file_name>                    the images each annotation file names

The annotation file is read once (bounded, :mod:`vitlab.data.safe_files`) and checked: a missing key, a wrong
type, a duplicate id, an annotation naming an unknown image or category, a box that is not finite or has a
negative width or height, a ``file_name`` leaving the image folder are each one line naming the entry. COCO's
category ids are not contiguous: the sorted ids become labels ``0..C-1`` (``cat_ids[label]`` is the COCO id,
``classes[label]`` its name). A sample is its image (``uint8 (3, H, W)``) and its target in the file's pixels
(:mod:`.batch`): boxes converted from COCO's ``x, y, w, h`` to corners, clipped to the image, those with no area
left out (as DETR does); masks decoded from polygons, compressed or uncompressed RLE by pycocotools (checked
first: an RLE whose runs do not cover the image exactly, or a polygon far outside it, is refused, since
pycocotools' C code trusts them); crowd annotations (``iscrowd`` 1) stay in the dataset (``anns``, and the
evaluator reads them from the file) but not in the targets.

Augmentation (DETR's, :class:`DetTransform`): a horizontal flip with probability ``hflip`` (boxes and masks
mirrored), then a resize so the shorter side is one of ``scales`` (drawn uniformly) and the longer at most
``max_size`` (bilinear with antialiasing for the image, nearest for masks; boxes scaled). DETR trains with the
shorter side in 480, 512, ..., 800 and ``max_size`` 1333, and evaluates at 800: :func:`detr_scales` and
:func:`default_max_size` give the same ratios for another evaluation size. :class:`DetLoader` draws every
batch's augmentation from the engine's per-batch generator, so a resumed run sees the batches an uninterrupted
one would.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from ...common.extras import require
from ...data import BatchLoader
from ...data.datasets import IMAGENET_MEAN, IMAGENET_STD
from ...data.safe_files import DataFileError, inside_root, open_regular
from ...data.samplers import derive_seed
from .batch import DetBatch
from .coco_format import FIX, bad, check_segmentation, decode_mask, read_instances

SPLITS = {"train": "train2017", "val": "val2017"}
SPEC_HELP = "coco:ROOT (ROOT/annotations/instances_{train2017,val2017}.json, ROOT/train2017/, ROOT/val2017/)"
IMAGE_FIX = "re-extract the image from the COCO archive, or remove it and its annotations from the annotation file"


def parse_coco_spec(text: str) -> Path:
    """``coco:ROOT`` -> ROOT, once it is a folder; ValueError saying what is wrong."""
    kind, sep, rest = text.partition(":")
    if not sep or kind != "coco" or not rest:
        raise ValueError(f"detection data {text!r}: give {SPEC_HELP}")
    root = Path(rest)
    if not root.is_dir():
        raise ValueError(f"detection data {text!r}: {root} is not a folder; give {SPEC_HELP}")
    return root


def _decode_image(path: Path, h: int, w: int) -> Tensor:
    """``uint8 (3, H, W)`` pixels of an image file the annotation file says is ``w x h``; one line otherwise."""
    from PIL import Image, UnidentifiedImageError

    with open_regular(path, "COCO image", IMAGE_FIX) as f:
        try:
            with Image.open(f) as im:
                if im.size != (w, h):  # boxes and masks are drawn on the declared size
                    raise DataFileError(
                        f"COCO image {path} is {im.size[0]} x {im.size[1]} pixels, the annotation file says "
                        f"{w} x {h}; {IMAGE_FIX}"
                    )
                pixels = np.array(im.convert("RGB"))
        except DataFileError:
            raise
        except UnidentifiedImageError:
            raise DataFileError(f"COCO image {path} is not an image Pillow can read; {IMAGE_FIX}") from None
        except MemoryError:
            raise
        except Exception as e:  # Pillow raises many types on damaged files (OSError, SyntaxError, zlib.error, ...)
            detail = " ".join(f"{type(e).__name__}: {e}".split())[:160]
            raise DataFileError(f"COCO image {path} cannot be decoded ({detail}): damaged; {IMAGE_FIX}") from None
    return torch.from_numpy(pixels).permute(2, 0, 1).contiguous()


@dataclass
class CocoDetection:
    """One split of a COCO-layout folder (module docstring): ``ds[i]`` is ``(uint8 (3, H, W), target)`` in the
    file's pixels; ``masks`` says whether targets carry instance masks."""

    root: Path
    split: str
    annotation_file: Path
    images: list[dict[str, Any]] = field(repr=False)  # the annotation file's image entries, with checked "path"
    anns: list[list[dict[str, Any]]] = field(repr=False)  # per image, its annotations (crowd ones included)
    cat_ids: list[int]
    classes: list[str]
    masks: bool = False
    mean: tuple[float, ...] = IMAGENET_MEAN
    std: tuple[float, ...] = IMAGENET_STD
    label_of: dict[int, int] = field(init=False, repr=False)  # COCO category id -> label

    def __post_init__(self) -> None:
        self.label_of = {c: k for k, c in enumerate(self.cat_ids)}

    def __len__(self) -> int:
        return len(self.images)

    @property
    def num_classes(self) -> int:
        return len(self.cat_ids)

    @property
    def image_ids(self) -> list[int]:
        return [im["id"] for im in self.images]

    def target(self, i: int) -> dict[str, Tensor]:
        """Image ``i``'s target in the file's pixels: its non-crowd boxes with an area (module docstring)."""
        im = self.images[i]
        h, w = im["height"], im["width"]
        anns = [a for a in self.anns[i] if not a["iscrowd"]]
        xywh = torch.tensor([a["bbox"] for a in anns], dtype=torch.float64).reshape(-1, 4)
        boxes = torch.cat([xywh[:, :2], xywh[:, :2] + xywh[:, 2:]], 1)
        boxes[:, 0::2] = boxes[:, 0::2].clamp(0, w)
        boxes[:, 1::2] = boxes[:, 1::2].clamp(0, h)
        keep = (boxes[:, 2:] > boxes[:, :2]).all(1)
        kept = [a for a, k in zip(anns, keep.tolist()) if k]
        target = {
            "boxes": boxes[keep].float().reshape(-1, 4),
            "labels": torch.tensor([self.label_of[a["category_id"]] for a in kept], dtype=torch.int64),
            "image_id": torch.tensor(im["id"]),
            "orig_size": torch.tensor([h, w]),
            "size": torch.tensor([h, w]),
        }
        if self.masks:
            planes = []
            for a in kept:
                where = f"COCO annotation file {self.annotation_file}: annotation id {a['id']}"
                if "segmentation" not in a:
                    raise bad(where, "it has no segmentation while others have (open with masks=False for boxes)")
                planes.append(decode_mask(check_segmentation(a["segmentation"], h, w, where), h, w))
            stack = np.stack(planes) if planes else np.zeros((0, h, w), np.uint8)
            target["masks"] = torch.from_numpy(stack)
        return target

    def __getitem__(self, i: int) -> tuple[Tensor, dict[str, Tensor]]:
        im = self.images[i]
        return _decode_image(im["path"], im["height"], im["width"]), self.target(i)


def open_coco(spec: str, split: str, masks: bool = True) -> CocoDetection:
    """The ``split`` ("train" / "val") of the COCO-layout folder ``spec`` (``coco:ROOT``); with ``masks`` the
    targets carry instance masks when the annotations have segmentations (a box-only detector reads faster
    without)."""
    if split not in SPLITS:
        raise ValueError(f"split must be train or val, got {split!r}")
    root = parse_coco_spec(spec)
    path = root / "annotations" / f"instances_{SPLITS[split]}.json"
    if not path.exists():
        raise FileNotFoundError(f"detection data {spec!r}: {path} does not exist; expected {SPEC_HELP}")
    doc = read_instances(path)
    folder, images, index = root / SPLITS[split], [], {}
    for im in doc["images"]:
        what = f"COCO annotation file {path}: image id {im['id']}"
        index[im["id"]] = len(images)
        images.append({**im, "path": inside_root(folder, im["file_name"], what, FIX)})
    if not images:
        raise ValueError(f"detection data {spec!r}: the {split} split has no images")
    anns: list[list[dict[str, Any]]] = [[] for _ in images]
    for a in doc["annotations"]:
        anns[index[a["image_id"]]].append(a)
    cats = sorted(doc["categories"], key=lambda c: c["id"])
    classes = ["".join(ch for ch in c["name"] if ch.isprintable()).strip()[:40] for c in cats]
    with_masks = masks and any("segmentation" in a for a in doc["annotations"])
    if with_masks:
        require("pycocotools.mask", "decoding COCO masks", extra="detection")
    return CocoDetection(root, split, path, images, anns, [c["id"] for c in cats], classes, with_masks)


# --------------------------------------------------------------------------- transforms


def detr_scales(size: int) -> tuple[int, ...]:
    """DETR's training scales (shorter side 480, 512, ..., 800 for evaluation at 800) for evaluation at ``size``."""
    return tuple(sorted({max(1, round(s * size / 800)) for s in range(480, 801, 32)}))


def default_max_size(size: int) -> int:
    """DETR's cap on the longer side (1333 at 800), for a shorter side of ``size``."""
    return max(1, round(size * 1333 / 800))


def resized_shape(h: int, w: int, size: int, max_size: int | None = None) -> tuple[int, int]:
    """``(h, w)`` scaled so the shorter side is ``size``, or smaller so the longer is at most ``max_size``."""
    short, long = min(h, w), max(h, w)
    if max_size is not None and size * long > max_size * short:
        size = max(1, max_size * short // long)
    other = max(1, size * long // short)
    return (size, other) if h <= w else (other, size)


def resize(image: Tensor, target: dict[str, Tensor], size: int, max_size: int | None) -> tuple[Tensor, dict]:
    """The image (bilinear, antialiased), boxes and masks (nearest) at :func:`resized_shape`."""
    h, w = image.shape[-2:]
    nh, nw = resized_shape(h, w, size, max_size)
    if (nh, nw) == (h, w):
        return image, target
    img = F.interpolate(image[None].float(), (nh, nw), mode="bilinear", align_corners=False, antialias=True)[0]
    out = {**target, "size": torch.tensor([nh, nw])}
    out["boxes"] = target["boxes"] * torch.tensor([nw / w, nh / h, nw / w, nh / h], dtype=torch.float32)
    if "masks" in target:
        m = target["masks"]
        m = F.interpolate(m[None].float(), (nh, nw), mode="nearest")[0] if len(m) else m.new_zeros(0, nh, nw)
        out["masks"] = m.to(torch.uint8)
    return img.round().clamp(0, 255).to(torch.uint8), out


def hflip(image: Tensor, target: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
    """The image mirrored left-right, its boxes (``x -> w - x``) and masks with it."""
    w = image.shape[-1]
    x0, y0, x1, y1 = target["boxes"].unbind(-1)
    out = {**target, "boxes": torch.stack([w - x1, y0, w - x0, y1], -1)}
    if "masks" in target:
        out["masks"] = target["masks"].flip(-1)
    return image.flip(-1), out


@dataclass(frozen=True)
class DetTransform:
    """Flip with probability ``hflip``, then resize to a shorter side drawn from ``scales`` (module docstring);
    a single scale and no flip is the evaluation transform, which needs no generator."""

    scales: tuple[int, ...]
    max_size: int | None = None
    hflip: float = 0.5

    def __call__(self, image: Tensor, target: dict[str, Tensor], g: torch.Generator | None = None) -> tuple:
        if g is None and (len(self.scales) > 1 or self.hflip > 0):
            raise ValueError("a random transform needs the batch's generator")
        u = torch.rand(2, generator=g).tolist() if g is not None else [1.0, 0.0]
        if u[0] < self.hflip:
            image, target = hflip(image, target)
        size = self.scales[min(int(u[1] * len(self.scales)), len(self.scales) - 1)]
        return resize(image, target, size, self.max_size)


# --------------------------------------------------------------------------- batches


def collate(samples: list[tuple[Tensor, dict[str, Tensor]]], mean: tuple[float, ...] = IMAGENET_MEAN,
            std: tuple[float, ...] = IMAGENET_STD, size_divisor: int = 1,
            device: torch.device | str | None = None) -> DetBatch:  # fmt: skip
    """A :class:`~.batch.DetBatch` of ``uint8`` images and their targets: normalised by ``mean`` / ``std``,
    zero-padded at the bottom and right to the largest image (rounded up to a multiple of ``size_divisor``),
    ``padding`` True there; moved to ``device`` before normalising (the copy is of bytes)."""
    if not samples:
        raise ValueError("collate needs at least one sample")
    d = max(1, size_divisor)
    hh = -(-max(im.shape[1] for im, _ in samples) // d) * d
    ww = -(-max(im.shape[2] for im, _ in samples) // d) * d
    images = torch.zeros(len(samples), 3, hh, ww, dtype=torch.uint8)
    padding = torch.ones(len(samples), hh, ww, dtype=torch.bool)
    for k, (im, _) in enumerate(samples):
        images[k, :, : im.shape[1], : im.shape[2]] = im
        padding[k, : im.shape[1], : im.shape[2]] = False
    batch = DetBatch(images, padding, [t for _, t in samples])
    if device is not None:
        batch = batch.to(device)
    m = torch.tensor(mean, device=batch.images.device).view(1, -1, 1, 1)
    s = torch.tensor(std, device=batch.images.device).view(1, -1, 1, 1)
    x = (batch.images.float() / 255 - m) / s
    batch.images = x.masked_fill(batch.padding[:, None], 0.0)  # DETR pads after normalising: zeros
    return batch


class DetLoader(BatchLoader):
    """:class:`~vitlab.data.BatchLoader` over a :class:`CocoDetection`: ``(DetBatch, targets)`` batches of
    images augmented by :class:`DetTransform` (shorter side among :func:`detr_scales` of ``size`` unless
    ``scales`` are given, longer side at most ``max_size``, by default :func:`default_max_size` of the largest
    scale), padded to a multiple of ``size_divisor``, from the engine's per-batch generator (same sharding,
    order and resume position as every vitlab loader)."""

    def __init__(self, dataset: CocoDetection, batch_size: int, size: int = 800, seed: int = 0, rank: int = 0,
                 world_size: int = 1, device: torch.device | str | None = None, hflip: float = 0.5,
                 scales: tuple[int, ...] | None = None, max_size: int | None = None,
                 size_divisor: int = 1, workers: int = 0) -> None:  # fmt: skip
        super().__init__(dataset, batch_size, shuffle=True, drop_last=True, seed=seed, rank=rank,
                         world_size=world_size, device=device)  # fmt: skip
        scales = tuple(scales) if scales else detr_scales(size)
        if not scales or min(scales) < 1 or not 0 <= hflip <= 1:
            raise ValueError(f"need scales >= 1 and 0 <= hflip <= 1, got {list(scales)} and {hflip}")
        self.augment = DetTransform(scales, max_size or default_max_size(max(scales)), hflip)
        self.size_divisor, self.workers = size_divisor, workers

    def __iter__(self) -> Iterator[tuple[DetBatch, list[dict[str, Tensor]]]]:
        """The batches in order; with ``workers`` threads, the next ``2 x workers`` batches are decoded ahead
        (Pillow and torch release the GIL while they decode and resize). Each batch is still a function of its
        own (seed, epoch, rank, batch) generator, so the batches are the same with and without workers."""
        if self.workers <= 0:
            yield from super().__iter__()
            return
        idx, bs, n = self.indices(), self.batch_size, len(self)
        first = self.start_batch % max(n, 1)

        def make(b: int) -> tuple[DetBatch, list[dict[str, Tensor]]]:
            g = torch.Generator().manual_seed(derive_seed(self.seed, self.epoch, self.rank, b))
            return self._batch(idx[b * bs : (b + 1) * bs], g)

        with ThreadPoolExecutor(self.workers) as pool:
            ahead = deque(pool.submit(make, b) for b in range(first, min(n, first + 2 * self.workers)))
            for b in range(first, n):
                batch = ahead.popleft().result()
                if b + len(ahead) + 1 < n:
                    ahead.append(pool.submit(make, b + len(ahead) + 1))
                self.start_batch = b + 1  # the state a checkpoint taken after this batch records
                yield batch

    def _batch(self, idx: Tensor, g: torch.Generator) -> tuple[DetBatch, list[dict[str, Tensor]]]:
        samples = [self.augment(*self.dataset[i], g) for i in idx.tolist()]
        batch = collate(samples, self.dataset.mean, self.dataset.std, self.size_divisor, self.device)
        return batch, batch.targets
