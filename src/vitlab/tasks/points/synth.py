"""Small generated point-cloud sets in the real distribution layouts (for tests and quick runs).

ModelNet40 (HDF5): shapes of a few kinds - points on a sphere, a cube's surface, a cylinder, a cone - with a
random size and noise, the kind being the class (labels 0..classes-1 of the 40). ShapeNet-Part (text): shapes of
a category made of its parts placed along the height, each point's part id beside it.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ...common.extras import require
from ...common.io import atomic_path
from .data import SHAPENET_PARTS, part_ranges

SYNSETS = ("02691156", "02773838", "02954340", "02958343", "03001627", "03261776", "03467517", "03624134",
           "03636649", "03642806", "03790512", "03797390", "03948459", "04099429", "04225943", "04379243")  # fmt: skip


def shape_points(rng: np.random.Generator, kind: int, n: int) -> np.ndarray:
    """``n`` points on the surface of shape ``kind`` (0 sphere, 1 cube, 2 cylinder, 3 cone, then stretched)."""
    u = rng.normal(size=(n, 3))
    if kind % 4 == 0:
        p = u / np.linalg.norm(u, axis=1, keepdims=True)
    elif kind % 4 == 1:
        p = u / np.abs(u).max(1, keepdims=True)
    else:
        angle, h = rng.uniform(0, 2 * np.pi, n), rng.uniform(-1, 1, n)
        r = np.ones(n) if kind % 4 == 2 else (1 - h) / 2
        p = np.stack([r * np.cos(angle), r * np.sin(angle), h], 1)
    p = p * (1 + kind // 4) ** np.array([1.0, 0.5, 0.25])  # further kinds: stretched copies
    return (p * rng.uniform(0.6, 1.0) + rng.normal(0, 0.02, size=p.shape)).astype(np.float32)


def make_modelnet40(root: str | Path, train: int = 64, test: int = 32, points: int = 256, classes: int = 4,
                    seed: int = 0) -> Path:  # fmt: skip
    """``ply_data_train0.h5``, ``ply_data_test0.h5``, their lists ``train_files.txt`` and ``test_files.txt``, and
    ``shape_names.txt`` under ``root`` (needs h5py)."""
    h5py = require("h5py", "writing ModelNet40's HDF5 files", extra="points")
    root, rng = Path(root), np.random.default_rng(seed)
    root.mkdir(parents=True, exist_ok=True)
    for split, count in (("train", train), ("test", test)):
        labels = np.arange(count) % classes
        data = np.stack([shape_points(rng, int(k), points) for k in labels])
        with atomic_path(root / f"ply_data_{split}0.h5") as tmp, h5py.File(tmp, "w") as h5:
            h5.create_dataset("data", data=data)
            h5.create_dataset("label", data=labels.astype(np.uint8)[:, None])
        with atomic_path(root / f"{split}_files.txt") as tmp:  # the official list, with its paths as it writes them
            tmp.write_text(f"data/modelnet40_ply_hdf5_2048/ply_data_{split}0.h5\n")
    with atomic_path(root / "shape_names.txt") as tmp:
        tmp.write_text("".join(f"shape{k}\n" for k in range(40)))
    return root


def make_shapenet_part(root: str | Path, per_split: int = 6, points: int = 128, categories: int = 3,
                       seed: int = 0) -> Path:  # fmt: skip
    """The ShapeNet-Part text layout under ``root``: shapes of the first ``categories`` categories."""
    root, rng = Path(root), np.random.default_rng(seed)
    (root / "train_test_split").mkdir(parents=True, exist_ok=True)
    with atomic_path(root / "synsetoffset2category.txt") as tmp:
        tmp.write_text("".join(f"{name}\t{s}\n" for (name, _), s in zip(SHAPENET_PARTS, SYNSETS)))
    for split in ("train", "val", "test"):
        entries = []
        for i in range(per_split):
            c = i % categories
            parts = part_ranges()[c]
            xyz = rng.uniform(-1, 1, size=(points, 3)).astype(np.float32)
            band = np.clip(((xyz[:, 2] + 1) / 2 * len(parts)).astype(int), 0, len(parts) - 1)
            rows = np.concatenate([xyz, np.zeros_like(xyz), (parts.start + band)[:, None]], 1)
            (root / SYNSETS[c]).mkdir(exist_ok=True)
            name = f"{split}{i:04d}"
            with atomic_path(root / SYNSETS[c] / f"{name}.txt") as tmp:
                np.savetxt(tmp, rows, fmt="%.5f")
            entries.append(f"shape_data/{SYNSETS[c]}/{name}")
        with atomic_path(root / "train_test_split" / f"shuffled_{split}_file_list.json") as tmp:
            tmp.write_text(json.dumps(entries))
    return root
