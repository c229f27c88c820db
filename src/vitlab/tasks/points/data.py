"""Point-cloud data in the layouts the benchmarks are distributed in, read into memory.

``modelnet40:ROOT`` - the HDF5 distribution of ModelNet40 (``modelnet40_ply_hdf5_2048``): ``ply_data_train<i>.h5``
and ``ply_data_test<i>.h5``, each with ``data`` (M, 2048, 3) float32 and ``label`` (M, 1) class indices 0..39;
``train_files.txt`` / ``test_files.txt`` list the part files of each split (when absent, the files matching
``ply_data_<split>*.h5`` are read) and ``shape_names.txt`` names the classes. ``ROOT`` may be that folder or the
one holding it (where ``modelnet40_ply_hdf5_2048.zip`` unpacks). Reading it needs h5py
(``pip install 'vitlab[points]'``).

``shapenetpart:ROOT`` - ShapeNet-Part (``shapenetcore_partanno_segmentation_benchmark_v0_normal``, or the folder
holding it): ``synsetoffset2category.txt`` (category name, synset id per line), ``<synset>/<shape>.txt`` with one
point per line (x y z nx ny nz part), part ids 0..49 numbered over all 16 categories, and
``train_test_split/shuffled_{train,val,test}_file_list.json`` listing ``shape_data/<synset>/<shape>``. Plain
text: no extra package.

What a file names is resolved inside the dataset folder (a name with ``../`` is refused), and only regular files
are opened (a named pipe would block the reader). An HDF5 part is read only from itself: a ``data`` or ``label``
that is a link (external or soft), a virtual dataset or one with external raw storage would read other files
(or, their source missing, zeros), and is refused; so is one whose decoded size passes :data:`PART_LIMIT`
(a small compressed file can unpack to gigabytes) or that was never written. Coordinates must be finite,
labels whole numbers in range. Each refusal is one line naming the file and what to do.

Each set is a :class:`PointSet`: ``points`` (M, N, 3), ``labels`` (M,) (the class; ShapeNet-Part: the object
category), and for ShapeNet-Part ``parts`` (M, N); its batches carry the category as a fourth channel of the
points, which :class:`~vitlab.tasks.points.PartSegmenter` reads. Training batches are augmented as PCT's recipe (one
random scale in [2/3, 3/2] and a shift in [-0.2, 0.2] per axis per shape): :func:`augment`, drawn from the
loader's per-batch generator. PCT also shuffles the points; these models see every point and are indifferent
to their order, so the shuffle is left out.
"""

from __future__ import annotations

import io
import json
import math
import warnings
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np
import torch
from torch import Tensor

from ...common.extras import require
from ...data.safe_files import MAX_UNPACKED_BYTES, DataFileError, inside_root, open_regular, read_regular

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


NESTED = {
    "modelnet40": "modelnet40_ply_hdf5_2048",
    "shapenetpart": "shapenetcore_partanno_segmentation_benchmark_v0_normal",
}
EXPECTED = {
    "modelnet40": "ply_data_{train,test}<i>.h5 beside train_files.txt, test_files.txt and shape_names.txt (the "
    "modelnet40_ply_hdf5_2048 folder), or the folder holding modelnet40_ply_hdf5_2048/ (where "
    "modelnet40_ply_hdf5_2048.zip unpacks)",
    "shapenetpart": "synsetoffset2category.txt, train_test_split/ and one folder per synset (the "
    "shapenetcore_partanno_segmentation_benchmark_v0_normal folder), or the folder holding it",
}
MODELNET_FIX = "re-extract modelnet40_ply_hdf5_2048.zip, or remove the file and its line in {split}_files.txt"
SHAPENET_FIX = "re-extract the ShapeNet-Part archive, or remove the shape from the split lists"
#: the most a ModelNet40 part file's ``data`` may decode to: the real parts hold 50 MB, and reading keeps about
#: three copies of a part (its values, as float32, joined with the others) - a quarter of the unpacking bound
PART_LIMIT = MAX_UNPACKED_BYTES // 4
TEXT_LIMIT = 64 << 20  # a split list or one shape's text file (the real ones: at most a few MB)


def _own_layout(root: Path, kind: str) -> bool:
    if kind == "modelnet40":
        return any(root.glob("ply_data_*.h5")) or (root / "train_files.txt").exists()
    return (root / "synsetoffset2category.txt").exists()


