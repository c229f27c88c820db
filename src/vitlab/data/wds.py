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

import collections
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
from .safe_files import DataFileError, check_regular, inside_root, open_regular, read_regular
from .samplers import derive_seed
from .sources import IMAGE_EXTS, IMAGENET_MEAN, IMAGENET_STD, read_dense
from .stream import StreamBatch, _batch_generator, collate
from .tokenlabel import crop_dense

MANIFEST = "shards.json"
WDS_FIX = "install it with: pip install 'vitlab[data]'"
SHARD_FIX = "copy or write the shard again (vitlab data shards), or leave it out of the pattern or shards.json"
MANIFEST_FORM = (
    '{"format": "webdataset", "classes": ["name", ...], "splits": {"train": {"shards": ["train-000000.tar", ...], '
    '"counts": [1000, ...]}, "val": {...}}}'
)
MANIFEST_FIX = f"write the shards again with `vitlab data shards`, or correct {MANIFEST} to the form {MANIFEST_FORM}"
MANIFEST_LIMIT = 64 << 20  # a manifest of a million shards holds ~40 MB
MAX_SHARDS = 1_000_000  # a brace pattern naming more is a typo (ImageNet-21k fits in ~15,000 shards)
TAR_BLOCK = 512  # every sample takes at least one tar header of this size: a shard holds at most size / 512
# compressed shards: tarfile would inflate them without a bound; vitlab reads (and writes) plain POSIX tar
_COMPRESSED = {b"\x1f\x8b": "gzip", b"BZh": "bzip2", b"\xfd7zXZ\x00": "xz", b"\x28\xb5\x2f\xfd": "zstd"}


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
    try:
        paths = [str(Path(p).expanduser()) for p in itertools.islice(braceexpand.braceexpand(pattern), MAX_SHARDS + 1)]
    except Exception as e:  # braceexpand's own errors on a malformed pattern
        raise ValueError(
            f"shard pattern {pattern!r} cannot be expanded ({e}); write e.g. /data/train-{{000000..000009}}.tar"
        ) from None
    if len(paths) > MAX_SHARDS:
        raise ValueError(f"shard pattern {pattern!r} names more than {MAX_SHARDS} shards; check the braces")
    missing = [p for p in paths if not Path(p).exists()]
    if missing:
        raise FileNotFoundError(
            f"{len(missing)} of the {len(paths)} shards of {pattern!r} do not exist (first: {missing[0]})"
        )
    for p in paths:
        check_regular(p, "shard", SHARD_FIX)  # a pipe named as a shard would block its reader forever
    return paths


def _check_plain(head: bytes, path: str) -> None:
    for magic, kind in _COMPRESSED.items():
        if head.startswith(magic):
            raise DataFileError(f"shard {path} is {kind}-compressed; vitlab reads plain tar shards: decompress it")


def iter_shard(path: str) -> Iterator[dict]:
    """The samples of one shard as dicts ``{__key__, <ext>: bytes, ...}`` (local files only). A shard that is
    not a regular file, is compressed, truncated or not a tar file at all is one :class:`DataFileError` line
    naming it, raised where the damage is found (the samples before it are read)."""
    wds = _webdataset()
    with open_regular(path, "shard", SHARD_FIX) as f:
        _check_plain(f.peek(8)[:8], path)
        files = wds.tariterators.tar_file_expander([{"url": path, "stream": f}])
        samples = wds.tariterators.group_by_keys(files)
        read = 0
        while True:
            try:
                sample = next(samples)
            except StopIteration:
                return
            except Exception as e:  # tarfile's, webdataset's and the OS's errors all mean a damaged shard
                raise DataFileError(
                    f"shard {path} cannot be read after {read} samples: it is truncated, damaged or not a tar file "
                    f"({_detail(e)}); {SHARD_FIX}"
                ) from None
            read += 1
            yield sample


def _detail(e: BaseException) -> str:
    """The first argument of an error in a few words (webdataset appends the stream and url to ``args``)."""
    first = e.args[0] if e.args else ""
    text = " ".join(str(first).split())[:120]
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def image_member(sample: dict) -> str | None:
    return next((k for k in sample if f".{k.rsplit('.', 1)[-1]}" in IMAGE_EXTS and "." not in k), None)


