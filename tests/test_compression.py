"""PowerSGD and scaled-sign compression with error feedback, in real gloo process groups."""

from __future__ import annotations

import math

import pytest
import torch

from scaletrain.optim.compression import (
    PowerSGD,
    SignCompressor,
    pack_bits,
    unpack_bits,
)
from scaletrain.runtime import Comm, Mesh, ParallelDims
from scaletrain.runtime.mesh import Group
from tests.distributed import run_distributed

# Two matrices that rank-2 PowerSGD compresses, a vector, and a 2 x 2 matrix
# too small to gain from it (2 * (2 + 2) elements would exceed its 4).
LOW_RANK_SHAPES = [torch.Size(s) for s in [(12, 10), (7,), (6, 2, 5), (2, 2)]]
LOW_RANK_NUMEL = sum(s.numel() for s in LOW_RANK_SHAPES)
# P round: r*m per matrix plus the uncompressed 7 + 4; Q round: r*k per matrix.
LOW_RANK_ROUNDS = [2 * 12 + 2 * 6 + 7 + 4, 2 * 10 + 2 * 10]


def _dp(rank: int, n: int) -> tuple[Comm, Group]:
    return Comm(), Mesh.build(ParallelDims(dp=n), rank, n).group("dp")


def _gathered(comm: Comm, group: Group, tensor: torch.Tensor) -> torch.Tensor:
    """Every rank's `tensor`, one row per rank (through a Comm the compressors do not use)."""
    rows = torch.empty(group.size, tensor.numel(), dtype=tensor.dtype)
    comm.all_gather(rows, tensor.contiguous(), group)
    return rows


def _low_rank_bucket(who: int) -> torch.Tensor:
    """Rank `who`'s contribution: U V_who^T per compressed matrix with U shared, so the sum has rank 2."""
    shared, own = torch.Generator().manual_seed(0), torch.Generator().manual_seed(1 + who)
    parts = []
    for shape in LOW_RANK_SHAPES:
        if len(shape) >= 2 and shape[0] > 2:
            u = torch.randn(shape[0], 2, generator=shared)
            v = torch.randn(math.prod(shape[1:]), 2, generator=own)
            parts.append((u @ v.T).reshape(-1))
        else:
            parts.append(torch.randn(shape.numel(), generator=own))
    return torch.cat(parts)


def _low_rank(rank: int, n: int) -> tuple[torch.Tensor, dict, list[int]]:
    comm, group = _dp(rank, n)
    sizes: list[int] = []

    def all_reduce(tensor: torch.Tensor) -> None:
        sizes.append(tensor.numel())
        comm.all_reduce(tensor, group, "sum")

    compressor = PowerSGD(comm, group, rank=2, all_reduce=all_reduce)
    flat = _low_rank_bucket(rank)
    compressor.reduce(0, flat, LOW_RANK_SHAPES)
    return flat, comm.ledger.to_json(), sizes


@pytest.mark.parametrize("n", [2, 3])
def test_powersgd_recovers_a_sum_of_its_rank(n):
    results = run_distributed(_low_rank, n)
    expected = sum(_low_rank_bucket(who) for who in range(n))
    flat, ledger, sizes = results[0]
    # Rank 2 spans the summed matrices exactly; the vector and the 2 x 2 go whole.
    torch.testing.assert_close(flat, expected, rtol=1e-5, atol=1e-5)
    for other, _, _ in results[1:]:
        assert torch.equal(other, flat)
    assert sizes == LOW_RANK_ROUNDS
    assert ledger["all_reduce"]["dp"]["calls"] == 2
    assert ledger["all_reduce"]["dp"]["bytes"] == 4 * sum(LOW_RANK_ROUNDS)
    compressor = PowerSGD(Comm(), Group("dp", (0,), 0), rank=2)
    assert compressor.transmitted_elements(LOW_RANK_SHAPES) == sum(LOW_RANK_ROUNDS)
    assert compressor.payload_bytes(LOW_RANK_SHAPES, torch.bfloat16) == 4 * sum(LOW_RANK_ROUNDS)


