"""ShardedSampler: any map-style dataset, sharded over the ranks that read different samples,
deterministic and resumable, with one process reading exactly what the ranks read together."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from scaletrain.data.sampler import ShardedSampler
from scaletrain.errors import UserError


def test_ranks_read_disjoint_slices_of_the_one_process_batch():
    size, batch, replicas = 23, 3, 2
    one = ShardedSampler(size, batch * replicas, seed=5)
    ranks = [ShardedSampler(size, batch, rank=r, replicas=replicas, seed=5) for r in range(replicas)]
    for k in range(20):  # several epochs, batches straddling their ends
        together = torch.cat([rank.micro_batch(k) for rank in ranks])
        assert torch.equal(together, one.micro_batch(k))


def test_every_item_once_per_epoch_and_each_epoch_reshuffled():
    sampler = ShardedSampler(12, 4, seed=1)
    epochs = [torch.cat([sampler.micro_batch(k) for k in range(3 * e, 3 * e + 3)]) for e in range(3)]
    for epoch in epochs:
        assert sorted(epoch.tolist()) == list(range(12))
    assert not torch.equal(epochs[0], epochs[1]) and not torch.equal(epochs[1], epochs[2])
    assert torch.equal(ShardedSampler(12, 4, seed=1, shuffle=False).micro_batch(1), torch.arange(4, 8))


def test_a_resumed_sampler_reads_what_the_uninterrupted_one_would():
    whole = list(ShardedSampler(50, 4, rank=1, replicas=3, seed=2, stop=20))
    resumed = list(ShardedSampler(50, 4, rank=1, replicas=3, seed=2, start=7, stop=20))
    assert resumed == whole[7 * 4:]


def test_a_dataloader_batches_the_sampler():
    data = TensorDataset(torch.arange(100) * 10)
    sampler = ShardedSampler(len(data), 5, rank=0, replicas=2, seed=0, stop=4)
    batches = [b[0] for b in DataLoader(data, batch_size=5, sampler=sampler)]
    assert len(batches) == 4 and len(sampler) == 20
    assert all(torch.equal(b, sampler.micro_batch(k) * 10) for k, b in enumerate(batches))
    assert sampler.micro_batches_per_epoch == 10


@pytest.mark.parametrize("kwargs, phrase", [
    (dict(size=0, batch_size=2), "at least one"),
    (dict(size=5, batch_size=0), "batch size of 1 or more"),
    (dict(size=5, batch_size=1, rank=2, replicas=2), "rank from 0 to replicas - 1"),
    (dict(size=5, batch_size=1, start=3, stop=2), "0 <= start <= stop"),
])
def test_bad_arguments_are_one_sentence(kwargs, phrase):
    with pytest.raises(UserError, match=phrase):
        ShardedSampler(**kwargs)
