"""Clipping folded into torch's fused AdamW (optim/clip.py): the scale ``min(1, max_norm / norm)``
left to the optimizer's pass over each gradient, not a pass of its own, gives the update the
separate scaling gives. Not bit for bit: the kernel divides by the scale's reciprocal where the
separate pass multiplies by the scale (one rounding apart), so the weights agree to fp32's rounding."""

import math

import pytest
import torch
from torch import nn

from scaletrain.config import TrainConfig
from scaletrain.optim import AdamW8bit, build_optimizer
from scaletrain.optim.clip import folds_scale, scale_to_norm


def _weights() -> list[nn.Parameter]:
    generator = torch.Generator().manual_seed(0)
    shapes = [(64, 48), (48,), (7, 5, 3), (1,)]
    params = [nn.Parameter(torch.randn(shape, generator=generator)) for shape in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, generator=generator)
    return params


def _adamw(params: list[nn.Parameter], **kind) -> torch.optim.AdamW:
    return torch.optim.AdamW(params, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, **kind)


def _norm(params: list[nn.Parameter]) -> torch.Tensor:
    return torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params]))


def test_the_run_optimizer_is_torch_fused_adamw_and_folds_the_scale():
    params = _weights()
    optimizer = build_optimizer([{"params": params, "weight_decay": 0.1}], TrainConfig())
    assert optimizer.defaults["fused"] and folds_scale(optimizer, torch.device("cpu"))


@pytest.mark.parametrize("max_norm", [0.5, math.inf, 1e6])  # clipping, no clipping, a norm under the limit
def test_a_folded_clip_steps_as_the_separate_scaling_does(max_norm):
    folded, separate = _weights(), _weights()
    folded_opt, separate_opt = _adamw(folded, fused=True), _adamw(separate, fused=True)
    generator = torch.Generator().manual_seed(1)
    for step in range(3):
        for p, q in zip(folded, separate):  # each step's gradients, the same for both
            p.grad = torch.randn(p.shape, generator=generator) * (step + 1)
            q.grad = p.grad.clone()
        norm = _norm(folded)
        scale_to_norm([p.grad for p in folded], max_norm, norm, folded_opt)
        assert all(torch.equal(p.grad, q.grad) for p, q in zip(folded, separate)), "the scale is the step's"
        scale_to_norm([p.grad for p in separate], max_norm, norm)  # no optimizer given: a pass of its own
        folded_opt.step()
        separate_opt.step()
        for p, q in zip(folded, separate):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
            # the kernel writes back the gradient it stepped with: what the separate pass left
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=0)
        clipped = norm > max_norm
        assert clipped == (float(_norm(folded)) < float(norm) * (1 - 1e-3))


@pytest.mark.parametrize("optimizer", [
    lambda ps: _adamw(ps, foreach=True),
    lambda ps: torch.optim.SGD(ps, lr=0.1),
    lambda ps: AdamW8bit(ps, lr=1e-2),
], ids=["foreach-adamw", "sgd", "adamw8bit"])
def test_an_optimizer_without_the_hook_has_its_gradients_scaled_first(optimizer):
    params = _weights()
    norm = _norm(params)
    before = [p.grad.clone() for p in params]
    opt = optimizer(params)
    assert not folds_scale(opt, torch.device("cpu"))
    scale_to_norm([p.grad for p in params], 0.5, norm, None)  # as the layout hands it: no optimizer to fold into
    coef = 0.5 / (norm + 1e-6)
    for p, g in zip(params, before):
        torch.testing.assert_close(p.grad, g * coef)


def test_weights_elsewhere_than_the_norm_are_not_folded():
    """A scale on one device and weights on another (host-offloaded masters beside a GPU's norm):
    the copy would be the kernel's, non-blocking, so the scaling stays a pass of its own."""
    params = _weights()
    assert not folds_scale(_adamw(params, fused=True), torch.device("meta"))
