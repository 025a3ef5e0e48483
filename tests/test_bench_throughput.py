"""scaletrain bench throughput, started from its README line at tiny size on the CPU: our trainer,
a plain loop over our model and transformers' model of the same family, each in a process of its
own, on equal work (the same weights and batches give the same losses); the figures agree with
each other; mistakes are one sentence before any process starts."""

from __future__ import annotations

import json

import pytest

from scaletrain.commands.cli import main
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
])
def test_what_it_cannot_measure_is_one_sentence(corpus, tmp_path, monkeypatch, capsys, flags, sentence):
    monkeypatch.chdir(tmp_path)
    assert main(["bench", "throughput", *TINY, "--data", str(corpus), *flags]) == 2
    err = capsys.readouterr().err
    assert sentence in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "runs").exists()
