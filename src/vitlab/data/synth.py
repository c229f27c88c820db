"""A synthetic ImageNet-layout folder of JPEGs that looks like the real thing to a data loader.

``OUT/train/<class>/<name>.JPEG`` and ``OUT/val/<class>/<name>.JPEG`` at ImageNet's typical sizes (500 x 375,
375 x 500, 500 x 333, ...; or one fixed size), JPEG quality 90 with 4:2:0 chroma subsampling, as most
ImageNet files are. Content depends on the class so a model can learn it: each class has its own hue and
shape (disc, square, triangle, bar, ring, cross), drawn one to three times at random places and sizes over a
smooth random background with pixel noise, so that random crops usually keep a piece of the object.
Everything is a function of ``seed``.
"""

from __future__ import annotations

import colorsys
import math
from collections.abc import Callable
from pathlib import Path

import numpy as np

IMAGENET_SIZES = ((500, 375), (375, 500), (500, 333), (333, 500), (500, 400), (400, 300), (640, 480))  # (W, H)
SHAPES = ("disc", "square", "triangle", "bar", "ring", "cross")


def _class_colour(c: int) -> tuple[int, int, int]:
    r, g, b = colorsys.hsv_to_rgb((c * 0.618034) % 1.0, 0.85, 0.95)
    return int(255 * r), int(255 * g), int(255 * b)


def _background(rng: np.random.Generator, w: int, h: int) -> np.ndarray:
    """A smooth random colour field (bilinear upsampling of a 4x4 grid) plus pixel noise."""
    from PIL import Image

    coarse = rng.integers(40, 215, size=(4, 4, 3), dtype=np.uint8)
    field = np.asarray(Image.fromarray(coarse).resize((w, h), Image.BILINEAR), dtype=np.float32)
    noise = rng.normal(0, 12, size=(h, w, 1)).astype(np.float32)
    return np.clip(field + noise, 0, 255).astype(np.uint8)


def _draw_shape(draw, shape: str, cx: float, cy: float, r: float, angle: float, colour) -> None:
    if shape == "disc":
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=colour)
    elif shape == "ring":
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], outline=colour, width=max(2, int(r / 3)))
    elif shape == "square":
        draw.regular_polygon((cx, cy, r), 4, rotation=angle, fill=colour)
    elif shape == "triangle":
        draw.regular_polygon((cx, cy, r), 3, rotation=angle, fill=colour)
    else:  # bar / cross: one or two thick strokes through the centre
        dirs = [angle] if shape == "bar" else [angle, angle + 90]
        for a in dirs:
            dx, dy = r * math.cos(math.radians(a)), r * math.sin(math.radians(a))
            draw.line([cx - dx, cy - dy, cx + dx, cy + dy], fill=colour, width=max(3, int(r / 2.5)))


def synth_image(c: int, num_classes: int, size: tuple[int, int], rng: np.random.Generator):
    """One PIL image of class ``c`` at ``size = (W, H)``."""
    from PIL import Image, ImageDraw

    w, h = size
    im = Image.fromarray(_background(rng, w, h))
    draw = ImageDraw.Draw(im)
    colour = _class_colour(c)
    shape = SHAPES[c % len(SHAPES)]
    for _ in range(int(rng.integers(1, 4))):
        r = float(rng.uniform(0.12, 0.3)) * min(w, h)
        cx, cy = float(rng.uniform(r, w - r)), float(rng.uniform(r, h - r))
        jitter = tuple(int(np.clip(v + rng.integers(-20, 21), 0, 255)) for v in colour)
        _draw_shape(draw, shape, cx, cy, r, float(rng.uniform(0, 360)), jitter)
    return im


def synthesize(
    out: str | Path,
    *,
    num_classes: int = 10,
    train_per_class: int = 100,
    val_per_class: int = 20,
    size: tuple[int, int] | None = None,
    quality: int = 90,
    seed: int = 0,
    log: Callable[[str], None] = print,
    force: bool = False,
) -> dict:
    """Write the folder (see the module docstring); ``size=(W, H)`` fixes the size (else ImageNet's mix).
    Returns a summary: counts, sizes, bytes written. ``out`` is owned for the whole write
    (:class:`vitlab.common.rundir.RunLock`): a second writer into it is refused with one line naming this one;
    ``log`` receives the lock's notes. A folder that holds ``train/`` or ``val/`` already is refused, unless
    ``force`` moves them aside (a new set never mixes with an old one's classes)."""
    from ..common.rundir import RunLock

    if num_classes < 2 or train_per_class < 1 or val_per_class < 0:
        raise ValueError(f"need >= 2 classes and >= 1 training image per class, got {num_classes}, {train_per_class}")
    if not 1 <= quality <= 100:
        raise ValueError(f"JPEG quality must be in 1..100, got {quality}")
    out = Path(out).expanduser()
    with RunLock(out, "vitlab data synth", log) as lock:
        lock.make_room(["train", "val"], force)
        return _write(out, num_classes, train_per_class, val_per_class, size, quality, seed)


def _write(out: Path, num_classes: int, train_per_class: int, val_per_class: int, size: tuple[int, int] | None,
           quality: int, seed: int) -> dict:  # fmt: skip
    from ..common.io import atomic_open

    total_bytes, count = 0, 0
    for split, per_class in (("train", train_per_class), ("val", val_per_class)):
        for c in range(num_classes):
            folder = out / split / f"n{c:08d}"
            folder.mkdir(parents=True, exist_ok=True)
            for k in range(per_class):
                rng = np.random.default_rng([seed, c, k, split == "val"])
                dims = size or IMAGENET_SIZES[int(rng.integers(len(IMAGENET_SIZES)))]
                path = folder / f"{split}_{c:04d}_{k:06d}.JPEG"
                with atomic_open(path, "wb") as f:
                    synth_image(c, num_classes, dims, rng).save(f, "JPEG", quality=quality)
                total_bytes += path.stat().st_size
                count += 1
    return {"root": str(out), "classes": num_classes, "images": count, "bytes": total_bytes}
