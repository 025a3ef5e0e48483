"""Bucketed, overlapped data parallelism (parallel/data.py) in real gloo process groups."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
from torch import nn

from scaletrain.parallel.data import DataParallel, plan_buckets, replicate
from scaletrain.runtime import Comm, Mesh, ParallelDims
from tests.distributed import run_distributed

D = 16


def _model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(D, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))


def _batch(rank: int, micro: int, size: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * rank + micro)
    return torch.randn(size, D, generator=generator), torch.randint(0, 4, (size,), generator=generator)


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(x), y)


def _reference_grads(n: int, accum: int) -> list[torch.Tensor]:
    """One process, the whole global batch: the gradients every rank must end with."""
    model = _model()
    for micro in range(accum):
        xs, ys = zip(*(_batch(rank, micro) for rank in range(n)))
        (_loss(model, torch.cat(xs), torch.cat(ys)) / accum).backward()
    return [p.grad for p in model.parameters()]


class EventComm(Comm):
    """A Comm that also notes, in order, when an all-reduce starts."""

    def __init__(self, events: list[str]):
        super().__init__()
        self.events = events

    def all_reduce(self, tensor, group, op="sum", async_op=False):
        self.events.append(f"all_reduce {tensor.numel()}")
        return super().all_reduce(tensor, group, op, async_op)


def _accumulate_and_average(rank: int, n: int, accum: int, allreduce: str) -> dict:
    """grad_accum micro-batches, the last one synchronised: the ledger and the gradients."""
    world = Mesh.build(ParallelDims(dp=n), rank, n).group("dp")
    model = _model(seed=rank)  # different on purpose: replicate must make them equal
    events: list[str] = []
    comm = EventComm(events)
    replicate([*model.parameters(), *model.buffers()], comm, world)
    dp = DataParallel(model, comm, world, bucket_mb=1600 / 2**20, allreduce=allreduce)
    # The last layer's weight is first in reverse order, the first layer's bias...
    first_layer = model[0].weight
    first_layer.register_hook(lambda grad: events.append("backward reaches the first layer"))
    before = comm.ledger.snapshot()
    for micro in range(accum):
        x, y = _batch(rank, micro)
        if micro < accum - 1:
            with dp.no_sync():
                (_loss(model, x, y) / accum).backward()
            assert not any(e.startswith("all_reduce") for e in events), "no_sync must not communicate"
        else:
            events.clear()
            (_loss(model, x, y) / accum).backward()
    dp.finish_gradient_sync()
    return {"grads": [p.grad.clone() for p in model.parameters()], "events": events,
            "ledger": comm.ledger.since(before), "plan": [b.nbytes for b in dp.buckets],
            "members": [len(b.params) for b in dp.buckets]}


@pytest.mark.numerics
@pytest.mark.parametrize("n", [2, 4])
def test_buckets_average_exactly_once_per_step_and_overlap_backward(n):
    accum = 3
    results = run_distributed(_accumulate_and_average, n, accum, "backend")
    reference = _reference_grads(n, accum)
    params = list(_model().parameters())
    for result in results:
        for got, want in zip(result["grads"], reference):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
        # Several buckets, the plan covering every gradient byte once.
        assert len(result["plan"]) >= 3
        assert sum(result["plan"]) == 4 * sum(p.numel() for p in params)
        assert sum(result["members"]) == len(params)
        # The ledger: exactly the plan, once per optimizer step despite 3 micro-batches.
        assert result["ledger"] == {"all_reduce": {"dp": {
            "calls": len(result["plan"]), "bytes": sum(result["plan"]),
            "wire_bytes": sum(result["plan"]) * 2 * (n - 1) // n}}}
        # Overlap: the first bucket is launched while backward still has the first layer to do.
        events = result["events"]
        reached = events.index("backward reaches the first layer")
        assert events[0].startswith("all_reduce") and reached > 0
        assert any(e.startswith("all_reduce") for e in events[reached:]), "the first layer's bucket comes last"
    assert all(torch.equal(a, b) for a, b in zip(results[0]["grads"], results[-1]["grads"]))


def test_ring_allreduce_buckets_equal_the_backend():
    ring = run_distributed(_accumulate_and_average, 3, 2, "ring")
    reference = _reference_grads(3, 2)
    for result in ring:
        for got, want in zip(result["grads"], reference):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
        assert "send" in result["ledger"] and "all_reduce" not in result["ledger"]
    assert all(torch.equal(a, b) for a, b in zip(ring[0]["grads"], ring[-1]["grads"]))


def _short_batch(rank: int, n: int) -> list[torch.Tensor]:
    world = Mesh.build(ParallelDims(dp=n), rank, n).group("dp")
    model = _model()
    dp = DataParallel(model, Comm(), world)
    x, y = _batch(0, 0, size=5)
    mine = slice(0, 4) if rank == 0 else slice(4, 5)  # rank 1 holds the short end of the batch
    dp.weigh_by(len(x[mine]))
    _loss(model, x[mine], y[mine]).backward()
    dp.finish_gradient_sync()
    return [p.grad.clone() for p in model.parameters()]


def test_a_short_last_batch_is_averaged_by_sample_count():
    results = run_distributed(_short_batch, 2)
    model = _model()
    _loss(model, *_batch(0, 0, size=5)).backward()
    for grads in results:
        for got, param in zip(grads, model.parameters()):
            torch.testing.assert_close(got, param.grad, rtol=1e-5, atol=1e-7)


def _fp32_reduction_of_bf16_grads(rank: int, n: int) -> dict:
    world = Mesh.build(ParallelDims(dp=n), rank, n).group("dp")
    model = _model().to(torch.bfloat16)
    comm = Comm()
    dp = DataParallel(model, comm, world, reduce_dtype=torch.float32)
    for micro in range(2):
        x, y = _batch(rank, micro)
        with dp.no_sync() if micro == 0 else nullcontext():
            _loss(model, x.bfloat16(), y).backward()
    dp.finish_gradient_sync()
    return {"grads": [p.grad for p in model.parameters()],
            "reduced": [dp.gradient(p).clone() for p in model.parameters()],
            "bytes": comm.ledger.to_json()["all_reduce"]["dp"]["bytes"]}


def test_bf16_gradients_accumulate_and_reduce_in_fp32():
    results = run_distributed(_fp32_reduction_of_bf16_grads, 2)
    numel = sum(p.numel() for p in _model().parameters())
    for result in results:
        assert all(g is None for g in result["grads"])  # the bf16 gradients were freed into the buckets
        assert all(r.dtype == torch.float32 for r in result["reduced"])
        assert result["bytes"] == 4 * numel  # fp32 on the wire
    # the fp32 result is not a rounded bf16 value: accumulation kept the extra bits
    flat = torch.cat([r.flatten() for r in results[0]["reduced"]])
    assert not torch.equal(flat, flat.bfloat16().float())
    assert all(torch.equal(a, b) for a, b in zip(results[0]["reduced"], results[1]["reduced"]))


def _gradient_arrives_twice(rank: int, n: int) -> str:
    world = Mesh.build(ParallelDims(dp=n), rank, n).group("dp")
    model = _model()
    dp = DataParallel(model, Comm(), world)
    x, y = _batch(rank, 0)
    _loss(model, x, y).backward()
    message = "the second backward was accepted"
    try:
        _loss(model, x, y).backward()
    except RuntimeError as error:
        message = str(error)
    dp.finish_gradient_sync()
    return message


def test_a_second_backward_outside_no_sync_is_refused():
    for message in run_distributed(_gradient_arrives_twice, 2):
        assert "no_sync" in message


def test_bucket_plan_follows_reverse_registration_and_the_cap():
    model = _model()
    params = list(model.parameters())[::-1]
    sizes = [4 * p.numel() for p in params]
    plan = plan_buckets(params, cap_bytes=600, dtype=None)
    assert [p for bucket in plan for p in bucket] == params  # order kept, nothing lost
    offset = 0
    for bucket in plan:
        total = sum(sizes[offset:offset + len(bucket)])
        assert total <= 600 or len(bucket) == 1  # only a lone oversized tensor exceeds the cap
        offset += len(bucket)
    # bf16 buckets hold twice the elements
    assert len(plan_buckets(params, cap_bytes=600, dtype=torch.bfloat16)) < len(plan)
