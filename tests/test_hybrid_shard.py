"""Hybrid sharding (--shard-group) and int8 weight gathers (--quantize-weights):
the mesh's shard and replica groups, parity with plain data parallelism and with
one device, the ledger's split of bytes between the groups against the formula
(and the planner's prediction of it), int8 blocks, and checkpoints across layouts."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from scaletrain.commands.parity import run_parity
from scaletrain.errors import UserError
from scaletrain.job.data_setup import prepare_data
from scaletrain.parallel.hybrid import (
    BLOCK,
    dequantize,
    quantize_int8,
    quantized_shard_bytes,
)
from scaletrain.planner.hardware import Cluster, cpu_device
from scaletrain.planner.predict import predict
from scaletrain.runtime.mesh import ParallelDims
from tests.distributed import run_distributed
from tests.trainers import build_trainer, train_and_save

STEPS = 3


# -- the groups ------------------------------------------------------------------


def test_shard_groups_are_neighbours_and_replica_groups_span_them():
    dims = ParallelDims(dp=8, shard_group=4)
    assert dims.hybrid_groups("shard") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert dims.hybrid_groups("replica") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    # Inside each tp slice's dp group, and over dp x cp where cp splits the sequence.
    with_tp = ParallelDims(dp=4, tp=2, shard_group=2)
    assert with_tp.hybrid_groups("shard") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert with_tp.named_group_ranks("dp_replica", 3) == [3, 7]
    with_cp = ParallelDims(dp=2, cp=2, shard_group=2)
    assert with_cp.hybrid_groups("shard") == [[0, 1], [2, 3]]
    assert with_cp.named_group_ranks("dp_cp_replica", 1) == [1, 3]
    for dims in (dims, with_tp, with_cp):
        for kind in ("shard", "replica"):
            members = sorted(r for group in dims.hybrid_groups(kind) for r in group)
            assert members == list(range(dims.world_size)), (dims, kind)


def test_shard_group_must_divide_the_sharded_ranks():
    with pytest.raises(UserError, match=r"--shard-group 3 must divide the 4 ranks ZeRO shards over"):
        ParallelDims.infer(4, shard_group=3)
    with pytest.raises(UserError, match="drop one of the two"):
        ParallelDims(dp=2, ep=2, shard_group=2)


# -- int8 blocks -------------------------------------------------------------------


def test_int8_blocks_keep_every_element_within_half_a_step_of_its_block():
    generator = torch.Generator().manual_seed(0)
    values = torch.randn(3 * BLOCK + 17, generator=generator) * torch.logspace(-3, 1, 3 * BLOCK + 17)
    values[BLOCK:2 * BLOCK] = 0.0  # an all-zero block stays exactly zero
    codes, scales = quantize_int8(values)
    assert codes.dtype == torch.int8 and codes.shape == values.shape and scales.shape == (4,)
    assert codes.abs().max() == 127
    restored = dequantize(codes, scales)
    steps = scales.repeat_interleave(BLOCK)[:values.numel()]
    assert torch.all((restored - values).abs() <= steps / 2 * (1 + 1e-6))
    assert torch.equal(restored[BLOCK:2 * BLOCK], values[BLOCK:2 * BLOCK])
    # Each block's largest value is on its grid: restored to rounding.
    for block in range(4):
        part = slice(block * BLOCK, (block + 1) * BLOCK)
        largest = values[part].abs().argmax()
        assert restored[part][largest] == pytest.approx(values[part][largest].item(), rel=1e-6)
    assert quantized_shard_bytes(values.numel()) == 4 * 4 + 4 * math.ceil(values.numel() / 4)


# -- parity and the ledger: one run of four ranks ----------------------------------


def _trained(trainer) -> tuple[list[float], list[float], list[dict]]:
    losses, norms, ledgers = [], [], []
    for step in range(STEPS):
        before = trainer.comm.ledger.snapshot()
        record = trainer.train_step(step)
        ledgers.append(trainer.comm.ledger.since(before))
        losses.append(record["loss"])
        norms.append(record["grad_norm"])
    return losses, norms, ledgers


def _gathered_weights(trainer) -> dict[str, torch.Tensor]:
    """The whole model as ZeRO-3 gathers it for a forward."""
    for unit in trainer.layout.zero.units:
        trainer.layout.zero.gathering.gather(unit)
    weights = {name: p.detach().clone() for name, p in trainer.layout.model.named_parameters()}
    for unit in trainer.layout.zero.units:
        trainer.layout.zero.gathering.free(unit)
    return weights


def _hybrid_and_plain(rank: int, n: int, hybrid_cfg, plain_cfg, quantized_cfg, spec) -> dict:
    hybrid = build_trainer(rank, n, hybrid_cfg, spec)
    losses, norms, ledgers = _trained(hybrid)
    units = [{"numel": u.full.numel(), "root": u.module is hybrid.layout.model} for u in hybrid.layout.zero.units]
    result = {"losses": losses, "norms": norms, "ledger": ledgers[1], "units": units,
              "weights": _gathered_weights(hybrid),
              "groups": (hybrid.layout.zero.group.ranks, hybrid.layout.zero.collectives.replica.ranks)}
    result["plain_losses"], result["plain_norms"], _ = _trained(build_trainer(rank, n, plain_cfg, spec))
    # int8 gathers: every rank computes with the dequantized int8 image of the fp32 masters
    quantized = build_trainer(rank, n, quantized_cfg, spec)
    result["quantized_losses"], _, quantized_ledgers = _trained(quantized)
    result["quantized_ledger"] = quantized_ledgers[1]
    zero = quantized.layout.zero
    block = zero.units[1]  # the first transformer block
    masters = torch.empty(block.full.numel())
    quantized.comm.all_gather(masters, block.master, zero.group)
    zero.gathering.gather(block)
    chunks = masters.view(zero.group.size, -1)
    expected = torch.cat([dequantize(*quantize_int8(chunk)) for chunk in chunks])
    result["quantized_exact"] = torch.equal(block.full, expected)
    result["quantized_error"] = ((block.full - masters).abs().max() / masters.abs().max()).item()
    zero.gathering.free(block)
    return result


@pytest.fixture(scope="module")
def four_ranks(corpus, tmp_path_factory) -> dict:
    """gpt-tiny for three steps on dp4: ZeRO-3 in two shard groups of 2, plain data
    parallelism, and the hybrid with int8 gathers; and the single-device reference."""
    from scaletrain.config import Config

    root = tmp_path_factory.mktemp("hybrid")
    base = Config().replace(name="gpt-tiny", data=str(corpus), seq_len=32, micro_batch=2, steps=STEPS,
                            warmup_steps=1, eval_every=0, eval_batches=1, sample_tokens=0, progress=False,
                            out=str(root / "run"), cache_dir=str(root / "cache"))
    spec = prepare_data(base, Path(base.data.cache_dir))
    hybrid = base.replace(nproc=4, dp=4, zero=3, shard_group=2)
    results = run_distributed(_hybrid_and_plain, 4, hybrid, base.replace(nproc=4, dp=4),
                              hybrid.replace(quantize_weights="int8"), spec, timeout_s=240)
    reference = build_trainer(0, 1, base.replace(micro_batch=8), spec)
    losses, norms, _ = _trained(reference)
    weights = {name: p.detach().clone() for name, p in reference.layout.model.named_parameters()}
    return {"ranks": results, "reference": (losses, norms, weights), "cfg": hybrid, "vocab": spec.vocab_size}


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


@pytest.mark.numerics
def test_hybrid_zero3_reproduces_data_parallel_and_one_device(four_ranks):
    """Per step, loss and gradient norm within 1e-5 of plain DP and of one device (fp32);
    the final weights within 1e-5 of one device's."""
    ref_losses, ref_norms, ref_weights = four_ranks["reference"]
    assert ref_losses[0] != ref_losses[-1]
    for rank, result in enumerate(four_ranks["ranks"]):
        assert result["groups"] == ((0, 1) if rank < 2 else (2, 3), (rank % 2, rank % 2 + 2))
        for step in range(STEPS):
            assert _rel(result["losses"][step], ref_losses[step]) <= 1e-5, (rank, step)
            assert _rel(result["losses"][step], result["plain_losses"][step]) <= 1e-5, (rank, step)
            assert _rel(result["norms"][step], ref_norms[step]) <= 1e-5, (rank, step)
            assert _rel(result["norms"][step], result["plain_norms"][step]) <= 1e-5, (rank, step)
        diff = sum((result["weights"][k] - w).square().sum() for k, w in ref_weights.items()).sqrt()
        assert diff / sum(w.square().sum() for w in ref_weights.values()).sqrt() <= 1e-5, rank