def parse_point_spec(text: str) -> tuple[str, Path]:
    """``modelnet40:ROOT`` / ``shapenetpart:ROOT`` -> (layout, dataset folder): ``ROOT`` itself, or the folder
    the layout's archive unpacked inside it; ValueError naming the expected layout."""
    kind, sep, rest = text.partition(":")
    if not sep or kind not in LAYOUTS:
        raise ValueError(f"point data {text!r}: give {SPEC_HELP}")
    root = Path(rest)
    if not root.is_dir():
        raise ValueError(f"point data {text!r}: {root} is not a folder")
    for candidate in (root, root / NESTED[kind]):
        if candidate.is_dir() and _own_layout(candidate, kind):
            return kind, candidate
    raise ValueError(f"point data {text!r}: {root} is not in the {kind} layout; expected {EXPECTED[kind]}")


def _text(path: Path, what: str, fix: str, limit: int = TEXT_LIMIT) -> str:
    """The UTF-8 text of a regular file of at most ``limit`` bytes; else one line."""
    data = read_regular(path, what, fix, limit)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise DataFileError(f"{what} {path} is not UTF-8 text; {fix}") from None


def modelnet40_files(root: Path, split: str) -> list[Path]:
    """The part files of ``split``: those ``{split}_files.txt`` lists (each taken by its name inside ``root``:
    the official list writes ``data/modelnet40_ply_hdf5_2048/ply_data_train0.h5``), else ``ply_data_{split}*.h5``."""
    listing = root / f"{split}_files.txt"
    fix = MODELNET_FIX.format(split=split)
    if not listing.exists():
        found: list[Path] = []
        for p in sorted(root.glob(f"ply_data_{split}*.h5")):
            if not p.name.isprintable():  # a line break in a file name would split every message naming it
                raise DataFileError(f"ModelNet40 file {str(p)!r} has a control character in its name; {fix}")
            found.append(inside_root(root, p.name, f"ModelNet40 folder {root}", fix))
        if not found:
            raise FileNotFoundError(f"no ply_data_{split}*.h5 nor {split}_files.txt in {root}; expected "
                                    f"{EXPECTED['modelnet40']}")  # fmt: skip
        return found
    files: list[Path] = []
    for n, line in enumerate(_text(listing, "ModelNet40 file list", fix).splitlines(), 1):
        name = line.strip()
        if not name:
            continue
        what = f"ModelNet40 file list {listing} line {n}"
        inside_root(root, name, what, "it names the part files of the modelnet40_ply_hdf5_2048 folder")
        path = inside_root(root, PurePosixPath(name).name, what, fix)
        if path in files:  # one part read twice would weigh its shapes double
            raise DataFileError(f"{what} names {name!r} a second time; {fix}")
        files.append(path)
    if not files:
        raise DataFileError(f"ModelNet40 file list {listing} names no file; {fix}")
    return files


