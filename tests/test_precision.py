"""Mixed precision against reference behaviour: GradScaler's trajectory, autocast dtypes, master weights."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn

from scaletrain.errors import UserError
from scaletrain.precision import (
    PRECISIONS,
    DynamicLossScaler,
    MasterWeights,
    autocast,
    compute_dtype,
)

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
    assert scaler.step(opt, found_inf=True)
    scaler.update(True)
    assert torch.equal(p.detach(), torch.tensor([-1.0, -1.0]))
    assert scaler.scale_value == 1.0 and scaler.skipped_steps == 0


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
    assert [compute_dtype(p) for p in PRECISIONS] == [torch.float32, torch.bfloat16, torch.float16]
    with pytest.raises(UserError):
        compute_dtype("fp8")


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


def test_master_weights_halve_param_bytes_and_keep_fp32_masters():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 1))
    original = [p.detach().clone() for p in model.parameters()]
    ids = [id(p) for p in model.parameters()]
    before = sum(p.numel() * p.element_size() for p in model.parameters())
    mw = MasterWeights(model)
    after = sum(p.numel() * p.element_size() for p in model.parameters())
    assert after * 2 == before
    assert [id(p) for p in model.parameters()] == ids  # same Parameter objects
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert all(m.dtype == torch.float32 and m.is_leaf and not m.requires_grad for m in mw.master_params)
    # Masters hold the exact fp32 initialisation, not its bf16 rounding.
    assert all(torch.equal(m, o) for m, o in zip(mw.master_params, original))


def test_master_groups_mirror_the_model_groups():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    groups = [{"params": [model[0].weight, model[1].weight], "weight_decay": 0.1},
              {"params": [model[0].bias, model[1].bias], "weight_decay": 0.0}]
    mw = MasterWeights(model)
    mapped = mw.master_groups(groups)
    assert [g["weight_decay"] for g in mapped] == [0.1, 0.0]
    assert mapped[0]["params"][1] is mw.master_params[2]  # model[1].weight is the third parameter
    with pytest.raises(UserError):
        mw.master_groups([{"params": [nn.Parameter(torch.zeros(1))]}])


def test_tiny_updates_vanish_in_bf16_but_accumulate_in_the_master():
    lr, steps = 1e-3, 100  # each update is 1e-3 < 2^-8 of the weight 1.0
    direct = nn.Parameter(torch.ones(1, dtype=torch.bfloat16))
    direct_opt = torch.optim.SGD([direct], lr=lr)
    model = nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.0)
    mw = MasterWeights(model)
    opt = torch.optim.SGD(mw.master_params, lr=lr)
    for _ in range(steps):
        direct.grad = torch.ones(1, dtype=torch.bfloat16)
        direct_opt.step()
        model.weight.grad = torch.ones(1, 1, dtype=torch.bfloat16)
        mw.copy_grads_to_master()
        opt.step()
        mw.copy_master_to_model()
        opt.zero_grad()
    assert direct.item() == 1.0
    assert mw.master_params[0].item() == pytest.approx(1.0 - lr * steps, abs=1e-5)
    assert model.weight.item() == torch.tensor(0.9).bfloat16().item()


def test_grads_accumulate_in_fp32_across_micro_batches():
    model = nn.Linear(1, 1, bias=False)
    mw = MasterWeights(model)
    for _ in range(3):
        model.weight.grad = torch.full((1, 1), 1.0 + 2**-7, dtype=torch.bfloat16)
        mw.copy_grads_to_master()
        assert model.weight.grad is None
    assert mw.master_params[0].grad.dtype == torch.float32
    assert mw.master_params[0].grad.item() == 3 * (1.0 + 2**-7)  # bf16 would round 3.0234 to 3.0312


def _regression(mode: str) -> float:
    """AdamW on a small MLP fitting a noisy smooth target; the final full-batch loss.

    mode: "fp32" (reference), "master" (bf16 working weights under bf16
    autocast, fp32 masters), or "bf16" (bf16 weights updated directly).
    """
    torch.manual_seed(0)
    x = torch.randn(256, 16)
    y = 2 * torch.tanh(x @ torch.randn(16, 1) / 2) + 0.3 * torch.randn(256, 1)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
    mw = MasterWeights(model) if mode == "master" else None
    if mode == "bf16":
        model.to(torch.bfloat16)
    opt = torch.optim.AdamW(mw.master_params if mw else model.parameters(), lr=3e-3, weight_decay=0.0)
    precision = "fp32" if mode == "fp32" else "bf16"
    for _ in range(300):
        with autocast(precision, CPU):
            pred = model(x)
        nn.functional.mse_loss(pred.float(), y).backward()
        if mw:
            mw.copy_grads_to_master()
        opt.step()
        if mw:
            mw.copy_master_to_model()
        opt.zero_grad()
    with torch.no_grad(), autocast(precision, CPU):
        return nn.functional.mse_loss(model(x).float(), y).item()


def test_bf16_master_training_tracks_fp32():
    fp32_loss = _regression("fp32")
    assert fp32_loss < 0.1  # learned: the target's variance is about 1.7
    # Margin: within 2% of the fp32 loss (measured: 0.1%). bf16 forward and
    # backward arithmetic stays; only the weight storage differs.
    assert _regression("master") == pytest.approx(fp32_loss, rel=0.02)
    # Without masters the same run loses its small updates and misses the
    # margin by a wide gap (measured: 23% worse), so the margin discriminates.
    assert _regression("bf16") > 1.1 * fp32_loss


def test_master_state_dict_restores_full_precision():
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    mw = MasterWeights(model)
    saved = mw.state_dict()
    with torch.no_grad():
        for m in mw.master_params:
            m.add_(1.0)
    fresh_model = copy.deepcopy(model)
    fresh = MasterWeights(fresh_model)
    fresh.load_state_dict(saved)
    assert all(torch.equal(a, b) for a, b in zip(fresh.master_params, saved.values()))
    assert all(torch.equal(p, m.bfloat16()) for p, m in zip(fresh_model.parameters(), saved.values()))
    with pytest.raises(UserError):
        fresh.load_state_dict({"weight": saved["weight"]})
