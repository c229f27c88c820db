"""Writing an ImageNet-layout folder as WebDataset shards (``vitlab data shards``), read back by
:mod:`vitlab.data.wds`."""

from __future__ import annotations

import io
import tarfile
from collections.abc import Callable
from pathlib import Path

import numpy as np

from .wds import MANIFEST


def write_shards(
    src_root: str | Path,
    out: str | Path,
    *,
    shard_size: int = 1000,
    splits: tuple[str, ...] = ("train", "val"),
    log: Callable[[str], None] = print,
    force: bool = False,
) -> dict:
    """Write an ImageNet-layout folder as WebDataset shards ``OUT/<split>-NNNNNN.tar`` (image bytes unchanged,
    ``.cls``, ``.tl.npy`` where a token-label file sits beside the image) and ``OUT/shards.json``. Samples go
    into the shards in a seeded random order so that a shard holds a mix of classes.

    ``OUT`` is owned for the whole write (:class:`vitlab.common.rundir.RunLock`): a second writer into the same
    folder is refused with one line naming this one; ``log`` receives the lock's notes. A folder that holds
    shards already is refused too, unless ``force`` moves them aside (new shards never mix with old ones)."""
    from ..common.rundir import RunLock

    if shard_size < 1:
        raise ValueError(f"shard size must be >= 1, got {shard_size}")
    out = Path(out).expanduser()
    with RunLock(out, "vitlab data shards", log) as lock:
        lock.make_room([MANIFEST, *sorted(p.name for p in out.glob("*-[0-9][0-9][0-9][0-9][0-9][0-9].tar"))], force)
        return _write_shards(src_root, out, shard_size, splits)


def _write_shards(src_root: str | Path, out: Path, shard_size: int, splits: tuple[str, ...]) -> dict:
    from ..common.io import atomic_open, write_json_atomic
    from .sources import open_folder

    meta: dict = {"format": "webdataset", "splits": {}}
    for split in splits:
        try:
            src = open_folder(src_root, split)
        except FileNotFoundError:
            if split == "train":
                raise
            continue
        meta["classes"] = src.classes
        order = np.random.default_rng(0).permutation(len(src))
        names, counts = [], []
        for s, first in enumerate(range(0, len(order), shard_size)):
            name = f"{split}-{s:06d}.tar"
            part = order[first : first + shard_size]
            # a plain (not stream) tar: a failed write leaves no buffer behind to flush at exit
            with atomic_open(out / name, "wb") as f, tarfile.open(fileobj=f, mode="w") as tar:
                for i in part:
                    _add_sample(tar, _sample(src, int(i)))
            names.append(name)
            counts.append(len(part))
        meta["splits"][split] = {"shards": names, "counts": counts}
    write_json_atomic(out / MANIFEST, meta)
    return meta


def _add_sample(tar: tarfile.TarFile, sample: dict) -> None:
    """The members ``<key>.<ext>`` of one sample, next to each other (WebDataset's layout)."""
    key = sample.pop("__key__")
    for ext, data in sample.items():
        info = tarfile.TarInfo(f"{key}.{ext}")
        info.size, info.mtime, info.mode = len(data), 0, 0o444
        tar.addfile(info, io.BytesIO(data))


def _sample(src, i: int) -> dict:
    path, label = src.read(i)
    rel = src.files.path(i)
    sample = {  # the key leads with the file's index: a.JPEG and a.png stay two samples
        "__key__": f"{i:09d}_" + rel.replace(".", "_"),
        path.suffix.lower().lstrip("."): path.read_bytes(),
        "cls": str(label).encode(),
    }
    dense = src.dense_path(i)
    if dense.is_file():
        sample["tl.npy"] = dense.read_bytes()
    return sample
