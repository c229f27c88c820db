"""DataLoader workers for streaming sources: per-sample decode + crop, batched augmentation, resumable.

Work is split in two stages. The per-sample stage (:func:`vitlab.data.crop.load_sample`: the crop box is
drawn from the header, the JPEG decoded at the smallest scale covering it, resampled, flipped) runs in
``torch.utils.data.DataLoader`` worker processes; the batch stage (RandAugment, colour jitter, normalisation,
random erasing: the batched ops of :mod:`vitlab.data.transforms`) runs by default where the batch is consumed,
on the training device or the main process (``transform_on_device=True``): workers send uint8 crops, a quarter
of the bytes of float batches, and the shared-memory pages each batch crosses in are what a worker pays most
for after decoding (measured with one worker: 717-783 images/s this way, 553-573 with the stage in the worker;
equal with two workers on two cores). ``transform_on_device=False`` runs it in the workers. Mixup/CutMix and
MixToken run on the main process.

Every random choice derives from ``(seed, epoch, rank, batch)``: batch ``b`` of this rank's epoch has its own
seed (its crop boxes are drawn at once from the images' headers, then its augmentations), so what a batch
contains does not depend on the number of workers or on which worker made it, and resuming at ``(epoch, batch)`` (:meth:`StreamLoader.load_state_dict`) reproduces the
uninterrupted run's batches bit for bit. Workers are seeded from a loader-private generator, so creating
them never draws from the training process's RNG.

A file that cannot be decoded is warned once with its path and counted; in training it is replaced by the
next readable index (same seed), so that every rank's batch keeps its size; in evaluation it is skipped, never
replaced (a replacement would be counted twice): the loader's ``bad_files`` says how many. Past
``max_bad_fraction`` of the dataset the run stops with one line naming the count.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from .crop import load_sample, load_samples
from .decode import UnreadableImage
from .geometry import CropSpec
from .loader import BatchOp, resume_point
from .samplers import ShardedSampler, derive_seed
from .tokenlabel import crop_dense

MAX_SUBSTITUTES = 16  # readable neighbours tried in place of an unreadable file


@dataclass(frozen=True)
class BatchPlan:
    """What one batch holds: its number in the epoch, its seed, the dataset indices."""

    batch: int
    seed: int
    indices: np.ndarray


@dataclass
class StreamBatch:
    """A worker's batch: images (float, or uint8 when the batch stage runs on the device), labels, dense
    targets ``(classes, weights)`` or None, unreadable files met, the batch's seed."""

    images: Tensor
    labels: Tensor
    dense: tuple[Tensor, Tensor] | None
    bad: tuple[str, ...]
    seed: int

    def pin_memory(self) -> StreamBatch:
        dense = None if self.dense is None else tuple(d.pin_memory() for d in self.dense)
        return StreamBatch(self.images.pin_memory(), self.labels.pin_memory(), dense, self.bad, self.seed)


def _batch_generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


class MapStream(torch.utils.data.Dataset):
    """A map-style source (``read(i) -> (file, label)``) behind the two stages; ``__getitems__(plan)``."""

    def __init__(
        self,
        source,
        crop: CropSpec,
        batch_transform: Callable[[Tensor, torch.Generator], Tensor] | None = None,
        *,
        decoder: str = "pillow",
        dense_grid: tuple[int, int] | None = None,
        transform_on_device: bool = True,
    ) -> None:
        self.source, self.crop, self.batch_transform, self.decoder = source, crop, batch_transform, decoder
        self.dense_grid, self.transform_on_device = dense_grid, transform_on_device

    def __len__(self) -> int:
        return len(self.source)

    def _dense(self, i: int, box) -> tuple[Tensor, Tensor] | None:
        if self.dense_grid is None:
            return None
        from .sources import read_dense

        return crop_dense(read_dense(self.source.dense_path(i)), box, self.dense_grid)

    def substitute(self, index: int, seed: int, bad: list[str]):
        """The first readable file after ``index`` (its own seed), for a file that could not be decoded."""
        for k in range(1, MAX_SUBSTITUTES):
            i = (index + k) % len(self.source)
            path, label = self.source.read(i)
            try:
                img, box = load_sample(path, self.crop, _batch_generator(derive_seed(seed, k)), self.decoder)
            except UnreadableImage as e:
                bad.append(str(e))
                continue
            return img, label, self._dense(i, box)
        raise ValueError(f"{MAX_SUBSTITUTES} files in a row cannot be decoded, the last: {bad[-1]}")

    def __getitems__(self, plan: BatchPlan) -> StreamBatch:
        files = [self.source.read(int(i)) for i in plan.indices]
        loaded = load_samples([f for f, _ in files], self.crop, _batch_generator(plan.seed), self.decoder)
        samples, bad = [], []
        for i, (_, label), result in zip(plan.indices, files, loaded):
            if isinstance(result, UnreadableImage):
                bad.append(str(result))
                if self.crop.train:  # evaluation skips it: a substitute would be counted twice
                    samples.append(self.substitute(int(i), derive_seed(plan.seed, int(i)), bad))
            else:
                samples.append((result[0], label, self._dense(int(i), result[1])))
        transform = None if self.transform_on_device else self.batch_transform
        return collate(samples, plan.seed, transform, tuple(bad))

    def __getitem__(self, index: int):
        img, box = load_sample(self.source.read(index)[0], self.crop, _batch_generator(index), self.decoder)
        return img, self.source.read(index)[1], self._dense(index, box)


