"""A small generated detection set in the official COCO layout (for tests and quick runs).

Each image is a noisy grey background with one to three objects that do not touch, each a filled shape of its
category: category ``k`` is a rectangle, an ellipse or a triangle (``k mod 3``) in a colour of its own, so a
detector can learn the class from colour and shape and the box from the outline. Annotations carry COCO's
fields (``bbox`` as ``x, y, w, h``, ``area`` the mask's pixel count, ``iscrowd``, ``segmentation``) and cover
every mask format the reader takes: polygons (most objects: the shape's outline, corners on pixel centres, and
its box the outline's extent), compressed RLE strings (every sixth annotation), and crowd regions (every twentieth, ``iscrowd`` 1)
as uncompressed RLE, as COCO stores its crowds. Category ids are not contiguous (1, 3, 7, 13, ...: ``k^2 + k +
1``) and listed out of order; image ids are odd in train and even in val; files are JPEG (quality 95) named by
the image id, as COCO's. Everything follows ``seed``.
"""

from __future__ import annotations

import colorsys
import json
from pathlib import Path

import numpy as np

from ...common.io import atomic_path
from .data import SPLITS

SHAPES = ("rectangle", "ellipse", "triangle")
CROWD_EVERY, RLE_EVERY = 20, 6  # one annotation in 20 is a crowd region, one in 6 a compressed RLE


def category_id(k: int) -> int:
    return k * k + k + 1


def class_colour(k: int) -> tuple[int, int, int]:
    r, g, b = colorsys.hsv_to_rgb((k * 0.618034 + 0.1) % 1.0, 0.85, 0.95)
    return int(255 * r), int(255 * g), int(255 * b)


def outline(kind: str, cx: float, cy: float, rx: float, ry: float) -> np.ndarray:
    """The ``(k, 2)`` corners ``x, y`` of a shape centred at ``(cx, cy)`` with half-extents ``rx, ry``."""
    if kind == "rectangle":
        return np.array([[cx - rx, cy - ry], [cx + rx, cy - ry], [cx + rx, cy + ry], [cx - rx, cy + ry]])
    if kind == "triangle":
        return np.array([[cx, cy - ry], [cx + rx, cy + ry], [cx - rx, cy + ry]])
    t = np.linspace(0, 2 * np.pi, 16, endpoint=False)
    return np.stack([cx + rx * np.cos(t), cy + ry * np.sin(t)], 1)


def rasterise(points: np.ndarray, h: int, w: int) -> np.ndarray:
    """Bool ``(h, w)``: the pixels whose centres lie inside the convex polygon ``points`` (clockwise on screen)."""
    yy, xx = np.mgrid[0:h, 0:w] + 0.5
    inside = np.ones((h, w), bool)
    for (x0, y0), (x1, y1) in zip(points, np.roll(points, -1, 0)):
        inside &= (x1 - x0) * (yy - y0) - (y1 - y0) * (xx - x0) >= 0
    return inside


def rle_runs(mask: np.ndarray) -> list[int]:
    """COCO's run lengths of a mask: alternating background / object runs in column-major order, background
    first (a leading 0 when the first pixel is object)."""
    flat = np.asarray(mask, bool).T.reshape(-1)
    edges = np.flatnonzero(flat[1:] != flat[:-1]) + 1
    runs = np.diff(np.concatenate([[0], edges, [flat.size]])).tolist()
    return [0, *runs] if flat[0] else runs


def rle_string(runs: list[int]) -> str:
    """COCO's compressed RLE string of run lengths (the inverse of :func:`.coco_format.rle_counts`)."""
    out = []
    for i, x in enumerate(runs):
        x = x - runs[i - 2] if i > 2 else x
        while True:
            c, x = x & 0x1F, x >> 5
            last = x == (-1 if c & 0x10 else 0)
            out.append(chr(48 + (c if last else c | 0x20)))
            if last:
                break
    return "".join(out)


def place(rng: np.random.Generator, h: int, w: int, taken: np.ndarray) -> tuple[float, ...] | None:
    """Centre and half-extents of an object clear of ``taken`` (one pixel apart); None after 20 tries."""
    for _ in range(20):
        rx, ry = rng.uniform(0.12, 0.3, size=2) * min(h, w)
        cx, cy = rng.uniform(rx + 1, w - rx - 1), rng.uniform(ry + 1, h - ry - 1)
        x0, y0, x1, y1 = int(cx - rx) - 1, int(cy - ry) - 1, int(cx + rx) + 2, int(cy + ry) + 2
        if not taken[max(y0, 0) : y1, max(x0, 0) : x1].any():
            taken[max(y0, 0) : y1, max(x0, 0) : x1] = True
            return cx, cy, rx, ry
    return None


