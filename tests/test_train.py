"""The trainer end to end, in one process: equivalences, exact resume,
checkpoint safety, parity of the trivial layout."""

import pickle

import pytest
import torch

from scaletrain.errors import UserError
from scaletrain.models import build_model
from scaletrain.parity import run_parity
from scaletrain.train import checkpoint as ckpt
from scaletrain.train.metrics import read_metrics
from scaletrain.train.run import execute, prepare_run


def train(cfg):
    summary = execute(cfg, prepare_run(cfg))
    losses = [r["loss"] for r in read_metrics(summary.run_dir / "metrics.jsonl")]
    return summary, losses


def test_metrics_and_run_folder(tiny_cfg):
    summary, losses = train(tiny_cfg.replace(eval_every=2))
    records = read_metrics(summary.run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    for r in records:
        assert {"step", "loss", "grad_norm", "lr", "tokens_per_s", "mfu", "mem_bytes"} <= r.keys()
        assert r["mfu"] is None and r["tokens_per_s"] > 0 and r["mem_bytes"] > 0
    assert "val_loss" in records[1] and "val_loss" not in records[0]
    assert (summary.run_dir / "config.toml").is_file()
    assert any((summary.run_dir / "tensorboard").iterdir())
    assert summary.checkpoint == summary.run_dir / "checkpoints" / "step_000004"


def test_mfu_with_a_given_peak(tiny_cfg):
    summary, _ = train(tiny_cfg.replace(peak_tflops="1.0", steps=1))
    record = read_metrics(summary.run_dir / "metrics.jsonl")[0]
    model = build_model(tiny_cfg.model, vocab_size=256, seq_len=tiny_cfg.data.seq_len)
    flops_per_token = model.flops_per_token()
    assert record["mfu"] == pytest.approx(record["tokens_per_s"] * flops_per_token / 1e12)


def test_grad_accumulation_equals_the_big_batch(tiny_cfg, tmp_path):
    _, big = train(tiny_cfg.replace(micro_batch=8, grad_accum=1, out=str(tmp_path / "big")))
    s2, accumulated = train(tiny_cfg.replace(micro_batch=4, grad_accum=2, out=str(tmp_path / "acc")))
    s1 = tmp_path / "big" / "checkpoints" / "step_000004"
    for a, b in zip(big, accumulated):
        assert a == pytest.approx(b, rel=1e-6)
    params_big = ckpt.read_model_tensors(s1)
    params_acc = ckpt.read_model_tensors(s2.checkpoint)
    for name, p in params_big.items():
        assert torch.allclose(p, params_acc[name], rtol=1e-6, atol=1e-7), name


def test_resume_reproduces_the_uninterrupted_run_exactly(tiny_cfg, tmp_path):
    cfg = tiny_cfg.replace(steps=6, dropout=0.1)  # dropout: the random stream must resume too
    whole, whole_losses = train(cfg.replace(out=str(tmp_path / "whole")))
    part_cfg = cfg.replace(out=str(tmp_path / "part"), checkpoint_every=2)
    train(part_cfg.replace(stop_at=3))
    assert [p.name for p in sorted((tmp_path / "part" / "checkpoints").iterdir())] == \
        ["step_000002", "step_000003"]
    resumed, resumed_losses = train(part_cfg.replace(resume=True))
    assert resumed_losses == whole_losses  # bit for bit
    final_whole = ckpt.read_model_tensors(whole.checkpoint)
    final_resumed = ckpt.read_model_tensors(resumed.checkpoint)
    assert all(torch.equal(final_whole[k], final_resumed[k]) for k in final_whole)


def test_resume_picks_the_latest_complete_checkpoint(tiny_cfg):
    summary, _ = train(tiny_cfg.replace(checkpoint_every=2))
    root = summary.run_dir / "checkpoints"
    (root / ".tmp_step_000006").mkdir()  # a save that crashed
    (root / "step_000005").mkdir()       # a folder without trainer state is not complete
    assert ckpt.latest_checkpoint(summary.run_dir) == root / "step_000004"


def test_corrupt_checkpoint_is_a_user_error(tiny_cfg):
    summary, _ = train(tiny_cfg.replace(steps=2))
    for f in summary.checkpoint.glob("*.distcp"):
        f.write_bytes(b"garbage")
    with pytest.raises(UserError, match="cannot be loaded"):
        execute(tiny_cfg.replace(steps=4, resume=True), None)


class _Exploit:
    def __reduce__(self):
        return (print, ("pwned",))


def test_checkpoint_metadata_cannot_run_code(tiny_cfg, capsys):
    summary, _ = train(tiny_cfg.replace(steps=2))
    (summary.checkpoint / ".metadata").write_bytes(pickle.dumps(_Exploit()))
    model = torch.nn.Linear(1, 1)
    with pytest.raises(UserError, match="builtins.print"):
        ckpt.load_checkpoint(summary.checkpoint, model, torch.optim.SGD(model.parameters()))
    assert "pwned" not in capsys.readouterr().out


def test_out_folder_holding_a_run_is_refused(tiny_cfg):
    train(tiny_cfg.replace(steps=1))
    with pytest.raises(UserError, match="already holds another run"):
        prepare_run(tiny_cfg)


def test_parity_of_the_trivial_layout(tiny_cfg):
    report = run_parity(tiny_cfg.replace(out=None, steps=3), tolerance=1e-5)
    assert report.passed and report.max_loss_rel_diff == 0.0 and report.max_param_rel_diff == 0.0
    assert report.to_json()["steps"] == 3
