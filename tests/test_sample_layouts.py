"""The end-of-run sample under every layout: every rank that holds a part of the model takes part
(ZeRO-3 and hybrid shards, tp slices, pp stages, cp, ep's experts), and the text is the one a
single device writes after training on the same global batch with the same seed.

Before, only the first replica's ranks generated; under ZeRO-3 rank 0's weight gathers then
waited for dp ranks that never came, and the run hung at its sample until the collective
timeout. The first tests run the commands that hung, as a user types them, with the sample and
evaluation on (the defaults); the README's `scaletrain train --nproc 4 --zero 3 --report-memory`,
the third, runs in tests/test_readme.py.
"""

from __future__ import annotations

import pytest

from scaletrain.commands.parity import reference_config
from scaletrain.commands.train import launch
from scaletrain.config import Config
from scaletrain.config_checks import resolve_layout
from tests.conftest import run_cli
from tests.test_llama_hf import PROSE, make_folder

SAMPLE_TOKENS = 16


def _finished_with_sample(done, what: str) -> None:
    assert done.returncode == 0, f"{what}: {done.stderr[-2000:]}"
    assert "--- sample ---" in done.stdout and "validation loss" in done.stdout, done.stdout[-2000:]


def test_a_zero3_run_ends_with_its_sample(corpus, tmp_path):
    model = "llama-tiny"
    done = run_cli("train", "--model", model, "--nproc", "2", "--zero", "3", "--steps", "3", "--data", str(corpus),
                   "--no-progress", "--out", str(tmp_path / "run"), "--cache-dir", str(tmp_path / "cache"))
    _finished_with_sample(done, f"{model} under --zero 3")
    # The collective timeout a local CPU run gets (runtime/launch.py): a hang shows within a minute.
    assert "timeout = 60.0" in (tmp_path / "run" / "config.toml").read_text()


@pytest.mark.slow  # 14 s; a ZeRO-3 run's closing sample runs by default (test_a_zero3_run_ends_with_its_sample)
def test_a_zero3_full_fine_tune_of_a_folder_ends_with_its_sample(tmp_path):
    folder = make_folder(tmp_path / "qwen2", "qwen2")
    prose = tmp_path / "prose.txt"
    prose.write_text(PROSE)
    done = run_cli("finetune", "--from", str(folder), "--data", str(prose), "--nproc", "2", "--zero", "3",
                   "--steps", "3", "--seq-len", "32", "--no-progress", "--out", str(tmp_path / "run"),
                   "--cache-dir", str(tmp_path / "cache"))
    _finished_with_sample(done, "a fine-tune of a folder under --zero 3")


def _sample(cfg: Config) -> str:
    summary = launch(cfg)
    assert summary.sample, f"{cfg.run.out} wrote no sample"
    return summary.sample


@pytest.mark.numerics
@pytest.mark.parametrize("layout", [
    dict(nproc=2, zero=3),
    pytest.param(dict(nproc=4, tp=2, sp=True, zero=3), marks=pytest.mark.slow),
    pytest.param(dict(nproc=2, zero=3, name="llama-tiny"), marks=pytest.mark.slow),
    pytest.param(dict(nproc=4, zero=3, shard_group=2), marks=pytest.mark.slow),
    pytest.param(dict(nproc=2, pp=2), marks=pytest.mark.slow),
    pytest.param(dict(nproc=2, cp=2, zero=3), marks=pytest.mark.slow),
    pytest.param(dict(nproc=2, ep=2, moe_experts=2), marks=pytest.mark.slow),
], ids=["zero3", "tp2-sp-zero3", "llama-zero3", "hybrid", "pp2", "cp2-zero3", "ep2"])
def test_every_layout_writes_the_text_one_device_writes(corpus, tmp_path, layout):
    cfg = Config().replace(**{"name": "gpt-tiny", **layout}).replace(
        data=str(corpus), seq_len=64, micro_batch=2, steps=2, warmup_steps=1, lr=1e-3, eval_every=0,
        eval_batches=1, sample_tokens=SAMPLE_TOKENS, progress=False, cache_dir=str(tmp_path / "cache"),
        out=str(tmp_path / "layout"))
    resolved, dims = resolve_layout(cfg, cfg.parallel.nproc)
    reference = reference_config(resolved, dims, tmp_path / "reference")
    assert _sample(cfg) == _sample(reference)