def draw_image(rng: np.random.Generator, h: int, w: int, classes: int, counter: list[int],
               image_id: int) -> tuple[np.ndarray, list[dict]]:  # fmt: skip
    """(``uint8 (h, w, 3)`` image, its COCO annotations); ``counter`` holds the split's next annotation index."""
    image = rng.normal(110, 18, size=(h, w, 3))
    taken, anns = np.zeros((h, w), bool), []
    for _ in range(int(rng.integers(1, 4))):
        k = int(rng.integers(0, classes))
        spot = place(rng, h, w, taken)
        if spot is None:
            continue
        # corners on pixel centres: pycocotools' rasterisation then reaches the outline's extent within half a
        # pixel (a sharp corner between pixel centres may rasterise to nothing)
        points = np.floor(outline(SHAPES[k % len(SHAPES)], *spot)) + 0.5
        mask = rasterise(points, h, w)
        image[mask] = np.asarray(class_colour(k)) + rng.normal(0, 8, size=(int(mask.sum()), 3))
        n = counter[0]
        counter[0] += 1
        ys, xs = np.nonzero(mask)
        pixel_box = [float(xs.min()), float(ys.min()), float(xs.max() + 1 - xs.min()), float(ys.max() + 1 - ys.min())]
        ann = {"id": 0, "image_id": image_id, "category_id": category_id(k), "area": float(mask.sum()), "iscrowd": 0}
        if n % CROWD_EVERY == CROWD_EVERY // 4:
            ann.update(iscrowd=1, bbox=pixel_box, segmentation={"size": [h, w], "counts": rle_runs(mask)})
        elif n % RLE_EVERY == RLE_EVERY // 3:
            ann.update(bbox=pixel_box, segmentation={"size": [h, w], "counts": rle_string(rle_runs(mask))})
        else:
            lo, hi = points.min(0), points.max(0)
            ann.update(bbox=[float(lo[0]), float(lo[1]), float(hi[0] - lo[0]), float(hi[1] - lo[1])],
                       segmentation=[[round(float(v), 2) for v in points.reshape(-1)]])  # fmt: skip
        anns.append(ann)
    return np.clip(image, 0, 255).astype(np.uint8), anns


def make_coco_folder(out: str | Path, train: int = 24, val: int = 8, size: tuple[int, int] = (64, 80),
                     classes: int = 3, seed: int = 0) -> Path:  # fmt: skip
    """Write ``train`` + ``val`` images of ``size`` (H, W) with ``classes`` categories under ``out`` in the COCO
    layout (module docstring); its path."""
    from PIL import Image

    h, w = size
    if classes < 1 or min(h, w) < 16 or train < 1 or val < 1:
        raise ValueError(f"need classes >= 1, images of at least 16 x 16 and both splits, got {classes}, {size}")
    root, rng = Path(out), np.random.default_rng(seed)
    categories = [{"id": category_id(k), "name": f"{SHAPES[k % len(SHAPES)]}_{k}", "supercategory": "shape"}
                  for k in reversed(range(classes))]  # fmt: skip
    next_id = 1
    for split, count in (("train", train), ("val", val)):
        folder = root / SPLITS[split]
        folder.mkdir(parents=True, exist_ok=True)
        images, anns, counter = [], [], [0]
        for i in range(count):
            image_id = 2 * i + (1 if split == "train" else 2)
            pixels, objects = draw_image(rng, h, w, classes, counter, image_id)
            name = f"{image_id:012d}.jpg"
            with atomic_path(folder / name) as tmp:
                Image.fromarray(pixels).save(tmp, format="JPEG", quality=95)
            images.append({"id": image_id, "file_name": name, "height": h, "width": w})
            for a in objects:
                a["id"], next_id = next_id, next_id + 1
            anns += objects
        doc = {"info": {"description": "vitlab synthetic detection set", "version": "1.0"}, "licenses": [],
               "images": images, "annotations": anns, "categories": categories}  # fmt: skip
        path = root / "annotations" / f"instances_{SPLITS[split]}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(path) as tmp:
            tmp.write_text(json.dumps(doc))
    return root