def test_ledger_splits_the_bytes_between_shard_and_replica_groups(four_ranks):
    """P the padded model's bytes, N = 2 ranks per shard group, G = 2 groups. Per step and
    rank, inside the shard group: reduce-scatter P + all-gathers 2P - P_root, (N-1)/N of
    it on the wire; across groups: one all-reduce of the rank's P/N bytes, 2(G-1)/G of
    them on the wire. The planner predicts the ledger exactly."""
    n, g = 2, 2
    for result in four_ranks["ranks"]:
        ledger, units = result["ledger"], result["units"]
        padded = 4 * sum(u["numel"] for u in units)
        root = 4 * sum(u["numel"] for u in units if u["root"])
        scatter, gather = ledger["reduce_scatter"]["dp_shard"], ledger["all_gather"]["dp_shard"]
        across = ledger["all_reduce"]["dp_replica"]
        assert (scatter["calls"], scatter["bytes"]) == (len(units), padded)
        assert gather["bytes"] == 2 * padded - root
        assert (across["calls"], across["bytes"]) == (len(units), padded // n)
        intra = scatter["wire_bytes"] + gather["wire_bytes"]
        assert intra == (n - 1) * (3 * padded - root) // n
        assert across["wire_bytes"] == 2 * (g - 1) * padded // n // g
        assert set(ledger["reduce_scatter"]) == set(ledger["all_gather"]) == {"dp_shard"}
        assert ledger["all_reduce"]["dp_shard"]["bytes"] == 4  # the gradient norm: the shard group's
        assert ledger["all_reduce"]["dp"]["bytes"] == 4  # the loss: averaged over all four ranks
    prediction = predict(four_ranks["cfg"], 4, four_ranks["vocab"], Cluster(cpu_device(1.0, 2**40), 4, 2))
    assert prediction.comm[0] == four_ranks["ranks"][0]["ledger"]
    assert prediction.time["step"] > 0


def test_int8_gathers_send_int8_and_train_on_the_quantized_masters(four_ranks):
    """The gathered weights are exactly the int8 image of the fp32 masters (every rank's
    shard, the own one included), within 1/254 of a block's absmax; the all-gathers move
    N x quantized_shard_bytes(S) per unit, a quarter of fp32's and a little more; the losses stay
    within 1e-3 of the exact run's but differ from it."""
    n = 2
    for result in four_ranks["ranks"]:
        assert result["quantized_exact"]
        assert 0 < result["quantized_error"] <= 1 / 254
        units, ledger = result["units"], result["quantized_ledger"]
        sent = {u["numel"]: n * quantized_shard_bytes(u["numel"] // n) for u in units}
        expected = sum(sent[u["numel"]] * (1 if u["root"] else 2) for u in units)
        assert ledger["all_gather"]["dp_shard"]["bytes"] == expected
        exact = result["ledger"]["all_gather"]["dp_shard"]["bytes"]
        assert 0.25 < expected / exact < 0.27
        assert ledger["reduce_scatter"] == result["ledger"]["reduce_scatter"]
        quantized, losses = result["quantized_losses"], result["losses"]
        assert quantized != losses
        assert max(_rel(q, e) for q, e in zip(quantized, losses)) < 1e-3
    prediction = predict(four_ranks["cfg"].replace(quantize_weights="int8"), 4, four_ranks["vocab"],
                         Cluster(cpu_device(1.0, 2**40), 4, 2))
    assert prediction.comm[0] == four_ranks["ranks"][0]["quantized_ledger"]


# -- the slower matrix ---------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("changes", [
    dict(zero=1, nproc=4, dp=4, shard_group=2, grad_accum=2),
    dict(zero=2, nproc=4, dp=4, shard_group=2, grad_accum=2),
    dict(zero=3, nproc=4, dp=4, shard_group=1),
    dict(zero=3, nproc=4, dp=4, shard_group=4),
    dict(zero=2, nproc=4, dp=2, cp=2, shard_group=2),
    dict(zero=3, nproc=8, dp=4, tp=2, shard_group=2),
    dict(zero=1, nproc=8, dp=4, pp=2, shard_group=2),
], ids=["z1-accum", "z2-accum", "z3-groups-of-1", "z3-one-group", "z2-cp", "z3-tp", "z1-pp"])
def test_hybrid_parity_across_stages_and_layouts(tiny_cfg, changes):
    """scaletrain parity: every stage, with accumulation, the degenerate group sizes (1: all
    replicas; dp: plain ZeRO), and composed with cp, tp and pp (fp32, 1e-5)."""
    report = run_parity(tiny_cfg.replace(steps=STEPS, micro_batch=8 // changes["dp"], **changes), tolerance=1e-5)
    assert report.passed, report.to_json()


@pytest.mark.slow
def test_hybrid_checkpoint_resumes_in_other_layouts(tiny_cfg):
    """Saved by ZeRO-3 in shard groups of 2 over 4 ranks (the replicas write each chunk
    once), the run continues exactly on 2 ranks in one shard group of 2 with ZeRO-1, and
    on 4 ranks of ZeRO-2 in groups of 2."""
    base = tiny_cfg.replace(steps=4)
    cfg = base.replace(nproc=4, dp=4, zero=3, shard_group=2, micro_batch=2)
    spec = prepare_data(cfg, Path(cfg.data.cache_dir))
    straight = run_distributed(train_and_save, 4, cfg, spec, 2, timeout_s=240)[0]
    for n, changes in ((2, dict(zero=1)), (4, dict(zero=2, shard_group=2))):
        resumed_cfg = base.replace(nproc=n, dp=n, micro_batch=8 // n, resume=True, **changes)
        resumed = run_distributed(train_and_save, n, resumed_cfg, spec, None, timeout_s=240)[0]
        assert len(resumed) == 2
        for got, want in zip(resumed, straight[2:]):
            assert _rel(got, want) < 1e-5, (n, changes, resumed, straight)
