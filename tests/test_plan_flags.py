"""scaletrain plan's training flags (commands/plan.py): scaletrain train's own, defined once. The
same flags given to both commands make the same configuration, and the planner's rows for it are
within 5% of the memory ledger of a real run (params, grads, optimizer, activations), one run per
set of flags; and what plan shows of them, on a 7B model's fine-tuning."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from scaletrain.commands.cli import build_parser, main
from scaletrain.commands.plan import TRAINING_FIELDS, base_config
from scaletrain.config import Config, resolve
from scaletrain.job.base_model import as_finetune
from scaletrain.job.data_setup import prepare_data
from scaletrain.planner.hardware import Cluster, cpu_device
from scaletrain.planner.predict import predict
from tests.distributed import run_distributed
from tests.test_plan import CATEGORIES
from tests.trainers import build_trainer

MODEL = "llama-tiny"  # RMSNorm, grouped-query attention, SwiGLU: the family LoRA is priced most finely for
# Each set of training flags one real run; every flag of TRAINING_FIELDS but head-loss appears.
FLAGS = {
    "adafactor": ["--optimizer", "adafactor"],
    "plain sgd": ["--optimizer", "sgd", "--momentum", "0"],
    "bf16 masters, bf16 gradients": ["--precision", "bf16", "--param-dtype", "bf16", "--reduce-dtype", "bf16"],
    "pure bf16 sgd, rounded at random": ["--precision", "bf16", "--param-dtype", "bf16", "--reduce-dtype", "bf16",
                                         "--masters", "none", "--optimizer", "sgd", "--stochastic-rounding"],
    "pure bf16 8-bit adamw": ["--precision", "bf16", "--param-dtype", "bf16", "--reduce-dtype", "bf16",
                              "--masters", "none", "--optimizer", "adamw8bit"],
    "offload": ["--precision", "bf16", "--param-dtype", "bf16", "--offload", "optimizer"],
    "int8 activations": ["--compress-activations", "int8"],
    "bf16 activations under autocast": ["--precision", "bf16", "--compress-activations", "bf16"],
    "fused": ["--fused", "triton"],
    "fp8": ["--precision", "fp8", "--param-dtype", "bf16"],
    "lora": ["--lora-rank", "4", "--lora-targets", "qkv,fc", "--precision", "bf16", "--param-dtype", "bf16"],
    "qlora, int8 activations": ["--lora-rank", "4", "--quantize", "nf4", "--compress-activations", "int8"],
    "lora, the embedding and head whole": ["--lora-rank", "4", "--lora-targets", "q_proj,v_proj,o_proj",
                                           "--lora-modules-to-save", "embed,head"],
}
PLAN_SHAPE = ["--model", MODEL, "--layers", "4", "--seq", "32", "--micro-batch", "4", "--gpus", "1", "--gpu", "cpu"]


def _train_config(flags: list[str], corpus: Path, root: Path) -> Config:
    """scaletrain train's configuration for ``flags``, parsed by its own parser."""
    args = build_parser().parse_args([
        "train", "--model", MODEL, "--n-layers", "4", "--seq-len", "32", "--micro-batch", "4", "--data", str(corpus),
        "--steps", "2", "--warmup-steps", "1", "--eval-every", "0", "--sample-tokens", "0", "--no-progress",
        "--report-memory", "--out", str(root / "run"), "--cache-dir", str(root / "cache"), *flags])
    return resolve(args)


def _measure(rank: int, n: int, base: Config, configs: dict[str, Config], spec) -> dict:
    """The base a LoRA run starts from (its weights at step 0), then each configuration's memory
    ledger over two steps."""
    build_trainer(rank, n, base, spec).save(0)
    measured = {}
    for name, cfg in configs.items():
        trainer = build_trainer(rank, n, as_finetune(cfg) if cfg.finetune.base else cfg, spec)
        trainer.train_step(0)
        trainer.train_step(1)
        measured[name] = trainer.stepper.memory
    return measured


@pytest.fixture(scope="module")
def measured(corpus, tmp_path_factory) -> tuple[dict, dict, int]:
    """({name: train's configuration}, {name: its ledger}, the vocabulary's size)."""
    root = tmp_path_factory.mktemp("plan-flags")
    base = _train_config([], corpus, root).replace(out=str(root / "base"))
    (root / "base").mkdir()
    (root / "base" / "config.toml").write_text(base.to_toml())
    spec = prepare_data(base, Path(base.data.cache_dir))
    configs = {}
    for name, flags in FLAGS.items():
        cfg = _train_config(flags, corpus, root)
        configs[name] = cfg.replace(base=str(root / "base")) if cfg.finetune.lora_rank else cfg
    return configs, run_distributed(_measure, 1, base, configs, spec, timeout_s=300)[0], spec.vocab_size


