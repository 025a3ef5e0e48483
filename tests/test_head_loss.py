"""The head and the loss, chunked or on whole logits (kernels/head_loss.py): chunked by default on a
GPU where the head's weight is whole, trained as the logits run does (on a CPU in Triton's
interpreter), counted so by the planner, and refused in one sentence where it cannot run."""

from __future__ import annotations

from pathlib import Path

import pytest

from scaletrain.commands.cli import main
from scaletrain.config import Config
from scaletrain.job.metrics import read_metrics
from scaletrain.kernels.head_loss import CHUNKED, LOGITS, chunk_bytes, chunked
from scaletrain.planner.hardware import DEVICES, Cluster
from scaletrain.planner.predict import predict
from tests.trainers import losses_of_run

VOCAB = 50304


def test_chunked_by_default_on_a_gpu_or_with_fused_triton_unless_told():
    assert chunked(None, "none", on_gpu=True) and not chunked(None, "none", on_gpu=False)
    assert chunked(None, "triton", on_gpu=False)
    assert not chunked(LOGITS, "triton", on_gpu=True) and chunked(CHUNKED, "none", on_gpu=False)


def test_the_planner_counts_one_chunk_where_the_head_is_whole():
    cfg = Config().replace(name="gpt2-124m", seq_len=1024, micro_batch=8, precision="bf16")
    h100 = Cluster(DEVICES["H100"], 1, 1)
    default, logits = (predict(cfg.replace(head_loss=choice), 1, VOCAB, h100).memory for choice in (None, LOGITS))
    n = 8 * 1024
    whole, one_chunk = 8 * n * VOCAB, chunk_bytes(n, 768, VOCAB, 2)
    assert one_chunk < whole / 4
    # Of one chunk's bytes, the gradients the kernel computes in the forward (the hidden states',
    # the head's fp32 one) are saved activations; the chunk's logits and 16-bit product are temporaries.
    temporaries = one_chunk - n * 768 * 2 - VOCAB * 768 * 4
    saved_more = logits["activations"] - default["activations"]  # the whole log-softmax the logits path keeps
    assert saved_more > 0
    # ``other`` is buffers, the loss's temporaries, and 10% of everything for the allocator
    assert logits["other"] - default["other"] == pytest.approx(1.1 * (whole - temporaries) + 0.1 * saved_more,
                                                               rel=1e-6)
    split = cfg.replace(tp=2, nproc=2)  # the head split by tp: whole logits whatever the default
    tp_default, tp_logits = (predict(split.replace(head_loss=choice), 2, VOCAB, Cluster(DEVICES["H100"], 2, 2))
                             .memory["other"] for choice in (None, LOGITS))
    assert tp_default == tp_logits


pytest.importorskip("triton", reason="the chunked head and loss are a Triton kernel (pip install -e '.[dev]')")


def _losses(cfg: Config, head_loss: str) -> list[float]:
    """The run's losses, and its last validation loss (the evaluation's forward takes the same path)."""
    out = Path(f"{cfg.run.out}-{head_loss}")
    return losses_of_run(cfg, out, head_loss=head_loss) + [read_metrics(out / "metrics.jsonl")[-1]["val_loss"]]


@pytest.mark.numerics
@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny"])
def test_chunked_head_and_loss_train_as_whole_logits(tiny_cfg, name):
    cfg = tiny_cfg.replace(name=name, steps=3, eval_batches=2)
    chunked_run, logits_run = _losses(cfg, CHUNKED), _losses(cfg, LOGITS)
    assert chunked_run == pytest.approx(logits_run, rel=1e-6)
    assert logits_run[0] != logits_run[2]


@pytest.mark.parametrize("args, words", [
    (["--head-loss", "chunked", "--nproc", "2", "--tp", "2"], "--head-loss chunked needs the head's weight whole"),
    (["--head-loss", "chunked", "--model", "mlp"], "--head-loss applies to a language model's head"),
], ids=["tp", "mlp"])
def test_where_the_chunked_head_cannot_run_it_says_so(tiny_cfg, capsys, args, words):
    code = main(["train", *args, "--out", tiny_cfg.run.out])
    err = capsys.readouterr().err
    assert code == 2 and words in err and len(err.strip().splitlines()) == 1, err
    assert not Path(tiny_cfg.run.out).exists()


def test_without_a_gpu_or_the_interpreter_chunked_names_its_flag(tiny_cfg, capsys, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    code = main(["train", "--head-loss", "chunked", "--out", tiny_cfg.run.out])
    err = capsys.readouterr().err
    assert code == 2 and "Triton kernels need a CUDA GPU" in err and "drop --head-loss chunked" in err, err
