"""fp32 master weights: bf16 working weights, host offload, checkpoints and the ledger."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from scaletrain.errors import UserError
from scaletrain.models.gpt import GPT, GPTConfig
from scaletrain.optim import MasterWeights, decay_groups
from scaletrain.techniques.precision import autocast
from scaletrain.train import checkpoint as ckpt
from scaletrain.train.memory import model_bytes

# Compared bit for bit or within bounds derived in each test: CI reruns them on other vector kernels.
pytestmark = pytest.mark.numerics

CPU = torch.device("cpu")
_CFG = GPTConfig(vocab_size=32, seq_len=16, n_layers=2, n_heads=2, d_model=32)


def _gpt(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(_CFG)


def _backward(model: GPT, step: int, precision: str = "fp32") -> None:
    gen = torch.Generator().manual_seed(100 + step)
    x = torch.randint(0, _CFG.vocab_size, (4, _CFG.seq_len), generator=gen)
    y = torch.randint(0, _CFG.vocab_size, (4, _CFG.seq_len), generator=gen)
    with autocast(precision, CPU):
        logits = model(x)
    F.cross_entropy(logits.flatten(0, 1).float(), y.flatten()).backward()


def _adamw(groups: list[dict]) -> torch.optim.AdamW:
    return torch.optim.AdamW(groups, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, foreach=True)


def _step(model: GPT, opt: torch.optim.Optimizer, masters: MasterWeights | None, step: int,
          precision: str = "fp32") -> None:
    """The trainer's order: backward, grads to masters, step, masters to model."""
    _backward(model, step, precision)
    if masters:
        masters.copy_grads_to_master()
    for i, group in enumerate(opt.param_groups):
        group["lr"] = 1e-2 / (step + 1) if i == 0 else 3e-3  # a schedule that differs per group
    opt.step()
    if masters:
        masters.copy_master_to_model()
    opt.zero_grad(set_to_none=True)


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


def test_a_tied_weight_gets_one_master():
    model = _gpt()
    mw = MasterWeights(model)
    assert "head.weight" not in mw.names and "tok_emb.weight" in mw.names
    assert model.head.weight is model.tok_emb.weight and model.head.weight.dtype == torch.bfloat16
    assert mw.master_of(model.head.weight) is mw.master_of(model.tok_emb.weight)
    assert mw.master_of(torch.zeros(1)) is None


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


def test_grads_move_to_the_masters_as_fp32_and_leave_the_model():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    mw = MasterWeights(model)
    grad = torch.full((2, 2), 1.0 + 2**-7, dtype=torch.bfloat16)
    model[0].weight.grad = grad
    mw.copy_grads_to_master()
    assert all(p.grad is None for p in model.parameters())
    assert mw.master_params[0].grad.dtype == torch.float32
    assert torch.equal(mw.master_params[0].grad, grad.float())
    # Parameters that had no gradient give masters without one: the optimizer skips them.
    assert all(m.grad is None for m in mw.master_params[1:])
    # The next step's gradient replaces the last one (accumulation happens in the model's grads).
    model[0].weight.grad = torch.ones(2, 2, dtype=torch.bfloat16)
    mw.copy_grads_to_master()
    assert torch.equal(mw.master_params[0].grad, torch.ones(2, 2))


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


def test_offloaded_fp32_masters_step_exactly_like_the_device_optimizer():
    """--offload optimizer: fp32 masters in host memory ("cpu"), same steps as AdamW on the model.

    Element by element is right here on any CPU: both sides run the same kernels on the same fp32
    values in the same order (the masters are exact copies, their gradients exact copies), so the
    runs are bit-identical by construction, and the 1e-6 tolerance is never used."""
    ref_model, off_model = _gpt(), _gpt()
    ref = _adamw(decay_groups(ref_model, 0.1))
    masters = MasterWeights(off_model, torch.float32, device="cpu")
    off = _adamw(masters.master_groups(decay_groups(off_model, 0.1)))
    assert all(m.device.type == "cpu" and m.data_ptr() != p.data_ptr()
               for m, p in zip(masters.master_params, masters.model_params))
    for step in range(5):
        _step(ref_model, ref, None, step)
        _step(off_model, off, masters, step)
        for (name, a), b in zip(ref_model.named_parameters(), off_model.parameters()):
            torch.testing.assert_close(b, a, rtol=0, atol=1e-6, msg=name)
    moved = sum((p - q).abs().sum() for p, q in zip(_gpt().parameters(), off_model.parameters()))
    assert moved > 0.1, "the steps must actually move the weights"


