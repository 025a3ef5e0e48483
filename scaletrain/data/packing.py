"""Instruction examples as fixed-length rows: one example per row, or several packed into each.

The examples are the documents of a prepared token stream: example d is
``tokens[starts[d]:starts[d + 1]]`` with its loss mask (1 = trained) at the
same positions. An example of n tokens gives n - 1 (input, target) pairs,
inputs ``t[:-1]`` and targets ``t[1:]``, a target the mask leaves out being
`IGNORE_INDEX`.

Unpacked (``pack=False``), each row holds one example and pads the rest with
input 0 and target `IGNORE_INDEX`: simple, but short examples waste most of
a row. Packed (``pack=True``), a row holds several examples, each with its
index within the row in ``documents`` (0, 0, 0, 1, 1, 2, ...), the padding
after the last one counting as one more document. A model that attends
within a document only (a block-diagonal causal mask) and restarts positions
at each document trains on a packed row exactly as on its examples apart:
packing without cross-contamination (Krell et al. 2021, "Efficient Sequence
Packing without Cross-contamination").

Which examples share a row is decided once, from the lengths alone (``starts``,
never the tokens): Best-Fit Decreasing bin packing (Johnson 1973), as Ding et
al. 2024 ("Fewer Truncations Improve Language Modeling") pack documents for
pre-training. Examples go in decreasing length, each into the open row with
the least room that still fits it, or else a new row. It never uses more than
11/9 of the optimal number of rows plus one, and when examples are short
against the row it leaves almost nothing empty: ``fill`` reports the share
of positions used: above 0.99 for 2,000 examples drawn uniformly up to a quarter
of the row, and for 20,000 drawn up to the whole row (tests/test_packing.py).
The rows then follow `_Batches`' ordering rule: shuffled per epoch as a pure
function of (seed, epoch).
"""

from __future__ import annotations

from bisect import bisect_left, insort
from functools import cached_property

import numpy as np
import torch

from scaletrain.data.batches import IGNORE_INDEX, _Batches
from scaletrain.errors import UserError

TOO_LONG = ("truncate", "refuse")
# Tokens of mask read at a time when counting trained targets.
_MASK_CHUNK = 1 << 24
# What an example cut down to no trained target no longer does, in each split.
_EMPTIED_DO = {"train": "train nothing", "validation": "count in no validation loss"}


