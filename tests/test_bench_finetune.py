"""scaletrain bench finetune (bench/finetune.py): the ladder predicted for a GPU, measured here
across one and two processes, a rung that cannot fit reported instead of run, bad input."""

from __future__ import annotations

import json

import pytest

from scaletrain.bench import finetune
from scaletrain.config import Config
from scaletrain.errors import UserError
from scaletrain.train.step_memory import POINTS
from tests.conftest import run_cli

GB = 10**9


def _at(row: dict, point: str, category: str) -> int:
    figures = row.get("measured") or row["predicted"]
    return figures["points"][point][category]


def test_the_predicted_ladder_of_a_1b_model_on_a_30gb_gpu():
    cfg = Config().replace(name="tinyllama-1.1b", seq_len=1024, micro_batch=4, nproc=4)
    rows = finetune.run(cfg, None, 3, 30 * GB)["rungs"]
    assert list(rows) == [*finetune.SINGLE, *finetune.SHARDED]
    assert all(list(row["predicted"]["points"]) == list(POINTS) for row in rows.values())
    # fp32 AdamW's 16 bytes a weight plus the activations of 4 x 1024 tokens: over 30 GB
    assert not rows["full"]["predicted"]["fits"] and rows["accumulation"]["predicted"]["fits"]
    assert _at(rows["accumulation"], "after_forward", "activations") < _at(rows["full"], "after_forward",
                                                                            "activations") / 3
    # pure bf16 halves the weights and drops the masters; 8-bit AdamW and SGD shrink the state
    assert _at(rows["pure-bf16"], "after_step", "params") == _at(rows["bf16-mixed"], "after_step", "params")
    assert _at(rows["pure-bf16"], "after_step", "optimizer") < _at(rows["bf16-mixed"], "after_step", "optimizer") / 2
    # 2 bytes a weight against pure bf16's 4, the embedding tables' moments kept in fp32
    assert _at(rows["adamw8bit"], "after_step", "optimizer") < 0.6 * _at(rows["pure-bf16"], "after_step", "optimizer")
    assert _at(rows["sgd"], "after_step", "optimizer") < _at(rows["adamw8bit"], "after_step", "optimizer")
    assert _at(rows["recompute"], "after_forward", "activations") < _at(rows["adamw8bit"], "after_forward",
                                                                         "activations") / 4
    assert _at(rows["offload"], "after_step", "optimizer") == 0  # the state lives on the host
    assert _at(rows["lora"], "after_step", "grads") < _at(rows["bf16-mixed"], "after_step", "grads") / 50
    # the blocks' linears in 4.127 bits, the embedding and head still in bf16
    assert _at(rows["qlora"], "after_step", "params") < _at(rows["lora"], "after_step", "params") / 2.5
    assert _at(rows["zero3"], "after_step", "params") == pytest.approx(_at(rows["dp"], "after_step", "params") / 4,
                                                                       rel=0.01)
    # adapters over a ZeRO-3 base: a quarter of the lora rung's base a rank, a quarter of the qlora rung's codes
    for adapters in ("lora", "qlora"):
        sharded, whole = (_at(rows[name], "after_step", "params") for name in (f"{adapters}-zero3", adapters))
        assert sharded == pytest.approx(whole / 4, rel=0.02), adapters


@pytest.mark.slow  # eight rungs, each in processes of its own: pytest -m slow tests/test_bench_finetune.py
def test_the_measured_ladder_across_one_and_two_processes(tmp_path, corpus):
    png = tmp_path / "ladder.png"
    done = run_cli("bench", "finetune", "--model", "llama-small", "--seq-len", "32", "--data", str(corpus),
                   "--steps", "3", "--warmup", "2", "--rungs", "full,pure-bf16,lora,qlora,dp,zero3,lora-zero3,qlora-zero3",
                   "--nproc", "2",
                   "--json", "--plot", str(png), "--cache-dir", str(tmp_path / "cache"), timeout=600)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.splitlines()[-1])
    rows = result["rungs"]
    assert result["mode"] == "measured" and list(rows) == ["full", "pure-bf16", "lora", "qlora", "dp", "zero3",
                                                           "lora-zero3", "qlora-zero3"]
    for row in rows.values():
        measured = row["measured"]
        assert list(measured["points"]) == list(POINTS)
        assert measured["points"]["before_forward"]["activations"] == 0
        assert measured["peak_bytes"] >= max(sum(p.values()) for p in measured["points"].values())
        assert measured["step_s"] > 0 and measured["loss"] > 0
    assert _at(rows["pure-bf16"], "after_forward", "activations") < _at(rows["full"], "after_forward",
                                                                         "activations") / 2  # micro-batch 1
    assert _at(rows["pure-bf16"], "after_step", "params") < 0.6 * _at(rows["full"], "after_step", "params")
    assert _at(rows["lora"], "after_step", "grads") < 0.2 * _at(rows["full"], "after_step", "grads")
    assert _at(rows["qlora"], "after_step", "params") < _at(rows["lora"], "after_step", "params")
    assert set(rows["zero3"]["measured"]["per_rank"]) == {"0", "1"}
    assert _at(rows["zero3"], "after_step", "optimizer") < 0.6 * _at(rows["dp"], "after_step", "optimizer")
    for adapters in ("lora", "qlora"):  # the base a rank halved (its embedding, norms and head too)
        assert _at(rows[f"{adapters}-zero3"], "after_step", "params") < 0.6 * _at(rows[adapters], "after_step", "params")
    assert png.read_bytes().startswith(b"\x89PNG")
    # the bench contract's figures: the other rungs' median step time against the full rung's
    assert result["peer"]["median_s"] == rows["full"]["measured"]["step_s"]
    assert result["ratio"] == pytest.approx(result["ours"]["median_s"] / result["peer"]["median_s"])


def test_a_rung_predicted_not_to_fit_is_reported_instead_of_run(tmp_path, corpus):
    cfg = Config().replace(name="llama3-70b", data=str(corpus), seq_len=32, steps=2,
                           cache_dir=str(tmp_path / "cache"))
    row = finetune.run(cfg, "full", 1, None)["rungs"]["full"]
    assert row["would_run_out_of_memory"] and "measured" not in row
    assert row["predicted"]["peak_bytes"] > 16 * 70 * GB  # AdamW's 16 bytes a weight, before activations


@pytest.mark.parametrize("rungs, nproc, message", [
    ("bogus", 1, "no rung named bogus"),
    ("zero3", 1, "--rungs zero3 compares processes; add --nproc 2"),
    ("hybrid", 2, "4 or more, even, for hybrid"),
])
def test_bad_rungs_are_refused_in_one_sentence(rungs, nproc, message):
    with pytest.raises(UserError, match=message):
        finetune.run(Config().replace(nproc=nproc), rungs, 3, GB)
