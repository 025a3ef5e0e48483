"""ZeRO-3 (and 2) inside pipeline stages (parallel/zero3.py's `PipelineGathering`): each
stage's weights sharded over its data-parallel ranks, gathered per round or per micro-batch,
reproduce one device under every schedule, with tp and sp inside the stage, and resume in
another layout."""

from __future__ import annotations

from pathlib import Path

import pytest

from scaletrain.commands.parity import run_parity
from scaletrain.job.data_setup import prepare_data
from tests.trainers import assert_resumes_both_ways

# dp2 x pp2: four ranks, two stages each sharded over two
LAYOUT = dict(nproc=4, pp=2, dp=2, zero=3, microbatches=4, steps=3)

PARITY = [
    # in CI: per micro-batch, with ZB-H1's weight pass after the block was freed again (per round:
    # the resume test below, and the ledger's in tests/test_plan.py)
    ("gpt-tiny", "zb-h1", "micro-batch", {}),
    pytest.param("gpt-tiny", "1f1b", "round", {}, marks=pytest.mark.slow),
    pytest.param("llama-tiny", "zb-h1", "micro-batch", {}, marks=pytest.mark.slow),
    pytest.param("gpt-tiny", "gpipe", "micro-batch", {}, marks=pytest.mark.slow),
    pytest.param("gpt-tiny", "zb-h1", "round", {}, marks=pytest.mark.slow),
    pytest.param("gpt-tiny", "interleaved", "micro-batch", {"n_layers": 4}, marks=pytest.mark.slow),
    pytest.param("llama-tiny", "1f1b", "round", {}, marks=pytest.mark.slow),
    pytest.param("llama-tiny", "gpipe", "round", {}, marks=pytest.mark.slow),
    pytest.param("llama-tiny", "interleaved", "round", {"n_layers": 4}, marks=pytest.mark.slow),
    # recomputed blocks are gathered once for their backward, not again for the recomputation
    pytest.param("llama-tiny", "1f1b", "micro-batch", {"recompute": "full", "grad_accum": 2},
                 marks=pytest.mark.slow),
]


@pytest.mark.numerics
@pytest.mark.parametrize("model, schedule, gather, changes", PARITY)
def test_zero3_inside_pipeline_stages_reproduces_one_device(tiny_cfg, model, schedule, gather, changes):
    """scaletrain parity --nproc 4 --pp 2 --zero 3: every schedule, both ways of gathering,
    losses, gradient norms and weights within 1e-5 of one device (fp32)."""
    cfg = tiny_cfg.replace(name=model, pp_schedule=schedule, zero3_gather=gather, **{**LAYOUT, **changes})
    report = run_parity(cfg, tolerance=1e-5)
    assert report.passed, report.to_json()


@pytest.mark.slow  # eight processes
@pytest.mark.numerics
@pytest.mark.parametrize("gather", ["round", "micro-batch"])
def test_zero3_with_tensor_and_sequence_parallelism_inside_the_stages(tiny_cfg, gather):
    """pp2 x tp2 x dp2 with --zero 3 --sp: each stage's tp slices sharded over its dp ranks."""
    cfg = tiny_cfg.replace(name="llama-tiny", nproc=8, pp=2, tp=2, dp=2, sp=True, zero=3, microbatches=4,
                           steps=3, zero3_gather=gather)
    report = run_parity(cfg, tolerance=1e-5)
    assert report.passed, report.to_json()


@pytest.mark.slow
@pytest.mark.numerics
def test_zero2_inside_pipeline_stages_reproduces_one_device(tiny_cfg):
    report = run_parity(tiny_cfg.replace(**{**LAYOUT, "zero": 2}, pp_schedule="zb-h1"), tolerance=1e-5)
    assert report.passed, report.to_json()


@pytest.mark.numerics
@pytest.mark.slow  # 16 s; a pipeline's checkpoint across layouts runs by default: tests/test_pipeline.py
def test_a_zero3_pipeline_checkpoint_resumes_in_one_process_and_back(tiny_cfg, tmp_path):
    """Saved by two stages each sharded over two ranks, the run continues exactly in one
    process (the micro-batches as accumulation steps, each holding both replicas' rows); and
    a one-process checkpoint continues exactly as dp2 x pp2 with --zero 3."""
    cfg = tiny_cfg.replace(name="llama-tiny", **{**LAYOUT, "steps": 4})
    spec = prepare_data(cfg, Path(cfg.data.cache_dir))
    one = cfg.replace(nproc=1, pp=1, dp=None, zero=0, microbatches=None, grad_accum=4,
                      micro_batch=2 * cfg.train.micro_batch, out=str(tmp_path / "one"))
    assert_resumes_both_ways(cfg, one, spec, 4)
