"""Comm results and Ledger counts, in real gloo process groups of 2 and 4 ranks."""

import pickle
from fractions import Fraction

import pytest
import torch
import torch.distributed as dist

from scaletrain.runtime import (
    Comm,
    Ledger,
    Mesh,
    ParallelDims,
    Pending,
    detect_environment,
    init_distributed,
    shutdown,
)
from scaletrain.runtime.autograd import exchange_rows
from scaletrain.runtime.mesh import Group
from tests.distributed import DistributedTestError, run_distributed

OBJECT_BYTES = len(pickle.dumps({"rank": 0}))


def _collectives(rank: int, n: int) -> dict:
    """Every operation over the whole world, each checked against its definition."""
    world = Mesh.build(ParallelDims(dp=n), rank, n).group("world")
    comm = Comm()

    x = torch.arange(6, dtype=torch.float32) + rank
    comm.all_reduce(x, world)
    assert torch.equal(x, torch.arange(6, dtype=torch.float32) * n + sum(range(n)))

    mine = torch.randn(1000, generator=torch.Generator().manual_seed(rank))
    total, mean = mine.clone(), mine.clone()
    comm.all_reduce(total, world, op="sum")
    comm.all_reduce(mean, world, op="avg")
    assert torch.equal(mean, total / n)
    halves = torch.tensor([rank + 0.5, 2.0 * rank])
    comm.all_reduce(halves, world, op="avg")
    assert halves.tolist() == [(n - 1) / 2 + 0.5, float(n - 1)]

    extremes = torch.tensor([float(rank), -float(rank)])
    comm.all_reduce(extremes, world, op="max")
    assert extremes.tolist() == [n - 1, 0]
    comm.all_reduce(extremes, world, op="min")
    assert extremes.tolist() == [n - 1, 0]
    counts = torch.tensor([1, rank, 10], dtype=torch.int64)
    comm.all_reduce(counts, world)
    assert counts.tolist() == [n, sum(range(n)), 10 * n]

    later = torch.tensor([float(rank), 4.0])
    pending = comm.all_reduce(later, world, op="avg", async_op=True)
    assert isinstance(pending, Pending)
    pending.wait()
    pending.wait()  # a second wait must not divide again
    assert later.tolist() == [(n - 1) / 2, 4.0]

    shared = torch.full((3,), float(rank))
    comm.broadcast(shared, world, src=n - 1)
    assert shared.tolist() == [n - 1] * 3

    gathered = torch.empty(2 * n, 3)
    comm.all_gather(gathered, torch.full((2, 3), float(rank)), world)
    assert torch.equal(gathered, torch.arange(n).repeat_interleave(2).float()[:, None].expand(2 * n, 3))
    gathered_later = torch.empty(2 * n)
    comm.all_gather(gathered_later, torch.tensor([rank, -rank], dtype=torch.float32), world, async_op=True).wait()
    assert gathered_later.tolist() == [v for r in range(n) for v in (r, -r)]

    contributions = torch.arange(2 * n, dtype=torch.float32) + rank
    shard = torch.empty(2)
    comm.reduce_scatter(shard, contributions, world)
    assert shard.tolist() == [n * (2 * rank) + sum(range(n)), n * (2 * rank + 1) + sum(range(n))]
    comm.reduce_scatter(shard, contributions, world, op="avg", async_op=True).wait()
    assert shard.tolist() == [2 * rank + (n - 1) / 2, 2 * rank + 1 + (n - 1) / 2]

    exchanged = torch.empty(2 * n)
    comm.all_to_all(exchanged, torch.arange(2 * n, dtype=torch.float32) + 100 * rank, world)
    assert exchanged.tolist() == [100 * j + 2 * rank + k for j in range(n) for k in range(2)]

    # A ring shift: everyone sends right and receives from the left at once.
    from_left = torch.empty(4)
    comm.batch_isend_irecv(
        [("send", torch.full((4,), float(rank)), (rank + 1) % n), ("recv", from_left, (rank - 1) % n)], world
    ).wait()
    assert from_left.tolist() == [(rank - 1) % n] * 4

    if rank == 0:
        comm.send(torch.tensor([7.0, 8.0]), world, dst=1)
    elif rank == 1:
        message = torch.empty(2)
        comm.recv(message, world, src=0)
        assert message.tolist() == [7.0, 8.0]
    with pytest.raises(ValueError, match="itself"):
        comm.send(torch.zeros(1), world, dst=rank)

    comm.barrier(world)
    assert comm.all_gather_object({"rank": rank}, world) == [{"rank": r} for r in range(n)]
    return comm.ledger.to_json()


