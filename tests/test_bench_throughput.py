"""scaletrain bench throughput, started from its README line at tiny size on the CPU: our trainer,
a plain loop over our model and transformers' model of the same family, each in a process of its
own, on equal work (the same weights and batches give the same losses); the figures agree with
each other; mistakes are one sentence before any process starts."""

from __future__ import annotations

import json
import statistics

import pytest

from scaletrain.bench import throughput
from scaletrain.commands.cli import main
from scaletrain.config import Config
from tests.readme import readme_argv

TINY = ("--model", "llama-tiny", "--seq-len", "32", "--micro-batch", "2", "--grad-accum", "2", "--steps", "4",
        "--warmup", "1", "--precision", "fp32", "--no-compile", "--peak-tflops", "0.5")


def test_ours_a_plain_loop_and_transformers_on_equal_work(corpus, tmp_path, monkeypatch, capsys):
    pytest.importorskip("transformers", reason="the peer is transformers' model (dev extra)")
    monkeypatch.chdir(tmp_path)
    command = readme_argv("scaletrain bench throughput --model tinyllama-1.1b --seq-len 2048 --micro-batch 4 "
                          "--precision bf16 --compile")
    assert main([*command[1:], *TINY, "--data", str(corpus), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["what"] == "throughput" and report["machine"]
    setup, ours, peer = report["setup"], report["ours"], report["peer"]
    assert (setup["model"], setup["seq_len"], setup["micro_batch"], setup["grad_accum"]) == ("llama-tiny", 32, 2, 2)
    assert setup["timed_steps"] == 3 and setup["tokens_per_step"] == 2 * 2 * 32
    assert [row["name"] for row in (ours, *report["peers"])] == ["scaletrain", "transformers", "plain"]
    assert peer["name"] == "transformers" and report["ratio"] == pytest.approx(ours["median_s"] / peer["median_s"])
    for row in (ours, *report["peers"]):
        assert len(row["step_s"]) == len(row["losses"]) == 4 and row["median_s"] > 0 and row["peak_memory_bytes"] > 0
        assert row["tokens_per_s"] == pytest.approx(128 / row["median_s"])
        # One FLOPs formula for all: MFU = tokens/s x F / peak.
        assert row["flops_per_token"] == setup["flops_per_token"]
        assert row["mfu"] == pytest.approx(row["tokens_per_s"] * setup["flops_per_token"] / 0.5e12)
    for row in report["peers"]:
        assert row["ratio"] == pytest.approx(ours["median_s"] / row["median_s"])
        # Equal work: the same weights, batches, clipping and schedule make the same losses.
        assert row["max_loss_rel_diff_to_ours"] < 1e-5, row["name"]
    assert ours["losses"][-1] < ours["losses"][0]


@pytest.mark.parametrize("flags, sentence", [
    (("--nproc", "2"), "measures one device's step; drop --nproc"),
    (("--model", "mlp"), "races language models"),
    (("--warmup", "4"), "--warmup 4 leaves no timed step"),
    (("--sft",), "drop --sft and --pack"),
    (("--rounds", "0"), "--rounds must be at least 1, not 0"),
    (("--peers", "plain,hf"), "--peers names hf; choose among plain and transformers"),
])
def test_what_it_cannot_measure_is_one_sentence(corpus, tmp_path, monkeypatch, capsys, flags, sentence):
    monkeypatch.chdir(tmp_path)
    assert main(["bench", "throughput", *TINY, "--data", str(corpus), *flags]) == 2
    err = capsys.readouterr().err
    assert sentence in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "runs").exists()


def test_rounds_pool_every_rounds_timed_steps_and_keep_each_rounds_ratio():
    """--rounds R: a contender's median is over all its rounds' timed steps (warm-up left out of each),
    and each round's ratio of medians is kept beside the pooled one."""
    def run(times: list[float]) -> dict:
        return {"name": "x", "device": "cpu", "step_s": times, "losses": [3.0] * len(times),
                "median_s": statistics.median(times[1:]), "tokens_per_step": 64, "flops_per_token": 1e6,
                "peak_tflops": None, "peak_memory_bytes": len(times)}

    ours = throughput.pooled([run([9.0, 1.0, 2.0, 3.0]), run([9.0, 4.0, 5.0, 6.0, 7.0])], warmup=1)
    assert ours["median_s"] == 4.0 and ours["round_medians_s"] == [2.0, 5.5]
    assert ours["tokens_per_s"] == 16.0 and ours["peak_memory_bytes"] == 5
    plain = throughput.pooled([run([9.0, 2.0, 2.0, 2.0]), run([9.0, 5.0, 5.0, 5.0])], warmup=1)
    rows = {"scaletrain": {**ours, "name": "scaletrain"}, "plain": {**plain, "name": "plain"},
            "transformers": {"name": "transformers", "skipped": "not here"}}
    report = throughput.report(Config(), 1, rows)
    assert report["peer"]["name"] == "plain" and report["ratio"] == pytest.approx(4.0 / plain["median_s"])
    assert report["peer"]["round_ratios"] == pytest.approx([1.0, 1.1])
    assert report["setup"]["rounds"] == 2