@pytest.mark.parametrize("name", FLAGS)
def test_the_planner_prices_each_training_flag_as_a_real_run_measures_it(measured, name):
    configs, ledgers, vocab = measured
    planned = base_config(build_parser().parse_args(["plan", *PLAN_SHAPE, *FLAGS[name]]), gpu=False)
    trained = configs[name]
    for field in TRAINING_FIELDS:  # one definition: the same flags, the same settings
        assert planned.flat()[field] == trained.flat()[field], field
    memory = predict(planned, 1, vocab, Cluster(cpu_device(1.0, 2**40), 1, 1)).memory
    for measured_name, predicted_name in CATEGORIES.items():
        assert memory[predicted_name] == pytest.approx(ledgers[name][measured_name], rel=0.05), \
            f"{measured_name}: predicted {memory[predicted_name]}, measured {ledgers[name][measured_name]}"


def _plan(capsys, *flags: str) -> dict:
    assert main(["plan", "--model", "llama2-7b", "--gpus", "1", "--micro-batch", "4", "--seq", "512", *flags,
                 "--json"]) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)


def test_pure_bf16_7b_fits_one_h100_and_the_layout_says_how_it_is_trained(capsys):
    best = _plan(capsys, "--precision", "bf16", "--param-dtype", "bf16", "--masters", "none")["candidates"][0]
    # --masters none takes bf16 gradients, which it needs: 2 + 2 + 4 bytes a weight
    assert best["fits"] and best["layout"]["masters"] == "none" and best["layout"]["reduce_dtype"] == "bf16"
    weights = best["memory_bytes"]["params"]
    assert best["memory_bytes"]["grads"] == weights and best["memory_bytes"]["optimizer"] == pytest.approx(
        2 * weights, rel=1e-3)
    assert best["memory_bytes"]["total"] < 80e9


def test_fine_tuning_flags_shrink_what_plan_predicts(capsys):
    pure = ["--precision", "bf16", "--param-dtype", "bf16", "--masters", "none"]
    adamw = _plan(capsys, *pure)["candidates"][0]["memory_bytes"]
    eight_bit = _plan(capsys, *pure, "--optimizer", "adamw8bit")["candidates"][0]
    lora = _plan(capsys, "--param-dtype", "bf16", "--lora-rank", "16")["candidates"][0]
    qlora = _plan(capsys, "--param-dtype", "bf16", "--lora-rank", "16", "--quantize", "nf4")["candidates"][0]
    # 2 bytes of 8-bit state a weight against pure bf16's 4 (the embedding tables' moments in fp32)
    assert eight_bit["layout"]["optimizer"] == "adamw8bit"
    assert eight_bit["memory_bytes"]["optimizer"] < 0.6 * adamw["optimizer"]
    assert lora["layout"]["lora_rank"] == 16 and lora["memory_bytes"]["grads"] < 1e9
    assert qlora["memory_bytes"]["params"] < lora["memory_bytes"]["params"] / 3
    # mixed precision's fp32 masters and gradients: 7B weights at 2 + 4 + 4 + 8 bytes fit no H100
    assert main(["plan", "--model", "llama2-7b", "--gpus", "1", "--micro-batch", "4", "--seq", "512", "--precision",
                 "bf16", "--param-dtype", "bf16"]) == 2
    assert "no layout fits in the 74.5 GiB of one H100" in capsys.readouterr().err


def test_adapters_are_planned_on_the_layouts_they_compose_with(capsys):
    result = _plan(capsys, "--gpus", "8", "--param-dtype", "bf16", "--lora-rank", "16")
    assert not any("--lora-rank" in reason for reason in result["dropped"])
    qlora = _plan(capsys, "--gpus", "8", "--param-dtype", "bf16", "--lora-rank", "16", "--quantize", "nf4",
                  "--top", "50")
    assert any(c["layout"]["zero"] == 3 for c in qlora["candidates"])
    # only tensor parallelism is dropped: the 4-bit codes' scales span whole matrices
    refusals = [reason for reason in qlora["dropped"] if "--quantize" in reason]
    assert refusals and all("--tp" in reason for reason in refusals)


@pytest.mark.parametrize("flags, phrase", [
    (["--quantize", "nf4"], "--quantize nf4 freezes the base in 4 bits, so only adapters can train; add --lora-rank"),
    (["--lora-rank", "-1"], "--lora-rank must not be negative, not -1"),
    (["--masters", "none"], "--masters none keeps the working weights as the only copy"),
], ids=["quantize-alone", "negative-rank", "masters-fp32-weights"])
def test_a_training_flag_plan_cannot_price_is_one_sentence(capsys, flags, phrase):
    assert main(["plan", "--model", "gpt-tiny", "--gpus", "1", "--precision", "fp32", *flags]) == 2
    err = capsys.readouterr().err
    assert phrase in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