def best_fit_decreasing(sizes: np.ndarray, capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """Items of ``sizes`` (each 1..capacity) packed into rows of ``capacity``: (row_starts, items),
    row r holding ``items[row_starts[r]:row_starts[r + 1]]``, in ascending order.

    Open rows are kept by their room left, and the distinct rooms in a sorted list, so finding
    the best fit is a bisection: O(n log n) for n items, about a second per million.
    """
    rows: list[list[int]] = []
    rows_with_room: list[list[int]] = [[] for _ in range(capacity + 1)]
    rooms: list[int] = []  # sorted, each with at least one row
    sizes_list = sizes.tolist()
    for item in np.argsort(-sizes, kind="stable").tolist():
        size = sizes_list[item]
        at = bisect_left(rooms, size)
        if at == len(rooms):
            row, room = len(rows), capacity
            rows.append([])
        else:
            room = rooms[at]
            row = rows_with_room[room].pop()
            if not rows_with_room[room]:
                del rooms[at]
        rows[row].append(item)
        room -= size
        if room:
            if not rows_with_room[room]:
                insort(rooms, room)
            rows_with_room[room].append(row)
    row_starts = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum([len(row) for row in rows], out=row_starts[1:])
    items = np.fromiter((item for row in rows for item in sorted(row)), dtype=np.int64, count=len(sizes))
    return row_starts, items


class SequenceBatches(_Batches):
    """Rows of ``seq_len`` (input, target) pairs from instruction examples, packed or one per row.

    ``get`` returns (inputs, targets), and with ``pack`` also ``documents``, all int64
    [count, seq_len]. ``documents`` (a range of example numbers) picks the examples, for a
    training/validation split. An example longer than ``seq_len`` pairs keeps its first
    ``seq_len`` (counted in ``truncated``, those of them left with no trained target in
    ``emptied``) or, with ``too_long="refuse"``, stops the run.
    """

    every_target_trained = False

    def __init__(self, tokens, starts, mask, seq_len: int, *, pack: bool, too_long: str = "truncate",
                 seed: int = 0, shuffle: bool = True, documents: range | None = None):
        if seq_len < 1:
            raise UserError(f"--seq-len is {seq_len}; use a sequence length of at least 1.")
        if too_long not in TOO_LONG:
            raise ValueError(f"too_long must be one of {TOO_LONG}, got {too_long!r}")
        starts = np.asarray(starts, dtype=np.int64)
        documents = range(len(starts) - 1) if documents is None else documents
        chosen = np.arange(documents.start, documents.stop, documents.step, dtype=np.int64)
        if len(chosen) == 0:
            raise UserError("there are no examples to train on; give a data set with at least one record.")
        pairs = starts[chosen + 1] - starts[chosen] - 1
        if (pairs < 1).any():
            raise UserError(f"{int((pairs < 1).sum())} examples have fewer than 2 tokens, too few for one "
                            f"(input, target) pair; drop them from the data.")
        longer = pairs > seq_len
        if too_long == "refuse" and longer.any():
            raise UserError(f"{int(longer.sum())} examples are longer than --seq-len {seq_len} (the longest needs "
                            f"{int(pairs.max())}); raise --seq-len or pass --too-long truncate.")
        self.truncated = int(longer.sum())
        self._cut = np.flatnonzero(longer)
        self._kept = np.minimum(pairs, seq_len)
        self._first = starts[chosen]
        if pack:
            self._row_starts, self._row_items = best_fit_decreasing(self._kept, seq_len)
        else:
            self._row_starts, self._row_items = np.arange(len(chosen) + 1), np.arange(len(chosen))
        super().__init__(len(self._row_starts) - 1, seed, shuffle)
        self._tokens, self._mask, self._seq_len, self._pack = tokens, mask, seq_len, pack
        self.fill = float(self._kept.sum()) / (self.num_samples * seq_len)

    @property
    def examples(self) -> int:
        """The examples its rows hold (as many as the rows without packing)."""
        return len(self._first)

    @cached_property
    def trained_tokens(self) -> int:
        """Targets the loss counts, over every example once."""
        return int(self._trained_in(np.arange(len(self._first))).sum())

    @cached_property
    def emptied(self) -> int:
        """The cut examples whose kept pairs train nothing: every answer token lay past ``seq_len``."""
        return int((self._trained_in(self._cut) == 0).sum())

    def cut_sentence(self, split: str = "train") -> str:
        """What a run says of its examples cut to fit (none: ''), ``split`` 'train' or 'validation'."""
        if not self.truncated:
            return ""
        one = self.truncated == 1
        examples = f"{'' if split == 'train' else split + ' '}example{'' if one else 's'}"
        said = (f"{self.truncated} {examples} longer than --seq-len {self._seq_len} {'was' if one else 'were'} "
                f"cut to fit")
        if self.emptied:
            said += f"; {'it' if one else f'{self.emptied} of them'} lost every answer token and {_EMPTIED_DO[split]}"
        return said + "."

    def _trained_in(self, examples: np.ndarray) -> np.ndarray:
        """Each of ``examples``' trained targets among its kept pairs. The mask is read in chunks from
        their lowest start to their highest end, and an example's count is a difference of the running
        sum at the ends of its kept pairs."""
        first, kept = self._first[examples], self._kept[examples]
        if self._mask is None or len(examples) == 0:  # plain-text documents: every kept target trains
            return kept
        ends = np.concatenate([first + 1, first + 1 + kept])
        order = np.argsort(ends, kind="stable")
        sorted_ends, running = ends[order], np.zeros(len(ends), dtype=np.int64)
        # running[i] counts the trained positions from the lowest end up to ends[i], excluded.
        low, high, total = int(sorted_ends[0]), int(sorted_ends[-1]), 0
        for chunk in range(low, high, _MASK_CHUNK):
            sums = np.cumsum(np.asarray(self._mask[chunk:min(chunk + _MASK_CHUNK, high)]) != 0, dtype=np.int64)
            inside = slice(*np.searchsorted(sorted_ends, [chunk, chunk + _MASK_CHUNK], side="right"))
            running[order[inside]] = total + sums[sorted_ends[inside] - chunk - 1]
            total += int(sums[-1])
        return running[len(first):] - running[: len(first)]

    def _gather(self, items: torch.Tensor) -> tuple[torch.Tensor, ...]:
        shape = (len(items), self._seq_len)
        inputs, targets = np.zeros(shape, np.int64), np.full(shape, IGNORE_INDEX, np.int64)
        documents = np.zeros(shape, np.int64)
        for r, row in enumerate(items.tolist()):
            members, at = self._row_items[self._row_starts[row]: self._row_starts[row + 1]], 0
            for index, example in enumerate(members.tolist()):
                first, n = int(self._first[example]), int(self._kept[example])
                ids = np.asarray(self._tokens[first: first + n + 1], dtype=np.int64)
                trained = np.ones(n, bool) if self._mask is None else \
                    np.asarray(self._mask[first + 1: first + n + 1]) != 0
                inputs[r, at: at + n] = ids[:-1]
                targets[r, at: at + n] = np.where(trained, ids[1:], IGNORE_INDEX)
                documents[r, at: at + n] = index
                at += n
            documents[r, at:] = len(members)
        tensors = torch.from_numpy(inputs), torch.from_numpy(targets)
        return (*tensors, torch.from_numpy(documents)) if self._pack else tensors
