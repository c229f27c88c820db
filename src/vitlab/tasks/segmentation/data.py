"""Segmentation data: images with PNG class masks in the PASCAL VOC, ADE20K and Cityscapes folder layouts.

Layouts (``--data voc:ROOT``, ``ade20k:ROOT``, ``cityscapes:ROOT``, or a bare ``ROOT`` recognised by its folders)::

    voc     ROOT/JPEGImages/<id>.jpg  ROOT/SegmentationClass/<id>.png  ROOT/ImageSets/Segmentation/{train,val}.txt
            21 classes (background + 20); mask values are class indices (palette PNG), 255 = ignored (object
            borders, "difficult")
    ade20k  ROOT/images/{training,validation}/<name>.jpg  ROOT/annotations/{training,validation}/<name>.png
            150 classes; mask value 0 ("other") is ignored and 1..150 become 0..149 (the benchmark's rule);
            ROOT/objectInfo150.csv, when there, names the classes (its ``Name`` column)
    cityscapes  ROOT/leftImg8bit/{train,val}/<city>/*_leftImg8bit.png  ROOT/gtFine/{train,val}/<city>/
            *_gtFine_labelIds.png; the 34 label ids become the benchmark's 19 train ids, the others 255
            (:mod:`.cityscapes`)

``ROOT`` may also be the folder an archive unpacks to: the one holding ``VOCdevkit/VOC2012`` (VOC2007 too), or
the one holding ``ADEChallengeData2016``; Cityscapes' archives unpack into ``ROOT`` itself. Every file a split
list names is resolved inside the dataset folder (an id with ``../`` or an absolute one is refused), images and
masks are opened only when they are regular files (a named pipe would block the reader), and an image or mask
that cannot be decoded is one line naming it.

Training samples are augmented jointly (:class:`JointTransform`): the image and its mask resized by one random
factor (short side = crop x U(0.5, 2.0); bilinear for the image, nearest for the mask), padded to the crop
(image 0, mask 255), cropped at one random place, flipped together, the image normalised by the ImageNet
statistics. :class:`SegLoader` draws every batch's augmentation from the engine's per-batch generator, so a
resumed run sees the batches an uninterrupted one would.
"""

from __future__ import annotations

import csv
import io
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from ...common.options import Validated
from ...data import BatchLoader
from ...data.datasets import IMAGENET_MEAN, IMAGENET_STD
from ...data.safe_files import MAX_UNPACKED_BYTES, DataFileError, inside_root, open_regular, read_regular
from ...engine.dense import IGNORE_INDEX
from . import cityscapes

LAYOUTS = {"voc": 21, "ade20k": 150, "cityscapes": cityscapes.NUM_CLASSES}  # layout -> classes
SPLITS = {
    "voc": {"train": "train", "val": "val"},
    "ade20k": {"train": "training", "val": "validation"},
    "cityscapes": {"train": "train", "val": "val"},
}
SPEC_HELP = (
    "voc:<root> (PASCAL VOC layout), ade20k:<root> (ADEChallengeData2016 layout), cityscapes:<root> "
    "(leftImg8bit/ and gtFine/), or a bare root"
)
NAMES = {"voc": "VOC", "ade20k": "ADE20K", "cityscapes": "Cityscapes"}

#: PASCAL VOC's 21 classes, in the order of their mask values
VOC_CLASSES = ("background", "aeroplane", "bicycle", "bird", "boat", "bottle", "bus", "car", "cat", "chair", "cow",
               "diningtable", "dog", "horse", "motorbike", "person", "pottedplant", "sheep", "sofa", "train",
               "tvmonitor")  # fmt: skip

# Where each layout's archive puts the dataset folder, relative to the folder it is unpacked in (first match).
NESTED = {
    "voc": ("VOC2012", "VOCdevkit/VOC2012", "VOC2007", "VOCdevkit/VOC2007"),
    "ade20k": ("ADEChallengeData2016",),
    "cityscapes": (),  # both archives unpack into the folder they are opened in
}
EXPECTED = {
    "voc": "JPEGImages/, SegmentationClass/ and ImageSets/Segmentation/{train,val}.txt (the VOC2012 folder), or the "
    "folder holding VOCdevkit/VOC2012/ (where VOCtrainval_11-May-2012.tar unpacks)",
    "ade20k": "images/{training,validation}/ and annotations/{training,validation}/ (the ADEChallengeData2016 "
    "folder), or the folder holding ADEChallengeData2016/ (where ADEChallengeData2016.zip unpacks)",
    "cityscapes": cityscapes.EXPECTED,
}
FIX = {
    "voc": "re-extract the file from the VOC archive, or remove its id from the split list",
    "ade20k": "re-extract the file from ADEChallengeData2016.zip, or remove the image and its annotation",
    "cityscapes": cityscapes.FIX,
}
LIST_LIMIT = 64 << 20  # a split list of ids (VOC's longest, with SBD's extra masks, is ~150 KB)
NAMES_LIMIT = 1 << 20  # objectInfo150.csv is ~5 KB


