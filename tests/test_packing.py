"""Instruction examples as rows: packed with document ids, or one per row; truncation; counts."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch

from scaletrain.data import packing
from scaletrain.data.packing import IGNORE_INDEX, SequenceBatches, best_fit_decreasing
from scaletrain.errors import UserError

SEQ = 32


@pytest.fixture
def examples(tmp_path):
    """(tokens, starts, mask) on disk as a prepared stream would be: 60 examples of 2..50 tokens,
    some longer than SEQ pairs, each with a prompt (mask 0) and an answer (mask 1)."""
    rng = np.random.default_rng(0)
    lengths = rng.integers(2, 51, 60)
    starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    mask = np.zeros(starts[-1], np.uint8)
    for a, b in zip(starts[:-1], starts[1:]):
        mask[a + rng.integers(0, b - a):b] = 1
    tokens_file, mask_file = tmp_path / "tokens.u16", tmp_path / "mask.u8"
    rng.integers(1, 5000, starts[-1]).astype(np.uint16).tofile(tokens_file)
    mask.tofile(mask_file)
    return np.memmap(tokens_file, np.uint16, "r"), starts, np.memmap(mask_file, np.uint8, "r")


def expected_pairs(tokens, starts, mask, documents, seq_len=SEQ) -> Counter:
    """Each example's (inputs, targets), truncated to seq_len pairs, as a multiset."""
    pairs = Counter()
    for d in documents:
        t = np.asarray(tokens[starts[d]:starts[d + 1]], np.int64)[: seq_len + 1]
        m = np.asarray(mask[starts[d]:starts[d + 1]])[1: seq_len + 1] != 0
        pairs[(tuple(t[:-1]), tuple(np.where(m, t[1:], IGNORE_INDEX)))] += 1
    return pairs


def all_rows(batches: SequenceBatches):
    return batches.get(0, batches.num_samples)


@pytest.mark.parametrize("documents", [None, range(10, 50)])
def test_packed_rows_hold_every_example_once_with_restarting_documents(examples, documents):
    tokens, starts, mask = examples
    batches = SequenceBatches(tokens, starts, mask, SEQ, pack=True, documents=documents)
    inputs, targets, docs = all_rows(batches)
    assert inputs.shape == targets.shape == docs.shape == (batches.num_samples, SEQ)
    assert inputs.dtype == targets.dtype == docs.dtype == torch.int64
    found, padding = Counter(), 0
    for row_inputs, row_targets, row_docs in zip(inputs.numpy(), targets.numpy(), docs.numpy()):
        steps = np.diff(row_docs)
        assert row_docs[0] == 0 and set(steps.tolist()) <= {0, 1}  # 0, 0, 1, 1, 1, 2, ...
        last = row_docs[-1]
        for d in range(last + 1):
            at = row_docs == d
            if d == last and (row_inputs[at] == 0).all():  # tokens are 1 or more: only padding is all 0
                assert (row_targets[at] == IGNORE_INDEX).all()
                padding += int(at.sum())
            else:
                found[(tuple(row_inputs[at]), tuple(row_targets[at]))] += 1
    chosen = range(len(starts) - 1) if documents is None else documents
    assert found == expected_pairs(tokens, starts, mask, chosen)
    assert batches.fill == pytest.approx(1 - padding / (batches.num_samples * SEQ))
    assert batches.trained_tokens == int((targets != IGNORE_INDEX).sum())
    lengths = np.diff(starts)[list(chosen)]
    assert batches.truncated == int((lengths - 1 > SEQ).sum()) > 0
    assert batches.num_samples < len(chosen) and batches.fill > 0.9


def test_unpacked_rows_hold_one_padded_example_each_in_order(examples):
    tokens, starts, mask = examples
    batches = SequenceBatches(tokens, starts, mask, SEQ, pack=False, shuffle=False)
    rows = all_rows(batches)
    assert len(rows) == 2 and batches.num_samples == len(starts) - 1
    inputs, targets = (t.numpy() for t in rows)
    for d in range(len(starts) - 1):
        n = min(starts[d + 1] - starts[d] - 1, SEQ)
        (key, count), = expected_pairs(tokens, starts, mask, [d]).items()
        assert (tuple(inputs[d, :n]), tuple(targets[d, :n])) == key
        assert (inputs[d, n:] == 0).all() and (targets[d, n:] == IGNORE_INDEX).all()
    assert batches.trained_tokens == int((targets != IGNORE_INDEX).sum())
    assert batches.fill == pytest.approx(np.minimum(np.diff(starts) - 1, SEQ).sum() / targets.size)


@pytest.mark.parametrize("pack", [True, False])
def test_rows_are_a_pure_function_of_seed_and_sample(examples, pack):
    tokens, starts, mask = examples
    one, two = (SequenceBatches(tokens, starts, mask, SEQ, pack=pack, seed=3) for _ in range(2))
    for got, expected in zip(one.get(5, 40), two.get(5, 40)):
        assert torch.equal(got, expected)
    other = SequenceBatches(tokens, starts, mask, SEQ, pack=pack, seed=4)
    assert not torch.equal(one.get(0, 20)[0], other.get(0, 20)[0])
    # Every row once per epoch, whatever the order.
    n = one.num_samples
    epoch = sorted(map(tuple, one.get(n, n)[0].tolist()))
    assert epoch == sorted(map(tuple, all_rows(one)[0].tolist()))


