"""Offloaded optimizer: same steps as on the device, trainer-style use, state
placement and keying, the byte ledger, and checkpoint round trips."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from scaletrain.models.gpt import GPT, GPTConfig
from scaletrain.optim.adamw import build_adamw, decay_groups
from scaletrain.optim.offload import OffloadedOptimizer
from scaletrain.train import checkpoint as ckpt

_CFG = GPTConfig(vocab_size=32, seq_len=16, n_layers=2, n_heads=2, d_model=32)


def _adamw(groups: list[dict]) -> torch.optim.AdamW:
    return torch.optim.AdamW(groups, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, foreach=True)


def _model(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(_CFG)


def _backward(model: GPT, step: int) -> None:
    gen = torch.Generator().manual_seed(100 + step)
    x = torch.randint(0, _CFG.vocab_size, (4, _CFG.seq_len), generator=gen)
    y = torch.randint(0, _CFG.vocab_size, (4, _CFG.seq_len), generator=gen)
    F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()


def _assert_same_params(a: GPT, b: GPT) -> None:
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb, rtol=0, atol=1e-6, msg=name)


def _train_pair(steps: int, lrs=None):
    """The same model stepped by AdamW on the device and by offloaded AdamW,
    the trainer's way: lr set on every group, step, zero_grad."""
    ref_model, off_model = _model(), _model()
    ref = _adamw(decay_groups(ref_model, 0.1))
    off = OffloadedOptimizer(decay_groups(off_model, 0.1), _adamw)
    for step in range(steps):
        for model, opt in ((ref_model, ref), (off_model, off)):
            _backward(model, step)
            for i, group in enumerate(opt.param_groups):
                group["lr"] = lrs(step, i) if lrs else 1e-2
            opt.step()
            opt.zero_grad(set_to_none=True)
        _assert_same_params(ref_model, off_model)
    return ref_model, off_model, ref, off


def test_offloaded_adamw_equals_device_adamw():
    ref_model, off_model, ref, off = _train_pair(steps=5)
    moved = sum((p - q).abs().sum() for p, q in zip(_model().parameters(), off_model.parameters()))
    assert moved > 0.1, "the steps must actually move the weights"
    for p_ref, p_off in zip(ref_model.parameters(), off_model.parameters()):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            torch.testing.assert_close(off.state[p_off][key], ref.state[p_ref][key],
                                       rtol=0, atol=1e-6)


def test_lr_set_on_the_wrapper_reaches_the_step():
    # A schedule that differs per step and per group, with lr 0 for the
    # vectors on even steps: both must show up in the offloaded run too.
    schedule = lambda step, group: 0.0 if group == 1 and step % 2 == 0 else 1e-2 / (step + 1)
    _, off_model, _, off = _train_pair(steps=4, lrs=schedule)
    assert off.inner.param_groups[0]["lr"] == 1e-2 / 4

    frozen = _model()
    off = OffloadedOptimizer(decay_groups(frozen, 0.0), _adamw)
    before = [p.detach().clone() for p in frozen.parameters()]
    _backward(frozen, 0)
    off.param_groups[0]["lr"] = 0.0
    off.step()
    for p, p0 in zip(frozen.parameters(), before):
        if p.dim() >= 2:
            assert torch.equal(p, p0)
        else:
            assert not torch.equal(p, p0)


def test_state_is_keyed_by_device_params_and_lives_on_the_host():
    model = _model()
    off = OffloadedOptimizer(decay_groups(model, 0.1), _adamw)
    assert len(off.state) == 0
    _backward(model, 0)
    off.step()
    params = list(model.parameters())
    assert set(off.state) == set(params) and len(off.state) == len(params)
    for p in params:
        assert p in off.state
        state = off.state[p]
        assert set(state) == {"step", "exp_avg", "exp_avg_sq"}
        assert all(t.device.type == "cpu" for t in state.values())
        # Separate host tensors, not views of the device parameter.
        assert state["exp_avg"].data_ptr() != p.data_ptr()
    # Writing through the device key (as a checkpoint load may) reaches the
    # inner optimizer's state of the host copy.
    p = params[0]
    replacement = {k: torch.full_like(v, 3.0) for k, v in off.state[p].items()}
    off.state[p] = replacement
    host = off.inner.param_groups[0]["params"][0]
    assert torch.equal(off.inner.state[host]["exp_avg"], replacement["exp_avg"])

    grouped = [p for g in decay_groups(model, 0.1) for p in g["params"]]
    assert [id(p) for g in off.param_groups for p in g["params"]] == [id(p) for p in grouped]
    host_params = [h for g in off.inner.param_groups for h in g["params"]]
    for host, p in zip(host_params, grouped, strict=True):
        assert host.dtype == torch.float32 and host.data_ptr() != p.data_ptr()
        torch.testing.assert_close(host, p.detach(), rtol=0, atol=0)


