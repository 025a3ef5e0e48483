"""ZeRO with expert parallelism (parallel/zero_experts.py): the dense weights sharded over dp x ep,
each expert over dp, reproduce one device's training (fp32, 1e-5 on losses, gradient norms and
final weights) at every stage and inside pipeline stages, and a checkpoint moves between that
layout and one process.

Every parity run clips below the tiny model's gradient norm, so a norm that summed the dense
shards over ep twice (or the experts' once too few) would change the update.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from scaletrain.commands.parity import run_parity
from scaletrain.errors import UserError
from scaletrain.job.data_setup import prepare_data
from scaletrain.models.moe import Expert, run_experts
from scaletrain.runtime.mesh import ParallelDims
from tests.trainers import assert_resumes_both_ways

CLIP = 0.5
# dp2 x ep2: four ranks, two experts each; every expert sharded over two, every dense weight over four
LAYOUT = dict(nproc=4, dp=2, ep=2, micro_batch=2, moe_experts=4, moe_top_k=2)


@pytest.mark.numerics
@pytest.mark.parametrize("stage", [
    pytest.param(1, marks=pytest.mark.slow),
    pytest.param(2, marks=pytest.mark.slow),
    3,  # two units per block, each gathered by its own hooks over its own group
])
def test_zero_over_expert_and_dense_replicas_reproduces_one_device(tiny_cfg, stage):
    """scaletrain parity --nproc 4 --dp 2 --ep 2 --zero S against one device with the same batch."""
    report = run_parity(tiny_cfg.replace(steps=3, grad_clip=CLIP, zero=stage, **LAYOUT), tolerance=1e-5)
    assert report.passed, report.to_json()
    assert all(norm > CLIP for norm in report.reference_grad_norms)  # clipping was active


@pytest.mark.slow  # eight processes
@pytest.mark.numerics
def test_zero3_over_experts_inside_pipeline_stages_reproduces_one_device(tiny_cfg):
    """dp2 x pp2 x ep2 with --zero 3: each stage's dense weights over its dp x ep ranks and its
    experts over its dp ranks, both parts' units held for the pipeline's round."""
    cfg = tiny_cfg.replace(steps=3, grad_clip=CLIP, zero=3, pp=2, microbatches=4, **{**LAYOUT, "nproc": 8})
    report = run_parity(cfg, tolerance=1e-5)
    assert report.passed, report.to_json()


@pytest.mark.numerics
@pytest.mark.slow  # 17 s; resuming ZeRO-3 in another layout runs by default: tests/test_nd.py
def test_an_expert_parallel_zero3_checkpoint_resumes_in_one_process_and_back(tiny_cfg, tmp_path):
    """Saved by dp2 x ep2 with --zero 3 after step 2 (each expert's shards by its dp ranks), the run
    continues exactly in one process; and a one-process checkpoint continues exactly as dp2 x ep2
    with --zero 3 (fp32, 1e-5)."""
    cfg = tiny_cfg.replace(steps=4, grad_clip=CLIP, zero=3, **LAYOUT)
    spec = prepare_data(cfg, Path(cfg.data.cache_dir))
    one = cfg.replace(nproc=1, dp=None, ep=1, zero=0, micro_batch=4 * LAYOUT["micro_batch"],
                      out=str(tmp_path / "one"))
    assert_resumes_both_ways(cfg, one, spec, 4)


def test_an_expert_without_rows_still_gets_a_zero_gradient():
    """Every backward gives every expert a gradient, so the replicas of a ZeRO group, whose routing
    differs, complete (and reduce) the same units in the same order; the output is unchanged."""
    torch.manual_seed(0)
    experts = [Expert(8, 16) for _ in range(3)]
    rows = torch.randn(5, 8)
    out = run_experts(experts, rows, [3, 0, 2])
    out.square().sum().backward()
    assert torch.equal(out, torch.cat([experts[0](rows[:3]), experts[2](rows[3:])]))
    assert all(p.grad is not None and not p.grad.any() for p in experts[1].parameters())
    assert all(p.grad.any() for e in (experts[0], experts[2]) for p in e.parameters())


def test_hybrid_sharding_with_expert_parallelism_is_refused_in_one_sentence():
    with pytest.raises(UserError) as caught:
        ParallelDims(dp=2, ep=2, shard_group=2)
    assert "drop one of the two" in str(caught.value) and str(caught.value).count(". ") == 0