def _error_feedback(rank: int, n: int) -> None:
    comm, group = _dp(rank, n)
    check = Comm()
    shapes = [torch.Size([10, 8]), torch.Size([5])]
    # Rank 1 of a full-rank 10 x 8 leaves a residual; the sign of anything does.
    for compressor in (PowerSGD(comm, group, rank=1), SignCompressor(comm, group)):
        previous = torch.zeros(85)
        for step in range(2):
            gradient = torch.randn(85, generator=torch.Generator().manual_seed(10 * step + rank))
            flat = gradient.clone()
            compressor.reduce(7, flat, shapes)
            residual = compressor.residual(7)
            offered = _gathered(check, group, gradient + previous).sum(dim=0)
            kept = _gathered(check, group, residual).sum(dim=0)
            torch.testing.assert_close(flat + kept, offered, rtol=1e-5, atol=1e-5)
            assert residual[:80].abs().max() > 0.1
            if isinstance(compressor, PowerSGD):
                assert torch.equal(residual[80:], torch.zeros(5))
            previous = residual


def test_error_feedback_loses_nothing():
    run_distributed(_error_feedback, 3)


def _warm_start(rank: int, n: int) -> None:
    comm, group = _dp(rank, n)
    check = Comm()
    shapes = [torch.Size([9, 7])]
    warm = PowerSGD(comm, group, rank=1, seed=3)
    first_result = torch.randn(63, generator=torch.Generator().manual_seed(rank))
    warm.reduce(0, first_result, shapes)
    residual = warm.residual(0).clone()
    second = torch.randn(63, generator=torch.Generator().manual_seed(100 + rank))
    offered = second + residual
    flat = second.clone()
    warm.reduce(0, flat, shapes)

    # The kept Q is the row space of the first result, A1 = P_hat Q^T; one more
    # power-iteration step from it on the second summed input S gives this.
    q = torch.linalg.svd(first_result.view(9, 7)).Vh[0]
    total = _gathered(check, group, offered).sum(dim=0).view(9, 7)
    p_hat = total @ q / (total @ q).norm()
    torch.testing.assert_close(flat.view(9, 7), torch.outer(p_hat, p_hat) @ total, rtol=1e-4, atol=1e-5)

    # A fresh compressor with the same seed and key starts from the first
    # step's random Q instead, and lands elsewhere.
    cold = offered.clone()
    PowerSGD(comm, group, rank=1, seed=3).reduce(0, cold, shapes)
    assert (cold - flat).norm() > 0.1 * flat.norm()


def test_powersgd_warm_starts_from_the_last_q():
    run_distributed(_warm_start, 2)


