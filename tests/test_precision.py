"""Mixed precision against reference behaviour: GradScaler's trajectory, autocast dtypes."""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

from scaletrain.errors import UserError
from scaletrain.techniques.precision import (
    PRECISIONS,
    DynamicLossScaler,
    autocast,
    compute_dtype,
)

# Compared bit for bit or within bounds derived in each test: CI reruns them on other vector kernels.
pytestmark = pytest.mark.numerics

CPU = torch.device("cpu")

# Steps at which a gradient is poisoned after backward, with growth_interval=3:
# steps 0-2 grow the scale; step 5 comes after two clean steps, so the counter
# must reset (otherwise step 6 would grow); 12-14 back off three times running.
POISON = {5: float("inf"), 12: float("-inf"), 13: float("nan"), 14: float("nan")}


def _batches(n: int):
    gen = torch.Generator().manual_seed(0)
    return [(torch.randn(8, 5, generator=gen), torch.randn(8, 3, generator=gen)) for _ in range(n)]


def _model() -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(5, 3)


def _poison(model: nn.Linear, step: int) -> None:
    if step in POISON:
        model.weight.grad[1, 2] = POISON[step]


def _run_ours(model, opt, scaler, batches, start=0):
    scales, stepped = [], []
    for i, (x, y) in enumerate(batches, start):
        opt.zero_grad()
        scaler.scale(nn.functional.mse_loss(model(x), y)).backward()
        _poison(model, i)
        found = scaler.unscale_(model.parameters())
        stepped.append(scaler.step(opt, bool(found)))
        scaler.update(bool(found))
        scales.append(scaler.scale_value)
    return scales, stepped


@pytest.mark.parametrize("make_opt", [lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
                                      lambda p: torch.optim.AdamW(p, lr=1e-2)],
                         ids=["sgd", "adamw"])
def test_scaler_matches_gradscaler(make_opt):
    """Bit for bit on any CPU: the loss scales are powers of two, so scaling and unscaling are exact,
    and both optimizers then step on bit-identical gradients with the same kernels."""
    batches = _batches(20)
    ref_model, our_model = _model(), _model()
    ref_opt, our_opt = make_opt(ref_model.parameters()), make_opt(our_model.parameters())
    ref = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3)
    ours = DynamicLossScaler(init_scale=2.0**10, growth_interval=3)

    ref_scales, ref_stepped = [], []
    for i, (x, y) in enumerate(batches):
        ref_opt.zero_grad()
        ref.scale(nn.functional.mse_loss(ref_model(x), y)).backward()
        _poison(ref_model, i)
        before = ref_model.weight.detach().clone()
        ref.step(ref_opt)
        ref.update()
        ref_stepped.append(not torch.equal(before, ref_model.weight))
        ref_scales.append(ref.get_scale())

    our_scales, our_stepped = _run_ours(our_model, our_opt, ours, batches)

    assert our_scales == ref_scales
    assert our_stepped == ref_stepped
    assert ours.skipped_steps == len(POISON) == ref_stepped.count(False)
    # The scale actually moved both ways, so the comparison covers growth and backoff.
    assert max(our_scales) > 2.0**10 > min(our_scales)
    for ours_p, ref_p in zip(our_model.parameters(), ref_model.parameters()):
        assert torch.equal(ours_p, ref_p)


def test_scaler_rule_by_hand():
    scaler = DynamicLossScaler(init_scale=8.0, growth_factor=3.0, backoff_factor=0.25, growth_interval=2)
    flags = [False, False, True, False, True, False, False, False, False]
    seen = []
    for found in flags:
        scaler.update(found)
        seen.append(scaler.scale_value)
    assert seen == [8.0, 24.0, 6.0, 6.0, 1.5, 1.5, 4.5, 4.5, 13.5]


def test_scale_never_grows_to_infinity():
    scaler = DynamicLossScaler(init_scale=2.0**127, growth_interval=1)
    scaler.update(False)
    assert scaler.scale_value == 2.0**127


def test_unscale_divides_exactly_and_detects_nonfinite():
    scaler = DynamicLossScaler(init_scale=2.0**12)
    a = nn.Parameter(torch.zeros(4))
    b = nn.Parameter(torch.zeros(2, 3))
    untouched = nn.Parameter(torch.zeros(3))  # no .grad: skipped, not an error
    a.grad = torch.tensor([1.0, -3.5, 2.0**-100, 7e30])
    b.grad = torch.randn(2, 3)
    expected = [a.grad / 2.0**12, b.grad / 2.0**12]
    found = scaler.unscale_([a, b, untouched])
    assert found.dtype == torch.float32 and found.item() == 0.0
    assert torch.equal(a.grad, expected[0]) and torch.equal(b.grad, expected[1])
    assert untouched.grad is None

    for bad in (float("inf"), float("-inf"), float("nan")):
        b.grad = torch.ones(2, 3)
        b.grad[1, 1] = bad
        assert scaler.unscale_([a, b]).item() == 1.0


def test_large_finite_gradients_are_not_flagged():
    # A 2-norm of these would overflow fp32; they are finite and must pass.
    scaler = DynamicLossScaler(init_scale=1.0)
    p = nn.Parameter(torch.zeros(1000))
    p.grad = torch.full((1000,), 3e37)
    assert scaler.unscale_([p]).item() == 0.0


