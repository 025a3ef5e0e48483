"""Batches as a pure function of (seed, sample index).

Samples are numbered 0, 1, 2, ... across epochs. Sample i belongs to epoch
e = i // n at position p = i % n, and is item perm_e[p], where perm_e is a
permutation drawn from a generator seeded with (seed, e) alone. So:

* a trainer resumes exactly by knowing how many samples it has consumed;
* data-parallel ranks read disjoint slices `get(first + rank * k, k)` of the
  same global batch, with no communication and no sampler state;
* every item is seen exactly once per epoch.

`TokenBatches` cuts a token stream into non-overlapping windows for language
modelling; `ArrayBatches` serves in-memory (inputs, targets) tensors. They
share the ordering rule and differ only in how they gather items.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from scaletrain.errors import UserError

# A target the loss leaves out (a prompt token, padding, a document's end in a packed row):
# torch's ignore_index, which every loss of the trainer honours.
IGNORE_INDEX = -100

# Keeps the per-epoch seeds of nearby run seeds apart (seed 1 epoch 0 vs seed 0 epoch 1).
_EPOCH_SEED_STRIDE = 1_000_003


class _Batches:
    """Ordering over `n` items; subclasses gather the items themselves."""

    # Whether every target counts in the loss (none is IGNORE_INDEX): the trainer then knows
    # the number of trained tokens without counting them (job/trainer.py).
    every_target_trained = True

    def __init__(self, n: int, seed: int, shuffle: bool):
        self._n = n
        self._seed = seed
        self._shuffle = shuffle
        # Calls mostly stay within one epoch, so its permutation is kept.
        self._epoch = -1
        self._order = torch.empty(0, dtype=torch.long)

    @property
    def num_samples(self) -> int:
        """Items per epoch."""
        return self._n

    def _epoch_order(self, epoch: int) -> torch.Tensor:
        if epoch != self._epoch:
            if self._shuffle:
                generator = torch.Generator().manual_seed(self._seed * _EPOCH_SEED_STRIDE + epoch)
                self._order = torch.randperm(self._n, generator=generator)
            else:
                self._order = torch.arange(self._n)
            self._epoch = epoch
        return self._order

    def _items(self, first: int, count: int) -> torch.Tensor:
        if first < 0 or count < 0:
            raise ValueError(f"sample range must be non-negative, got first={first}, count={count}")
        items = torch.empty(count, dtype=torch.long)
        done = 0
        # A range may span several epochs; each part reads its own epoch's order.
        while done < count:
            epoch, position = divmod(first + done, self._n)
            take = min(self._n - position, count - done)
            items[done : done + take] = self._epoch_order(epoch)[position : position + take]
            done += take
        return items

    def _gather(self, items: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def get(self, first: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Samples `first .. first + count - 1` of the endless stream, as (inputs, targets)."""
        return self._gather(self._items(first, count))

    def get_samples(self, samples: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The samples of the endless stream at the given indices (data/mixture.py draws them)."""
        items = torch.empty(len(samples), dtype=torch.long)
        for i, sample in enumerate(samples.tolist()):
            epoch, position = divmod(sample, self._n)
            items[i] = self._epoch_order(epoch)[position]
        return self._gather(items)

    def eval_batches(
        self, batch_size: int, max_batches: int | None = None
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Items in their stored order, `batch_size` at a time (the last may be short)."""
        starts = range(0, self._n, batch_size)
        if max_batches is not None:
            starts = starts[:max_batches]
        for start in starts:
            yield self._gather(torch.arange(start, min(start + batch_size, self._n)))


class TokenBatches(_Batches):
    """Non-overlapping windows of `seq_len` tokens; targets are inputs shifted by one."""

    def __init__(self, tokens: np.ndarray, seq_len: int, seed: int = 0, shuffle: bool = True):
        if seq_len < 1:
            raise UserError(f"--seq-len is {seq_len}; use a sequence length of at least 1.")
        n = (len(tokens) - 1) // seq_len
        if n == 0:
            raise UserError(
                f"The corpus has {len(tokens)} tokens, fewer than one sequence of {seq_len + 1}; "
                f"give more text or a smaller --seq-len."
            )
        super().__init__(n, seed, shuffle)
        self._tokens = tokens
        self._seq_len = seq_len

    @property
    def tokens(self) -> int:
        """The tokens of the stream its windows are cut from."""
        return len(self._tokens)

    def _gather(self, items: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # One extra token per window supplies the last target.
        offsets = items.numpy()[:, None] * self._seq_len + np.arange(self._seq_len + 1)
        windows = torch.from_numpy(np.asarray(self._tokens[offsets], dtype=np.int64))
        # Contiguous, so callers may .view() them.
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()


class ArrayBatches(_Batches):
    """Rows of in-memory `inputs` and `targets` tensors."""

    def __init__(self, inputs: torch.Tensor, targets: torch.Tensor, seed: int = 0, shuffle: bool = True):
        if len(inputs) != len(targets):
            raise ValueError(f"inputs have {len(inputs)} rows but targets have {len(targets)}")
        if len(inputs) == 0:
            raise ValueError("ArrayBatches needs at least one sample")
        super().__init__(len(inputs), seed, shuffle)
        self._inputs = inputs
        self._targets = targets

    def _gather(self, items: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self._inputs[items], self._targets[items]


def _validation_tokens(n_tokens: int, val_fraction: float, seq_len: int) -> int:
    # Each part needs one whole sequence plus the token after it.
    return max(int(n_tokens * val_fraction), seq_len + 1)


def corpus_too_short(n_tokens: int, val_fraction: float, seq_len: int) -> bool:
    """Whether `n_tokens` leave training or validation without one whole sequence."""
    return n_tokens - _validation_tokens(n_tokens, val_fraction, seq_len) < seq_len + 1


def check_corpus_length(n_tokens: int, val_fraction: float, seq_len: int) -> None:
    if not 0 < val_fraction < 1:
        raise UserError(f"--val-fraction is {val_fraction}; use a value between 0 and 1.")
    if corpus_too_short(n_tokens, val_fraction, seq_len):
        raise UserError(
            f"The corpus has {n_tokens} tokens, too few for a sequence of {seq_len + 1} in both training "
            f"and validation with --val-fraction {val_fraction}; give more text or a smaller --seq-len."
        )


def split_tokens(tokens: np.ndarray, val_fraction: float, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """The tokens before and after the cut: training first, the last `val_fraction` for validation."""
    check_corpus_length(len(tokens), val_fraction, seq_len)
    cut = len(tokens) - _validation_tokens(len(tokens), val_fraction, seq_len)
    return tokens[:cut], tokens[cut:]
