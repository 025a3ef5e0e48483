"""The planner prices adapters under every axis as real runs measure them: each rank's memory ledger
within 5% and its communication ledger exactly (tests/test_plan.py's `assert_predicted`), for LoRA and
QLoRA over a Llama folder under tp (with and without sp: a frozen embedding's output needs no
gradient, so the first region's backward collective never runs, and a frozen head gathers no input
again), pp, cp and tp x dp with ZeRO-1. ZeRO-3's: tests/test_lora_zero3.py. The slow cases:
``pytest -m slow tests/test_lora_plan.py``."""

from __future__ import annotations

from pathlib import Path

import pytest

from scaletrain.job.base_model import as_finetune
from scaletrain.job.data_setup import prepare_data
from tests.distributed import run_distributed
from tests.test_lora_zero3 import _config, llama_and_prose
from tests.test_plan import assert_predicted
from tests.trainers import build_trainer


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> tuple[Path, Path]:
    return llama_and_prose(tmp_path_factory.mktemp("lora-plan"))


def _measure(rank: int, n: int, cfg, spec) -> tuple:
    """This rank's memory ledger and its second step's communication."""
    trainer = build_trainer(rank, n, cfg, spec)
    trainer.train_step(0)
    before = trainer.comm.ledger.snapshot()
    trainer.train_step(1)
    return trainer.stepper.memory, trainer.comm.ledger.since(before)


@pytest.mark.parametrize("changes", [
    dict(nproc=2, tp=2),
    dict(nproc=2, tp=2, sp=True, lora_modules_to_save="embed,head"),
    pytest.param(dict(nproc=2, tp=2, sp=True), marks=pytest.mark.slow),
    pytest.param(dict(nproc=2, tp=2, lora_modules_to_save="embed,head"), marks=pytest.mark.slow),
    pytest.param(dict(nproc=2, pp=2, microbatches=2, quantize="nf4"), marks=pytest.mark.slow),
    pytest.param(dict(nproc=2, cp=2, quantize="nf4"), marks=pytest.mark.slow),
    pytest.param(dict(nproc=4, tp=2, dp=2, sp=True, zero=1, micro_batch=2), marks=pytest.mark.slow),
], ids=["tp2", "tp2-sp-embed-head-whole", "tp2-sp", "tp2-embed-head-whole", "qlora-pp2", "qlora-cp2",
        "tp2-sp-dp2-zero1"])
def test_the_planner_predicts_the_ledgers_of_adapters_under_each_axis(base, tmp_path, changes):
    """About 5 s each."""
    cfg = as_finetune(_config(base, tmp_path, report_memory=True, steps=2, **changes))
    spec = prepare_data(cfg, Path(cfg.data.cache_dir))
    n = changes["nproc"]
    assert_predicted(cfg, n, spec.vocab_size, run_distributed(_measure, n, cfg, spec, timeout_s=300))
