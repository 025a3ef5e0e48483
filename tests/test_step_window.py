"""``--log-every K``: a step reads nothing from the device; its numbers are read a window at a time."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from scaletrain.errors import JobFailed
from scaletrain.job.data_setup import prepare_data
from scaletrain.job.loop import fit
from scaletrain.runtime.faults import Faults, parse
from tests.trainers import build_trainer

# The ways Python code reads a tensor's value on the host (on a GPU, each waits for the device).
_READS = ("item", "tolist", "__bool__", "__float__", "__int__")


def _trainer(cfg, device: str = "cpu"):
    spec = prepare_data(cfg, Path(cfg.data.cache_dir))
    Path(cfg.run.out).mkdir(parents=True, exist_ok=True)
    return build_trainer(0, 1, cfg, spec, device)


def _records(cfg) -> list[dict]:
    fit(_trainer(cfg))
    return [json.loads(line) for line in (Path(cfg.run.out) / "metrics.jsonl").read_text().splitlines()]


def test_windows_record_every_step_with_the_numbers_read_at_once(tiny_cfg, tmp_path):
    cfg = tiny_cfg.replace(steps=5, eval_every=2)
    at_once = _records(cfg.replace(out=str(tmp_path / "k1")))
    windows = _records(cfg.replace(out=str(tmp_path / "k3"), log_every=3))
    assert [r["step"] for r in windows] == [1, 2, 3, 4, 5]
    for key in ("loss", "grad_norm", "lr", "skipped_steps"):
        assert [r[key] for r in windows] == [r[key] for r in at_once]
    # an evaluation ends a window early, so it still sees (and records at) its own step
    assert [r.get("val_loss") for r in windows] == [r.get("val_loss") for r in at_once]
    assert [r["step"] for r in windows if "val_loss" in r] == [2, 4, 5]
    assert all(r["tokens_per_s"] > 0 and r["mem_bytes"] > 0 for r in windows)


def _reads_during_a_step(cfg, monkeypatch) -> int:
    """How often scaletrain's own code reads a tensor's value during one optimizer step."""
    trainer = _trainer(cfg)
    trainer.queue_step(0, record=False)  # the first step builds state lazily; count a later one
    count = 0

    def counting(name):
        original = getattr(torch.Tensor, name)

        def read(self, *args, **kwargs):
            nonlocal count
            if sys._getframe(1).f_globals.get("__name__", "").startswith("scaletrain"):
                count += 1
            return original(self, *args, **kwargs)
        return read

    for name in _READS:
        monkeypatch.setattr(torch.Tensor, name, counting(name))
    trainer.queue_step(1, record=False)
    monkeypatch.undo()
    return count


def test_a_deferred_step_reads_nothing_and_an_immediate_one_only_its_verdict(tiny_cfg, monkeypatch):
    assert _reads_during_a_step(tiny_cfg.replace(log_every=4), monkeypatch) == 0
    assert _reads_during_a_step(tiny_cfg, monkeypatch) == 1  # whether to stop before the update
    # skipping needs the verdict before the update whatever K is
    assert _reads_during_a_step(tiny_cfg.replace(log_every=4, on_nan="skip"), monkeypatch) == 1


def test_a_non_finite_step_stops_the_run_at_its_window_before_any_checkpoint(tiny_cfg):
    cfg = tiny_cfg.replace(steps=6, log_every=4, checkpoint_every=2)
    trainer = _trainer(cfg)
    trainer.stepper.faults = Faults(parse("nan rank=0 step=3"), 0, attempt=0)
    with pytest.raises(JobFailed) as stop:
        fit(trainer)
    assert "step 3 is not finite" in str(stop.value)
    assert "read at step 4 with --log-every 4" in str(stop.value)
    assert "resume from step_000002" in str(stop.value)
    records = (Path(cfg.run.out) / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(r)["step"] for r in records] == [1, 2]
    saved = sorted(p.name for p in (Path(cfg.run.out) / "checkpoints").iterdir())
    assert saved == ["step_000002"]  # the window closed at the checkpoint of step 2, then stopped at 4


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: host syncs exist only there")
def test_a_deferred_step_makes_no_cuda_host_sync(tiny_cfg):
    trainer = _trainer(tiny_cfg.replace(log_every=4, precision="bf16"), "cuda")
    trainer.queue_step(0, record=False)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any synchronizing CUDA call now raises
    try:
        trainer.queue_step(1, record=False)
    finally:
        torch.cuda.set_sync_debug_mode("default")