def _own_layout(root: Path) -> str | None:
    if (root / "JPEGImages").is_dir() and (root / "SegmentationClass").is_dir():
        return "voc"
    if (root / "images").is_dir() and (root / "annotations").is_dir():
        return "ade20k"
    if cityscapes.is_cityscapes(root):
        return "cityscapes"
    return None


def locate(root: Path, layout: str | None = None) -> tuple[str, Path] | None:
    """(layout, dataset folder) of ``root`` or of the folder its archive put inside it (:data:`NESTED`); None
    when neither is in ``layout`` (any layout when None)."""
    for candidate in (root, *(root / sub for layouts in NESTED.values() for sub in layouts)):
        found = _own_layout(candidate)
        if found is not None and layout in (None, found):
            return found, candidate
    return None


def detect_layout(root: Path) -> str | None:
    """The layout of ``root`` (or of the dataset folder an archive unpacked inside it); None if none."""
    found = locate(root)
    return found[0] if found else None


def parse_mask_spec(text: str) -> tuple[str, Path]:
    """``voc:ROOT`` / ``ade20k:ROOT`` / ``cityscapes:ROOT`` / ``ROOT`` -> (layout, dataset folder); ValueError
    saying what is wrong."""
    kind, sep, rest = text.partition(":")
    layout, root = (kind, Path(rest)) if sep and kind in LAYOUTS else (None, Path(text))
    if not root.is_dir():
        raise ValueError(f"segmentation data {text!r}: {root} is not a folder; give {SPEC_HELP}")
    found = locate(root, layout)
    if found is None:
        want = layout or "voc, ade20k or cityscapes"
        expected = EXPECTED[layout] if layout else "; ".join(f"{NAMES[k]}: {v}" for k, v in EXPECTED.items())
        raise ValueError(f"segmentation data {text!r}: {root} is not in the {want} layout; expected {expected}")
    return found


def _checked_spec(text: str) -> str:
    parse_mask_spec(text)
    return text


#: argparse type of ``vitlab seg --data``: the text, once it names a readable layout
mask_spec = Validated(_checked_spec, "segmentation data")


def _voc_ids(listing: Path) -> list[tuple[int, str]]:
    """(line number, id) of a VOC split list; a list that is not text is one line."""
    fix = "it lists one image id per line (ImageSets/Segmentation of the VOC archive)"
    data = read_regular(listing, "VOC split list", fix, LIST_LIMIT)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise DataFileError(f"VOC split list {listing} is not UTF-8 text; {fix}") from None
    return [(n, line.split()[0]) for n, line in enumerate(text.splitlines(), 1) if line.strip()]


def pairs(layout: str, root: Path, split: str) -> list[tuple[Path, Path]]:
    """(image, mask) paths of ``split`` ("train" or "val") in the layout's order, each inside ``root``."""
    if split not in SPLITS[layout]:
        raise ValueError(f"split must be train or val, got {split!r}")
    if layout == "cityscapes":
        return cityscapes.pairs(root, split)
    if layout == "voc":
        listing = root / "ImageSets" / "Segmentation" / f"{split}.txt"
        out = []
        for n, i in _voc_ids(listing):
            what = f"VOC split list {listing} line {n}"
            fix = "an id names an image of JPEGImages/ and its mask in SegmentationClass/; correct or remove the line"
            # resolved against the image and mask folders themselves, so an id cannot reach the other folder,
            # and a folder that is a symlink (a dataset kept on another disk) still works
            out.append((inside_root(root / "JPEGImages", f"{i}.jpg", what, fix),
                        inside_root(root / "SegmentationClass", f"{i}.png", what, fix)))  # fmt: skip
        return out
    sub = SPLITS[layout][split]
    image_dir, mask_dir = root / "images" / sub, root / "annotations" / sub
    out = []
    for p in sorted(image_dir.glob("*.jpg")):
        if not p.name.isprintable():  # a line break in a file name would split every message naming it
            raise DataFileError(f"ADE20K image {str(p)!r} has a control character in its name; rename or remove it")
        what, fix = f"ADE20K image {p}", "the images and annotations must lie in the dataset folder itself"
        out.append((inside_root(image_dir, p.name, what, fix), inside_root(mask_dir, f"{p.stem}.png", what, fix)))
    return out


def _clean_name(name: str) -> str:
    """A class name fit for one line of a terminal: printable, at most 40 characters."""
    return "".join(c for c in name if c.isprintable()).strip()[:40]


