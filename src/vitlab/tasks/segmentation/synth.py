"""A small generated segmentation set in the real VOC, ADE20K or Cityscapes folder layout (for tests and quick
runs).

Each image is a smooth noisy background (class 0 for VOC; ADE20K's "other", ignored; Cityscapes' "road") with
one to three filled discs and rectangles, each of a class with its own colour; the mask holds each pixel's class,
and for VOC a one-pixel band around every object is 255 (ignored), as VOC marks object borders. Images are JPEG
(quality 90; Cityscapes: PNG), masks PNG (VOC: palette; ADE20K: grey levels 1..K for the classes; Cityscapes:
grey *label ids*, train id k written as the id that maps to it, the border band as "unlabeled" (0) and the bottom
eighth of every image as "ego vehicle" (1), both ignored once read). Cityscapes frames are spread over two city
folders per split, named as the archive names them. Everything follows ``seed``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ...common.io import atomic_path
from . import cityscapes
from .data import IGNORE_INDEX, LAYOUTS, SPLITS

CITIES = {"train": ("aachen", "bochum"), "val": ("frankfurt", "lindau")}  # real city folders of each split
# train id -> the Cityscapes label id that maps to it (the inverse of cityscapes.TRAIN_IDS on the scored ids)
LABEL_ID_OF = {t: i for i, t in cityscapes.TRAIN_IDS.items() if t != IGNORE_INDEX}
UNLABELED, EGO_VEHICLE = 0, 1


def class_colour(c: int) -> tuple[int, int, int]:
    import colorsys

    r, g, b = colorsys.hsv_to_rgb((c * 0.618034) % 1.0, 0.9, 0.95)
    return int(255 * r), int(255 * g), int(255 * b)


def draw_sample(rng: np.random.Generator, h: int, w: int, classes: int) -> tuple[np.ndarray, np.ndarray]:
    """(image uint8 (H, W, 3), mask uint8 (H, W) with labels 0..classes-1 and 255 borders)."""
    yy, xx = np.mgrid[0:h, 0:w]
    image = np.clip(rng.normal(110, 18, size=(h, w, 3)), 0, 255)
    mask = np.zeros((h, w), np.uint8)
    border = np.zeros((h, w), bool)
    for _ in range(int(rng.integers(1, 4))):
        c = int(rng.integers(1, classes))
        cy, cx = rng.uniform(0.2, 0.8) * h, rng.uniform(0.2, 0.8) * w
        r = rng.uniform(0.12, 0.3) * min(h, w)
        if rng.random() < 0.5:
            d = np.hypot(yy - cy, xx - cx)
            inside, edge = d <= r, np.abs(d - r) <= 1.0
        else:
            d = np.maximum(np.abs(yy - cy), np.abs(xx - cx))
            inside, edge = d <= r, np.abs(d - r) <= 1.0
        mask[inside] = c
        border &= ~inside
        border |= edge
        image[inside] = np.asarray(class_colour(c)) + rng.normal(0, 10, size=(int(inside.sum()), 3))
    mask[border] = IGNORE_INDEX
    return np.clip(image, 0, 255).astype(np.uint8), mask


def write_png(path: Path, mask: np.ndarray, palette: bool) -> None:
    from PIL import Image

    im = Image.fromarray(mask, mode="L")
    if palette:
        im = im.convert("P")
        im.putpalette([v for c in range(256) for v in class_colour(c)])
    with atomic_path(path) as tmp:
        im.save(tmp, format="PNG")


def cityscapes_label_ids(mask: np.ndarray) -> np.ndarray:
    """A drawn mask (train ids, 255 borders) as a ``*_gtFine_labelIds.png`` holds it (module docstring)."""
    ids = np.full(mask.shape, UNLABELED, np.uint8)
    for t, label_id in LABEL_ID_OF.items():
        ids[mask == t] = label_id
    ids[-max(1, mask.shape[0] // 8) :] = EGO_VEHICLE
    return ids


def cityscapes_paths(root: Path, split: str, i: int) -> tuple[Path, Path]:
    """(image, mask) of frame ``i`` of ``split``: alternate cities, names as ``aachen_000000_000019``."""
    cities = CITIES[split]
    city = cities[i % len(cities)]
    frame = f"{city}_{i // len(cities):06d}_{19 + i:06d}"
    return (root / "leftImg8bit" / split / city / f"{frame}{cityscapes.IMAGE_SUFFIX}",
            root / "gtFine" / split / city / f"{frame}{cityscapes.MASK_SUFFIX}")  # fmt: skip


def make_mask_folder(root: str | Path, layout: str = "voc", train: int = 24, val: int = 8,
                     size: tuple[int, int] = (48, 64), classes: int = 5, seed: int = 0) -> Path:  # fmt: skip
    """Write ``train`` + ``val`` image-mask pairs of ``size`` (H, W) in ``layout`` under ``root``; its path."""
    from PIL import Image

    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    if not 2 <= classes <= LAYOUTS[layout]:
        raise ValueError(f"classes must lie in [2, {LAYOUTS[layout]}] for {layout}, got {classes}")
    root, rng = Path(root), np.random.default_rng(seed)
    for split, count in (("train", train), ("val", val)):
        ids = [f"{split}_{i:05d}" for i in range(count)]
        sub = SPLITS[layout][split]
        img_dir, mask_dir = (
            (root / "JPEGImages", root / "SegmentationClass")
            if layout == "voc"
            else (root / "images" / sub, root / "annotations" / sub)
        )
        for n, name in enumerate(ids):
            image, mask = draw_sample(rng, *size, classes + (layout == "ade20k"))
            if layout == "ade20k":  # labels 1..K; 0 ("other") is the background here, and no border band
                mask = np.where(mask == IGNORE_INDEX, 0, mask).astype(np.uint8)
            if layout == "cityscapes":
                image_path, mask_path = cityscapes_paths(root, split, n)
                mask = cityscapes_label_ids(mask)
            else:
                image_path, mask_path = img_dir / f"{name}.jpg", mask_dir / f"{name}.png"
            image_path.parent.mkdir(parents=True, exist_ok=True)
            mask_path.parent.mkdir(parents=True, exist_ok=True)
            with atomic_path(image_path) as tmp:
                if layout == "cityscapes":
                    Image.fromarray(image).save(tmp, format="PNG")
                else:
                    Image.fromarray(image).save(tmp, format="JPEG", quality=90)
            write_png(mask_path, mask, palette=layout == "voc")
        if layout == "voc":
            listing = root / "ImageSets" / "Segmentation" / f"{split}.txt"
            listing.parent.mkdir(parents=True, exist_ok=True)
            with atomic_path(listing) as tmp:
                tmp.write_text("".join(f"{i}\n" for i in ids))
    return root