def test_bytes_by_device_counts_state_masters_and_grads():
    model = _model()
    params = list(model.parameters())
    n = sum(p.numel() for p in params)
    off = OffloadedOptimizer(decay_groups(model, 0.1), _adamw)
    # Before the first step: the fp32 master and the fp32 gradient buffer.
    assert off.bytes_by_device() == {"cpu": (4 + 4) * n}
    _backward(model, 0)
    off.step()
    # After: + exp_avg and exp_avg_sq (fp32) + one fp32 step counter per tensor.
    assert off.bytes_by_device() == {"cpu": (4 + 4 + 8) * n + 4 * len(params)}


def test_parameters_without_gradients_are_left_alone():
    model = _model()
    off = OffloadedOptimizer(decay_groups(model, 0.1), _adamw)
    _backward(model, 0)
    model.pos_emb.weight.grad = None
    before = model.pos_emb.weight.detach().clone()
    off.step()
    assert torch.equal(model.pos_emb.weight, before)
    assert model.pos_emb.weight not in off.state
    assert model.tok_emb.weight in off.state


def test_state_dict_is_interchangeable_with_device_adamw():
    ref_model, off_model, ref, off = _train_pair(steps=2)
    fresh_model = _model()
    fresh_model.load_state_dict(off_model.state_dict())
    fresh = OffloadedOptimizer(decay_groups(fresh_model, 0.1), _adamw)
    # Written by the on-device optimizer; copied, as a save and load would
    # (torch's load_state_dict adopts same-device tensors without copying).
    fresh.load_state_dict(copy.deepcopy(ref.state_dict()))
    for model, opt in ((ref_model, ref), (fresh_model, fresh)):
        _backward(model, 7)
        opt.step()
    _assert_same_params(ref_model, fresh_model)


def test_checkpoint_round_trip_refreshes_the_masters(tmp_path):
    """The project's checkpoint code saves ``optimizer.state[p]`` by parameter
    name and loads weights in place; the host masters must follow the loaded
    weights, or the next step would write the stale ones back."""
    ref_model, off_model, ref, off = _train_pair(steps=3)
    path = ckpt.save_checkpoint(tmp_path, 3, off_model, off, {"step": 3}, is_main=True,
                                barrier=lambda: None)

    resumed_model = _model(seed=1)  # different initial weights
    resumed = OffloadedOptimizer(decay_groups(resumed_model, 0.1), _adamw)
    assert ckpt.load_checkpoint(path, resumed_model, resumed) == {"step": 3}
    _assert_same_params(off_model, resumed_model)
    for model, opt in ((ref_model, ref), (resumed_model, resumed)):
        _backward(model, 3)
        for group in opt.param_groups:
            group["lr"] = 1e-2
        opt.step()
    _assert_same_params(ref_model, resumed_model)


def test_build_adamw_factory_drives_the_trainer_optimizer():
    """The trainer's optimizer, offloaded: build_adamw's options come along."""
    model = _model()
    ref_model = _model()
    ref = build_adamw(ref_model, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    off = OffloadedOptimizer(
        decay_groups(model, 0.1),
        lambda groups: torch.optim.AdamW(groups, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, foreach=True))
    assert [g["weight_decay"] for g in off.param_groups] == [0.1, 0.0]
    for m, opt in ((ref_model, ref), (model, off)):
        _backward(m, 0)
        opt.step()
    _assert_same_params(ref_model, model)
