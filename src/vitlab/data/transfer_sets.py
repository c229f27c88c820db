"""The transfer sets of the papers' fine-tuning tables, read in the layouts their publishers distribute:

- ``cifar100:<folder>``: ``cifar-100-python`` (``train``, ``test``, ``meta``: python pickles of
  ``{b"data": uint8 (N, 3072), b"fine_labels": [...], b"coarse_labels": [...]}``, read with the restricted
  unpickler of :mod:`.readers`), the 100 fine classes, in memory; the class names (``meta``) travel with the
  data into a run's checkpoint, as a folder's do;
- ``pets:<folder>``: Oxford-IIIT Pets (``images/<Breed>_<n>.jpg``, ``annotations/trainval.txt`` and
  ``annotations/test.txt`` with lines ``<image> <class id 1..37> <species> <breed id>``), streamed;
- ``flowers102:<folder>``: Oxford Flowers-102 (``jpg/image_NNNNN.jpg``, ``imagelabels.mat`` with ``labels``
  1..102 per image, ``setid.mat`` with ``trnid``, ``valid``, ``tstid``: the official train / validation / test
  ids), streamed; ``train`` is the official train and validation parts together, as the fine-tuning papers use
  them, ``val``/``test`` the test part.

Each takes the folder its archives were extracted into or the folder they unpack to (``cifar-100-python/``,
torchvision's ``oxford-iiit-pet/`` and ``flowers-102/``; Pets' ``images/`` or ``annotations/`` and Flowers'
``jpg/`` name their parent). The streamed sets are :class:`~vitlab.data.sources.FolderSource` file lists
(decoded per sample in DataLoader workers, as ``folder:`` data). Every image a split file or ``setid.mat``
names is checked when the list is made: it must lie inside the dataset folder (no ``..``, no absolute path, no
symlink out of it) and be a regular file (a named pipe would block a reader forever); an image listed twice
with two classes is refused. Every problem is one line naming the file and what to do.
"""

from __future__ import annotations

import io
import os
import re
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch

from .datasets import ImageDataset
from .readers import read_cifar_arrays, read_label_names
from .safe_files import DataFileError, check_regular, inside_root, read_regular
from .sources import FileList, FolderSource

CIFAR100_FIX = "download the complete cifar-100-python folder (python version) from www.cs.toronto.edu/~kriz"
PETS_FIX = "extract images.tar.gz and annotations.tar.gz of Oxford-IIIT Pets into one folder"
FLOWERS_FIX = "put 102flowers.tgz's jpg/ folder, imagelabels.mat and setid.mat of Oxford Flowers-102 in one folder"
CIFAR100_MEAN, CIFAR100_STD = (0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)
CIFAR100_LAYOUT = "train, test and meta, or a cifar-100-python/ folder holding them"
PETS_LAYOUT = "images/<Breed>_<n>.jpg and annotations/trainval.txt, annotations/test.txt"
FLOWERS_LAYOUT = "jpg/image_NNNNN.jpg, imagelabels.mat and setid.mat"
# the subfolder each set's archive (or torchvision's download) unpacks to, looked for inside the given folder
CIFAR100_SUBFOLDER = "cifar-100-python"
PETS_SUBFOLDER = "oxford-iiit-pet"
FLOWERS_SUBFOLDERS = ("flowers-102", "102flowers")
PETS_CLASSES, FLOWERS_CLASSES = 37, 102
SPLIT_FILE_LIMIT = 64 << 20  # Pets' split files hold ~100 kB; a larger one is not a split file
MAT_LIMIT = 64 << 20  # Flowers' .mat files hold ~100 kB


def _folder(root: str | Path, what: str, fix: str) -> Path:
    root = Path(root).expanduser()
    if not root.is_dir():
        if root.exists():
            raise DataFileError(f"{what} path {root} is not a folder; {fix}")
        raise FileNotFoundError(f"{what} folder {root} does not exist; {fix}")
    return root


def _part(split: str) -> str:
    if split not in ("train", "val", "test"):
        raise ValueError(f"split must be 'train' or 'test' (val: the same), got {split!r}")
    return "train" if split == "train" else "test"


def _find_root(
    root: Path, candidates: Sequence[Path], marker: Callable[[Path], bool], what: str, layout: str, fix: str
) -> Path:
    """The first of ``candidates`` (the given folder, the subfolder its archive unpacks to, the parent of a
    folder the archive holds) where ``marker(folder)`` holds; else one line naming the expected layout."""
    for folder in candidates:
        if marker(folder):
            return folder
    others = ", ".join(str(c) for c in candidates[1:])
    raise FileNotFoundError(f"{what} folder {root} (nor {others}) holds {layout}; {fix}")


