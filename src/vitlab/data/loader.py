"""A single-process batch iterator over in-memory datasets, deterministic and DDP-aware.

The sample order of an epoch is a pure function of ``(seed, epoch)``, and batch ``b``'s augmentation
a pure function of ``(seed, epoch, rank, b)``: resuming at an epoch (or at a batch inside it, via
``set_epoch(epoch, start_batch)``) reproduces exactly the batches an uninterrupted run would have seen.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor

from .samplers import ShardedSampler, derive_seed

BatchOp = Callable[[Tensor, Tensor, torch.Generator], tuple[Tensor, Tensor]]


class BatchLoader:
    """Yields ``(images, labels)`` batches: images float, transformed (``transform(x_uint8, g)``, or just
    scaled to ``[0, 1]``), labels int64 or soft targets when a ``mix`` batch op (e.g. MixupCutmix) is given.

    Sharding follows ``DistributedSampler`` (:class:`ShardedSampler`): the global permutation is cut to a
    multiple of ``world_size`` (``drop_last``) or padded by wrapping around, and rank ``r`` takes positions
    ``r, r + world_size, ...``, so ranks get disjoint, equal-size shards (padding repeats a few samples).
    Another sampler (e.g. :class:`RepeatedAugSampler`) can be passed as ``sampler``.
    """

    def __init__(
        self,
        dataset,
        batch_size: int,
        shuffle: bool = True,
        drop_last: bool = False,
        transform: Callable[[Tensor, torch.Generator], Tensor] | None = None,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        mix: BatchOp | None = None,
        device: torch.device | str | None = None,
        sampler: ShardedSampler | None = None,
    ) -> None:
        if batch_size < 1 or world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"need batch_size >= 1 and 0 <= rank < world_size, got {batch_size}, {rank}, {world_size}")
        self.sampler = sampler or ShardedSampler(
            len(dataset), shuffle=shuffle, seed=seed, rank=rank, world_size=world_size, drop_last=drop_last
        )
        self.dataset, self.batch_size, self.shuffle, self.drop_last = dataset, batch_size, shuffle, drop_last
        self.transform, self.mix, self.seed, self.rank, self.world_size = transform, mix, seed, rank, world_size
        self.device = torch.device(device) if device is not None else None
        self.epoch, self.start_batch = 0, 0

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        """Select the epoch (its order) and the batch to start from, for resuming mid-epoch."""
        if not 0 <= start_batch <= len(self):
            raise ValueError(f"start_batch must be in [0, {len(self)}], got {start_batch}")
        self.epoch, self.start_batch = epoch, start_batch

    def state_dict(self) -> dict[str, Any]:
        """Where the loader stands: the epoch and how many of its batches were handed out (everything else
        derives from the seed)."""
        return {"epoch": self.epoch, "batch": self.start_batch, "seed": self.seed, "num_batches": len(self)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue where ``state`` stood (a finished epoch continues with the next one)."""
        self.set_epoch(*resume_point(state, self.seed, len(self)))

    @property
    def num_samples(self) -> int:
        """Samples per rank per epoch."""
        return self.sampler.num_samples

    def __len__(self) -> int:
        n, bs = self.num_samples, self.batch_size
        return n // bs if self.drop_last else math.ceil(n / bs)

    def indices(self, epoch: int | None = None) -> Tensor:
        """This rank's sample indices for ``epoch`` (default: the current one), in order."""
        return self.sampler.indices(self.epoch if epoch is None else epoch)

    def _fetch(self, idx: Tensor) -> tuple[Tensor, Tensor]:
        if hasattr(self.dataset, "get_batch"):
            return self.dataset.get_batch(idx)
        items = [self.dataset[int(i)] for i in idx]
        return torch.stack([x for x, _ in items]), torch.tensor([int(y) for _, y in items])

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        idx, bs = self.indices(), self.batch_size
        for b in range(self.start_batch % max(len(self), 1), len(self)):  # a finished pass starts over
            self.start_batch = b + 1  # the state a checkpoint taken after this batch records
            g = torch.Generator().manual_seed(derive_seed(self.seed, self.epoch, self.rank, b))
            yield self._batch(idx[b * bs : (b + 1) * bs], g)

    def _batch(self, idx: Tensor, g: torch.Generator) -> tuple[Tensor, Tensor]:
        """The batch of the samples ``idx``, its augmentation drawn from ``g`` (a subclass may read other data:
        image-mask pairs, :class:`vitlab.tasks.segmentation.SegLoader`)."""
        x, y = self._fetch(idx)
        if self.device is not None:
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        if self.transform is not None:
            x = self.transform(x, g)
        elif x.dtype == torch.uint8:
            x = x.float().div_(255)
        if self.mix is not None:
            x, y = self.mix(x, y, g)
        return x, y

    def __repr__(self) -> str:
        return (
            f"BatchLoader({len(self.dataset)} samples, batch_size={self.batch_size}, shuffle={self.shuffle}, "
            f"drop_last={self.drop_last}, rank={self.rank}/{self.world_size}, {len(self)} batches)"
        )


def resume_point(state: dict[str, Any], seed: int, num_batches: int) -> tuple[int, int]:
    """(epoch, batch) to continue from a loader ``state``; a state of another seed or epoch length is refused."""
    if int(state.get("seed", seed)) != seed or int(state.get("num_batches", num_batches)) != num_batches:
        raise ValueError(
            f"loader state (seed {state.get('seed')}, {state.get('num_batches')} batches per epoch) does not match "
            f"this loader (seed {seed}, {num_batches} batches per epoch): resume with the same data, batch size, "
            "world size and seed"
        )
    epoch, batch = int(state["epoch"]), int(state["batch"])
    return (epoch + 1, 0) if batch >= num_batches else (epoch, batch)