def test_disabled_scaler_is_a_pass_through():
    scaler = DynamicLossScaler(enabled=False)
    loss = torch.tensor(2.5)
    assert scaler.scale(loss) is loss
    p = nn.Parameter(torch.zeros(2))
    p.grad = torch.tensor([float("inf"), 3.0])
    assert scaler.unscale_([p]).item() == 0.0
    assert torch.equal(p.grad, torch.tensor([float("inf"), 3.0]))
    opt = torch.optim.SGD([p], lr=1.0)
    p.grad = torch.tensor([1.0, 1.0])
    assert scaler.step(opt, found_inf=False)
    assert torch.equal(p.detach(), torch.tensor([-1.0, -1.0]))
    # A step the trainer found non-finite (--on-nan skip) is skipped and counted; the scale stays 1.
    assert not scaler.step(opt, found_inf=True)
    scaler.update(True)
    assert torch.equal(p.detach(), torch.tensor([-1.0, -1.0]))
    assert scaler.scale_value == 1.0 and scaler.skipped_steps == 1


def test_state_dict_resumes_the_same_trajectory():
    batches = _batches(20)
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = DynamicLossScaler(init_scale=2.0**10, growth_interval=3)
    _run_ours(model, opt, scaler, batches[:10])

    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "scaler": scaler.state_dict()},
               buffer)
    full_scales, _ = _run_ours(model, opt, scaler, batches[10:], start=10)

    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)  # plain tensors and ints only
    resumed_model = nn.Linear(5, 3)
    resumed_model.load_state_dict(saved["model"])
    resumed_opt = torch.optim.AdamW(resumed_model.parameters(), lr=1e-2)
    resumed_opt.load_state_dict(saved["opt"])
    resumed = DynamicLossScaler(init_scale=2.0**10, growth_interval=3)
    resumed.load_state_dict(saved["scaler"])
    # The first resumed step only grows the scale if the clean-step count came back too.
    resumed_scales, _ = _run_ours(resumed_model, resumed_opt, resumed, batches[10:], start=10)

    assert resumed_scales == full_scales
    assert resumed.skipped_steps == scaler.skipped_steps == len(POISON)
    for a, b in zip(resumed_model.parameters(), model.parameters()):
        assert torch.equal(a, b)


def test_state_dict_missing_keys_is_a_user_error():
    with pytest.raises(UserError):
        DynamicLossScaler().load_state_dict({"scale": torch.tensor(1.0)})


def test_bad_scaler_settings_are_user_errors():
    for kwargs in ({"init_scale": 0.0}, {"growth_factor": 1.0}, {"backoff_factor": 1.0},
                   {"growth_interval": 0}):
        with pytest.raises(UserError):
            DynamicLossScaler(**kwargs)


def test_compute_dtype():
    # fp8: the blocks' products in float8 (techniques/fp8.py), everything else in bf16
    assert [compute_dtype(p) for p in PRECISIONS] == [torch.float32, torch.bfloat16, torch.float16, torch.bfloat16]
    with pytest.raises(UserError):
        compute_dtype("fp4")


def test_autocast_bf16_runs_linear_in_bf16():
    torch.manual_seed(0)
    lin = nn.Linear(64, 32)
    x = torch.randn(16, 64)
    with autocast("bf16", CPU):
        y = lin(x)
    assert y.dtype == torch.bfloat16
    # Reference: the same product on bf16-rounded operands, in fp32. Only the
    # output rounding (relative 2^-8) and accumulation order separate them.
    ref = nn.functional.linear(x.bfloat16().float(), lin.weight.bfloat16().float(), lin.bias.bfloat16().float())
    torch.testing.assert_close(y.float(), ref, rtol=2**-7, atol=1e-2)
    # And it is genuinely lower precision than the fp32 product.
    assert not torch.equal(y.float(), lin(x))


def test_autocast_fp32_is_unchanged():
    lin = nn.Linear(8, 4)
    x = torch.randn(3, 8)
    with autocast("fp32", CPU):
        y = lin(x)
    assert y.dtype == torch.float32 and torch.equal(y, lin(x))


def test_autocast_fp16_on_cpu_works_in_this_torch():
    # CPU autocast accepts fp16 in the pinned torch, so no error path exists.
    lin = nn.Linear(8, 4)
    with autocast("fp16", CPU):
        assert lin(torch.randn(3, 8)).dtype == torch.float16


def test_cpu_autocast_reductions_follow_their_input_dtype():
    # The docstring's statement about CPU autocast: softmax and layer_norm are
    # not forced to fp32 (they keep the input's dtype), cross-entropy is.
    x = torch.randn(4, 8)
    with autocast("bf16", CPU):
        h = nn.functional.linear(x, torch.randn(8, 8))
        assert h.dtype == torch.bfloat16
        assert torch.softmax(h, -1).dtype == torch.bfloat16
        assert nn.functional.layer_norm(h, (8,)).dtype == torch.bfloat16
        assert torch.softmax(x, -1).dtype == torch.float32
        assert nn.functional.layer_norm(x, (8,)).dtype == torch.float32
        assert nn.functional.cross_entropy(h, torch.zeros(4, dtype=torch.long)).dtype == torch.float32