# ------------------------------------------------------------------------------------------------- CIFAR-100
def cifar100(root: str | Path, split: str = "train") -> ImageDataset:
    """CIFAR-100 (fine labels) from a ``cifar-100-python`` folder or its parent: ``train`` or ``test``, named
    by the class names of ``meta`` (without them, a warning says why, the classes are unnamed)."""
    root = _folder(root, "CIFAR-100", CIFAR100_FIX)
    part = _part(split)
    folder = _find_root(
        root,
        [root, root / CIFAR100_SUBFOLDER],
        lambda f: (f / part).exists(),
        "CIFAR-100",
        f"no '{part}' file: expected {CIFAR100_LAYOUT}",
        CIFAR100_FIX,
    )
    path = folder / part
    data, labels = read_cifar_arrays(path, "CIFAR-100 file", "fine_labels", 100, CIFAR100_FIX)
    names = read_label_names(folder / "meta", "CIFAR-100 meta file", "fine_label_names", 100, CIFAR100_FIX, False)
    return ImageDataset(
        torch.from_numpy(data.copy()),
        torch.from_numpy(labels),
        100,
        CIFAR100_MEAN,
        CIFAR100_STD,
        names,
        f"cifar100-{part}",
        str(path),
    )


# ------------------------------------------------------------------------------------------- Oxford-IIIT Pets
def _pets_root(root: str | Path) -> Path:
    root = _folder(root, "Oxford-IIIT Pets", PETS_FIX)
    candidates = [root, root / PETS_SUBFOLDER] + ([root.parent] if root.name in ("images", "annotations") else [])
    return _find_root(
        root,
        candidates,
        lambda f: (f / "annotations").is_dir() and (f / "images").is_dir(),
        "Oxford-IIIT Pets",
        f"no images/ and annotations/ folders: expected {PETS_LAYOUT}",
        PETS_FIX,
    )


