"""The 8-bit AdamW kernel (kernels/adamw8bit.py) against the pure-PyTorch AdamW8bit: one step
from a worn state, ties on the map's midpoints, a model over steps, bf16 parameters, a NaN,
the refusals, and training with --fused triton."""

from __future__ import annotations

import os

import torch

# triton.jit picks the interpreter when it decorates, so this precedes every import of Triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import copy
import json
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="the 8-bit AdamW kernel is written in Triton")

from scaletrain.commands.parity import relative_diffs
from scaletrain.config import Config
from scaletrain.config_checks import check_values
from scaletrain.kernels import adamw8bit as kernel
from scaletrain.kernels.adamw8bit import adamw8bit_step, lookup_table
from scaletrain.optim import build_optimizer
from scaletrain.optim.adamw8bit import BLOCK, AdamW8bit, dynamic_map, quantize
from scaletrain.commands.train import launch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
HYPER = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
CODES = ("exp_avg_codes", "exp_avg_sq_codes")


def _worn_state(numel: int, step: int, gen: torch.Generator) -> dict:
    """8-bit state as after ``step`` steps: moments of scales that vary from block to block,
    one block all zeros (an all-zero block's codes must survive its zero maximum)."""
    scales = torch.logspace(-4, -1, -(-numel // BLOCK)).repeat_interleave(BLOCK)[:numel]
    exp_avg = torch.randn(numel, generator=gen) * scales
    exp_avg_sq = torch.rand(numel, generator=gen) * scales.square()
    exp_avg[BLOCK:2 * BLOCK] = 0.0
    exp_avg_sq[BLOCK:2 * BLOCK] = 0.0
    m_codes, m_absmax = quantize(exp_avg, dynamic_map(signed=True))
    v_codes, v_absmax = quantize(exp_avg_sq, dynamic_map(signed=False))
    return {"step": torch.tensor(float(step)), "exp_avg_codes": m_codes, "exp_avg_absmax": m_absmax,
            "exp_avg_sq_codes": v_codes, "exp_avg_sq_absmax": v_absmax}


def _pair(param: torch.Tensor, state: dict | None = None, **hyper) -> list[tuple[torch.Tensor, AdamW8bit]]:
    """(parameter, optimizer) for the reference and for the kernel, from the same values and state."""
    runs = []
    for fused in (False, True):
        p = param.detach().clone().to(DEVICE).requires_grad_()
        opt = AdamW8bit([p], fused=fused, **{**HYPER, **hyper})
        if state is not None:
            # The step count stays a CPU scalar, as the optimizer keeps it.
            opt.state[p] = {key: value if key == "step" else value.to(DEVICE)
                            for key, value in copy.deepcopy(state).items()}
        runs.append((p, opt))
    return runs


def _assert_codes_agree(want: torch.Tensor, got: torch.Tensor) -> None:
    """Equal but where the two fp32 normalized values straddle a midpoint within a rounding
    error (a fused multiply-add in one of them): rare, and then one code apart."""
    differ = want != got
    assert differ.float().mean() <= 1e-3
    assert ((want.int() - got.int())[differ].abs() == 1).all()


def test_one_step_from_a_worn_state_matches_the_reference():
    gen = torch.Generator().manual_seed(0)
    numel = 3 * BLOCK + 100  # a partial last block
    state = _worn_state(numel, step=4, gen=gen)
    runs = _pair(torch.randn(numel, generator=gen), state)
    grad = torch.randn(numel, generator=gen) * 1e-2
    grad[:50] = 0.0  # the moments decay alone
    for p, opt in runs:
        p.grad = grad.to(DEVICE)
        opt.step()
    (want, want_opt), (got, got_opt) = runs
    # Both compute the same fp32 operations in the same order; a fused multiply-add in torch's
    # lerp moves m by an ulp, which moves the step by an ulp of lr-sized updates.
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    want_state, got_state = want_opt.state[want], got_opt.state[got]
    assert got_state["step"].item() == 5
    for key in ("exp_avg_absmax", "exp_avg_sq_absmax"):
        torch.testing.assert_close(got_state[key], want_state[key], rtol=1e-6, atol=0)
    assert got_state["exp_avg_absmax"][1] > 0  # the zero block took the gradient
    for key in CODES:
        _assert_codes_agree(want_state[key], got_state[key])


def test_a_value_on_a_midpoint_takes_the_lower_code_as_searchsorted():
    """With b1 = 0 and zero moments, m is the gradient exactly in both, and a maximum of 1 leaves
    it unscaled: gradients on every midpoint of the signed map, and on every map value, must
    get the reference's codes exactly."""
    qmap = dynamic_map(signed=True)
    midpoints = (qmap[1:] + qmap[:-1]) / 2
    grad = torch.cat([midpoints, qmap, -midpoints.flip(0)])
    grad = torch.cat([grad, torch.linspace(-1, 1, 2 * BLOCK - len(grad))])  # 8-bit: over 4096 elements
    runs = _pair(torch.zeros_like(grad), betas=(0.0, 0.95))
    for p, opt in runs:
        p.grad = grad.to(DEVICE)
        opt.step()
    (want, want_opt), (got, got_opt) = runs
    want_codes, got_codes = want_opt.state[want]["exp_avg_codes"], got_opt.state[got]["exp_avg_codes"]
    assert torch.equal(got_codes, want_codes)
    assert torch.equal(got_codes[:len(midpoints)].long().cpu(), torch.arange(len(midpoints)))  # the lower one


def _train(fused: bool, steps: int = 5) -> tuple[dict[str, torch.Tensor], AdamW8bit]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Tanh(), torch.nn.Linear(96, 1)).to(DEVICE)
    opt = AdamW8bit(model.parameters(), fused=fused, **HYPER)
    inputs = torch.randn(32, 64, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    targets = inputs[:, :3].sum(1, keepdim=True)
    for _ in range(steps):
        opt.zero_grad()
        (model(inputs) - targets).square().mean().backward()
        opt.step()
    return {name: t.detach().cpu() for name, t in model.state_dict().items()}, opt


def test_a_model_trains_as_with_the_reference_over_steps():
    """The first weight (6144 elements) takes the kernel; the rest keep fp32 moments. A code
    that differs by one moves that element's moment by one gap of the map (under 1.5% of its
    block's maximum), hence its later steps by under lr * 1.5% / (1 - b1) = 1.5e-3 each, while the
    weights are ~0.07 in size: a few such elements over five steps stay well under 1e-3 of the
    weights' norm. A wrong kernel (a bias correction, a decay, codes off by one throughout)
    moves every element by a fraction of lr = 1e-2, a relative difference above 1e-2."""
    want, reference = _train(fused=False)
    got, fused = _train(fused=True)
    weight = next(iter(fused.state))
    assert "exp_avg_codes" in fused.state[weight] and "exp_avg" in fused.state[list(fused.state)[1]]
    assert relative_diffs(got, want)[1] < 1e-3
    for key in CODES:
        _assert_codes_agree(reference.state[next(iter(reference.state))][key], fused.state[weight][key])


def test_bf16_parameters_match_the_reference_within_rounding():
    gen = torch.Generator().manual_seed(2)
    numel = 2 * BLOCK + 7
    runs = _pair(torch.randn(numel, generator=gen).bfloat16(), _worn_state(numel, step=2, gen=gen))
    for step in range(2):
        grad = (torch.randn(numel, generator=gen) * 1e-2).bfloat16()
        for p, opt in runs:
            p.grad = grad.to(DEVICE)
            opt.step()
    (want, want_opt), (got, got_opt) = runs
    assert got.dtype == torch.bfloat16
    # Each rounds the same fp32 value to bf16 once per step; an ulp of fp32 may cross a tie.
    torch.testing.assert_close(got, want, rtol=2 ** -7, atol=1e-6)
    for key in CODES:
        _assert_codes_agree(want_opt.state[want][key], got_opt.state[got][key])


def test_a_nan_gradient_poisons_its_blocks_maxima_as_in_the_reference():
    gen = torch.Generator().manual_seed(4)
    runs = _pair(torch.randn(2 * BLOCK, generator=gen))
    grad = torch.randn(2 * BLOCK, generator=gen)
    grad[7] = float("nan")
    for p, opt in runs:
        p.grad = grad.to(DEVICE)
        opt.step()
    (want, want_opt), (got, got_opt) = runs
    for key in ("exp_avg_absmax", "exp_avg_sq_absmax"):
        torch.testing.assert_close(got_opt.state[got][key], want_opt.state[want][key], equal_nan=True)
        assert got_opt.state[got][key][0].isnan()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7, equal_nan=True)


def test_unfit_tensors_are_refused():
    gen = torch.Generator().manual_seed(3)
    state = _worn_state(2 * BLOCK, step=1, gen=gen)
    tables = lookup_table(dynamic_map(signed=True)), lookup_table(dynamic_map(signed=False))
    param = torch.zeros(2 * BLOCK)
    with pytest.raises(ValueError, match="contiguous"):
        adamw8bit_step(param, torch.zeros(2, BLOCK).t(), state, *tables, block=BLOCK, step=2, lr=1e-2,
                       beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0)
    with pytest.raises(TypeError, match="among"):
        adamw8bit_step(param.double(), param.double(), state, *tables, block=BLOCK, step=2, lr=1e-2, beta1=0.9,
                       beta2=0.95, eps=1e-8, weight_decay=0.0)


def test_fused_triton_selects_the_kernel_for_adamw8bit():
    cfg = Config().replace(optimizer="adamw8bit", fused="triton")
    check_values(cfg)
    opt = build_optimizer([{"params": [torch.zeros(4096, device=DEVICE)], "weight_decay": 0.0}], cfg.train)
    assert isinstance(opt, AdamW8bit) and opt.fused


def test_training_with_bf16_masters_follows_the_unfused_run(tiny_cfg, monkeypatch):
    """--fused triton --optimizer adamw8bit with fp32 masters: the masters stepped by the kernel,
    the bf16 working weights copied as without it (the AdamW kernel's fused copy is not used)."""
    cfg = tiny_cfg.replace(steps=3, optimizer="adamw8bit", precision="bf16", param_dtype="bf16")
    stepped, real_step = [], kernel.adamw8bit_step
    monkeypatch.setattr(kernel, "adamw8bit_step", lambda param, *a, **k: (stepped.append(param.numel()),
                                                                          real_step(param, *a, **k)))
    losses = {}
    for fused in ("triton", "none"):
        out = Path(f"{cfg.run.out}-{fused}")
        launch(cfg.replace(fused=fused, out=str(out)))
        losses[fused] = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert stepped and min(stepped) >= 4096  # the kernel took the 8-bit tensors, and only those
    # bf16 forward and backward: the losses agree to bf16's precision, not fp32's.
    assert losses["triton"] == pytest.approx(losses["none"], rel=1e-3)
