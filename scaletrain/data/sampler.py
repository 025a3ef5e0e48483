"""Any map-style dataset read as the trainer reads its own: ``ShardedSampler``.

    sampler = ShardedSampler(len(dataset), batch_size=8, rank=dist.get_rank(), replicas=dist.get_world_size())
    loader = DataLoader(dataset, batch_size=8, sampler=sampler)

The dataset's indices form one endless stream (data/batches.py's rule):
sample i is item ``perm_e[i % n]`` of epoch ``e = i // n``, the permutation
drawn from a generator seeded by (seed, e) alone, so every item is seen once
per epoch and every epoch is shuffled anew. Micro-batch k of rank r of R
reading ranks holds samples

    ((k * R) + r) * B  ...  ((k * R) + r) * B + B - 1

so the R ranks read disjoint slices of the same global batch of R * B
samples, one process with batch R * B reads exactly their union, and a run
that resumes after K micro-batches (``start=K``) reads what it would have
read had it never stopped: no sampler state to save, no communication.
``start`` may also be a function, read when iteration begins: the engine's
sampler (library.py) starts where the engine stands when the loop reaches it,
whether the sampler was built before ``engine.load`` or after.
torch's ``DistributedSampler`` deals each epoch out rank by rank instead,
pads the last round by repeating items, and needs ``set_epoch`` to reshuffle;
a different layout then reads a different batch at the same step.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator

import torch
from torch.utils.data import Sampler

from scaletrain.data.batches import _Batches
from scaletrain.errors import UserError


class ShardedSampler(_Batches, Sampler[int]):
    """This rank's indices of a dataset of ``size`` items, ``batch_size`` per micro-batch, from
    micro-batch ``start`` (to resume; a function: read as iteration begins) to ``stop`` (None:
    endless; module docstring)."""

    def __init__(self, size: int, batch_size: int, *, rank: int = 0, replicas: int = 1, seed: int = 0,
                 shuffle: bool = True, start: int | Callable[[], int] = 0, stop: int | None = None):
        if size < 1:
            raise UserError(f"the dataset has {size} items; a sampler needs at least one.")
        if batch_size < 1 or replicas < 1 or not 0 <= rank < replicas:
            raise UserError(f"batch_size {batch_size}, rank {rank} of {replicas} replicas: give a batch size of "
                            f"1 or more and a rank from 0 to replicas - 1.")
        first = start if isinstance(start, int) else 0
        if first < 0 or (stop is not None and stop < first):
            raise UserError(f"micro-batches from {first} to {stop}: give 0 <= start <= stop.")
        super().__init__(size, seed, shuffle)
        self.batch_size, self.rank, self.replicas = batch_size, rank, replicas
        self._start, self.stop = start, stop
        self.reading_from: int | None = None  # the first micro-batch of the iteration under way

    @property
    def start(self) -> int:
        """The micro-batch the next iteration begins at."""
        return self._start if isinstance(self._start, int) else self._start()

    @property
    def micro_batches_per_epoch(self) -> int:
        """Micro-batches each rank reads per pass over the dataset (whole global batches only)."""
        return self.num_samples // (self.batch_size * self.replicas)

    def micro_batch(self, k: int) -> torch.Tensor:
        """The dataset indices of this rank's micro-batch ``k``."""
        return self._items((k * self.replicas + self.rank) * self.batch_size, self.batch_size)

    def _gather(self, items: torch.Tensor) -> torch.Tensor:
        return items

    def __iter__(self) -> Iterator[int]:
        start = self.start
        steps = itertools.count(start) if self.stop is None else range(start, self.stop)
        self.reading_from = start
        try:
            for k in steps:
                yield from self.micro_batch(k).tolist()
        finally:  # ended, or left by the loop (the iterator closed)
            self.reading_from = None

    def __len__(self) -> int:
        if self.stop is None:
            raise TypeError("an endless ShardedSampler has no length; give stop= for one")
        return max(self.stop - self.start, 0) * self.batch_size
