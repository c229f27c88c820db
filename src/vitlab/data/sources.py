"""Streaming image sources: where each sample's bytes live, scanned once, nothing decoded up front.

``FolderSource`` is an ImageNet-layout folder (``ROOT/train/<class>/<image>``, ``ROOT/val/<class>/<image>``;
a folder of class folders alone is split by a seeded stratified holdout of its file list). Its file list is
kept as one byte string plus offsets and a label array (numpy), never as Python objects per file: forked
DataLoader workers share those pages without copying them (a list of a million path objects would be copied
into every worker page by page, as reference counts are touched), so the loader's memory does not grow with
the dataset. Validation labels follow the training classes *by name*: a val class train does not have is an
error (the labels would silently shift otherwise), a val folder lacking some classes is fine.

Only regular files are listed (a named pipe or a device among the images would block a reader forever); a
class folder without images is an error (the class count and every later label would shift silently).
:meth:`FolderSource.read`, through which every reader (``folder:``, ``pets:``, ``flowers102:``) gets a file to
open, checks again, without blocking, that the file is still a regular file: one that became a pipe or device
after the listing is one line, never a read that waits forever.

Dense token-label targets (see :mod:`vitlab.data.tokenlabel`) are read per image from ``<image name>.tl.npy``
beside the image (``a.JPEG.tl.npy``: the whole name, so ``a.JPEG`` and ``a.png`` have maps of their own), or
from ``<dense_root>/<class>/<image name>.tl.npy``.
"""

from __future__ import annotations

import os
import stat
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from .datasets import IMAGE_EXTS, IMAGENET_MEAN, IMAGENET_STD, stratified_holdout
from .safe_files import DataFileError, check_regular, read_regular

DENSE_SUFFIX = ".tl.npy"
DENSE_FIX = "write the token-label maps again (vitlab relabel)"
LAYOUT = "ROOT/train/<class>/<image> and ROOT/val/<class>/<image> (or ROOT/<class>/<image>)"


class FileList:
    """Relative paths and labels of N files in three numpy arrays (no per-file Python objects)."""

    def __init__(self, paths: Sequence[str], labels: Sequence[int]) -> None:
        encoded = [p.encode("utf-8", "surrogateescape") for p in paths]
        self.offsets = np.zeros(len(encoded) + 1, dtype=np.int64)
        np.cumsum([len(e) for e in encoded], out=self.offsets[1:])
        self.blob = np.frombuffer(b"".join(encoded), dtype=np.uint8) if encoded else np.zeros(0, np.uint8)
        self.labels = np.asarray(labels, dtype=np.int32)

    def __len__(self) -> int:
        return len(self.labels)

    def path(self, i: int) -> str:
        return self.blob[self.offsets[i] : self.offsets[i + 1]].tobytes().decode("utf-8", "surrogateescape")

    def subset(self, idx: np.ndarray) -> FileList:
        return FileList([self.path(int(i)) for i in idx], self.labels[idx])

    @property
    def nbytes(self) -> int:
        return self.offsets.nbytes + self.blob.nbytes + self.labels.nbytes


def _class_dirs(root: Path) -> list[str]:
    return sorted(e.name for e in os.scandir(root) if e.is_dir() and not e.name.startswith("."))


def _image_files(folder: Path, prefix: str) -> list[str]:
    """Regular image files under ``folder`` (recursively), as paths relative to the split root, sorted.
    ``DirEntry.is_file`` is False for pipes, sockets and devices (and follows symlinks to regular files)."""
    out, dirs = [], []
    with os.scandir(folder) as entries:
        for e in entries:
            if e.name.startswith("."):
                continue
            if e.is_dir():
                dirs.append(e.name)
            elif e.is_file() and os.path.splitext(e.name)[1].lower() in IMAGE_EXTS:
                out.append(f"{prefix}/{e.name}")
    out.sort()
    for d in sorted(dirs):
        out += _image_files(folder / d, f"{prefix}/{d}")
    return out


def dense_file(image: Path) -> Path:
    """Where the dense token-label maps of ``image`` live: ``<image name>.tl.npy`` beside it."""
    return image.with_name(image.name + DENSE_SUFFIX)


def scan_folder(root: Path, classes: list[str] | None = None) -> tuple[list[str], FileList]:
    """(class names, file list) of ``root/<class>/<image>``; with ``classes`` given (the training split's),
    labels are those classes' indices by name."""
    if not root.is_dir():
        raise FileNotFoundError(f"image folder {root} does not exist; expected {LAYOUT}")
    found = _class_dirs(root)
    defines_classes = classes is None
    if classes is None:
        classes = found
    unknown = sorted(set(found) - set(classes))
    if unknown:
        raise ValueError(
            f"{root} has class folders the training split does not have: {', '.join(unknown[:5])}"
            f"{' ...' if len(unknown) > 5 else ''} ({len(unknown)} in all); validation classes must match the "
            "training classes by name"
        )
    missing = sorted(set(classes) - set(found))
    if missing and found:
        warnings.warn(
            f"{root} lacks {len(missing)} of the {len(classes)} training classes ({missing[0]}, ...)", stacklevel=2
        )
    index = {c: i for i, c in enumerate(classes)}
    paths, labels, empty = [], [], []
    for name in found:
        files = _image_files(root / name, name)
        empty += [] if files else [name]
        paths += files
        labels += [index[name]] * len(files)
    if not paths:
        raise ValueError(f"image folder {root} has no images in class subfolders; expected {LAYOUT}")
    if empty and defines_classes:
        raise ValueError(f"class folder {root / empty[0]} holds no images ({len(empty)} empty in all); add their "
                         "images or remove them (an empty class would shift the class count and later labels)")  # fmt: skip
    return classes, FileList(paths, labels)


