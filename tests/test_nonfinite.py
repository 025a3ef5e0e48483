"""A NaN on one rank: every rank sees it in the same step and skips it together, or stops with a report."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from scaletrain.commands.parity import relative_diffs
from scaletrain.errors import JobFailed
from scaletrain.job.data_setup import prepare_data
from scaletrain.runtime.faults import Faults, parse
from tests.distributed import run_distributed
from tests.trainers import build_trainer


def _train_with_fault(rank: int, n: int, cfg, spec, fault: str) -> dict:
    """Steps until the end or a stop; the records, the stop's sentence, the weights before each step."""
    trainer = build_trainer(rank, n, cfg, spec)
    trainer.stepper.faults = Faults(parse(fault), rank, attempt=0)
    records, weights, stopped = [], [], None

    def snapshot() -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1).clone() for p in trainer.layout.model.parameters()])

    for step in range(cfg.train.steps):
        weights.append(snapshot())
        try:
            records.append(trainer.train_step(step))
        except JobFailed as exc:
            stopped = str(exc)
            break
    weights.append(snapshot())
    return {"records": records, "stopped": stopped, "weights": weights}


def _run(cfg, n: int, fault: str) -> list[dict]:
    spec = prepare_data(cfg, Path(cfg.data.cache_dir))
    return run_distributed(_train_with_fault, n, cfg, spec, fault, timeout_s=120)


@pytest.mark.parametrize("layout,param", [
    (dict(dp=2), "blocks.0.attn.qkv.weight"),
    (dict(dp=2, zero=1), "blocks.0.attn.qkv.weight"),
    # a weight tp replicates: rank 1's copy is one the gradient norm does not count (checked apart)
    (dict(tp=2), "blocks.0.ln1.weight"),
], ids=["dp2", "dp2-zero1", "tp2-replicated-copy"])
def test_stop_reports_the_step_and_the_first_non_finite_gradient_on_every_rank(tiny_cfg, layout, param):
    cfg = tiny_cfg.replace(nproc=2, steps=5, **layout)
    ranks = _run(cfg, 2, f"nan rank=1 step=3 param={param}")
    for rank in ranks:
        assert len(rank["records"]) == 2  # steps 1 and 2; step 3 stopped
        assert rank["stopped"] == ranks[0]["stopped"]  # the same verdict, the same sentence
        assert torch.equal(rank["weights"][-1], rank["weights"][-2])  # stopped before the update
    assert "step 3 is not finite" in ranks[0]["stopped"]
    assert f"the first non-finite gradient is {param} (rank 1)" in ranks[0]["stopped"]


@pytest.mark.numerics
def test_skip_leaves_the_step_out_on_every_rank_as_one_device_does(tiny_cfg):
    """dp2 with the NaN on rank 1 against one process with it on rank 0, the same global batch:
    both skip step 3, and the runs agree step by step (the parity contract holds through a skip)."""
    common = tiny_cfg.replace(on_nan="skip", steps=5)
    two = _run(common.replace(nproc=2, dp=2), 2, "nan rank=1 step=3")
    [one] = _run(common.replace(grad_accum=2), 1, "nan rank=0 step=3")
    for run in (*two, one):
        assert run["stopped"] is None
        assert [r["skipped_steps"] for r in run["records"]] == [0, 0, 1, 1, 1]
        assert torch.equal(run["weights"][3], run["weights"][2])  # no update in step 3
        assert not torch.equal(run["weights"][4], run["weights"][3])  # training went on
    assert torch.equal(two[0]["weights"][-1], two[1]["weights"][-1])  # replicas still equal
    for a, b in zip(two[0]["records"], one["records"], strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
    # parity's whole-model rule, not per element: AdamW steps by up to the learning rate wherever a
    # gradient sits at fp32's noise floor, and dp2 sums the batch in another order than one device.
    assert relative_diffs({"weights": two[0]["weights"][-1]}, {"weights": one["weights"][-1]})[1] <= 1e-5


def test_fp16_defaults_to_skip_and_every_other_precision_to_stop(tiny_cfg):
    spec = prepare_data(tiny_cfg, Path(tiny_cfg.data.cache_dir))
    for precision, policy in (("fp32", "stop"), ("bf16", "stop"), ("fp16", "skip")):
        assert build_trainer(0, 1, tiny_cfg.replace(precision=precision), spec).stepper.on_nan == policy
    assert build_trainer(0, 1, tiny_cfg.replace(on_nan="skip"), spec).stepper.on_nan == "skip"
