"""WebDataset tar shards: reading ``wds:`` specs as a resumable stream (written by :mod:`.shard_writer`).

Format (WebDataset's): each shard is a POSIX tar; the files of one sample share a key (the name up to the
first dot) and sit next to each other: ``<key>.jpg`` (or .png, ...: the image bytes as stored), ``<key>.cls``
(the class index as ASCII), optionally ``<key>.tl.npy`` (dense token-label maps). ``vitlab data shards``
also writes ``shards.json`` beside them: the classes, and per split the shard names and sample counts, so
the epoch length is known without reading the shards; without it, each shard's tar headers are scanned once.

Reading: an epoch is one pass over a sequence of all the samples, the shards in an order permuted with
``(seed, epoch)`` (training; their listed order in evaluation), each shard's samples in the order stored. Rank
``r`` takes a contiguous share of that sequence (training: ``total // world`` samples each, the
``total % world`` < ``world`` last ones left to later epochs; evaluation: shares differing by at most one, every
sample once), cut into batches (the last one short when the share is not a multiple of the batch). DataLoader
worker ``w`` makes batches ``w, w + workers, ...`` and reads their samples, a contiguous part of the rank's
share, so each sample belongs to exactly one (rank, worker) and every shard is read by the one worker whose
part holds it (a shard across a boundary by both, each reading only its samples). Training passes a worker's
samples through a seeded shuffle buffer (``shuffle_buffer`` samples; 0 or 1: off) that empties at the end of its
part: no sample crosses into another epoch. What a worker reads is a function of ``(seed, epoch, rank, worker,
workers)``: resuming mid-epoch with the same number of workers replays it, skipping (reading, not decoding) the
samples of the batches already handed out.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import random
import re
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .crop import load_samples
from .decode import UnreadableImage
from .geometry import CropSpec
from .samplers import derive_seed
from .sources import IMAGE_EXTS, IMAGENET_MEAN, IMAGENET_STD, read_dense
from .stream import StreamBatch, _batch_generator, collate
from .tokenlabel import crop_dense

MANIFEST = "shards.json"
WDS_FIX = "install it with: pip install 'vitlab[data]'"


def _webdataset():
    try:
        import webdataset
    except ImportError as e:
        raise ImportError(f"wds: data needs the webdataset package; {WDS_FIX}") from e
    return webdataset


def expand_pattern(pattern: str) -> list[str]:
    """Brace-expand a shard pattern (``/data/train-{000000..000146}.tar``) into existing shard paths."""
    try:
        import braceexpand  # webdataset's own dependency
    except ImportError as e:
        raise ImportError(f"wds: data needs the webdataset package; {WDS_FIX}") from e
    paths = [str(Path(p).expanduser()) for p in braceexpand.braceexpand(pattern)]
    missing = [p for p in paths if not Path(p).is_file()]
    if missing:
        raise FileNotFoundError(
            f"{len(missing)} of the {len(paths)} shards of {pattern!r} do not exist (first: {missing[0]})"
        )
    return paths


def iter_shard(path: str) -> Iterator[dict]:
    """The samples of one shard as dicts ``{__key__, <ext>: bytes, ...}`` (local files only)."""
    wds = _webdataset()
    with open(path, "rb") as f:
        files = wds.tariterators.tar_file_expander([{"url": path, "stream": f}])
        yield from wds.tariterators.group_by_keys(files)


def image_member(sample: dict) -> str | None:
    return next((k for k in sample if f".{k.rsplit('.', 1)[-1]}" in IMAGE_EXTS and "." not in k), None)


def count_shard(path: str) -> int:
    """Samples in a shard from its tar headers alone (``tarfile`` seeks over the file contents)."""
    key = _webdataset().tariterators.base_plus_ext
    try:
        with tarfile.open(path, "r:") as tar:
            return len({key(m.name)[0] for m in tar if m.isreg()})
    except (tarfile.TarError, OSError) as e:
        raise ValueError(f"shard {path} is not a readable tar file ({e})") from None


@dataclass
class ShardSource:
    """One split of WebDataset shards: their paths, sample counts and classes."""

    shards: list[str]
    counts: list[int]
    classes: list[str] | None = None
    name: str = ""
    mean: tuple[float, ...] = IMAGENET_MEAN
    std: tuple[float, ...] = IMAGENET_STD
    extra: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return sum(self.counts)

    @property
    def num_classes(self) -> int:
        if self.classes is None:
            raise ValueError(f"shards {self.name} carry no class list (no {MANIFEST} beside them); give the number "
                             f"of classes with --num-classes, or write a {MANIFEST} (docs/data.md)")  # fmt: skip
        return len(self.classes)

    def with_num_classes(self, n: int) -> ShardSource:
        """Plain shards (no class list) given their number of classes; shards that list theirs must agree."""
        if self.classes is not None and len(self.classes) != n:
            raise ValueError(f"shards {self.name} list {len(self.classes)} classes in {MANIFEST}, not {n}")
        if self.classes is None:
            self.classes = [str(i) for i in range(n)]
        return self


SPLIT_FIX = "name the held-out shards too: wds:train=PATTERN,val=PATTERN (or a folder of `vitlab data shards`)"


def split_patterns(spec_path: str) -> dict[str, str] | None:
    """``train=PATTERN,val=PATTERN`` (either order; a brace pattern may hold commas) -> ``{split: pattern}``;
    None for a folder or a single pattern."""
    if not re.match(r"\s*(train|val)=", spec_path):
        return None
    parts = re.split(r",\s*(?=(?:train|val)=)", spec_path.strip())
    out: dict[str, str] = {}
    for part in parts:
        name, _, pattern = part.partition("=")
        if name in out or not pattern:
            raise ValueError(
                f"wds:{spec_path} must name each split once with its shards: wds:train=PATTERN,val=PATTERN"
            )
        out[name] = pattern
    return out


def open_shards(spec_path: str, split: str = "train") -> ShardSource:
    """``wds:`` spec path -> :class:`ShardSource`: a folder holding ``shards.json`` (either split),
    ``train=PATTERN,val=PATTERN`` (each split its own shards), or one brace pattern (the training shards, or
    with ``split="all"`` data to evaluate as a whole; never the held-out part of a training run). A manifest
    beside pattern shards supplies classes and counts."""
    path = Path(spec_path).expanduser()
    split = "val" if split == "test" else split
    named = split_patterns(spec_path)
    if named is not None:
        if split not in named:
            raise ValueError(f"wds:{spec_path} names no {split!r} shards; {SPLIT_FIX}")
        spec_path, split = named[split], "all"
    if path.is_dir() and named is None:
        return _open_written(path, split)
    if split == "val":
        raise ValueError(f"wds:{spec_path} names one set of shards, trained on: it is not held-out data; {SPLIT_FIX}")
    shards = expand_pattern(spec_path)
    counts, classes = _counts_beside(shards)
    return ShardSource(shards, counts, classes, Path(shards[0]).stem)


def _open_written(path: Path, split: str) -> ShardSource:
    """One split of a folder written by ``vitlab data shards`` (its ``shards.json``)."""
    manifest = path / MANIFEST
    if not manifest.is_file():
        raise FileNotFoundError(f"{path} holds no {MANIFEST}; write shards with `vitlab data shards` or give a "
                                "brace pattern of shard files, e.g. wds:/data/train-{000000..000009}.tar")  # fmt: skip
    meta = _read_manifest(manifest)
    if split not in meta["splits"]:
        raise ValueError(f"{manifest} has no {split!r} split (it has {sorted(meta['splits'])})")
    part = meta["splits"][split]
    shards = [str(path / s) for s in part["shards"]]
    missing = [s for s in shards if not Path(s).is_file()]
    if missing:
        raise FileNotFoundError(f"{len(missing)} shards listed in {manifest} do not exist (first: {missing[0]})")
    return ShardSource(shards, [int(c) for c in part["counts"]], meta.get("classes"), f"{path.name}-{split}")


def _read_manifest(path: Path) -> dict:
    try:
        meta = json.loads(path.read_text())
        assert isinstance(meta.get("splits"), dict)
        return meta
    except (ValueError, AssertionError, OSError) as e:
        raise ValueError(f"{path} is not a shard manifest ({e or 'no splits'}); re-write the shards") from None


def _counts_beside(shards: list[str]) -> tuple[list[int], list[str] | None]:
    manifest = Path(shards[0]).parent / MANIFEST
    known: dict[str, int] = {}
    classes = None
    if manifest.is_file():
        meta = _read_manifest(manifest)
        classes = meta.get("classes")
        for part in meta["splits"].values():
            known.update(zip(part["shards"], part["counts"]))
    return [int(known[Path(s).name]) if Path(s).name in known else count_shard(s) for s in shards], classes


class ShardStream(torch.utils.data.IterableDataset):
    """Batches from shards in DataLoader workers (see the module docstring); ``epoch`` and the start batch
    live in a shared tensor so persistent workers see each new epoch."""

    def __init__(
        self,
        source: ShardSource,
        crop: CropSpec,
        batch_transform,
        *,
        batch_size: int,
        train: bool,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        workers: int = 0,
        shuffle_buffer: int = 2000,
        decoder: str = "pillow",
        dense_grid: tuple[int, int] | None = None,
        transform_on_device: bool = True,
    ) -> None:
        if shuffle_buffer < 0:
            raise ValueError(f"the shuffle buffer holds >= 0 samples, got {shuffle_buffer}")
        self.source, self.crop, self.batch_transform, self.batch_size = source, crop, batch_transform, batch_size
        self.train, self.seed, self.rank, self.world_size = train, seed, rank, world_size
        self.workers, self.shuffle_buffer, self.decoder = max(workers, 1), shuffle_buffer, decoder
        self.dense_grid, self.transform_on_device = dense_grid, transform_on_device
        self.position = torch.zeros(2, dtype=torch.long).share_memory_()  # epoch, first batch to produce
        first, stop = self.rank_span()
        self.sizes = [min(batch_size, stop - first - b) for b in range(0, stop - first, batch_size)]

    def __len__(self) -> int:
        return len(self.sizes)

    def rank_span(self) -> tuple[int, int]:
        """This rank's positions ``[first, stop)`` in the epoch's sequence of samples: equal shares of
        ``total // world`` when training (the ``total % world`` last samples of the epoch's order wait for a
        later epoch), shares differing by at most one sample in evaluation (every sample once)."""
        total, world, r = len(self.source), self.world_size, self.rank
        if self.train:
            share = total // world
            return r * share, (r + 1) * share
        return total * r // world, total * (r + 1) // world

    def worker_span(self, worker: int) -> tuple[int, int]:
        """The positions of a worker's batches ``worker, worker + workers, ...``, contiguous and in worker order."""
        first = self.rank_span()[0] + sum(sum(self.sizes[w :: self.workers]) for w in range(worker))
        return first, first + sum(self.sizes[worker :: self.workers])

    def shard_order(self, epoch: int) -> list[int]:
        """The epoch's order of the shards: permuted with ``(seed, epoch)`` when training."""
        order = list(range(len(self.source.shards)))
        if self.train:
            random.Random(derive_seed(self.seed, epoch, "shards")).shuffle(order)
        return order

    def pieces(self, epoch: int, first: int, stop: int) -> list[tuple[int, int, int]]:
        """``(shard, skip, take)`` triples that read positions ``[first, stop)`` of the epoch's sequence."""
        out, start = [], 0
        for i in self.shard_order(epoch):
            end = start + self.source.counts[i]
            lo, hi = max(first, start), min(stop, end)
            if lo < hi:
                out.append((i, lo - start, hi - lo))
            start = end
        return out

    def _worker(self) -> int:
        info = torch.utils.data.get_worker_info()
        return 0 if info is None else info.id

    def _raw(self, epoch: int, worker: int) -> Iterator[dict]:
        for i, skip, take in self.pieces(epoch, *self.worker_span(worker)):
            path, got = self.source.shards[i], 0
            with contextlib.closing(iter_shard(path)) as samples:  # the file closes when the part is read
                for sample in itertools.islice(samples, skip, skip + take):
                    got += 1
                    yield sample
            if got < take:
                raise ValueError(f"shard {path} holds fewer samples than the {self.source.counts[i]} listed for "
                                 f"it; re-write {MANIFEST} (or delete it to count the shards)")  # fmt: skip

    def _shuffled(self, epoch: int, worker: int) -> Iterator[dict]:
        """The worker's samples in a seeded shuffle-buffer order; the buffer empties at the end of the epoch."""
        stream = self._raw(epoch, worker)
        if not self.train or self.shuffle_buffer <= 1:
            yield from stream
            return
        rng = random.Random(derive_seed(self.seed, epoch, self.rank, "buffer", worker))
        buf: list[dict] = []
        for sample in stream:
            if len(buf) < self.shuffle_buffer:
                buf.append(sample)
                continue
            k = rng.randrange(len(buf))
            buf[k], sample = sample, buf[k]
            yield sample
        rng.shuffle(buf)
        yield from buf

    def _parse(self, sample: dict) -> tuple[bytes, int]:
        """(image bytes, label) of a sample; UnreadableImage when a member is missing or malformed."""
        name = f"{sample.get('__url__')}:{sample.get('__key__')}"
        key = image_member(sample)
        if key is None:
            raise UnreadableImage(f"{name}: sample has no image member")
        try:
            label = int(sample["cls"].decode().strip())
        except (KeyError, ValueError, UnicodeDecodeError):
            raise UnreadableImage(f"{name}: no integer .cls member") from None
        classes = self.source.classes
        if classes is not None and not 0 <= label < len(classes):  # else a wrong loss, or a crash on a GPU
            raise ValueError(f"{name}: class {label} is outside the {len(classes)} classes of {self.source.name}; "
                             "check --num-classes or the shards' shards.json")  # fmt: skip
        return bytes(sample[key]), label

    def _dense(self, sample: dict, box):
        if self.dense_grid is None:
            return None
        if "tl.npy" not in sample:
            raise ValueError(f"{sample['__url__']}:{sample['__key__']} has no tl.npy token-label member")
        return crop_dense(read_dense(bytes(sample["tl.npy"])), box, self.dense_grid)

    def _batch(self, raw: list[dict], seed: int) -> StreamBatch:
        """Decode a batch's raw samples (unreadable ones dropped and named; maybe all of them)."""
        parsed, bad = [], []
        for sample in raw:
            try:
                parsed.append((sample, *self._parse(sample)))
            except UnreadableImage as e:
                bad.append(str(e))
        loaded = load_samples([p[1] for p in parsed], self.crop, _batch_generator(seed), self.decoder)
        samples = []
        for (sample, _, label), result in zip(parsed, loaded):
            if isinstance(result, UnreadableImage):
                bad.append(f"{sample['__url__']}:{sample['__key__']}: {str(result).split(': ', 1)[-1]}")
            else:
                samples.append((result[0], label, self._dense(sample, result[1])))
        transform = None if self.transform_on_device else self.batch_transform
        return collate(samples, seed, transform, tuple(bad))

    def __iter__(self) -> Iterator[StreamBatch]:
        epoch, start = (int(v) for v in self.position)
        # DataLoader takes batches from workers 0, 1, ... in turn: after a resume at batch `start`, worker 0
        # plays the role of the worker that made batch `start` in the uninterrupted run
        worker = (self._worker() + start) % self.workers
        stream = self._shuffled(epoch, worker)
        mine = range(worker, len(self.sizes), self.workers)
        for _ in range(sum(self.sizes[b] for b in mine if b < start)):  # handed out before the resume point
            next(stream)  # read, not decoded
        for b in (b for b in mine if b >= start):
            raw = list(itertools.islice(stream, self.sizes[b]))
            yield self._batch(raw, derive_seed(self.seed, epoch, self.rank, "batch", b))
