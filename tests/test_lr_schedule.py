"""The learning-rate schedules (optim/schedule.py): warm-up, then cosine or linear decay to
``--min-lr-ratio x --lr``, or constant; the value of every step, as a pure function and as a
run records it in metrics.jsonl, and through the library's ``setup(lr_schedule=...)``."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import scaletrain
from scaletrain.commands.cli import main
from scaletrain.job.metrics import read_metrics
from scaletrain.optim.schedule import lr_at

PEAK, FLOOR = 0.01, 0.001  # --lr 0.01 --min-lr-ratio 0.1
# Warm-up 2, 6 steps: t = 0, 1 warm up; the decay's progress is p = (t - 2) / 4 for t = 2 ... 5,
# and steps past the last (t = 6, 7) stay where the last one ended.
EXPECTED = {
    "cosine": [0.005, 0.01] + [FLOOR + (PEAK - FLOOR) * (1 + math.cos(math.pi * p)) / 2 for p in (0, 0.25, 0.5, 0.75)]
              + [FLOOR, FLOOR],
    "linear": [0.005, 0.01, 0.01, 0.00775, 0.0055, 0.00325, FLOOR, FLOOR],
    "constant": [0.005, 0.01, 0.01, 0.01, 0.01, 0.01, 0.01, 0.01],
}


@pytest.mark.parametrize("schedule", sorted(EXPECTED))
def test_every_step_has_its_schedules_learning_rate(schedule):
    got = [lr_at(t, peak=PEAK, warmup=2, total=6, min_ratio=0.1, schedule=schedule) for t in range(8)]
    assert got == pytest.approx(EXPECTED[schedule], rel=1e-12, abs=0)


def test_the_default_schedule_is_cosine():
    assert [lr_at(t, peak=PEAK, warmup=2, total=6, min_ratio=0.1) for t in range(8)] == \
        [lr_at(t, peak=PEAK, warmup=2, total=6, min_ratio=0.1, schedule="cosine") for t in range(8)]


# A run of 4 steps, warm-up 1, floor 0.25 x 0.01: the decay's progress is p = (t - 1) / 3.
RUN_EXPECTED = {
    "cosine": [0.01, 0.01, 0.0025 + 0.0075 * 0.75, 0.0025 + 0.0075 * 0.25],
    "linear": [0.01, 0.01, 0.0025 + 0.0075 * 2 / 3, 0.0025 + 0.0075 / 3],
    "constant": [0.01, 0.01, 0.01, 0.01],
}


@pytest.mark.parametrize("schedule", sorted(RUN_EXPECTED))
def test_a_run_records_its_schedules_learning_rate_at_every_step(corpus, tmp_path, capsys, schedule):
    run = tmp_path / "run"
    assert main(["train", "--model", "gpt-tiny", "--data", str(corpus), "--seq-len", "32", "--micro-batch", "2",
                 "--steps", "4", "--warmup-steps", "1", "--lr", "0.01", "--min-lr-ratio", "0.25",
                 "--lr-schedule", schedule, "--eval-every", "0", "--eval-batches", "1", "--sample-tokens", "0",
                 "--no-progress", "--out", str(run), "--cache-dir", str(tmp_path / "cache")]) == 0
    capsys.readouterr()
    assert [r["lr"] for r in read_metrics(run / "metrics.jsonl")] == pytest.approx(RUN_EXPECTED[schedule], rel=1e-12)
    assert f'lr_schedule = "{schedule}"' in (run / "config.toml").read_text()


def test_the_library_takes_the_schedule():
    """``setup(lr_schedule="linear")``: each step's record carries the linear schedule's rate."""
    torch.manual_seed(0)
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    with scaletrain.setup(nn.Linear(4, 3), lr=0.01, steps=4, warmup_steps=1, min_lr_ratio=0.25,
                          lr_schedule="linear") as engine:
        lrs = []
        for _ in range(4):
            engine.backward(F.cross_entropy(engine(x), y))
            lrs.append(engine.step()["lr"])
    assert lrs == pytest.approx(RUN_EXPECTED["linear"], rel=1e-12)


def test_an_unknown_schedule_is_refused_in_one_sentence(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["train", "--lr-schedule", "step"])
    assert exited.value.code == 2
    assert "--lr-schedule: invalid choice: 'step'" in capsys.readouterr().err