def _expected_ledger(rank: int, n: int) -> dict:
    """The conventions of the comm module's docstring, applied to `_collectives`."""
    ring = Fraction(n - 1, n)
    # (op, logical bytes, wire fraction) of every recorded call, in order.
    calls = [("all_reduce", b, 2 * ring) for b in (24, 4000, 4000, 8, 8, 8, 24, 8)]
    calls += [("broadcast", 12, ring), ("all_gather", 2 * n * 3 * 4, ring), ("all_gather", 2 * n * 4, ring)]
    calls += [("reduce_scatter", 2 * n * 4, ring)] * 2
    calls += [("all_to_all", 2 * n * 4, ring), ("send", 16, 1), ("recv", 16, 0)]
    calls += {0: [("send", 8, 1)], 1: [("recv", 8, 0)]}.get(rank, [])
    calls += [("barrier", 0, 0), ("all_gather_object", n * OBJECT_BYTES, ring)]
    expected: dict = {}
    for op, nbytes, fraction in calls:
        entry = expected.setdefault(op, {}).setdefault("world", {"calls": 0, "bytes": 0, "wire_bytes": 0})
        entry["calls"] += 1
        entry["bytes"] += nbytes
        entry["wire_bytes"] += int(nbytes * fraction)
    return expected


@pytest.mark.parametrize("n", [2, 4])
def test_collectives_compute_and_count(n):
    ledgers = run_distributed(_collectives, n)
    for rank, ledger in enumerate(ledgers):
        assert ledger == _expected_ledger(rank, n)


def _mesh_groups(rank: int, n: int) -> dict:
    dims = ParallelDims(dp=2, tp=2)
    mesh = Mesh.build(dims, rank, n)
    assert mesh.coords == dims.coords(rank)
    for name in ("dp", "ep", "pp", "cp", "tp", "dp_cp", "dp_ep", "dp_ep_cp", "world"):
        group = mesh.group(name)
        expected = list(range(n)) if name == "world" else dims.group_ranks(tuple(name.split("_")), rank)
        assert (group.name, list(group.ranks), group.ranks[group.rank]) == (name, expected, rank)
        if group.size == 1:
            assert group.handle is None
        else:
            assert dist.get_process_group_ranks(group.handle) == expected
    assert mesh.group(("cp", "dp")) is mesh.group("dp_cp")
    # Groups with the same members share one torch group.
    assert mesh.group("dp_cp").handle is mesh.group("dp").handle

    comm = Comm()
    along_tp = torch.tensor([float(rank)])
    comm.all_reduce(along_tp, mesh.group("tp"))
    assert along_tp.item() == {0: 1, 1: 1, 2: 5, 3: 5}[rank]
    along_dp = torch.tensor([float(rank)])
    comm.all_reduce(along_dp, mesh.group("dp"))
    assert along_dp.item() == {0: 2, 1: 4, 2: 2, 3: 4}[rank]

    before = comm.ledger.snapshot()
    for name in ("pp", "cp", "ep"):
        _check_group_of_one(comm, mesh.group(name))
    assert comm.ledger.since(before) == {}
    return comm.ledger.to_json()


def _check_group_of_one(comm: Comm, group: Group) -> None:
    """Every operation on a group of one leaves the data as a single rank would."""
    value = torch.tensor([3.0, 5.0])
    comm.all_reduce(value, group, op="avg")
    comm.all_reduce(value, group, async_op=True).wait()
    comm.broadcast(value, group)
    assert value.tolist() == [3.0, 5.0]
    copied = torch.empty(2)
    comm.all_gather(copied, value, group)
    assert copied.tolist() == [3.0, 5.0]
    comm.reduce_scatter(copied, value * 2, group, op="avg")
    assert copied.tolist() == [6.0, 10.0]
    comm.all_to_all(copied, value, group)
    assert copied.tolist() == [3.0, 5.0]
    comm.all_to_all(copied, value * 3, group, output_splits=[2], input_splits=[2])
    assert copied.tolist() == [9.0, 15.0]
    comm.barrier(group)
    assert comm.all_gather_object("meta", group) == ["meta"]