@pytest.mark.parametrize("length", [1, 7, 8, 9, 17, 100])
def test_bits_round_trip(length):
    bits = torch.rand(length, generator=torch.Generator().manual_seed(length)) > 0.5
    packed = pack_bits(bits)
    assert packed.dtype == torch.uint8 and packed.numel() == -(-length // 8)
    assert torch.equal(unpack_bits(packed, length), bits)


def test_bits_fill_bytes_from_the_high_bit():
    bits = torch.tensor([1, 0, 0, 0, 0, 0, 0, 1, 1], dtype=torch.bool)
    assert pack_bits(bits).tolist() == [129, 128]


def _alone() -> tuple[Comm, Group]:
    """A group of one: the compressors work the same, with no processes to start."""
    return Comm(), Group("dp", (0,), 0)


def test_sign_counts_zero_as_positive():
    compressor = SignCompressor(*_alone())
    flat = torch.tensor([0.0, 2.0, -1.0, 0.0])
    compressor.reduce(0, flat, [torch.Size([4])])
    assert flat.tolist() == [0.75, 0.75, -0.75, 0.75]
    assert compressor.residual(0).tolist() == [-0.75, 1.25, -0.25, -0.75]


@pytest.mark.parametrize("make", [lambda: PowerSGD(*_alone(), rank=1), lambda: SignCompressor(*_alone())])
def test_a_non_finite_step_leaves_the_state_alone(make):
    shapes = [torch.Size([6, 5])]
    steps = [torch.randn(30, generator=torch.Generator().manual_seed(seed)) for seed in range(2)]
    overflowed, clean = make(), make()
    for compressor in (overflowed, clean):
        compressor.reduce(0, steps[0].clone(), shapes)
    kept = overflowed.residual(0).clone()
    inf = steps[1].clone()
    inf[3] = float("inf")
    overflowed.reduce(0, inf, shapes)
    assert not torch.isfinite(inf).all()
    assert torch.equal(overflowed.residual(0), kept)
    # The next step goes on as if the overflowed one had never been offered.
    after_overflow, after_clean = steps[1].clone(), steps[1].clone()
    overflowed.reduce(0, after_overflow, shapes)
    clean.reduce(0, after_clean, shapes)
    assert torch.equal(after_overflow, after_clean)


SIGN_SHAPES = [torch.Size(s) for s in [(5, 7), (13,), (3,)]]


def _sign_steps(rank: int, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict]:
    comm, group = _dp(rank, n)
    compressor = SignCompressor(comm, group)
    # A steady direction with uneven magnitudes, which sign alone would flatten.
    drift = torch.linspace(-1, 1, 51) ** 3
    sent, true = torch.zeros(51), torch.zeros(51)
    for step in range(100):
        gradient = drift + 0.5 * torch.randn(51, generator=torch.Generator().manual_seed(1000 * step + rank))
        flat = gradient.clone()
        before = comm.ledger.snapshot()
        compressor.reduce(0, flat, SIGN_SHAPES)
        if step == 0:
            first_call = comm.ledger.since(before)
        sent += flat
        true += gradient
    check = Comm()
    kept = _gathered(check, group, compressor.residual(0)).sum(dim=0)
    return sent, _gathered(check, group, true).sum(dim=0), kept, first_call


def test_sign_sends_bits_and_tracks_the_true_sum():
    n = 3
    results = run_distributed(_sign_steps, n)
    sent, true, kept, first_call = results[0]
    payload = math.ceil(51 / 8) + 4 * len(SIGN_SHAPES)
    assert SignCompressor.payload_bytes(SIGN_SHAPES) == payload
    assert first_call == {"all_gather": {"dp": {"calls": 1, "bytes": n * payload, "wire_bytes": (n - 1) * payload}}}
    for other in results[1:]:
        assert torch.equal(other[0], sent)
    # What the results lack of the true gradients is exactly what the residuals hold...
    torch.testing.assert_close(sent + kept, true, rtol=1e-5, atol=1e-4)
    # ...and that stays small while the sums grow with the number of steps.
    assert (true - sent).norm() < 0.05 * true.norm()


def _bfloat16(rank: int, n: int) -> None:
    comm, group = _dp(rank, n)
    shapes = [torch.Size([12, 10]), torch.Size([7])]
    contribution = _low_rank_bucket(rank)[:127].bfloat16()
    offered = _gathered(Comm(), group, contribution.float()).sum(dim=0)
    flat = contribution.clone()
    PowerSGD(comm, group, rank=2).reduce(0, flat, shapes)
    # Rounding to bf16 perturbs the rank-2 structure by about bf16's precision.
    assert flat.dtype == torch.bfloat16
    torch.testing.assert_close(flat.float(), offered, rtol=2e-2, atol=5e-2)

    # Sign in bf16 computes in fp32 and rounds once, at the write-back.
    low, high = contribution.clone(), contribution.float()
    SignCompressor(comm, group).reduce(0, low, shapes)
    SignCompressor(comm, group).reduce(0, high, shapes)
    assert low.dtype == torch.bfloat16
    assert torch.equal(low, high.bfloat16())


def test_bfloat16_buckets_are_written_back_in_bfloat16():
    run_distributed(_bfloat16, 2)
