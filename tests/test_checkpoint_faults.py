"""Checkpoints under faults: a save cut off at any point, damaged files, another model's checkpoint.

A save killed at each of its points (faults.py) must leave the newest
*complete* checkpoint the one a resume takes, and the resumed run must log
what an uninterrupted run logs. A damaged or foreign checkpoint is refused
with one sentence before any work.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from scaletrain.errors import UserError
from scaletrain.train import checkpoint as ckpt
from scaletrain.train.manifest import MANIFEST
from scaletrain.commands.train import execute, prepare_run


def _train(corpus: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "scaletrain", "train", "--model", "gpt-tiny", "--data", str(corpus),
            "--seq-len", "32", "--micro-batch", "4", "--steps", "6", "--checkpoint-every", "2", "--keep-last", "1",
            "--warmup-steps", "1", "--eval-every", "0", "--eval-batches", "1", "--sample-tokens", "0",
            "--no-progress", "--cache-dir", str(out.parent / "cache"), "--out", str(out), *extra]


def _losses(run: Path) -> list[float]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    return [r["loss"] for r in records]


@pytest.fixture(scope="module")
def straight(corpus, tmp_path_factory) -> list[float]:
    """The losses of the run nothing interrupts."""
    run = tmp_path_factory.mktemp("straight") / "run"
    result = subprocess.run(_train(corpus, run), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert [p.name for p in ckpt.complete_checkpoints(run)] == ["step_000006"]  # --keep-last 1
    return _losses(run)


@pytest.mark.parametrize("point, rank, launch, complete", [
    pytest.param("save-begin", 0, [], "step_000002", marks=pytest.mark.slow),
    ("save-written", 0, [], "step_000002"),
    pytest.param("save-manifest", 0, [], "step_000002", marks=pytest.mark.slow),
    pytest.param("save-rename", 0, [], "step_000002", marks=pytest.mark.slow),
    ("save-prune", 0, [], "step_000004"),  # the new one was in place; the old one half deleted
    pytest.param("save-written", 1, ["--nproc", "2", "--dp", "2", "--micro-batch", "2"], "step_000002",
                 marks=pytest.mark.slow),
])
def test_a_save_cut_off_leaves_a_complete_checkpoint_and_the_resume_is_exact(corpus, tmp_path, straight, point,
                                                                             rank, launch, complete):
    run = tmp_path / "run"
    env = {**os.environ, "SCALETRAIN_FAULT": f"kill rank={rank} step=4 at={point}"}
    cut = subprocess.run(_train(corpus, run, *launch), capture_output=True, text=True, timeout=300, env=env)
    assert cut.returncode in (-signal.SIGKILL, 1), cut.stderr[-3000:]  # one process killed, or its launcher's report
    root = run / "checkpoints"
    assert [p.name for p in ckpt.complete_checkpoints(run)] == [complete]
    assert all((p / MANIFEST).is_file() for p in root.glob("step_*"))  # nothing partial looks complete
    leftovers = {p.name for p in root.glob(".*")}
    assert leftovers, "the kill should have left the save's or the deletion's folder"

    resumed = subprocess.run(_train(corpus, run, *launch, "--resume"), capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from checkpoint {complete}" in resumed.stdout
    assert not {p.name for p in root.glob(".*")}  # the next save cleared them
    assert [p.name for p in ckpt.complete_checkpoints(run)] == ["step_000006"]
    losses = _losses(run)
    assert losses == pytest.approx(straight, rel=1e-5) if launch else losses == straight  # one process: exactly


@pytest.fixture(scope="module")
def saved(tiny_cfg_module) -> Path:
    """A run of two steps with its checkpoint, trained once, copied by each test that damages it."""
    summary = execute(tiny_cfg_module.replace(steps=2), None)
    return summary.run_dir


@pytest.fixture(scope="module")
def tiny_cfg_module(corpus, tmp_path_factory):
    from scaletrain.config import Config

    root = tmp_path_factory.mktemp("saved")
    return Config().replace(name="gpt-tiny", data=str(corpus), seq_len=32, micro_batch=4, steps=2, warmup_steps=1,
                            eval_every=0, eval_batches=1, sample_tokens=0, progress=False, out=str(root / "run"),
                            cache_dir=str(root / "cache"))


def _damaged(saved: Path, tmp_path: Path, damage) -> Path:
    run = tmp_path / "run"
    shutil.copytree(saved, run)
    damage(ckpt.latest_checkpoint(run))
    return run


def _truncate(checkpoint: Path) -> None:
    tensors = checkpoint / "__0_0.distcp"
    tensors.write_bytes(tensors.read_bytes()[:1000])


def _flip(checkpoint: Path) -> None:
    tensors = checkpoint / "__0_0.distcp"
    data = bytearray(tensors.read_bytes())
    data[len(data) // 2] ^= 0xFF
    tensors.write_bytes(bytes(data))


def _drop_state(checkpoint: Path) -> None:
    (checkpoint / ckpt.STATE_FILE).unlink()


@pytest.mark.parametrize("damage, change, phrase", [
    (_truncate, {}, r"is damaged: __0_0.distcp has 1000 bytes instead of \d+; delete the folder"),
    (_flip, {}, "is damaged: __0_0.distcp does not match its SHA-256"),
    (_drop_state, {}, "is damaged: trainer_state.json is missing"),
    (None, {"d_model": 32}, r"holds tok_emb.weight of shape \[257, 64\], but this model's is \[257, 32\]"),
    (None, {"n_layers": 3}, "is of another model: it lacks blocks.2"),
    (None, {"tokenizer": "bpe", "vocab_size": 300}, "has a vocabulary of 257 tokens, but this run's data and "
                                                    "tokenizer give 300"),
])
def test_a_damaged_or_foreign_checkpoint_is_one_sentence_before_any_work(saved, tiny_cfg_module, tmp_path, damage,
                                                                         change, phrase):
    run = _damaged(saved, tmp_path, damage or (lambda checkpoint: None))
    before = sorted(p.relative_to(run) for p in run.rglob("*"))
    cfg = tiny_cfg_module.replace(out=str(run), steps=4, resume=True, **change)
    with pytest.raises(UserError, match=phrase):
        prepare_run(cfg)
    assert sorted(p.relative_to(run) for p in run.rglob("*")) == before  # the run folder untouched