def _uneven_all_to_all(rank: int, n: int) -> dict:
    """Member i sends (i + j) % 3 rows to member j: some none, the rows it keeps included."""
    world = Mesh.build(ParallelDims(dp=n), rank, n).group("world")
    comm = Comm()
    send = [(rank + j) % 3 for j in range(n)]
    recv = [(i + rank) % 3 for i in range(n)]
    rows = torch.tensor([[100.0 * rank + 10 * j + k, -1.0] for j in range(n) for k in range(send[j])])
    out = torch.empty(sum(recv), 2)
    comm.all_to_all(out, rows, world, output_splits=recv, input_splits=send)
    assert out.tolist() == [[100.0 * i + 10 * rank + k, -1.0] for i in range(n) for k in range(recv[i])]
    traffic = comm.ledger.to_json()

    with pytest.raises(ValueError, match="splits summing"):
        comm.all_to_all(out, rows, world, output_splits=recv, input_splits=[len(rows) + 1] + [0] * (n - 1))
    with pytest.raises(ValueError, match="together"):
        comm.all_to_all(out, rows, world, input_splits=send)

    # Differentiable: the gradient retraces the rows' way back to where they came from.
    mine = rows.clone().requires_grad_()
    exchanged = exchange_rows(mine, send, recv, comm, world)
    exchanged.backward(2 * exchanged.detach())
    assert torch.equal(mine.grad, 2 * rows)
    return {"traffic": traffic, "rows": sum(send), "kept": send[rank]}


@pytest.mark.parametrize("n", [2, 4])
def test_uneven_all_to_all_sends_each_member_its_rows(n):
    """The ledger counts the whole input as bytes and, on the wire, all but the rows a
    member keeps for itself (2 fp32 values per row)."""
    for result in run_distributed(_uneven_all_to_all, n):
        row = 2 * 4
        assert result["traffic"] == {"all_to_all": {"world": {
            "calls": 1, "bytes": result["rows"] * row, "wire_bytes": (result["rows"] - result["kept"]) * row}}}


def test_mesh_groups_match_parallel_dims():
    ledgers = run_distributed(_mesh_groups, 4)
    for ledger in ledgers:
        assert ledger == {
            "all_reduce": {
                "tp": {"calls": 1, "bytes": 4, "wire_bytes": 4},
                "dp": {"calls": 1, "bytes": 4, "wire_bytes": 4},
            }
        }


def test_world_of_one_needs_no_process_group():
    runtime = init_distributed(detect_environment({}), timeout_s=5, backend="gloo")
    assert (runtime.backend, runtime.device, runtime.is_main) == (None, torch.device("cpu"), True)
    mesh = Mesh.build(ParallelDims(), 0, 1)
    assert not dist.is_initialized()
    comm = Comm()
    for name in ("world", "dp", "tp", "dp_ep_cp"):
        assert mesh.group(name).handle is None
        _check_group_of_one(comm, mesh.group(name))
    assert comm.ledger.to_json() == {}
    shutdown(runtime)


def _fails_on_rank_one(rank: int, n: int) -> None:
    if rank == 1:
        raise ValueError("rank one gives up")


def test_helper_reports_the_failing_rank():
    with pytest.raises(DistributedTestError, match=r"(?s)rank 1 of 2 raised.*ValueError: rank one gives up"):
        run_distributed(_fails_on_rank_one, 2, timeout_s=20)


def test_ledger_since_totals_and_table():
    ledger = Ledger()
    tp, dp = Group("tp", (0, 1, 2, 3), 0), Group("dp", (0, 1), 0)
    ledger.record("all_reduce", tp, 1000)
    before = ledger.snapshot()
    ledger.record("all_reduce", tp, 1000)
    ledger.record("all_gather", dp, 4096)
    ledger.record("recv", dp, 10)
    assert before == {"all_reduce": {"tp": {"calls": 1, "bytes": 1000, "wire_bytes": 1500}}}
    assert ledger.since(before) == {
        "all_reduce": {"tp": {"calls": 1, "bytes": 1000, "wire_bytes": 1500}},
        "all_gather": {"dp": {"calls": 1, "bytes": 4096, "wire_bytes": 2048}},
        "recv": {"dp": {"calls": 1, "bytes": 10, "wire_bytes": 0}},
    }
    assert Ledger.totals(ledger.to_json()) == {"calls": 4, "bytes": 6106, "wire_bytes": 5048}
    lines = ledger.table().splitlines()
    assert lines[0].split() == ["op", "group", "calls", "bytes", "wire", "bytes"]
    assert lines[2].split() == ["all_gather", "dp", "1", "4.00", "KiB", "2.00", "KiB"]
    assert lines[-1].split() == ["total", "4", "5.96", "KiB", "4.93", "KiB"]
    assert len({len(line) for line in lines}) == 1
    ledger.reset()
    assert ledger.to_json() == {}
