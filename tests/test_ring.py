"""The ring all-reduce against the backend's, and the bytes it records, in real gloo groups."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist

from scaletrain.runtime import Comm, Mesh, ParallelDims
from scaletrain.runtime.ring import RingAllReduce, ring_all_reduce
from tests.distributed import run_distributed


def _lengths(n: int) -> list[int]:
    """Empty, shorter than the ring (empty chunks), uneven chunks, and larger buffers."""
    return [0, 1, n - 1, n + 1, 7, 1000, 4097]


def _chunk_sizes(length: int, n: int) -> list[int]:
    return [length // n + (i < length % n) for i in range(n)]


def _expected_bytes(length: int, n: int, rank: int, element_size: int) -> tuple[int, int]:
    """(sent, received) bytes of one call, from the formulas of the ring module's docstring."""
    c = _chunk_sizes(length, n)
    sent = 2 * length - c[(rank + 1) % n] - c[(rank + 2) % n]
    received = 2 * length - c[rank] - c[(rank + 1) % n]
    return sent * element_size, received * element_size


def _check(ring: torch.Tensor, reference: torch.Tensor, n: int) -> None:
    if n == 2:
        # a + b == b + a exactly, so two members leave no room for rounding differences.
        assert torch.equal(ring, reference)
    else:
        torch.testing.assert_close(ring, reference, rtol=1e-6, atol=1e-6)


def _ring_matches_backend(rank: int, n: int) -> None:
    world = Mesh.build(ParallelDims(dp=n), rank, n).group("world")
    comm = Comm()
    generator = torch.Generator().manual_seed(100 + rank)
    inputs = [torch.randn(length, generator=generator) for length in _lengths(n)]
    inputs += [torch.randn(5, 7, generator=generator), torch.randn(33, generator=generator, dtype=torch.float64)]
    kept_ring = RingAllReduce(comm, world)
    for x in inputs:
        ring, reference = x.clone(), x.clone()
        before = comm.ledger.snapshot()
        ring_all_reduce(comm, ring, world)
        recorded = comm.ledger.since(before)
        dist.all_reduce(reference)
        _check(ring, reference, n)

        sent, received = _expected_bytes(x.numel(), n, rank, x.element_size())
        assert set(recorded) <= {"send", "recv"}
        assert recorded.get("send", {}).get("world", {}).get("bytes", 0) == sent
        assert recorded.get("recv", {}).get("world", {}).get("bytes", 0) == received

        mean = x.clone()
        ring_all_reduce(comm, mean, world, op="avg")
        assert torch.equal(mean, ring / n)

        # The kept scratch of RingAllReduce (grown, reused, of another dtype) gives the same bits.
        kept = x.clone()
        kept_ring(kept)
        assert torch.equal(kept, ring)
    with pytest.raises(ValueError, match="scratch buffer needs"):
        ring_all_reduce(comm, torch.ones(10 * n), world, scratch=torch.empty(9))


@pytest.mark.parametrize("n", [2, 3, 4])
def test_ring_matches_backend_and_formula(n):
    run_distributed(_ring_matches_backend, n)


def _ring_in_subgroups_from_a_thread(rank: int, n: int) -> None:
    """Peers are indices inside the group: a dp group of a dp2 x tp2 mesh is ranks {0, 2} or {1, 3}."""
    mesh = Mesh.build(ParallelDims(dp=2, tp=2), rank, n)
    comm = Comm()
    for name in ("dp", "tp"):
        group = mesh.group(name)
        x = torch.randn(101, generator=torch.Generator().manual_seed(rank))
        ring, reference = x.clone(), x.clone()
        # As a communication thread overlapping backward would call it.
        worker = threading.Thread(target=ring_all_reduce, args=(comm, ring, group))
        worker.start()
        worker.join()
        comm.all_reduce(reference, group)
        assert torch.equal(ring, reference)


def test_ring_in_subgroups_from_a_thread():
    run_distributed(_ring_in_subgroups_from_a_thread, 4)


def test_group_of_one_is_a_no_op_that_records_nothing():
    group = Mesh.build(ParallelDims(), 0, 1).group("world")
    comm = Comm()
    x = torch.randn(10)
    expected = x.clone()
    for op in ("sum", "avg"):
        ring_all_reduce(comm, x, group, op=op)
    assert torch.equal(x, expected)
    assert comm.ledger.to_json() == {}


def test_bad_reductions_are_refused():
    group = Mesh.build(ParallelDims(), 0, 1).group("world")
    with pytest.raises(ValueError, match="unknown reduction 'max'"):
        ring_all_reduce(Comm(), torch.zeros(4), group, op="max")
    with pytest.raises(TypeError, match="avg needs a floating-point tensor"):
        ring_all_reduce(Comm(), torch.zeros(4, dtype=torch.int64), group, op="avg")
    with pytest.raises(ValueError, match="contiguous"):
        ring_all_reduce(Comm(), torch.zeros(4, 4).t(), group)
