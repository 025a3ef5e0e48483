"""ZeRO stages 1-3: parity with one device, the memory and communication
formulas against the ledgers, stage 3's gather/free discipline, and sharded
checkpoints read back by other layouts."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from scaletrain.commands.parity import run_parity
from scaletrain.job.data_setup import prepare_data
from scaletrain.train.checkpoint import flat_chunks
from tests.distributed import run_distributed
from tests.trainers import build_trainer, train_and_save


def test_flat_chunks_hold_exactly_the_range():
    """Every flat range of every shape becomes rectangles that hold its elements, each once."""
    generator = torch.Generator().manual_seed(0)
    for shape in [(7,), (5, 3), (4, 1), (1, 6), (2, 3, 4), (3, 2, 2, 5)]:
        numel = math.prod(shape)
        index = torch.arange(numel).view(shape)
        for _ in range(40):
            start, stop = sorted(torch.randint(0, numel + 1, (2,), generator=generator).tolist())
            held = []
            for offsets, sizes in flat_chunks(shape, start, stop):
                region = index[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]
                held += region.reshape(-1).tolist()
            assert sorted(held) == list(range(start, stop)), (shape, start, stop)


# The portable-kernel rerun (marker numerics) takes the two-rank cases of stages 2 and 3: four ranks
# cut the same sums into more shards, and stage 1 reduces as stage 2 does, on the same kernels.
@pytest.mark.parametrize("stage,n", [
    (1, 2), *(pytest.param(stage, 2, marks=pytest.mark.numerics) for stage in (2, 3)),
    *(pytest.param(stage, 4, marks=pytest.mark.slow) for stage in (1, 2, 3))])
def test_zero_reproduces_single_device_training(tiny_cfg, stage, n):
    """scaletrain parity --nproc N --dp N --zero S: losses and final weights within 1e-5 (fp32)."""
    report = run_parity(tiny_cfg.replace(nproc=n, dp=n, zero=stage, micro_batch=8 // n, steps=4),
                        tolerance=1e-5)
    assert report.passed, report.to_json()
    assert report.reference_losses[0] != report.reference_losses[-1]


@pytest.mark.numerics
@pytest.mark.parametrize("changes", [
    pytest.param(dict(name="gpt-tiny", zero=2, grad_accum=2, nproc=4, dp=4), marks=pytest.mark.slow),
    dict(name="gpt-tiny", zero=3, grad_accum=2, recompute="full", nproc=2, dp=2),
    pytest.param(dict(name="gpt-tiny", zero=3, offload="optimizer", nproc=2, dp=2), marks=pytest.mark.slow),
    pytest.param(dict(name="gpt-tiny", zero=1, offload="optimizer", grad_accum=2, nproc=2, dp=2),
                 marks=pytest.mark.slow),
    dict(name="mlp", zero=3, grad_accum=2, nproc=2, dp=2, data=None),
    pytest.param(dict(name="gpt-tiny", zero=3, compile=True, nproc=2, dp=2), marks=pytest.mark.slow),
], ids=["z2-accum-dp4", "z3-accum-recompute", "z3-offload", "z1-offload-accum", "z3-mlp-accum", "z3-compile"])
def test_zero_composes_with_accumulation_offload_and_recompute(tiny_cfg, changes):
    report = run_parity(tiny_cfg.replace(steps=3, **changes), tolerance=1e-5)
    assert report.passed, report.to_json()


# -- the ledgers ---------------------------------------------------------------


def _one_step(rank: int, n: int, cfg, spec) -> dict:
    trainer = build_trainer(rank, n, cfg, spec)
    comm = trainer.comm
    before = comm.ledger.snapshot()
    trainer.train_step(0)
    traffic = comm.ledger.since(before)
    units = []
    if trainer.layout.zero:
        z = trainer.layout.zero
        units = [{"numel": u.full.numel(), "root": u.module is trainer.layout.model, "gathered": u.gathered}
                 for u in z.units]
    params = sum(p.numel() for p in trainer.layout.model.parameters())
    return {"memory": trainer.memory_report(), "traffic": traffic, "units": units, "params": params,
            "pieces": len(trainer.layout.step_params)}


def _step_all(tiny_cfg, n: int, **changes) -> list[dict]:
    cfg = tiny_cfg.replace(nproc=n, dp=n, steps=1, report_memory=True, **changes)
    spec = prepare_data(cfg, Path(cfg.data.cache_dir))
    return run_distributed(_one_step, n, cfg, spec, timeout_s=120)


# Bytes per parameter of (params, grads, optimizer): replicated weights w, gradients g,
# sharded optimizer state k (ZeRO paper's K: moments, and the fp32 master in mixed precision).
FORMULAS = {
    # stage: lambda P, N, w, g, k
    0: lambda P, N, w, g, k: (w * P, g * P, k * P),
    1: lambda P, N, w, g, k: (w * P, g * P, k * P / N),
    2: lambda P, N, w, g, k: (w * P, g * P / N, k * P / N),
    3: lambda P, N, w, g, k: (w * P / N, g * P / N, k * P / N),
}


# fp32 (slow): ZeRO's ledgers in fp32 against the planner's by default, tests/test_plan.py
@pytest.mark.parametrize("precision", [pytest.param("fp32", marks=pytest.mark.slow), "bf16"])
def test_memory_ledger_matches_the_zero_formulas(tiny_cfg, precision):
    """Per rank, params/grads/optimizer bytes are the ZeRO paper's formula within 1% plus
    a stated constant (padding: under N elements per unit; 4-byte step counters), and
    the saved-activations peak is the same for every stage."""
    n = 2
    mixed = dict(precision="bf16", param_dtype="bf16") if precision == "bf16" else {}
    w, g, k = (2, 4, 12) if mixed else (4, 4, 8)
    peaks = {}
    for stage in (0, 1, 2, 3):
        results = _step_all(tiny_cfg, n, zero=stage, **mixed)
        for rank, result in enumerate(results):
            memory, P = result["memory"], result["params"]
            padding = sum(u["numel"] for u in result["units"]) - P if result["units"] else 0
            expected = FORMULAS[stage](P, n, w, g, k)
            constants = (w * padding, g * padding, 4 * result["pieces"] + k * padding)
            for entry, want, slack in zip(("params", "grads", "optimizer"), expected, constants):
                assert abs(memory[entry] - want) <= 0.01 * want + slack, (stage, rank, entry, memory[entry], want)
                assert memory["points"]["after_step"][entry] == memory[entry]  # the same moment
            peaks[(stage, rank)] = memory["activations_peak"]
        if stage:
            assert all(u["gathered"] == (stage < 3) for u in results[0]["units"]), "stage 3 frees after the step"
    assert len(set(peaks.values())) == 1, peaks
    assert min(peaks.values()) > 0


def test_communication_ledger_matches_the_zero_volumes(tiny_cfg):
    """Per step: stages 1 and 2 reduce-scatter and all-gather the padded model once each,
    which moves what DP's all-reduce moves; stage 3 all-gathers every unit twice (the root
    unit once: it stays gathered from forward into backward) and reduce-scatters once."""
    n = 2
    dp = _step_all(tiny_cfg, n, zero=0)[0]
    all_reduce = dp["traffic"]["all_reduce"]["dp"]
    assert all_reduce["bytes"] == 4 * dp["params"] + 4  # the gradients, and the loss average
    dp_wire = all_reduce["wire_bytes"] - 2 * (n - 1) / n * 4
    for stage in (1, 2, 3):
        result = _step_all(tiny_cfg, n, zero=stage)[0]
        traffic, units = result["traffic"], result["units"]
        padded = 4 * sum(u["numel"] for u in units)
        gathers = 2 * padded - 4 * sum(u["numel"] for u in units if u["root"]) if stage == 3 else padded
        scatter, gather = traffic["reduce_scatter"]["dp"], traffic["all_gather"]["dp"]
        assert (scatter["calls"], scatter["bytes"]) == (len(units), padded)
        assert gather["bytes"] == gathers
        assert traffic["all_reduce"]["dp"]["bytes"] == 8  # the gradient norm and the loss
        ratio = (scatter["wire_bytes"] + gather["wire_bytes"]) / dp_wire
        if stage < 3:
            assert ratio == pytest.approx(padded / (4 * dp["params"]))  # 1, but for the padding
            assert padded - 4 * dp["params"] < 4 * n * len(units)
        else:
            assert 1.0 < ratio <= 1.5 + 1e-3


# -- stage 3's discipline ------------------------------------------------------


def _gathered_counts(rank: int, n: int, cfg, spec) -> dict:
    trainer = build_trainer(rank, n, cfg, spec)
    zero = trainer.layout.zero
    counts: list[int] = []
    for unit in zero.units:
        unit.module.register_forward_pre_hook(
            lambda *_: counts.append(sum(u.full.untyped_storage().nbytes() > 0 for u in zero.units)))
    trainer.train_step(0)
    trainer.train_step(1)
    return {"counts": counts, "units": len(zero.units),
            "after": [u.full.untyped_storage().nbytes() for u in zero.units]}


def test_stage3_gathers_one_unit_ahead_and_frees_after_use(tiny_cfg):
    cfg = tiny_cfg.replace(nproc=2, dp=2, zero=3, steps=2, n_layers=4)
    spec = prepare_data(cfg, Path(cfg.data.cache_dir))
    result = run_distributed(_gathered_counts, 2, cfg, spec, timeout_s=120)[0]
    assert result["units"] == 5  # the root (embeddings, final norm, tied head) and 4 blocks
    # Entering a unit's forward: the root, this unit, and the next one prefetched at most.
    assert max(result["counts"]) <= 3
    assert result["after"] == [0] * 5, "every unit is freed once the step is done"


# -- checkpoints across layouts ------------------------------------------------


def test_checkpoint_saved_by_one_layout_resumes_in_another(tiny_cfg):
    """Saved sharded by ZeRO-3 over 2 ranks, the run continues exactly over 4 ranks with
    ZeRO-1, and in one process without ZeRO: weights and optimizer state are resharded."""
    base = tiny_cfg.replace(steps=4, micro_batch=4)  # global batch 8 in every layout
    cfg = base.replace(nproc=2, dp=2, zero=3)
    spec = prepare_data(cfg, Path(cfg.data.cache_dir))
    straight = run_distributed(train_and_save, 2, cfg, spec, 2, timeout_s=120)[0]
    for n, stage in ((4, 1), (1, 0)):
        resumed_cfg = base.replace(nproc=n, dp=n, zero=stage, micro_batch=8 // n, resume=True)
        resumed = run_distributed(train_and_save, n, resumed_cfg, spec, None, timeout_s=120)[0]
        assert len(resumed) == 2
        for got, want in zip(resumed, straight[2:]):
            assert abs(got - want) / want < 1e-5, (n, stage, resumed, straight)
