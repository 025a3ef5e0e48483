"""Several data sources mixed by weight: ``--data a.jsonl:0.7 --data b.parquet:0.3``.

The mixed stream stays a pure function of the sample index, as every stream
here is (data/batches.py), so resumes and layouts see the same samples. It is
cut into blocks of ``BLOCK`` samples, and every block holds the same number
of samples of each source, the weights rounded to the block by largest
remainder:

    n_k = floor(w_k * BLOCK) + (one more for the largest remainders),  sum n_k = BLOCK

Inside block b the samples' sources are a permutation, seeded by (seed, b),
of n_0 zeros, n_1 ones, ...: the mixture is exact at every block's end and
shuffled within it. Sample p of block b comes from source k = order_b[p], and
is sample ``b * n_k + (how many k precede p in order_b)`` of source k's own
stream, which has its own epochs and shuffles. So a source is never read
faster than its weight says, and a small source simply goes round more
epochs than a large one (Megatron-LM's blended datasets choose the same way,
by a greedy error rule over a precomputed index; the block rule needs no
index and no pass over the run's length).

Validation reads each source's held-out samples in turn.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
import torch

from scaletrain.data.batches import _EPOCH_SEED_STRIDE

BLOCK = 1000  # samples per block: weights hold to 1/BLOCK


def block_counts(weights: Sequence[float], block: int = BLOCK) -> list[int]:
    """Samples of each source per block: the weights (normalized) rounded by largest remainder."""
    total = sum(weights)
    shares = [w / total * block for w in weights]
    counts = [int(share) for share in shares]
    by_remainder = sorted(range(len(shares)), key=lambda k: (counts[k] - shares[k], k))
    for k in by_remainder[:block - sum(counts)]:
        counts[k] += 1
    return counts


class Mixture:
    """Batches drawn from ``sources`` (each with ``get_samples`` and ``eval_batches``, as
    data/batches.py's streams have) in the proportions of ``weights``."""

    def __init__(self, sources: Sequence, weights: Sequence[float], seed: int = 0):
        self.sources = list(sources)
        self.counts = block_counts(weights)
        self._seed = seed
        self._block = -1
        self._order = np.empty(0, dtype=np.int64)
        self._rank = np.empty(0, dtype=np.int64)  # each position's count of earlier same-source positions

    @property
    def every_target_trained(self) -> bool:
        return all(source.every_target_trained for source in self.sources)

    @property
    def num_samples(self) -> int:
        return sum(source.num_samples for source in self.sources)

    def _block_order(self, block: int) -> tuple[np.ndarray, np.ndarray]:
        if block != self._block:
            sources = np.repeat(np.arange(len(self.counts)), self.counts)
            generator = torch.Generator().manual_seed(self._seed * _EPOCH_SEED_STRIDE + block)
            self._order = sources[torch.randperm(BLOCK, generator=generator).numpy()]
            self._rank = np.empty(BLOCK, dtype=np.int64)
            for k in range(len(self.counts)):
                where = self._order == k
                self._rank[where] = np.arange(where.sum())
            self._block = block
        return self._order, self._rank

    def locate(self, first: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        """Samples ``first .. first + count - 1`` as (source, index in that source's stream)."""
        sources, indices = np.empty(count, dtype=np.int64), np.empty(count, dtype=np.int64)
        for i, sample in enumerate(range(first, first + count)):
            block, position = divmod(sample, BLOCK)
            order, rank = self._block_order(block)
            sources[i] = order[position]
            indices[i] = block * self.counts[order[position]] + rank[position]
        return sources, indices

    def get(self, first: int, count: int) -> tuple[torch.Tensor, ...]:
        """Samples ``first .. first + count - 1`` of the mixed stream, each source's gathered at once."""
        sources, indices = self.locate(first, count)
        parts: list[tuple[torch.Tensor, ...] | None] = [None] * count
        for k in np.unique(sources):
            rows = np.flatnonzero(sources == k)
            gathered = self.sources[k].get_samples(torch.from_numpy(indices[rows]))
            for j, row in enumerate(rows):
                parts[row] = tuple(tensor[j] for tensor in gathered)
        return tuple(torch.stack(column) for column in zip(*parts))

    def eval_batches(self, batch_size: int, max_batches: int | None = None) -> Iterator[tuple[torch.Tensor, ...]]:
        """Each source's held-out batches in turn, ``max_batches`` in all."""
        served = 0
        for source in self.sources:
            for batch in source.eval_batches(batch_size):
                if max_batches is not None and served == max_batches:
                    return
                served += 1
                yield batch