def _read_array(h5: Any, path: Path, name: str, what: str, fix: str, limit: int) -> np.ndarray:
    """The values of the dataset ``name`` of the open HDF5 file ``h5``, read from that file only (module
    docstring); numbers only, at most ``limit`` bytes decoded."""
    import h5py

    link = h5.get(name, getlink=True)
    if link is None:
        raise DataFileError(f"{what} {path} has no dataset {name!r}; {fix}")
    if not isinstance(link, h5py.HardLink):
        kind = "an external link" if isinstance(link, h5py.ExternalLink) else "a soft link"
        raise DataFileError(f"{what} {path}: {name!r} is {kind}, which would read another file; {fix}")
    dset = h5[name]
    if not isinstance(dset, h5py.Dataset):
        raise DataFileError(f"{what} {path}: {name!r} is a group, not a dataset; {fix}")
    if dset.is_virtual or dset.external:
        kind = "a virtual dataset" if dset.is_virtual else "a dataset with external storage"
        raise DataFileError(f"{what} {path}: {name!r} is {kind}, which reads other files; {fix}")
    if dset.shape is None:
        raise DataFileError(f"{what} {path}: {name!r} is an empty (null) dataset; {fix}")
    if dset.dtype.kind not in "iuf":
        raise DataFileError(f"{what} {path}: {name!r} holds {dset.dtype} values, not numbers; {fix}")
    size = math.prod(dset.shape or ()) * dset.dtype.itemsize
    if size > limit:
        raise DataFileError(
            f"{what} {path}: {name!r} {tuple(dset.shape)} {dset.dtype} unpacks to {size >> 20} MiB, more than "
            f"{limit >> 20} MiB: damaged or hostile (raise VITLAB_MAX_UNPACKED_BYTES if it is real); {fix}"
        )
    # an unwritten dataset (or chunk) reads as its fill value: zeros that would train without a word
    if dset.chunks is None:
        written = dset.id.get_storage_size() >= size or dset.size == 0
    else:
        want = math.prod(-(-n // c) for n, c in zip(dset.shape, dset.chunks))
        written = dset.id.get_num_chunks() >= want
    if not written:
        raise DataFileError(f"{what} {path}: {name!r} was never (fully) written: it would read as zeros; {fix}")
    return np.asarray(dset[()])


def _read_part(path: Path, split: str, limit: int) -> tuple[np.ndarray, np.ndarray]:
    """``data`` (M, N, 3) float32 and ``label`` (M,) int64 of one ModelNet40 part file, checked."""
    h5py = require("h5py", "reading ModelNet40's HDF5 files", extra="points")
    what, fix = "ModelNet40 file", MODELNET_FIX.format(split=split)
    with open_regular(path, what, fix) as f:
        try:
            with h5py.File(f, "r") as h5:  # read through the checked descriptor: no second open by name
                points = _read_array(h5, path, "data", what, fix, limit)
                labels = _read_array(h5, path, "label", what, fix, limit)
        except (DataFileError, MemoryError):
            raise
        except Exception as e:  # h5py and HDF5 raise OSError, KeyError, ValueError, TypeError on damaged files
            detail = " ".join(f"{type(e).__name__}: {e}".split())[:160]
            raise DataFileError(f"{what} {path} cannot be read as HDF5 ({detail}); {fix}") from None
    if points.ndim != 3 or points.shape[-1] != 3 or points.shape[1] == 0:
        raise DataFileError(f"{what} {path}: 'data' must be (M, N, 3) points, got {points.shape}; {fix}")
    if labels.size != len(points) or labels.ndim not in (1, 2):
        raise DataFileError(
            f"{what} {path}: 'label' {labels.shape} must hold one label per shape ((M, 1) or (M,)) for the "
            f"{len(points)} shapes of 'data'; {fix}"
        )
    with np.errstate(over="ignore"):  # a float64 beyond float32's range becomes inf: refused below
        points = points.astype(np.float32, copy=False)
    bad = ~np.isfinite(points).all(axis=(1, 2))
    if bad.any():
        raise DataFileError(f"{what} {path}: shape {int(np.argmax(bad))} has a NaN or infinite coordinate; {fix}")
    return points, _class_labels(labels.reshape(-1), 40, f"{what} {path}", fix)


def _class_labels(labels: np.ndarray, classes: int, what: str, fix: str) -> np.ndarray:
    """``labels`` as int64 when every one is a whole number in ``0..classes-1``; else one line naming the first."""
    ok = np.isfinite(labels) & (labels == np.round(labels)) & (labels >= 0) & (labels < classes)
    if not ok.all():
        i = int(np.argmax(~ok))
        raise DataFileError(f"{what}: label {labels[i].item()!r} (entry {i}) is not a class 0..{classes - 1}; {fix}")
    return labels.astype(np.int64)


def read_modelnet40(root: Path, split: str) -> PointSet:
    """The ``train`` or ``test`` split of the ModelNet40 HDF5 distribution under ``root``."""
    require("h5py", "reading ModelNet40's HDF5 files", extra="points")
    points, labels, total = [], [], 0
    for path in modelnet40_files(root, split):
        pts, lab = _read_part(path, split, min(PART_LIMIT, MAX_UNPACKED_BYTES - total))
        if points and pts.shape[1] != points[0].shape[1]:
            raise DataFileError(
                f"ModelNet40 file {path} holds {pts.shape[1]} points per shape, the split's first file "
                f"{points[0].shape[1]}; {MODELNET_FIX.format(split=split)}"
            )
        total += pts.nbytes
        points.append(pts)
        labels.append(lab)
    pts, lab = torch.from_numpy(np.concatenate(points)), torch.from_numpy(np.concatenate(labels))
    if not len(lab):
        raise DataFileError(
            f"the ModelNet40 {split} split in {root} holds no shape; {MODELNET_FIX.format(split=split)}"
        )
    return PointSet(pts, lab, 40, classes=modelnet40_classes(root), source=str(root))


def modelnet40_classes(root: Path) -> list[str] | None:
    """The 40 names of ``shape_names.txt``; None when it is absent or not 40 printable names."""
    try:
        names = _text(root / "shape_names.txt", "ModelNet40 class names", "it is optional", 1 << 20).split()
    except (ValueError, FileNotFoundError):
        return None  # the names only label the classes: numbers serve when the file is unusable
    return names if len(names) == 40 and all(n.isprintable() and len(n) <= 40 for n in names) else None


def _shapenet_synsets(root: Path) -> list[str]:
    """The synset ids of ``synsetoffset2category.txt``, in order (at most the 16 categories)."""
    path = root / "synsetoffset2category.txt"
    fix = "it lists a category name and its synset id per line (the ShapeNet-Part archive's own file)"
    synsets = []
    for n, line in enumerate(_text(path, "ShapeNet-Part category list", fix, 1 << 20).splitlines(), 1):
        if not line.strip():
            continue
        fields = line.split()
        if len(fields) != 2 or not fields[1].isalnum():
            raise DataFileError(f"ShapeNet-Part category list {path} line {n} is not 'name synset'; {fix}")
        synsets.append(fields[1])
    if not 0 < len(synsets) <= len(SHAPENET_PARTS) or len(set(synsets)) != len(synsets):
        raise DataFileError(
            f"ShapeNet-Part category list {path} names {len(synsets)} synsets (some twice?), not up to the "
            f"{len(SHAPENET_PARTS)} categories; {fix}"
        )
    return synsets


def _shapenet_rows(path: Path) -> np.ndarray:
    """The ``(P, C >= 4)`` float rows of one shape file (x y z [nx ny nz] part per line), checked."""
    what = "ShapeNet-Part shape"
    text = _text(path, what, SHAPENET_FIX)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "input contained no data": an empty file is refused just below
            rows = np.loadtxt(io.StringIO(text), dtype=np.float64, ndmin=2)
    except ValueError as e:
        detail = " ".join(str(e).split())[:160]
        raise DataFileError(f"{what} {path} is not rows of numbers ({detail}); {SHAPENET_FIX}") from None
    if rows.shape[0] == 0 or rows.shape[1] < 4:
        raise DataFileError(f"{what} {path} holds {rows.shape} values, not rows of x y z ... part; {SHAPENET_FIX}")
    with np.errstate(over="ignore"):  # a coordinate beyond float32's range becomes inf: refused as such
        bad = ~np.isfinite(rows[:, :3].astype(np.float32)).all(1)
    if bad.any():
        raise DataFileError(
            f"{what} {path}: point {int(np.argmax(bad))} has a NaN or infinite coordinate; {SHAPENET_FIX}"
        )
    return rows


def read_shapenet_part(root: Path, split: str, num_points: int = 2048) -> PointSet:
    """The ``train``/``val``/``test`` split of ShapeNet-Part under ``root``; every shape's first ``num_points``
    points after a fixed shuffle (the files hold 2-3 thousand points each; shorter ones are repeated)."""
    if split not in ("train", "val", "test"):
        raise ValueError(f"split must be train, val or test, got {split!r}")
    synsets = _shapenet_synsets(root)
    listing = root / "train_test_split" / f"shuffled_{split}_file_list.json"
    fix = "it lists 'shape_data/<synset>/<shape>' names (the ShapeNet-Part archive's own file)"
    try:
        entries = json.loads(_text(listing, "ShapeNet-Part split list", fix))
    except json.JSONDecodeError as e:
        raise DataFileError(
            f"ShapeNet-Part split list {listing} is not JSON ({e.msg}, line {e.lineno}); {fix}"
        ) from None
    if not isinstance(entries, list) or not entries:
        raise DataFileError(f"ShapeNet-Part split list {listing} is not a non-empty JSON list; {fix}")
    rng = np.random.default_rng(0)
    points, labels, parts = [], [], []
    for n, entry in enumerate(entries):
        what = f"ShapeNet-Part split list {listing} entry {n}"
        fields = entry.split("/") if isinstance(entry, str) else []
        if len(fields) != 3 or fields[1] not in synsets or not entry.isprintable():
            raise DataFileError(f"{what} is {entry!r}, not 'shape_data/<synset>/<shape>' of a listed synset; {fix}")
        path = inside_root(root / fields[1], f"{fields[2]}.txt", what, fix)
        rows = _shapenet_rows(path)
        part = rows[:, -1]
        ok = (part == np.round(part)) & (part >= 0) & (part < 50)
        if not ok.all():
            i = int(np.argmax(~ok))
            raise DataFileError(
                f"ShapeNet-Part shape {path}: point {i} has part {part[i].item()!r}, not 0..49; {SHAPENET_FIX}"
            )
        pick = np.resize(rng.permutation(len(rows)), num_points)
        points.append(rows[pick, :3].astype(np.float32))
        parts.append(part[pick].astype(np.int64))
        labels.append(synsets.index(fields[1]))
    names = [n for n, _ in SHAPENET_PARTS]
    return PointSet(torch.from_numpy(np.stack(points)), torch.tensor(labels), 16, torch.from_numpy(np.stack(parts)),
                    names, str(root))  # fmt: skip


def open_points(text: str, split: str) -> PointSet:
    """The ``split`` of point data ``text`` ("train", or "test"/"val" for the held-out part)."""
    if text.startswith("modelnet40:"):  # without h5py, say so before anything else
        require("h5py", "reading ModelNet40's HDF5 files", extra="points")
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