def test_ledger_counts_masters_under_optimizer_and_their_grads_under_grads():
    model = _gpt()
    masters = MasterWeights(model)
    opt = _adamw(masters.master_groups(decay_groups(model, 0.1)))
    _backward(model, 0, "bf16")
    masters.copy_grads_to_master()
    opt.step()
    n = sum(p.numel() for p in model.parameters())
    tensors = len(list(model.parameters()))
    ledger = model_bytes(model, opt, masters)
    # The seeds' 2 + 4 + 12 bytes per parameter at the optimizer step:
    # bf16 weight; fp32 master; fp32 gradient + exp_avg + exp_avg_sq (+ a 4-byte step count per tensor).
    assert ledger["params"] == 2 * n
    assert ledger["grads"] == 4 * n  # the bf16 gradients were freed by the copy
    assert ledger["optimizer"] == (4 + 8) * n + 4 * tensors
    assert ledger["by_device"] == {"cpu": {"params": 2 * n, "grads": 4 * n,
                                           "optimizer": (4 + 8) * n + 4 * tensors}}


def test_checkpoint_saves_fp32_masters_and_resumes_exactly(tmp_path):
    model = _gpt()
    masters = MasterWeights(model)
    opt = _adamw(masters.master_groups(decay_groups(model, 0.1)))
    for step in range(3):
        _step(model, opt, masters, step, "bf16")
    path = ckpt.save_checkpoint(tmp_path, 3, model, opt, masters, {"step": 3})
    saved = ckpt.read_model_tensors(path)
    assert saved["tok_emb.weight"].dtype == torch.float32
    assert torch.equal(saved["blocks.0.mlp.fc.weight"], masters.master_params[masters.names.index(
        "blocks.0.mlp.fc.weight")])

    resumed_model = _gpt(seed=1)  # different initial weights
    resumed_masters = MasterWeights(resumed_model)
    resumed = _adamw(resumed_masters.master_groups(decay_groups(resumed_model, 0.1)))
    assert ckpt.load_checkpoint(path, resumed_model, resumed, resumed_masters) == {"step": 3}
    for a, b in zip(masters.master_params, resumed_masters.master_params):
        assert torch.equal(a, b)  # every fp32 bit, not the bf16 image
    for a, b in zip(model.parameters(), resumed_model.parameters()):
        assert torch.equal(a, b)
    _step(model, opt, masters, 3, "bf16")
    _step(resumed_model, resumed, resumed_masters, 3, "bf16")
    for a, b in zip(masters.master_params, resumed_masters.master_params):
        assert torch.equal(a, b)


def test_a_bf16_run_resumes_from_an_fp32_checkpoint(tmp_path):
    """Checkpoints are fp32 whatever the working dtype, so the two load each other's."""
    model = _gpt()
    opt = _adamw(decay_groups(model, 0.1))
    _step(model, opt, None, 0)
    path = ckpt.save_checkpoint(tmp_path, 1, model, opt, None, {"step": 1})
    bf16_model = _gpt(seed=1)
    masters = MasterWeights(bf16_model)
    bf16_opt = _adamw(masters.master_groups(decay_groups(bf16_model, 0.1)))
    ckpt.load_checkpoint(path, bf16_model, bf16_opt, masters)
    for (name, p), m in zip(model.named_parameters(), masters.master_params):
        assert torch.equal(p, m), name
    assert torch.equal(bf16_opt.state[masters.master_params[0]]["exp_avg"],
                       opt.state[next(model.parameters())]["exp_avg"])
