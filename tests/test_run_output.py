"""What a run prints: nothing before its checks pass (a refusal is its one sentence), one plain
line every --log-every steps where no progress bar can be drawn, and a LoRA rank above a
layer's width warned once."""

from __future__ import annotations

import re

import pytest

from scaletrain.commands.cli import main

TINY = ("--model", "gpt-tiny", "--seq-len", "32", "--micro-batch", "4", "--warmup-steps", "1", "--eval-batches", "1",
        "--sample-tokens", "0")


def _data(corpus, tmp_path) -> tuple[str, ...]:
    return "--data", str(corpus), "--cache-dir", str(tmp_path / "cache")


@pytest.mark.parametrize("nproc", [(), ("--nproc", "2")], ids=["in the worker", "in the launching process"])
def test_a_refusal_prints_no_configuration(nproc, corpus, tmp_path, capsys):
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "notes.txt").write_text("another run's folder\n")
    code = main(["train", *TINY, "--steps", "2", *nproc, *_data(corpus, tmp_path), "--out", str(taken)])
    captured = capsys.readouterr()
    assert code == 2
    assert captured.out == ""
    assert captured.err.count("\n") == 1 and "already holds another run" in captured.err, captured.err


@pytest.mark.parametrize("progress", [(), ("--no-progress",)], ids=["output not a terminal", "--no-progress"])
def test_a_plain_line_every_log_every_steps_and_at_the_last(progress, corpus, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", *TINY, "--steps", "3", "--log-every", "2", *progress, *_data(corpus, tmp_path),
                 "--out", str(out)]) == 0
    captured = capsys.readouterr()
    lines = [line for line in captured.out.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in lines] == ["2", "3"], captured.out
    for line in lines:
        assert re.fullmatch(r"step \d+ loss \d+\.\d{4} lr [0-9.e-]+ tok/s [\d,]+", line), line
    assert captured.out.index("# resolved configuration") < captured.out.index("step 2 ")
    assert "\r" not in captured.out + captured.err  # no progress bar's redraws


def test_a_lora_rank_above_a_layers_width_is_warned_once(corpus, tmp_path, capfd):
    base = tmp_path / "base"
    assert main(["train", *TINY, "--steps", "1", "--no-progress", *_data(corpus, tmp_path), "--out", str(base)]) == 0
    assert main(["finetune", "--from", str(base), "--lora-rank", "100", "--nproc", "2", "--dp", "2", *TINY,
                 "--steps", "1", "--no-progress", *_data(corpus, tmp_path), "--out", str(tmp_path / "tuned")]) == 0
    warned = [line for line in capfd.readouterr().err.splitlines() if "--lora-rank" in line]
    # gpt-tiny is 64 wide: the attention's qkv layer (64 in, 192 out) is the first of the narrowest
    assert len(warned) == 1, warned
    assert warned[0].startswith("warning: --lora-rank 100 is above 64, min(in, out) of blocks.0.attn.qkv "
                                "(64 in, 192 out)"), warned
