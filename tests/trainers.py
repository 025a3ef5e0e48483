"""A `Trainer` inside a `run_distributed` rank, and the save-then-resume routine
the cross-layout checkpoint tests share."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from scaletrain.job.trainer import Trainer
from scaletrain.runtime import Comm, Mesh, ProcessEnv
from scaletrain.runtime.launch import DistRuntime
from tests.distributed import run_distributed


def build_trainer(rank: int, n: int, cfg, spec, device: str = "cpu") -> Trainer:
    """The trainer of rank ``rank`` of ``n``, in the layout ``cfg`` names (dp filled in)."""
    env = ProcessEnv(rank, n, rank, n, "127.0.0.1", 0, "single")
    mesh = Mesh.build(cfg.parallel.mesh_dims(n), rank, n)
    return Trainer(cfg, spec, DistRuntime(env, "gloo", torch.device(device)), mesh, Comm(), Path(cfg.run.out))


def train_and_save(rank: int, n: int, cfg, spec, save_at: int | None) -> list[float]:
    """Train from where the run stands (``--resume`` loads its checkpoint) to ``--steps``,
    saving after step ``save_at``; the losses of the steps taken."""
    trainer = build_trainer(rank, n, cfg, spec)
    losses = []
    for step in range(trainer.start_step, cfg.train.steps):
        losses.append(trainer.train_step(step)["loss"])
        if step + 1 == save_at:
            trainer.save(step + 1)
    return losses


def assert_resumes_both_ways(cfg, one, spec, nproc: int) -> None:
    """``cfg`` on ``nproc`` ranks saved after step 2 continues exactly as ``one`` (one process, the
    same global batch, its own run folder), and ``one`` saved after step 2 continues exactly as ``cfg``."""
    straight = run_distributed(train_and_save, nproc, cfg, spec, 2, timeout_s=240)[0]
    resumed = run_distributed(train_and_save, 1, one.replace(out=cfg.run.out, resume=True), spec, None,
                              timeout_s=240)[0]
    assert resumed == pytest.approx(straight[2:], rel=1e-5)
    run_distributed(train_and_save, 1, one, spec, 2, timeout_s=240)
    back = run_distributed(train_and_save, nproc, cfg.replace(out=one.run.out, resume=True), spec, None,
                           timeout_s=240)[0]
    assert back == pytest.approx(straight[2:], rel=1e-5)


def losses_of_run(cfg, out: Path, **changes) -> list[float]:
    """Launch ``cfg`` (with ``changes``) into ``out`` as the command does; the losses of its metrics.jsonl."""
    import json

    from scaletrain.commands.train import launch

    launch(cfg.replace(out=str(out), **changes))
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
