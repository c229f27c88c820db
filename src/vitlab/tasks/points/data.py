"""Point-cloud data in the layouts the benchmarks are distributed in, read into memory.

``modelnet40:ROOT`` - the HDF5 distribution of ModelNet40 (``modelnet40_ply_hdf5_2048``): ``ply_data_train<i>.h5``
and ``ply_data_test<i>.h5``, each with ``data`` (M, 2048, 3) float32 and ``label`` (M, 1) class indices 0..39;
``shape_names.txt`` names the classes. Reading it needs h5py (``pip install 'vitlab[points]'``).

``shapenetpart:ROOT`` - ShapeNet-Part (``shapenetcore_partanno_segmentation_benchmark_v0_normal``):
``synsetoffset2category.txt`` (category name, synset id per line), ``<synset>/<shape>.txt`` with one point per
line (x y z nx ny nz part), part ids 0..49 numbered over all 16 categories, and
``train_test_split/shuffled_{train,val,test}_file_list.json`` listing ``shape_data/<synset>/<shape>``. Plain
text: no extra package.

Each set is a :class:`PointSet`: ``points`` (M, N, 3), ``labels`` (M,) (the class; ShapeNet-Part: the object
category), and for ShapeNet-Part ``parts`` (M, N); its batches carry the category as a fourth channel of the
points, which :class:`~vitlab.tasks.points.PartSegmenter` reads. Training batches are augmented as PCT's recipe (one
random scale in [2/3, 3/2] and a shift in [-0.2, 0.2] per axis per shape): :func:`augment`, drawn from the
loader's per-batch generator. PCT also shuffles the points; these models see every point and are indifferent
to their order, so the shuffle is left out.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from ...common.extras import require

#: the 16 ShapeNet-Part categories in their synset order, with their number of parts (50 in all, numbered in order)
SHAPENET_PARTS = (("Airplane", 4), ("Bag", 2), ("Cap", 2), ("Car", 4), ("Chair", 4), ("Earphone", 3), ("Guitar", 3),
                  ("Knife", 2), ("Lamp", 4), ("Laptop", 2), ("Motorbike", 6), ("Mug", 2), ("Pistol", 3),
                  ("Rocket", 3), ("Skateboard", 3), ("Table", 3))  # fmt: skip
LAYOUTS = ("modelnet40", "shapenetpart")
SPEC_HELP = "modelnet40:<root> (HDF5 files ply_data_{train,test}*.h5) or shapenetpart:<root>"


def part_ranges() -> list[range]:
    """Each category's part ids (ShapeNet-Part numbers the parts of all categories in one sequence)."""
    out, start = [], 0
    for _, n in SHAPENET_PARTS:
        out.append(range(start, start + n))
        start += n
    return out


@dataclass
class PointSet:
    """Point clouds of one split, in memory; ``get_batch`` serves :class:`vitlab.data.BatchLoader`."""

    points: Tensor  # float32 (M, N, 3)
    labels: Tensor  # int64 (M,)
    num_classes: int
    parts: Tensor | None = None  # int64 (M, N), part segmentation only
    classes: list[str] | None = None
    source: str = ""

    def __len__(self) -> int:
        return len(self.labels)

    @property
    def in_chans(self) -> int:
        return int(self.points.shape[-1])

    def get_batch(self, idx: Tensor) -> tuple[Tensor, Tensor]:
        """(points, classes); for part segmentation (points with the object category as a last channel, parts)."""
        if self.parts is None:
            return self.points[idx], self.labels[idx]
        pts = self.points[idx]
        category = self.labels[idx].to(pts.dtype)[:, None, None].expand(-1, pts.shape[1], 1)
        return torch.cat([pts, category], -1), self.parts[idx]


def parse_point_spec(text: str) -> tuple[str, Path]:
    kind, sep, rest = text.partition(":")
    if not sep or kind not in LAYOUTS:
        raise ValueError(f"point data {text!r}: give {SPEC_HELP}")
    root = Path(rest)
    if not root.is_dir():
        raise ValueError(f"point data {text!r}: {root} is not a folder")
    return kind, root