def test_trained_tokens_read_the_mask_in_chunks(examples, monkeypatch):
    tokens, starts, mask = examples
    whole = SequenceBatches(tokens, starts, mask, SEQ, pack=True, documents=range(3, 57, 2)).trained_tokens
    monkeypatch.setattr(packing, "_MASK_CHUNK", 7)
    assert SequenceBatches(tokens, starts, mask, SEQ, pack=True, documents=range(3, 57, 2)).trained_tokens == whole
    _, targets, _ = all_rows(SequenceBatches(tokens, starts, mask, SEQ, pack=True, documents=range(3, 57, 2)))
    assert whole == int((targets != IGNORE_INDEX).sum())


def test_too_long_and_too_short_examples_are_refused_in_one_sentence(examples):
    tokens, starts, mask = examples
    longest = int(np.diff(starts).max()) - 1
    with pytest.raises(UserError, match=rf"examples are longer than --seq-len {SEQ} \(the longest needs "
                                        rf"{longest}\); raise --seq-len or pass --too-long truncate") as caught:
        SequenceBatches(tokens, starts, mask, SEQ, pack=True, too_long="refuse")
    assert str(caught.value).count(". ") == 0
    assert SequenceBatches(tokens, starts, mask, longest, pack=True, too_long="refuse").truncated == 0
    with pytest.raises(UserError, match="1 examples have fewer than 2 tokens"):
        SequenceBatches(np.arange(5), np.array([0, 3, 4, 5]), np.ones(5), SEQ, pack=False, documents=range(1, 2))
    with pytest.raises(UserError, match="no examples"):
        SequenceBatches(tokens, starts, mask, SEQ, pack=True, documents=range(0))


def test_best_fit_decreasing_places_every_item_once_within_capacity():
    sizes = np.random.default_rng(1).integers(1, 65, 5000)
    row_starts, items = best_fit_decreasing(sizes, 64)
    assert sorted(items.tolist()) == list(range(len(sizes)))
    loads = np.add.reduceat(sizes[items], row_starts[:-1])
    assert loads.max() <= 64 and sizes.sum() / (64 * len(loads)) > 0.99
    assert all((np.diff(items[a:b]) > 0).all() for a, b in zip(row_starts[:-1], row_starts[1:]))
    again = best_fit_decreasing(sizes, 64)
    assert np.array_equal(again[0], row_starts) and np.array_equal(again[1], items)


@pytest.mark.parametrize("count, longest", [(2_000, 32), (20_000, 128)], ids=["short", "any-length"])
def test_best_fit_decreasing_leaves_under_one_percent_of_rows_empty(count, longest):
    """The fill docs/data.md states: examples of 1 to ``longest`` pairs in rows of 128."""
    sizes = np.random.default_rng(0).integers(1, longest + 1, count)
    row_starts, items = best_fit_decreasing(sizes, 128)
    assert sorted(items.tolist()) == list(range(count))  # each example in exactly one row
    rows = np.split(sizes[items], row_starts[1:-1])
    assert max(row.sum() for row in rows) <= 128
    assert sizes.sum() / ((len(row_starts) - 1) * 128) > 0.99


def test_cut_examples_left_without_an_answer_are_counted_apart(examples):
    """``emptied``: the cut examples none of whose kept targets is trained, as their rows show."""
    tokens, starts, mask = examples
    batches = SequenceBatches(tokens, starts, mask, SEQ, pack=False, shuffle=False)
    _, targets = all_rows(batches)
    cut = np.diff(starts) - 1 > SEQ
    untrained = (targets == IGNORE_INDEX).all(dim=1).numpy()
    assert batches.emptied == int((cut & untrained).sum()) > 0 and batches.truncated == int(cut.sum())
    assert batches.emptied < batches.truncated  # some cut examples keep part of their answer


def test_the_cut_sentence_says_how_many_cut_examples_train_nothing():
    """Four examples cut to 8 pairs (targets at positions 1..8): answers from position 8 (one target
    kept), 9 and 10 (none), 1 (all); a fifth that fits. Plain text has no answers to lose."""
    lengths, answer_from = [12, 12, 12, 12, 5], [8, 9, 10, 1, 3]
    starts = np.concatenate([[0], np.cumsum(lengths)])
    mask = np.zeros(starts[-1], np.uint8)
    for start, end, first in zip(starts[:-1], starts[1:], answer_from):
        mask[start + first:end] = 1
    tokens = np.arange(1, starts[-1] + 1)
    batches = SequenceBatches(tokens, starts, mask, 8, pack=True)
    assert (batches.truncated, batches.emptied) == (4, 2)
    assert batches.cut_sentence() == ("4 examples longer than --seq-len 8 were cut to fit; 2 of them lost every "
                                      "answer token and train nothing.")
    assert batches.cut_sentence("validation") == ("4 validation examples longer than --seq-len 8 were cut to fit; 2 "
                                                  "of them lost every answer token and count in no validation loss.")
    plain = SequenceBatches(tokens, starts, None, 8, pack=True)
    assert plain.emptied == 0 and plain.cut_sentence() == "4 examples longer than --seq-len 8 were cut to fit."
    assert SequenceBatches(tokens, starts, mask, 11, pack=True).cut_sentence() == ""
