"""Which sample indices a rank sees in an epoch: a pure function of ``(seed, epoch)``, so nothing to save.

``ShardedSampler`` is ``DistributedSampler``'s rule: one seeded permutation of the dataset per epoch, cut to
a multiple of ``world_size`` (``drop_last``) or padded by wrapping around, rank ``r`` taking positions
``r, r + world_size, ...`` (``pad=False``: no padding, ranks differ by at most one sample -- evaluation). ``RepeatedAugSampler`` is DeiT's repeated augmentation (Hoffer et al. 2020,
DeiT's ``RASampler``): every index of the permutation repeated ``repeats`` times in a row before the cut, so
the copies of one image land on different ranks in the same step and get different augmentations; by
default an epoch keeps the length of a plain one (``len(dataset)`` samples in all, rounded down to a
multiple of ``select_round`` as DeiT does), ``full_epoch=True`` keeps all ``repeats * len(dataset)``.
"""

from __future__ import annotations

import hashlib
import math

import torch
from torch import Tensor


def derive_seed(*parts: int | str) -> int:
    """A well-mixed 63-bit seed from integers (nearby inputs give unrelated streams)."""
    digest = hashlib.blake2b(",".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class ShardedSampler:
    """This rank's indices of a dataset of ``n`` samples for an epoch (see the module docstring)."""

    def __init__(
        self,
        n: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        drop_last: bool = False,
        pad: bool = True,
    ) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"need 0 <= rank < world_size, got rank {rank} of {world_size}")
        if n < world_size:
            raise ValueError(f"dataset of {n} samples cannot be sharded over {world_size} ranks")
        self.n, self.shuffle, self.seed, self.rank, self.world_size = n, shuffle, seed, rank, world_size
        self.drop_last, self.pad = drop_last, pad

    def order(self, epoch: int) -> Tensor:
        """The epoch's global sequence of indices before it is cut into ranks."""
        if not self.shuffle:
            return torch.arange(self.n)
        return torch.randperm(self.n, generator=torch.Generator().manual_seed(derive_seed(self.seed, epoch)))

    @property
    def total(self) -> int:
        """Length of the global sequence after the cut or padding, a multiple of ``world_size``."""
        n, ws = self.n, self.world_size
        return (n // ws if self.drop_last else math.ceil(n / ws)) * ws

    @property
    def num_samples(self) -> int:
        """Samples per rank per epoch."""
        if not (self.pad or self.drop_last):  # every sample exactly once over the ranks (evaluation)
            return len(range(self.rank, self.n, self.world_size))
        return self.total // self.world_size

    def indices(self, epoch: int) -> Tensor:
        """This rank's indices for ``epoch``, in order."""
        order = self.order(epoch)
        if not (self.pad or self.drop_last):
            return order[self.rank :: self.world_size]
        if self.total > len(order):  # pad by wrapping around (world_size <= n, so once suffices)
            order = torch.cat([order, order[: self.total - len(order)]])
        return order[self.rank : self.total : self.world_size][: self.num_samples]

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(n={self.n}, shuffle={self.shuffle}, rank={self.rank}/{self.world_size}, "
            f"{self.num_samples} per rank)"
        )


class RepeatedAugSampler(ShardedSampler):
    """DeiT's repeated-augmentation sampler (see the module docstring)."""

    def __init__(
        self,
        n: int,
        *,
        repeats: int = 3,
        shuffle: bool = True,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        select_round: int = 256,
        full_epoch: bool = False,
    ) -> None:
        if repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {repeats}")
        super().__init__(n, shuffle=shuffle, seed=seed, rank=rank, world_size=world_size)
        self.repeats, self.select_round, self.full_epoch = repeats, select_round, full_epoch

    def order(self, epoch: int) -> Tensor:
        return super().order(epoch).repeat_interleave(self.repeats)

    @property
    def total(self) -> int:
        return math.ceil(self.n * self.repeats / self.world_size) * self.world_size

    @property
    def num_samples(self) -> int:
        if self.full_epoch:
            return self.total // self.world_size
        n, r = self.n, self.select_round
        kept = n // r * r if r and n >= r else n  # DeiT: a plain epoch's length, a multiple of 256
        return max(1, kept // self.world_size)