@dataclass
class FolderSource:
    """One split of an image folder, read lazily: ``read(i) -> (path, label)``."""

    root: Path
    files: FileList
    classes: list[str]
    name: str = ""
    dense_root: Path | None = None
    mean: tuple[float, ...] = IMAGENET_MEAN
    std: tuple[float, ...] = IMAGENET_STD
    extra: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.files)

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    @property
    def labels(self) -> torch.Tensor:
        return torch.from_numpy(self.files.labels.astype(np.int64))

    def path(self, i: int) -> Path:
        return self.root / self.files.path(i)

    def read(self, i: int) -> tuple[Path, int]:
        """The path of file ``i`` and its label; a file that is no longer a regular file is refused (one line)."""
        path = self.path(i)
        refuse_special(path, "image")
        return path, int(self.files.labels[i])

    def dense_path(self, i: int) -> Path:
        return dense_file((self.dense_root or self.root) / self.files.path(i))

    def subset(self, indices) -> FolderSource:
        """The files at ``indices`` (e.g. a seeded random subset for a quick run), same classes and root."""
        idx = np.asarray(indices, dtype=np.int64)
        return FolderSource(self.root, self.files.subset(idx), self.classes, f"{self.name}[{len(idx)}]",
                            self.dense_root, self.mean, self.std, dict(self.extra))  # fmt: skip

    def class_counts(self) -> list[int]:
        return np.bincount(self.files.labels, minlength=self.num_classes).tolist()

    def __repr__(self) -> str:
        return f"FolderSource({self.name}: {len(self)} files, {self.num_classes} classes; {self.root})"


def open_folder(
    root: str | Path,
    split: str = "train",
    *,
    holdout: int | float = 0.1,
    seed: int = 0,
    dense_root: str | Path | None = None,
    classes: list[str] | None = None,
) -> FolderSource:
    """A split of an image folder: ``train`` / ``val`` (``test`` is an alias) subfolders when present, else a
    seeded stratified holdout of ``root/<class>/*`` (``holdout``: count or fraction), file list only;
    ``split="all"``: every image of a folder without train/val subfolders. ``classes``: the class names a model
    was trained on (its labels' order); labels follow them by name, and a class outside them is an error."""
    root = Path(root).expanduser()
    if not root.is_dir():
        raise FileNotFoundError(f"image folder {root} does not exist; expected {LAYOUT}")
    dense = Path(dense_root).expanduser() if dense_root else None
    val_dir = next((root / s for s in ("val", "test") if (root / s).is_dir()), None)
    if (root / "train").is_dir():
        classes, files = scan_folder(root / "train", None if classes is None else list(classes))
        if split == "train":
            return FolderSource(root / "train", files, classes, f"{root.name}-train", _sub(dense, "train"))
        if split not in ("val", "test"):
            raise ValueError(f"split must be 'train' or 'val', got {split!r}")
        if val_dir is None:
            raise FileNotFoundError(f"{root} has a train/ folder but no val/ (or test/) folder")
        _, files = scan_folder(val_dir, classes)
        return FolderSource(val_dir, files, classes, f"{root.name}-{val_dir.name}", _sub(dense, val_dir.name))
    classes, files = scan_folder(root, None if classes is None else list(classes))
    if split == "all":  # the whole folder, e.g. ImageNet's val/ given on its own to `vitlab eval`
        return FolderSource(root, files, classes, root.name, dense)
    train_idx, held_idx = stratified_holdout(torch.from_numpy(files.labels.astype(np.int64)), holdout, seed)
    part = (train_idx if split == "train" else held_idx).numpy()
    src = FolderSource(root, files.subset(part), classes, f"{root.name}-{split}", dense)
    src.extra["holdout"] = f"seeded stratified split (holdout={holdout}, seed={seed}): {split} part"
    return src


def refuse_special(path: Path, what: str) -> None:
    """One line when ``path`` is a pipe, socket, device or folder (opening it to read could block forever); a
    regular file, a missing or an unreadable one passes (the decoder counts those as unreadable images). A
    ``stat``, which never blocks."""
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError):  # missing, no permission, a NUL in the name: the decoder says so
        return
    if not stat.S_ISREG(mode):
        check_regular(path, what, "replace it by the image file or remove it from the dataset")


def _sub(dense: Path | None, name: str) -> Path | None:
    return None if dense is None else (dense / name if (dense / name).is_dir() else dense)


def read_dense(path: Path | bytes) -> np.ndarray:
    """A dense token-label file: ``float16 (2, k, Hm, Wm)`` (top-k scores, class indices); never unpickles."""
    import io

    name = "bytes" if isinstance(path, bytes) else str(path)
    try:
        # read through read_regular: a pipe in the file's place is refused, never waited on
        data = path if isinstance(path, bytes) else read_regular(path, "token-label file", DENSE_FIX)
        arr = np.load(io.BytesIO(data), allow_pickle=False)
    except DataFileError:
        raise
    except FileNotFoundError as e:  # a ValueError line, as every other unreadable token-label file
        raise ValueError(str(e)) from None
    except (OSError, ValueError, EOFError) as e:
        raise ValueError(f"token-label file {name} cannot be read: {e}") from None
    if arr.ndim != 4 or arr.shape[0] != 2:
        raise ValueError(f"token-label maps must have shape (2, k, H, W) (scores, class indices), got {arr.shape}")
    return arr
