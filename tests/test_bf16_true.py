"""``--precision bf16-true`` (pure bf16 in one word) under every sharding: the four settings it
stands for, parity with one device running it under ZeRO-1/2/3 and hybrid sharding (8-bit AdamW
too), a fine-tune from a Hugging Face folder under ZeRO-3, the ledgers equal to the planner's, what
plan prices for a 7B model, the library's setup (the refusals: tests/test_bad_input.py). With them Adafactor under ZeRO
(parallel/zero_adafactor.py): parity with one device at fp32's tolerance, its ledgers, its resume."""

from __future__ import annotations

import json

import pytest

from scaletrain.commands.cli import build_parser, main
from scaletrain.commands.parity import run_parity
from scaletrain.commands.plan import base_config
from scaletrain.config import resolve
from scaletrain.errors import UserError
from tests.test_plan import assert_predicted, measure_layouts

PURE = dict(precision="bf16", param_dtype="bf16", masters="none", reduce_dtype="bf16")
TRUE = {"precision": "bf16-true"}
# Each a real run of two steps (tests/test_plan.py's measure_layouts); the planner predicts its ledgers.
LEDGER_LAYOUTS = ((2, {"zero1": {**TRUE, "zero": 1}, "zero2 grad-accum 2": {**TRUE, "zero": 2, "grad_accum": 2},
                       "zero3": {**TRUE, "zero": 3}, "zero3 8-bit AdamW": {**TRUE, "zero": 3, "optimizer": "adamw8bit"},
                       "zero2 sgd, rounded at random": {**TRUE, "zero": 2, "optimizer": "sgd",
                                                        "stochastic_rounding": True},
                       "zero1 adafactor fp32": {"zero": 1, "optimizer": "adafactor"},
                       "zero3 adafactor": {**TRUE, "zero": 3, "optimizer": "adafactor"}}),
                  (4, {"zero3 shard-group 2": {**TRUE, "zero": 3, "shard_group": 2},
                       "zero2 shard-group 2 adafactor": {**TRUE, "zero": 2, "shard_group": 2, "optimizer": "adafactor"},
                       "dp2 ep2 zero3 adafactor": {"zero": 3, "ep": 2, "moe_experts": 4, "moe_top_k": 2,
                                                   "optimizer": "adafactor"}}))