def count_shard(path: str) -> int:
    """Samples in a shard from its tar headers alone (``tarfile`` seeks over the file contents)."""
    key = _webdataset().tariterators.base_plus_ext
    with open_regular(path, "shard", SHARD_FIX) as f:
        _check_plain(f.peek(8)[:8], path)
        try:
            with tarfile.open(fileobj=f, mode="r:") as tar:
                return len({key(m.name)[0] for m in tar if m.isreg()})
        except Exception as e:  # tarfile.TarError, OSError, EOFError, UnicodeDecodeError...: a damaged shard
            raise DataFileError(f"shard {path} is not a readable tar file ({_detail(e)}); {SHARD_FIX}") from None


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
    if not manifest.exists():
        raise FileNotFoundError(f"{path} holds no {MANIFEST}; write shards with `vitlab data shards` or give a "
                                "brace pattern of shard files, e.g. wds:/data/train-{000000..000009}.tar")  # fmt: skip
    meta = read_manifest(manifest)
    if split not in meta["splits"]:
        raise ValueError(f"{manifest} has no {split!r} split (it has {sorted(meta['splits'])})")
    part = meta["splits"][split]
    shards = [str(path / s) for s in part["shards"]]
    missing = [s for s in shards if not Path(s).exists()]
    if missing:
        raise FileNotFoundError(f"{len(missing)} shards listed in {manifest} do not exist (first: {missing[0]})")
    for shard, count in zip(shards, part["counts"]):
        _check_count(shard, count, manifest)
    return ShardSource(shards, list(part["counts"]), meta.get("classes"), f"{path.name}-{split}")


def _check_count(shard: str, count: int, manifest: Path) -> None:
    """The shard is a regular file that can hold ``count`` samples (each takes at least one tar header)."""
    size = check_regular(shard, "shard", SHARD_FIX).stat().st_size
    if count > size // TAR_BLOCK:
        raise DataFileError(
            f"{manifest} lists {count} samples for {shard}, whose {size} bytes hold at most {size // TAR_BLOCK}; "
            f"{MANIFEST_FIX}"
        )


def _bad(path: Path, what: str, value: object) -> DataFileError:
    shown = repr(value)
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    return DataFileError(f"{path}: {what}, got {shown}; {MANIFEST_FIX}")


def _is_count(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def read_manifest(path: Path) -> dict:
    """``shards.json``, every field checked (one line naming the manifest, the field and the expected form):
    ``format`` "webdataset" (optional), ``classes`` a list of distinct names (optional), ``splits`` an object
    of splits, each ``{"shards": [names inside the manifest's folder], "counts": [samples per shard]}``."""
    raw = read_regular(path, "shard manifest", MANIFEST_FIX, MANIFEST_LIMIT)
    try:
        meta = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise DataFileError(f"{path} is not valid JSON ({type(e).__name__}); {MANIFEST_FIX}") from None
    if not isinstance(meta, dict):
        raise _bad(path, "the manifest must be a JSON object", type(meta).__name__)
    if meta.get("format", "webdataset") != "webdataset":
        raise _bad(path, "'format' must be \"webdataset\"", meta["format"])
    classes = meta.get("classes")
    if classes is not None:
        if not isinstance(classes, list) or not classes or not all(isinstance(c, str) for c in classes):
            raise _bad(path, "'classes' must be a non-empty list of class names", classes)
        twice = [c for c, n in collections.Counter(classes).items() if n > 1]
        if twice:
            raise _bad(path, "'classes' must name each class once", twice[0])
    splits = meta.get("splits")
    if not isinstance(splits, dict) or not splits:
        raise _bad(path, '\'splits\' must be an object such as {"train": {...}, "val": {...}}', splits)
    for name, part in splits.items():
        if not isinstance(part, dict):
            raise _bad(path, f'split {name!r} must be an object {{"shards": [...], "counts": [...]}}', part)
        shards, counts = part.get("shards"), part.get("counts")
        if not isinstance(shards, list) or not shards or not all(isinstance(s, str) for s in shards):
            raise _bad(path, f"split {name!r}: 'shards' must be a non-empty list of shard file names", shards)
        if not isinstance(counts, list) or not all(_is_count(c) for c in counts):
            raise _bad(path, f"split {name!r}: 'counts' must be a list of sample counts (integers >= 0)", counts)
        if len(counts) != len(shards):
            raise _bad(path, f"split {name!r}: 'counts' must have one entry per shard ({len(shards)})", counts)
        for shard in shards:  # names, not paths: a shard outside the manifest's folder is refused
            inside_root(path.parent, shard, f"{path} split {name!r}", MANIFEST_FIX)
    return meta


def _counts_beside(shards: list[str]) -> tuple[list[int], list[str] | None]:
    manifest = Path(shards[0]).parent / MANIFEST
    known: dict[str, int] = {}
    classes = None
    if manifest.exists():
        meta = read_manifest(manifest)
        classes = meta.get("classes")
        for part in meta["splits"].values():
            known.update(zip(part["shards"], part["counts"]))
    counts = []
    for s in shards:
        if Path(s).name in known:
            _check_count(s, known[Path(s).name], manifest)
            counts.append(known[Path(s).name])
        else:
            counts.append(count_shard(s))
    return counts, classes


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
