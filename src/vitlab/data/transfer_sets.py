"""The transfer sets of the papers' fine-tuning tables, read in the layouts their publishers distribute:

- ``cifar100:<folder>``: ``cifar-100-python`` (``train``, ``test``, ``meta``: python pickles of
  ``{b"data": uint8 (N, 3072), b"fine_labels": [...], b"coarse_labels": [...]}``, read with the restricted
  unpickler of :mod:`.readers`), the 100 fine classes, in memory;
- ``pets:<folder>``: Oxford-IIIT Pets (``images/<Breed>_<n>.jpg``, ``annotations/trainval.txt`` and
  ``annotations/test.txt`` with lines ``<image> <class id 1..37> <species> <breed id>``), streamed;
- ``flowers102:<folder>``: Oxford Flowers-102 (``jpg/image_NNNNN.jpg``, ``imagelabels.mat`` with ``labels``
  1..102 per image, ``setid.mat`` with ``trnid``, ``valid``, ``tstid``: the official train / validation / test
  ids), streamed; ``train`` is the official train and validation parts together, as the fine-tuning papers use
  them, ``val``/``test`` the test part.

The streamed sets are :class:`~vitlab.data.sources.FolderSource` file lists (decoded per sample in DataLoader
workers, as ``folder:`` data). Every problem is one line naming the file and what to do.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from .datasets import ImageDataset
from .readers import load_array_pickle
from .sources import FileList, FolderSource

CIFAR100_FIX = "download the complete cifar-100-python folder (python version) from www.cs.toronto.edu/~kriz"
PETS_FIX = "extract images.tar.gz and annotations.tar.gz of Oxford-IIIT Pets into one folder"
FLOWERS_FIX = "put 102flowers.tgz's jpg/ folder, imagelabels.mat and setid.mat of Oxford Flowers-102 in one folder"
CIFAR100_MEAN, CIFAR100_STD = (0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)


def _folder(root: str | Path, what: str, fix: str) -> Path:
    root = Path(root).expanduser()
    if not root.is_dir():
        raise FileNotFoundError(f"{what} folder {root} does not exist; {fix}")
    return root


def _part(split: str) -> str:
    if split not in ("train", "val", "test"):
        raise ValueError(f"split must be 'train' or 'test' (val: the same), got {split!r}")
    return "train" if split == "train" else "test"


def cifar100(root: str | Path, split: str = "train") -> ImageDataset:
    """CIFAR-100 (fine labels) from a ``cifar-100-python`` folder or its parent: ``train`` or ``test``."""
    root = _folder(root, "CIFAR-100", CIFAR100_FIX)
    folder = root / "cifar-100-python" if (root / "cifar-100-python").is_dir() else root
    path = folder / _part(split)
    d = load_array_pickle(path, "CIFAR-100 file", CIFAR100_FIX)
    d = {(k.decode() if isinstance(k, bytes) else k): v for k, v in d.items()} if isinstance(d, dict) else {}
    data, labels = d.get("data"), d.get("fine_labels")
    if not isinstance(data, np.ndarray) or labels is None:
        raise ValueError(f"CIFAR-100 file {path} has no 'data' array and 'fine_labels' list; {CIFAR100_FIX}")
    labels = np.asarray(labels, dtype=np.int64)
    n = len(labels)
    if data.dtype != np.uint8 or data.shape != (n, 3072):
        raise ValueError(
            f"CIFAR-100 file {path} holds data {data.dtype}{list(data.shape)} for {n} labels, expected "
            f"uint8[{n}, 3072]; {CIFAR100_FIX}"
        )
    if n and (labels.min() < 0 or labels.max() > 99):
        raise ValueError(f"CIFAR-100 file {path} has fine labels outside 0..99; {CIFAR100_FIX}")
    images = torch.from_numpy(data.reshape(n, 3, 32, 32).copy())
    return ImageDataset(
        images,
        torch.from_numpy(labels),
        100,
        CIFAR100_MEAN,
        CIFAR100_STD,
        _cifar100_names(folder / "meta"),
        f"cifar100-{_part(split)}",
        str(path),
    )


def _cifar100_names(path: Path) -> list[str] | None:
    try:
        d = load_array_pickle(path, "CIFAR-100 meta file", CIFAR100_FIX)
    except (FileNotFoundError, ValueError):
        return None
    names = d.get(b"fine_label_names") if isinstance(d, dict) else None
    return [n.decode() if isinstance(n, bytes) else str(n) for n in names] if isinstance(names, list) else None


def oxford_pets(root: str | Path, split: str = "train") -> FolderSource:
    """Oxford-IIIT Pets: the 37 breeds, ``train`` = ``trainval.txt``, ``test`` = ``test.txt``; class names
    from the image names (``Abyssinian_100`` -> ``Abyssinian``), in the order of their ids."""
    root = _folder(root, "Oxford-IIIT Pets", PETS_FIX)
    listing = root / "annotations" / ("trainval.txt" if _part(split) == "train" else "test.txt")
    if not listing.is_file():
        raise FileNotFoundError(f"Oxford-IIIT Pets split file {listing} does not exist; {PETS_FIX}")
    names: dict[int, str] = {}
    paths, labels = [], []
    for number, line in enumerate(listing.read_text(errors="replace").splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        fields = line.split()
        if len(fields) < 2 or not fields[1].isdigit() or not 1 <= int(fields[1]) <= 37:
            raise ValueError(f"{listing} line {number}: expected '<image> <class id 1..37> ...'; {PETS_FIX}")
        image, label = fields[0], int(fields[1]) - 1
        names.setdefault(label, image.rsplit("_", 1)[0])
        paths.append(f"images/{image}.jpg")
        labels.append(label)
    if not paths:
        raise ValueError(f"{listing} lists no images; {PETS_FIX}")
    _check_files(root, paths[:1], "Oxford-IIIT Pets", PETS_FIX)
    classes = [names.get(i, f"class_{i + 1}") for i in range(37)]
    return FolderSource(root, FileList(paths, labels), classes, f"pets-{_part(split)}")


def flowers102(root: str | Path, split: str = "train") -> FolderSource:
    """Oxford Flowers-102: ``train`` = the official train + validation ids, ``test`` = the test ids."""
    from ..common.extras import require

    sio = require("scipy.io", "reading Flowers-102's imagelabels.mat and setid.mat", "data")
    root = _folder(root, "Flowers-102", FLOWERS_FIX)
    labels_all = _mat_vector(sio, root / "imagelabels.mat", "labels")
    ids = [
        _mat_vector(sio, root / "setid.mat", k) for k in (("trnid", "valid") if _part(split) == "train" else ("tstid",))
    ]
    chosen = np.concatenate(ids)
    if len(labels_all) == 0 or chosen.min() < 1 or chosen.max() > len(labels_all):
        raise ValueError(f"{root / 'setid.mat'} names images outside 1..{len(labels_all)}; {FLOWERS_FIX}")
    labels = labels_all[chosen - 1] - 1
    if labels.min() < 0 or labels.max() > 101:
        raise ValueError(f"{root / 'imagelabels.mat'} has labels outside 1..102; {FLOWERS_FIX}")
    paths = [f"jpg/image_{i:05d}.jpg" for i in chosen.tolist()]
    _check_files(root, paths[:1], "Flowers-102", FLOWERS_FIX)
    return FolderSource(root, FileList(paths, labels), [f"flower_{i + 1}" for i in range(102)], f"flowers102-{split}")


def _mat_vector(sio, path: Path, key: str) -> np.ndarray:
    """A vector of positive integers from a MATLAB file (``loadmat``: numeric arrays only, nothing executed)."""
    if not path.is_file():
        raise FileNotFoundError(f"Flowers-102 file {path} does not exist; {FLOWERS_FIX}")
    try:
        value = sio.loadmat(str(path)).get(key)
    except Exception as e:  # a damaged file: scipy's many error types
        raise ValueError(f"{path} is not a readable MATLAB file ({type(e).__name__}); {FLOWERS_FIX}") from None
    if not isinstance(value, np.ndarray) or value.dtype.kind not in "iuf":
        raise ValueError(f"{path} has no numeric '{key}' array; {FLOWERS_FIX}")
    return value.reshape(-1).astype(np.int64)


def _check_files(root: Path, paths: list[str], what: str, fix: str) -> None:
    """The first listed image exists (a wrong root fails here, not in a DataLoader worker)."""
    for p in paths:
        if not (root / p).is_file():
            raise FileNotFoundError(f"{what} image {root / p} does not exist; {fix}")