def ade20k_classes(root: Path) -> list[str] | None:
    """The 150 class names of ``root/objectInfo150.csv`` (its ``Name`` column, the first name of each ``a;b``
    list, in the order of ``Idx`` 1..150); None when the file is absent or not that table."""
    path = root / "objectInfo150.csv"
    if not path.exists():
        return None
    try:
        text = read_regular(path, "ADE20K class table", "it is optional: remove it", NAMES_LIMIT).decode("utf-8")
        rows = list(csv.DictReader(io.StringIO(text)))
        names = {int(r["Idx"]): _clean_name(r["Name"].split(";")[0]) for r in rows}
    except (ValueError, FileNotFoundError, KeyError, TypeError, AttributeError, csv.Error):
        return None  # the names are only shown beside the scores: numbers serve when the table is unusable
    if sorted(names) != list(range(1, 151)) or not all(names.values()):
        return None
    return [names[k] for k in range(1, 151)]


@dataclass
class MaskDataset:
    """Image-mask pairs of one split; :meth:`load` decodes one as ``uint8 (3, H, W)`` and ``int64 (H, W)`` with
    the layout's labels (0..K-1, or 255 ignored). ``classes`` names the K classes when the layout does."""

    items: list[tuple[Path, Path]]
    layout: str
    num_classes: int
    mean: tuple[float, ...] = IMAGENET_MEAN
    std: tuple[float, ...] = IMAGENET_STD
    source: str = ""
    extra: dict = field(default_factory=dict)
    classes: list[str] | None = None

    def __len__(self) -> int:
        return len(self.items)

    @property
    def in_chans(self) -> int:
        return 3

    def load(self, i: int) -> tuple[Tensor, Tensor]:
        image_path, mask_path = self.items[i]
        name = NAMES[self.layout]
        fix = FIX.get(self.layout, "replace or remove the file")
        image = _decode(image_path, f"{name} image", fix, mask=False)
        image = torch.from_numpy(image).permute(2, 0, 1).contiguous()
        mask = _decode(mask_path, f"{name} mask", fix, mask=True)
        mask = torch.from_numpy(mask.astype(np.int64))
        if mask.shape != image.shape[1:]:
            raise ValueError(
                f"{name} mask {mask_path}: mask {tuple(mask.shape)} and image {tuple(image.shape[1:])} differ in "
                f"size; {fix}"
            )
        if self.layout == "ade20k":  # 0 = "other", not scored; classes 1..150 -> 0..149
            mask = torch.where(mask == 0, IGNORE_INDEX, mask - 1)
        elif self.layout == "cityscapes":  # the 34 label ids -> the 19 train ids, the rest ignored
            mask = cityscapes.to_train_ids(mask, mask_path)
        bad = (mask != IGNORE_INDEX) & (mask >= self.num_classes)
        if bad.any():
            raise ValueError(
                f"{name} mask {mask_path}: label {int(mask[bad].max())} is outside the {self.num_classes} classes of "
                f"{self.layout}; {fix}"
            )
        return image, mask


def _one_line(text: str, limit: int = 160) -> str:
    return " ".join(text.split())[:limit]


def _decode(path: Path, what: str, fix: str, mask: bool) -> np.ndarray:
    """The pixels of the image file ``path``: ``uint8 (H, W, 3)``, or for a ``mask`` the ``(H, W)`` values of a
    one-channel (palette or grey) image; anything that is not such a file is one line naming it."""
    from PIL import Image, UnidentifiedImageError

    with open_regular(path, what, fix) as f:
        try:
            with Image.open(f) as im:
                w, h = im.size
                if w * h * 3 > MAX_UNPACKED_BYTES:
                    raise DataFileError(
                        f"{what} {path} declares {w} x {h} pixels, more than any sample of this dataset; {fix}"
                    )
                if mask and im.mode not in ("P", "L"):
                    raise DataFileError(
                        f"{what} {path}: a mask must be a one-channel PNG of class indices, got mode {im.mode}; {fix}"
                    )
                return np.asarray(im, dtype=np.uint8) if mask else np.array(im.convert("RGB"))
        except DataFileError:
            raise
        except UnidentifiedImageError:
            raise DataFileError(f"{what} {path} is not an image Pillow can read (not a JPEG or PNG); {fix}") from None
        except MemoryError:
            raise
        except Exception as e:  # Pillow raises many types on damaged files (OSError, SyntaxError, zlib.error, ...)
            detail = _one_line(f"{type(e).__name__}: {e}")
            raise DataFileError(f"{what} {path} cannot be decoded ({detail}): damaged or truncated; {fix}") from None


def open_masks(text: str, split: str) -> MaskDataset:
    """The ``split`` ("train" / "val") of the segmentation data ``text`` (:func:`parse_mask_spec`)."""
    layout, root = parse_mask_spec(text)
    items = pairs(layout, root, split)
    if not items:
        raise ValueError(f"segmentation data {text!r}: the {split} split has no images")
    fixed = {"voc": VOC_CLASSES, "cityscapes": cityscapes.CLASSES}  # ADE20K's are read from a file, when there
    classes = list(fixed[layout]) if layout in fixed else ade20k_classes(root)
    return MaskDataset(items, layout, LAYOUTS[layout], source=str(root), classes=classes)


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
