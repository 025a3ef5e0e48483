"""--optimizer sgd: its state (one buffer per weight with momentum, none without) against the
planner's formula, parity with one device under ZeRO and tp, and an exact resume."""

from __future__ import annotations

import pytest
import torch

from scaletrain.commands.parity import run_parity
from scaletrain.config import Config
from scaletrain.models import build_model
from scaletrain.optim import build_optimizer, decay_groups
from scaletrain.planner.memory import optimizer_bytes
from scaletrain.train.memory import optimizer_state, tensor_bytes
from tests.trainers import losses_of_run


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_state_bytes_equal_the_planners(momentum):
    cfg = Config().replace(name="gpt-tiny", optimizer="sgd", momentum=momentum)
    model = build_model(cfg.model, vocab_size=64, seq_len=16)
    optimizer = build_optimizer(decay_groups(model, cfg.train.weight_decay), cfg.train)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()
    measured = tensor_bytes(optimizer_state(optimizer))
    params = list(model.parameters())
    assert measured == optimizer_bytes(params, "sgd", momentum)
    assert measured == (4 * sum(p.numel() for p in params) if momentum else 0)


def test_momentum_update_is_the_heavy_ball_rule():
    """v <- mu v + (g + wd p); p <- p - lr v, two steps by hand against the optimizer."""
    cfg = Config().replace(optimizer="sgd", momentum=0.5, lr=0.1)
    p = torch.nn.Parameter(torch.tensor([1.0, -2.0]))
    optimizer = build_optimizer([{"params": [p], "weight_decay": 0.1}], cfg.train)
    expected, velocity = p.detach().clone(), torch.zeros(2)
    for g in (torch.tensor([0.5, 1.0]), torch.tensor([-1.0, 0.25])):
        p.grad = g.clone()
        optimizer.step()
        velocity = 0.5 * velocity + (g + 0.1 * expected)
        expected = expected - 0.1 * velocity
    torch.testing.assert_close(p.detach(), expected, rtol=1e-6, atol=0)


@pytest.mark.numerics
@pytest.mark.parametrize("changes", [dict(zero=3), pytest.param(dict(tp=2), marks=pytest.mark.slow),
                                     pytest.param(dict(zero=2, offload="optimizer"), marks=pytest.mark.slow)],
                         ids=["zero3", "tp2", "zero2-offload"])
def test_sgd_layouts_equal_one_device(tiny_cfg, changes):
    cfg = tiny_cfg.replace(nproc=2, steps=3, optimizer="sgd", momentum=0.9, lr=0.1, **changes)
    report = run_parity(cfg, tolerance=1e-5)
    assert report.passed, report.to_json()


@pytest.mark.numerics
@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_a_resumed_sgd_run_continues_exactly(tiny_cfg, tmp_path, momentum):
    cfg = tiny_cfg.replace(optimizer="sgd", momentum=momentum, lr=0.1)

    straight = losses_of_run(cfg, tmp_path / "straight")
    losses_of_run(cfg, tmp_path / "cut", stop_at=2)
    assert losses_of_run(cfg, tmp_path / "cut", resume=True) == straight
