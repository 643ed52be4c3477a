"""Which samples each rank reads in an epoch: a distributed sampler, written from scratch.

Data parallelism needs every rank to read a *different* part of the data each step, and the
ranks together to read every sample once per epoch. The recipe (the same as torch's
``DistributedSampler``, so the two can be swapped):

1. all ranks draw the same permutation of 0..n-1 from a generator seeded with ``seed + epoch``
   (same seed everywhere, so no communication is needed; a new epoch, a new order);
2. pad it to a multiple of world_size by repeating its first indices (``drop_last=False``), or
   cut it down to one (``drop_last=True``), so every rank gets the same number of samples
   -- otherwise one rank would run a step fewer and the others would wait in its allreduce;
3. rank r takes every world_size-th index starting at r.

    n = 10, world_size = 4, permutation 7 2 9 0 5 3 8 1 6 4 | padded with 7 2
    rank 0: 7 5 6            rank 2: 9 8 7
    rank 1: 2 3 4            rank 3: 0 1 2     (7 and 2 are read twice this epoch)

With ``drop_last=True`` the permutation is cut to 8: ranks get 2 samples each, 2 samples are
skipped this epoch (different ones next epoch).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

__all__ = ["DistributedSampler"]


class DistributedSampler:
    """Indices of rank ``rank`` of ``world_size`` for one epoch; call ``set_epoch`` before each epoch.

    ``len(sampler)`` is ceil(n / world_size) (``drop_last=False``) or floor(n / world_size).
    """

    def __init__(
        self,
        num_samples: int,
        rank: int,
        world_size: int,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = False,
    ) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be at least 1, got {world_size}")
        if not 0 <= rank < world_size:
            raise ValueError(
                f"rank {rank} is outside 0..{world_size - 1}: pass comm.rank and comm.world_size"
            )
        if num_samples < 0:
            raise ValueError(f"num_samples must be >= 0, got {num_samples}")
        if num_samples == 0 and not drop_last:
            raise ValueError("no samples to pad from: the dataset is empty")
        self.num_samples = num_samples
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch's order; every rank must call it with the same epoch."""
        self.epoch = epoch

    def __len__(self) -> int:
        if self.drop_last:
            return self.num_samples // self.world_size
        return -(-self.num_samples // self.world_size)  # ceil

    def __iter__(self) -> Iterator[int]:
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.num_samples, generator=generator).tolist()
        else:
            order = list(range(self.num_samples))
        total = len(self) * self.world_size
        if total > len(order):  # pad: repeat the start of the order, as often as needed
            repeats = -(-total // len(order))
            order = (order * repeats)[:total]
        else:
            order = order[:total]
        return iter(order[self.rank : total : self.world_size])