def read_modelnet40(root: Path, split: str) -> PointSet:
    """The ``train`` or ``test`` split of the ModelNet40 HDF5 distribution under ``root``."""
    h5py = require("h5py", "reading ModelNet40's HDF5 files", extra="points")
    files = sorted(root.glob(f"ply_data_{split}*.h5"))
    if not files:
        raise FileNotFoundError(f"no ply_data_{split}*.h5 in {root}: not the ModelNet40 HDF5 layout")
    points, labels = [], []
    for f in files:
        with h5py.File(f, "r") as h5:
            if "data" not in h5 or "label" not in h5:
                raise ValueError(f"{f}: needs the datasets 'data' (M, N, 3) and 'label' (M, 1)")
            points.append(np.asarray(h5["data"], dtype=np.float32))
            labels.append(np.asarray(h5["label"]).reshape(-1).astype(np.int64))
    names_file = root / "shape_names.txt"
    names = names_file.read_text().split() if names_file.is_file() else None
    pts, lab = torch.from_numpy(np.concatenate(points)), torch.from_numpy(np.concatenate(labels))
    if pts.dim() != 3 or pts.shape[-1] != 3 or len(pts) != len(lab):
        raise ValueError(f"{root}: 'data' must be (M, N, 3) beside 'label' (M, 1), got {tuple(pts.shape)}")
    if len(lab) and not 0 <= int(lab.min()) <= int(lab.max()) < 40:
        raise ValueError(f"{root}: labels must lie in [0, 40), got {int(lab.min())}..{int(lab.max())}")
    return PointSet(pts, lab, 40, classes=names, source=str(root))


def read_shapenet_part(root: Path, split: str, num_points: int = 2048) -> PointSet:
    """The ``train``/``val``/``test`` split of ShapeNet-Part under ``root``; every shape's first ``num_points``
    points after a fixed shuffle (the files hold 2-3 thousand points each; shorter ones are repeated)."""
    synsets = [line.split()[1] for line in (root / "synsetoffset2category.txt").read_text().splitlines() if line]
    listing = root / "train_test_split" / f"shuffled_{split}_file_list.json"
    if not listing.is_file():
        raise FileNotFoundError(f"{listing} is missing: not the ShapeNet-Part layout")
    rng = np.random.default_rng(0)
    points, labels, parts = [], [], []
    for entry in json.loads(listing.read_text()):
        _, synset, shape = entry.split("/")
        rows = np.loadtxt(root / synset / f"{shape}.txt", dtype=np.float32, ndmin=2)
        pick = rng.permutation(len(rows))
        pick = np.resize(pick, num_points)
        points.append(rows[pick, :3])
        parts.append(rows[pick, -1].astype(np.int64))
        labels.append(synsets.index(synset))
    part_t = torch.from_numpy(np.stack(parts))
    if int(part_t.max()) >= 50 or int(part_t.min()) < 0:
        raise ValueError(f"{root}: part ids must lie in [0, 50)")
    names = [n for n, _ in SHAPENET_PARTS]
    return PointSet(torch.from_numpy(np.stack(points)), torch.tensor(labels), 16, part_t, names, str(root))


def open_points(text: str, split: str) -> PointSet:
    """The ``split`` of point data ``text`` ("train", or "test"/"val" for the held-out part)."""
    kind, root = parse_point_spec(text)
    if kind == "modelnet40":
        return read_modelnet40(root, "train" if split == "train" else "test")
    return read_shapenet_part(root, split)


def augment(points: Tensor, g: torch.Generator) -> Tensor:
    """PCT's training augmentation of a batch ``(B, N, 3 [+ category])``: per shape a scale in [2/3, 3/2] and a
    shift in [-0.2, 0.2] per axis of the coordinates (a category channel is left as it is)."""
    b = points.shape[0]
    scale = torch.empty(b, 1, 3).uniform_(2 / 3, 3 / 2, generator=g).to(points.device)
    shift = torch.empty(b, 1, 3).uniform_(-0.2, 0.2, generator=g).to(points.device)
    return torch.cat([points[..., :3] * scale + shift, points[..., 3:]], -1)