def test_bf16_true_is_the_four_settings_for_train_and_plan(capsys):
    trained = resolve(build_parser().parse_args(["train", "--precision", "bf16-true", "--zero", "3"]))
    planned = base_config(build_parser().parse_args(["plan", "--precision", "bf16-true", "--zero", "3"]), gpu=False)
    for cfg in (trained, planned):
        assert {name: cfg.flat()[name] for name in PURE} == PURE and cfg.parallel.zero == 3
    assert "bf16-true" not in trained.to_toml()  # the run records the four settings
    for command in ("train", "plan"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        assert "bf16-true: pure bf16, short for --precision bf16" in " ".join(capsys.readouterr().out.split())


@pytest.mark.numerics
@pytest.mark.parametrize("changes", [
    pytest.param(dict(nproc=2, dp=2, zero=1), marks=pytest.mark.slow),
    pytest.param(dict(nproc=2, dp=2, zero=2, stochastic_rounding=True), marks=pytest.mark.slow),
    pytest.param(dict(nproc=2, dp=2, zero=3, optimizer="adamw8bit"), marks=pytest.mark.slow),
    pytest.param(dict(nproc=4, dp=4, zero=3, shard_group=2), marks=pytest.mark.slow),
], ids=["zero1", "zero2-rounded", "zero3-8bit", "zero3-shard-group-2"])
def test_sharded_pure_bf16_reproduces_one_device_running_it(tiny_cfg, changes):
    """scaletrain parity --precision bf16-true: at bf16's tolerance (1e-2). ZeRO-3 runs in CI through the
    fine-tune below, the others (15 to 25 s each) with ``pytest -m slow tests/test_bf16_true.py``; the ledger
    tests run every layout, hybrid sharding included, for two steps."""
    report = run_parity(tiny_cfg.replace(**TRUE, micro_batch=8 // changes["nproc"], steps=3, **changes))
    assert report.tolerance == 1e-2 and report.passed, report.to_json()
    assert report.reference_losses[-1] < report.reference_losses[0]


@pytest.mark.numerics
def test_adafactor_under_zero3_steps_each_matrix_as_one_device_does(tiny_cfg):
    """Each rank holds a range of a matrix's elements; the factored statistics completed over the group
    give one device's step (fp32: 1e-5), where a piece stepped as a vector of its own would not."""
    report = run_parity(tiny_cfg.replace(optimizer="adafactor", nproc=2, dp=2, zero=3, micro_batch=2, steps=3),
                        tolerance=1e-5)
    assert report.passed, report.to_json()


@pytest.mark.slow
@pytest.mark.numerics
def test_adafactor_under_zero_resumes_on_one_device_and_back(tiny_cfg):
    """Its checkpoint holds the whole matrices' factors as one device's does (about 15 s)."""
    from pathlib import Path

    from scaletrain.job.data_setup import prepare_data
    from tests.trainers import assert_resumes_both_ways

    cfg = tiny_cfg.replace(optimizer="adafactor", nproc=2, dp=2, zero=2, micro_batch=2)
    one = tiny_cfg.replace(optimizer="adafactor", out=str(Path(tiny_cfg.run.out).parent / "one"))
    assert_resumes_both_ways(cfg, one, prepare_data(cfg, Path(cfg.data.cache_dir)), 2)


@pytest.mark.numerics
def test_finetune_a_folder_under_zero3_in_bf16_true_equals_one_device(tmp_path, capsys):
    """The goal's command over two ranks (four by hand: docs/techniques.md), through scaletrain parity."""
    from tests.test_llama_hf import PROSE, SEQ, make_folder

    folder = make_folder(tmp_path / "llama", "llama")
    prose = tmp_path / "prose.txt"
    prose.write_text(PROSE)
    assert main(["parity", "--from", str(folder), "--data", str(prose), "--nproc", "2", "--zero", "3",
                 "--precision", "bf16-true", "--steps", "3", "--seq-len", str(SEQ), "--micro-batch", "2",
                 "--lr", "1e-3", "--warmup-steps", "1", "--eval-every", "0", "--eval-batches", "1",
                 "--sample-tokens", "0", "--no-progress", "--out", str(tmp_path / "run"), "--cache-dir",
                 str(tmp_path / "cache"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["pass"] and report["tolerance"] == 1e-2


@pytest.fixture(scope="module")
def measured(corpus, tmp_path_factory) -> tuple[dict, int]:
    return measure_layouts("gpt-tiny", corpus, tmp_path_factory.mktemp("bf16-true"), LEDGER_LAYOUTS)


@pytest.mark.parametrize("case", [(n, name) for n, layouts in LEDGER_LAYOUTS for name in layouts],
                         ids=lambda case: f"{case[0]}-{case[1]}")
def test_the_planner_predicts_the_ledgers_of_sharded_pure_bf16_and_adafactor(measured, case):
    results, vocab = measured
    cfg, ledgers = results[case]
    assert_predicted(cfg, case[0], vocab, ledgers)


def test_the_ledger_holds_no_fp32_copy_under_zero3(measured):
    """Weights, gradient shards and AdamW's moments at 2 bytes each, nothing else beside them."""
    results, _ = measured
    cfg, ledgers = results[(2, "zero3")]
    memory = ledgers[0][0]
    assert memory["grads"] == memory["params"]  # the bf16 shard and its bf16 gradient shard
    counters = memory["optimizer"] - 2 * memory["params"]  # two bf16 moments, a 4-byte step a piece
    assert 0 < counters < 4 * 64 and counters % 4 == 0


def _plan(capsys, *flags: str) -> dict:
    assert main(["plan", "--model", "llama2-7b", "--gpus", "4", "--gpu", "A100", "--zero", "3", "--micro-batch",
                 "4", "--seq", "512", "--dp", "4", *flags, "--json"]) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)["candidates"][0]


def test_plan_prices_bf16_true_under_zero3_without_masters(capsys):
    pure = _plan(capsys, "--precision", "bf16-true")
    mixed = _plan(capsys, "--precision", "bf16", "--param-dtype", "bf16")
    assert pure["layout"]["masters"] == "none" and pure["layout"]["zero"] == 3
    weights = pure["memory_bytes"]["params"]  # 2 bytes a weight, a quarter of them
    assert pure["memory_bytes"]["grads"] == weights
    assert pure["memory_bytes"]["optimizer"] == pytest.approx(2 * weights, rel=1e-3)
    # mixed precision: the same bf16 quarter, fp32 gradients and masters beside fp32 moments
    assert mixed["memory_bytes"]["optimizer"] == pytest.approx(6 * weights, rel=1e-3)
    assert pure["memory_bytes"]["total"] < mixed["memory_bytes"]["total"] - 4 * weights
    main(["plan", "--model", "llama2-7b", "--gpus", "4", "--gpu", "A100", "--zero", "3", "--micro-batch", "4",
          "--seq", "512", "--dp", "4", "--precision", "bf16-true"])
    assert "Trained with --precision bf16-true." in capsys.readouterr().out


def test_library_setup_takes_bf16_true_as_the_same_four_settings(tiny_cfg):
    from scaletrain.library_checks import engine_config

    assert {name: engine_config({"precision": "bf16-true"}).flat()[name] for name in PURE} == PURE
    with pytest.raises(UserError, match="which --masters fp32 contradicts"):
        tiny_cfg.replace(precision="bf16-true", masters="fp32")