def oxford_pets(root: str | Path, split: str = "train") -> FolderSource:
    """Oxford-IIIT Pets: the 37 breeds, ``train`` = ``trainval.txt``, ``test`` = ``test.txt``; class names
    from the image names (``Abyssinian_100`` -> ``Abyssinian``), in the order of their ids. An image listed
    twice with one class is kept once (a warning counts them); with two classes it is refused."""
    root = _pets_root(root)
    listing = root / "annotations" / ("trainval.txt" if _part(split) == "train" else "test.txt")
    text = read_regular(listing, "Oxford-IIIT Pets split file", PETS_FIX, SPLIT_FILE_LIMIT)
    names: dict[int, str] = {}
    seen: dict[str, tuple[int, int]] = {}  # image file -> (label, line number)
    paths, labels, repeated = [], [], 0
    for number, line in enumerate(text.decode("utf-8", errors="replace").splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        where = f"{listing} line {number}"
        fields_ = line.split()
        # digits only, and few of them: int() of '²' or of 5,000 digits would raise a bare ValueError
        if len(fields_) < 2 or not re.fullmatch(r"[0-9]{1,3}", fields_[1]) or not 1 <= int(fields_[1]) <= PETS_CLASSES:
            raise DataFileError(f"{where}: expected '<image> <class id 1..{PETS_CLASSES}> ...'; {PETS_FIX}")
        image, label = fields_[0], int(fields_[1]) - 1
        inside_root(root / "images", f"{image}.jpg", where, PETS_FIX)  # no '..', no absolute path, no symlink out
        rel = os.path.normpath(f"images/{image}.jpg")  # one key per file, however the line spells it
        if rel in seen:
            first_label, first = seen[rel]
            if first_label != label:
                raise DataFileError(
                    f"{where} lists {image} as class {label + 1}, line {first} as class {first_label + 1}: an image "
                    f"has one class; correct {listing.name} or extract annotations.tar.gz again"
                )
            repeated += 1
            continue
        seen[rel] = (label, number)
        names.setdefault(label, Path(rel).stem.rsplit("_", 1)[0])
        paths.append(rel)
        labels.append(label)
    if not paths:
        raise DataFileError(f"{listing} lists no images; {PETS_FIX}")
    if repeated:
        warnings.warn(f"{listing} lists {repeated} image(s) more than once with the same class; each is read once",
                      stacklevel=2)  # fmt: skip
    _check_files(root, paths, "Oxford-IIIT Pets image", PETS_FIX)
    classes = [names.get(i, f"class_{i + 1}") for i in range(PETS_CLASSES)]
    return FolderSource(root, FileList(paths, labels), classes, f"pets-{_part(split)}")


# ------------------------------------------------------------------------------------------------ Flowers-102
def _flowers_root(root: str | Path) -> Path:
    root = _folder(root, "Flowers-102", FLOWERS_FIX)
    candidates = [root] + [root / s for s in FLOWERS_SUBFOLDERS] + ([root.parent] if root.name == "jpg" else [])
    return _find_root(
        root,
        candidates,
        lambda f: (f / "imagelabels.mat").exists(),
        "Flowers-102",
        f"no imagelabels.mat: expected {FLOWERS_LAYOUT}",
        FLOWERS_FIX,
    )


def flowers102(root: str | Path, split: str = "train") -> FolderSource:
    """Oxford Flowers-102: ``train`` = the official train + validation ids, ``test`` = the test ids.

    ``imagelabels.mat``'s ``labels`` must be a vector of integers 1..102, one per ``jpg/image_NNNNN.jpg``;
    ``setid.mat``'s ``trnid``, ``valid`` and ``tstid`` vectors of image numbers, none twice and none both in
    training and test."""
    from ..common.extras import require

    sio = require("scipy.io", "reading Flowers-102's imagelabels.mat and setid.mat", "data")
    root = _flowers_root(root)
    labels_path, ids_path = root / "imagelabels.mat", root / "setid.mat"
    labels_all = _mat_vectors(sio, labels_path, ("labels",), FLOWERS_CLASSES)["labels"]
    images = _count_images(root / "jpg")
    if images != len(labels_all):
        raise DataFileError(
            f"{labels_path} labels {len(labels_all)} images but {root / 'jpg'} holds {images} image_NNNNN.jpg "
            f"files: labels and images must match; {FLOWERS_FIX}"
        )
    ids = _mat_vectors(sio, ids_path, ("trnid", "valid", "tstid"), len(labels_all))
    train_ids, test_ids = np.concatenate([ids["trnid"], ids["valid"]]), ids["tstid"]
    for name, part in (("trnid and valid", train_ids), ("tstid", test_ids)):
        values, counts = np.unique(part, return_counts=True)
        if (counts > 1).any():
            raise DataFileError(f"{ids_path} lists image {int(values[counts > 1][0])} twice in {name}; {FLOWERS_FIX}")
    both = np.intersect1d(train_ids, test_ids)
    if len(both):
        raise DataFileError(
            f"{ids_path} lists image {int(both[0])} in both the training (trnid, valid) and the test ids (tstid) "
            f"({len(both)} in all): test accuracy would count training images; {FLOWERS_FIX}"
        )
    chosen = train_ids if _part(split) == "train" else test_ids
    labels = labels_all[chosen - 1] - 1
    paths = [f"jpg/image_{i:05d}.jpg" for i in chosen.tolist()]
    for p in paths:
        inside_root(root, p, f"{ids_path}", FLOWERS_FIX)  # jpg/ may be a link; an image linking out is refused
    _check_files(root, paths, "Flowers-102 image", FLOWERS_FIX)
    classes = [f"flower_{i + 1}" for i in range(FLOWERS_CLASSES)]
    return FolderSource(root, FileList(paths, labels), classes, f"flowers102-{split}")


def _count_images(folder: Path) -> int:
    """The ``image_NNNNN.jpg`` entries of Flowers' ``jpg/`` folder."""
    if not folder.is_dir():
        raise FileNotFoundError(f"Flowers-102 image folder {folder} does not exist: expected {FLOWERS_LAYOUT}; "
                                f"{FLOWERS_FIX}")  # fmt: skip
    with os.scandir(folder) as entries:
        return sum(1 for e in entries if re.fullmatch(r"image_[0-9]+\.jpg", e.name))


def _mat_vectors(sio, path: Path, keys: Sequence[str], high: int) -> dict[str, np.ndarray]:
    """Vectors of integers ``1..high`` from a MATLAB file (``loadmat``: numeric arrays only, nothing executed)."""
    raw = read_regular(path, "Flowers-102 file", FLOWERS_FIX, MAT_LIMIT)
    try:
        found = sio.loadmat(io.BytesIO(raw), variable_names=list(keys))
    except Exception as e:  # a damaged file: scipy's many error types
        raise DataFileError(f"{path} is not a readable MATLAB file ({type(e).__name__}); {FLOWERS_FIX}") from None
    return {key: _vector(found.get(key), path, key, high) for key in keys}


def _vector(value: object, path: Path, key: str, high: int) -> np.ndarray:
    expected = f"'{key}' must be a vector of integers 1..{high}"
    if not isinstance(value, np.ndarray) or value.dtype.kind not in "iuf":
        got = "nothing" if value is None else f"a {getattr(value, 'dtype', type(value).__name__)} value"
        raise DataFileError(f"{path}: {expected}, found {got}; {FLOWERS_FIX}")
    if value.ndim > 2 or value.size != max(value.shape, default=0) or value.size == 0:
        shape = "x".join(str(s) for s in value.shape) or "scalar"
        raise DataFileError(f"{path}: {expected}, found a {shape} array; {FLOWERS_FIX}")
    flat = value.reshape(-1)
    if value.dtype.kind == "f":
        bad = ~np.isfinite(flat) | (flat != np.round(flat))
        if bad.any():
            raise DataFileError(f"{path}: {expected}, found {flat[bad][0]}; {FLOWERS_FIX}")
    outside = (flat < 1) | (flat > high)  # compared as stored: a huge float never reaches an int64 cast
    if outside.any():
        raise DataFileError(f"{path}: {expected}, found {flat[outside][0]}; {FLOWERS_FIX}")
    return flat.astype(np.int64)


def _check_files(root: Path, paths: list[str], what: str, fix: str) -> None:
    """Every listed image is a regular file (a missing one, or a pipe or device in its place, is one line)."""
    for p in paths:
        check_regular(root / p, what, fix)