def collate(samples: list, seed: int, batch_transform, bad: tuple[str, ...] = ()) -> StreamBatch:
    """Stack per-sample results into a :class:`StreamBatch`, applying the batch stage when given (none: an
    empty batch, every file of it unreadable, which the loader counts and skips)."""
    if not samples:
        return StreamBatch(torch.empty(0, dtype=torch.uint8), torch.empty(0, dtype=torch.long), None, bad, seed)
    images = torch.stack([s[0] for s in samples])
    labels = torch.tensor([s[1] for s in samples], dtype=torch.long)
    dense = None
    if samples[0][2] is not None:
        dense = (torch.stack([s[2][0] for s in samples]), torch.stack([s[2][1] for s in samples]))
    if batch_transform is not None:
        images = batch_transform(images, _batch_generator(seed))
    return StreamBatch(images, labels, dense, bad, seed)


def _first(batch):  # DataLoader's collate_fn: __getitems__ already built the batch
    return batch


class _PlanSampler:
    """The DataLoader's batch sampler: this rank's batches of the current epoch from ``start`` on."""

    def __init__(self, sampler: ShardedSampler, batch_size: int, drop_last: bool, seed: int) -> None:
        self.sampler, self.batch_size, self.drop_last, self.seed = sampler, batch_size, drop_last, seed
        self.epoch, self.start = 0, 0

    def __len__(self) -> int:
        n, bs = self.sampler.num_samples, self.batch_size
        return n // bs if self.drop_last else math.ceil(n / bs)

    def __iter__(self) -> Iterator[BatchPlan]:
        idx, bs, rank = self.sampler.indices(self.epoch).numpy(), self.batch_size, self.sampler.rank
        for b in range(self.start, len(self)):
            yield BatchPlan(b, derive_seed(self.seed, self.epoch, rank, "batch", b), idx[b * bs : (b + 1) * bs])


