"""A single-process batch iterator over in-memory datasets, deterministic and DDP-aware.

The sample order of an epoch is a pure function of ``(seed, epoch)``, and batch ``b``'s augmentation
a pure function of ``(seed, epoch, rank, b)``: resuming at an epoch (or at a batch inside it, via
``set_epoch(epoch, start_batch)``) reproduces exactly the batches an uninterrupted run would have seen.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterator

import torch
from torch import Tensor

BatchOp = Callable[[Tensor, Tensor, torch.Generator], tuple[Tensor, Tensor]]


def derive_seed(*parts: int) -> int:
    """A well-mixed 63-bit seed from integers (nearby inputs give unrelated streams)."""
    digest = hashlib.blake2b(",".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class BatchLoader:
    """Yields ``(images, labels)`` batches: images float, transformed (``transform(x_uint8, g)``, or just
    scaled to ``[0, 1]``), labels int64 or soft targets when a ``mix`` batch op (e.g. MixupCutmix) is given.

    Sharding follows ``DistributedSampler``: the global permutation is cut to a multiple of
    ``world_size`` (``drop_last``) or padded by wrapping around, and rank ``r`` takes positions
    ``r, r + world_size, ...``, so ranks get disjoint, equal-size shards (padding repeats a few samples).
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
    ) -> None:
        if batch_size < 1 or world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"need batch_size >= 1 and 0 <= rank < world_size, got {batch_size}, {rank}, {world_size}")
        if len(dataset) < world_size:
            raise ValueError(f"dataset of {len(dataset)} samples cannot be sharded over {world_size} ranks")
        self.dataset, self.batch_size, self.shuffle, self.drop_last = dataset, batch_size, shuffle, drop_last
        self.transform, self.mix, self.seed, self.rank, self.world_size = transform, mix, seed, rank, world_size
        self.device = torch.device(device) if device is not None else None
        self.epoch, self.start_batch = 0, 0

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        """Select the epoch (its order) and the batch to start from, for resuming mid-epoch."""
        if not 0 <= start_batch <= len(self):
            raise ValueError(f"start_batch must be in [0, {len(self)}], got {start_batch}")
        self.epoch, self.start_batch = epoch, start_batch

    @property
    def num_samples(self) -> int:
        """Samples per rank per epoch."""
        n, ws = len(self.dataset), self.world_size
        return n // ws if self.drop_last else math.ceil(n / ws)

    def __len__(self) -> int:
        n, bs = self.num_samples, self.batch_size
        return n // bs if self.drop_last else math.ceil(n / bs)

    def indices(self, epoch: int | None = None) -> Tensor:
        """This rank's sample indices for ``epoch`` (default: the current one), in order."""
        epoch = self.epoch if epoch is None else epoch
        n = len(self.dataset)
        if self.shuffle:
            order = torch.randperm(n, generator=torch.Generator().manual_seed(derive_seed(self.seed, epoch)))
        else:
            order = torch.arange(n)
        total = self.num_samples * self.world_size
        if total > n:
            order = torch.cat([order, order[: total - n]])  # wrap around (world_size <= n, so this suffices)
        return order[self.rank : total : self.world_size]

    def _fetch(self, idx: Tensor) -> tuple[Tensor, Tensor]:
        if hasattr(self.dataset, "get_batch"):
            return self.dataset.get_batch(idx)
        items = [self.dataset[int(i)] for i in idx]
        return torch.stack([x for x, _ in items]), torch.tensor([int(y) for _, y in items])

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        idx, bs = self.indices(), self.batch_size
        for b in range(self.start_batch, len(self)):
            x, y = self._fetch(idx[b * bs : (b + 1) * bs])
            if self.device is not None:
                x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            g = torch.Generator().manual_seed(derive_seed(self.seed, self.epoch, self.rank, b))
            if self.transform is not None:
                x = self.transform(x, g)
            elif x.dtype == torch.uint8:
                x = x.float().div_(255)
            if self.mix is not None:
                x, y = self.mix(x, y, g)
            yield x, y

    def __repr__(self) -> str:
        return (
            f"BatchLoader({len(self.dataset)} samples, batch_size={self.batch_size}, shuffle={self.shuffle}, "
            f"drop_last={self.drop_last}, rank={self.rank}/{self.world_size}, {len(self)} batches)"
        )