class StreamLoader:
    """Batches ``(images, labels)`` -- ``(images, labels, (classes, weights))`` with dense targets -- through
    DataLoader workers from a :class:`MapStream` (with a sampler) or a shard stream (an IterableDataset that
    makes its own batches); the interface of :class:`~vitlab.data.BatchLoader` (``set_epoch``, ``len``,
    ``state_dict``/``load_state_dict``) so a training loop drives both alike."""

    def __init__(
        self,
        dataset: torch.utils.data.Dataset,
        batch_size: int,
        sampler: ShardedSampler | None = None,
        *,
        drop_last: bool = False,
        seed: int = 0,
        mix: BatchOp | None = None,
        device: torch.device | str | None = None,
        workers: int = 0,
        pin_memory: bool | None = None,
        persistent_workers: bool = True,
        prefetch_factor: int = 2,
        max_bad_fraction: float = 0.01,
    ) -> None:
        if batch_size < 1 or workers < 0 or not 0 <= max_bad_fraction <= 1:
            raise ValueError(f"need batch_size >= 1, workers >= 0, max_bad_fraction in [0, 1]; got {batch_size}, "
                             f"{workers}, {max_bad_fraction}")  # fmt: skip
        self.dataset, self.batch_size, self.seed, self.mix = dataset, batch_size, seed, mix
        self.device = torch.device(device) if device is not None else None
        self.iterable = isinstance(dataset, torch.utils.data.IterableDataset)
        if not self.iterable and sampler is None:
            raise ValueError("a map-style dataset needs a sampler")
        self.plans = None if self.iterable else _PlanSampler(sampler, batch_size, drop_last, seed)
        self.epoch, self.start = 0, 0
        self.workers, self.max_bad_fraction = workers, max_bad_fraction
        self.num_images = len(dataset.source)
        pin = self.device is not None and self.device.type == "cuda" if pin_memory is None else pin_memory
        self._loader_kwargs = dict(
            num_workers=workers,
            pin_memory=pin,
            persistent_workers=persistent_workers and workers > 0,
            prefetch_factor=prefetch_factor if workers > 0 else None,
        )
        self._loader: torch.utils.data.DataLoader | None = None
        self.bad_files: dict[str, str] = {}  # path -> reason, warned once each

    @property
    def sampler(self) -> ShardedSampler | None:
        return None if self.plans is None else self.plans.sampler

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        if not 0 <= start_batch <= len(self):
            raise ValueError(f"start_batch must be in [0, {len(self)}], got {start_batch}")
        self.epoch, self.start = epoch, start_batch

    def __len__(self) -> int:
        return len(self.dataset) if self.plans is None else len(self.plans)

    def state_dict(self) -> dict[str, Any]:
        """The epoch and how many of its batches were handed out; the seed and epoch length to check against
        (and, for shards, the worker count, which decides what each worker reads)."""
        state = {"epoch": self.epoch, "batch": self.start, "seed": self.seed, "num_batches": len(self)}
        return state | ({"workers": self.workers} if self.iterable else {})

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.iterable and int(state.get("workers", self.workers)) != self.workers:
            raise ValueError(
                f"this shard stream was saved with {state['workers']} workers per process; resume with --workers "
                f"{state['workers']} (each worker's share of the shards depends on it)"
            )
        self.set_epoch(*resume_point(state, self.seed, len(self)))

    def _dataloader(self) -> torch.utils.data.DataLoader:
        if self._loader is None:
            batching = {"batch_size": None} if self.iterable else {"batch_sampler": self.plans}
            self._loader = torch.utils.data.DataLoader(
                self.dataset,
                collate_fn=_first,
                generator=torch.Generator().manual_seed(derive_seed(self.seed, "workers")),
                **batching,
                **self._loader_kwargs,
            )
        return self._loader

    def _count_bad(self, bad: tuple[str, ...]) -> None:
        for reason in bad:
            path = reason.split(": ", 1)[0]
            if path not in self.bad_files:
                self.bad_files[path] = reason
                warnings.warn(f"unreadable image skipped ({len(self.bad_files)} so far): {reason}", stacklevel=2)
        if len(self.bad_files) > self.max_bad_fraction * self.num_images:
            raise ValueError(
                f"{len(self.bad_files)} of {self.num_images} images cannot be decoded (more than "
                f"{self.max_bad_fraction:.1%}), e.g. {next(iter(self.bad_files.values()))}; repair or remove them"
            )

    def finish(self, sb: StreamBatch):
        """Main-process end of a batch: count bad files, move to the device, batch stage there, mixing."""
        self._count_bad(sb.bad)
        x, y, dense = sb.images, sb.labels, sb.dense
        if self.device is not None:
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            if dense is not None:
                dense = tuple(d.to(self.device, non_blocking=True) for d in dense)
        if x.dtype == torch.uint8:
            bt = self.dataset.batch_transform
            x = bt(x, _batch_generator(sb.seed)) if bt is not None else x.float().div_(255)
        if self.mix is not None:
            g = _batch_generator(derive_seed(sb.seed, "mix"))
            if dense is not None:
                return self.mix(x, y, dense, g)
            x, y = self.mix(x, y, g)
        return (x, y) if dense is None else (x, y, dense)

    def __iter__(self) -> Iterator[tuple]:
        if self.start >= len(self):  # a finished pass starts over (as BatchLoader)
            self.start = 0
        if self.plans is not None:
            self.plans.epoch, self.plans.start = self.epoch, self.start
        else:
            self.dataset.position.copy_(torch.tensor([self.epoch, self.start]))
        try:
            for sb in self._dataloader():
                self.start += 1
                if len(sb.labels):
                    yield self.finish(sb)
                    continue
                self._count_bad(sb.bad)
                if getattr(self.dataset, "train", False):  # a rank skipping a step would stall the others
                    raise ValueError(f"no image of a training batch can be decoded ({len(sb.bad)} unreadable, "
                                     f"e.g. {sb.bad[0]}); repair or remove them")  # fmt: skip
        except (ValueError, FileNotFoundError) as e:
            raise type(e)(_worker_message(e)) from None

    def close(self) -> None:
        """Stop the persistent workers (also done when the loader is garbage collected)."""
        self._loader = None

    def __repr__(self) -> str:
        return (
            f"StreamLoader({self.num_images} images, batch_size={self.batch_size}, workers={self.workers}, "
            f"{len(self)} batches per epoch)"
        )


def _worker_message(e: BaseException) -> str:
    """The original one-line message of an error re-raised from a DataLoader worker (which adds a traceback)."""
    text = str(e)
    if "Original Traceback" not in text:
        return text
    last = text.strip().splitlines()[-1]
    return last.split(": ", 1)[1] if ": " in last else last
