"""Memory ledger: exact byte counts for the model's tensors, and the activation meter."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from scaletrain.models.gpt import GPT, GPTConfig
from scaletrain.techniques.recompute import apply_recompute
from scaletrain.train.memory import (
    ActivationMeter,
    format_table,
    memory_ledger,
    model_bytes,
    tensor_bytes,
)

B, S, D, L = 8, 64, 64, 4


def gpt(dropout: float = 0.0) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=64, seq_len=S, n_layers=L, n_heads=4, d_model=D, dropout=dropout))


def step(model: nn.Module, bf16: bool = False) -> None:
    data = torch.Generator().manual_seed(1)
    idx = torch.randint(0, 64, (B, S), generator=data)
    targets = torch.randint(0, 64, (B, S), generator=data)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        loss = F.cross_entropy(model(idx).flatten(0, 1), targets.flatten())
    loss.backward()


def activation_peak(policy: str, dropout: float = 0.0, bf16: bool = False) -> int:
    model = gpt(dropout)
    apply_recompute(model, policy)
    with ActivationMeter(model) as meter:
        step(model, bf16)
    return meter.peak


def test_tensor_bytes_counts_each_storage_once():
    a = torch.zeros(10)
    assert tensor_bytes([a, a, a[2:5], a.view(2, 5)]) == 40
    assert tensor_bytes([a, torch.zeros(3, dtype=torch.float64)]) == 64
    assert tensor_bytes([]) == 0


def test_params_grads_and_adamw_state_exact():
    model = gpt()
    n = sum(p.numel() for p in model.parameters())  # the tied weight once
    assert n < sum(p.numel() for p in model.state_dict().values())  # state_dict lists it twice
    opt = torch.optim.AdamW(model.parameters())
    before = model_bytes(model, opt)
    assert before["params"] == 4 * n
    assert before["grads"] == 0 and before["optimizer"] == 0
    step(model)
    opt.step()
    ledger = model_bytes(model, opt)
    tensors = len(list(model.parameters()))
    assert ledger["grads"] == 4 * n
    # exp_avg and exp_avg_sq in fp32, and one fp32 step counter per tensor
    assert ledger["optimizer"] == 8 * n + 4 * tensors
    assert ledger["by_device"] == {"cpu": {k: ledger[k] for k in ("params", "grads", "optimizer")}}


def test_optimizer_may_be_any_object_with_a_state():
    class Wrapper:
        def __init__(self):
            self.state = {"shards": [torch.zeros(5), (torch.zeros(2, dtype=torch.float16),)], "note": "text"}
    model = nn.Linear(3, 2, bias=False)
    assert model_bytes(model, Wrapper())["optimizer"] == 24
    assert model_bytes(model)["optimizer"] == 0


def test_linear_relu_saved_bytes_by_hand():
    linear = nn.Linear(16, 32)
    x = torch.randn(8, 16, requires_grad=True)
    with ActivationMeter(linear) as meter:
        torch.relu(linear(x)).sum().backward()
    # Linear saves its input x (its weight is a parameter); ReLU saves its output.
    assert meter.peak == 8 * 16 * 4 + 8 * 32 * 4
    assert meter.current == 8 * 16 * 4  # x is still held by this test


def test_meter_sees_saves_inside_checkpoint_and_their_recomputation():
    linear = nn.Linear(16, 32, bias=False)
    x = torch.randn(8, 16, requires_grad=True)

    def region(t):
        return torch.relu(linear(t)) * 2

    with ActivationMeter(linear) as meter:
        checkpoint(region, x, use_reentrant=False).sum().backward()
    # Checkpoint keeps x; the relu output is dropped in forward and recomputed in
    # backward, where it is saved again: both count at the peak.
    assert meter.peak == 8 * 16 * 4 + 8 * 32 * 4

    # Plain hooks alone never see the relu output: checkpoint's own hooks shadow them.
    shapes = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: shapes.append(t.shape) or t, lambda t: t):
        checkpoint(region, x, use_reentrant=False).sum().backward()
    assert torch.Size([8, 32]) not in shapes


@pytest.fixture(scope="module")
def peaks() -> dict[str, int]:
    return {policy: activation_peak(policy) for policy in ("none", "full", "every:2", "sqrt", "selective")}


def test_full_recompute_keeps_block_inputs_plus_one_block(peaks):
    block_inputs = L * B * S * D * 4
    assert block_inputs <= peaks["full"] < 0.4 * peaks["none"]
    one_block = (peaks["none"] - block_inputs) / L  # rough: what a block saves beyond its input
    assert peaks["full"] < block_inputs + 2 * one_block


def test_sqrt_and_every_lie_between_full_and_none(peaks):
    assert peaks["full"] < peaks["sqrt"] < peaks["none"]
    assert peaks["full"] < peaks["every:2"] < peaks["none"]


def test_selective_saves_the_attention_matrices():
    # The fused CPU kernel saves no s x s matrix, so only its small extras go ...
    assert activation_peak("selective") < activation_peak("none")
    # ... while with dropout attention runs unfused and saves b*h*s*s probabilities
    # and mask per layer, which selective recompute drops.
    none, selective = activation_peak("none", 0.1), activation_peak("selective", 0.1)
    assert none - selective >= L * B * 4 * S * S * 4


def test_bf16_autocast_roughly_halves_activations(peaks):
    ratio = activation_peak("none", bf16=True) / peaks["none"]
    # Not exactly half: the residual stream and layer norms stay fp32, and
    # autocast's bf16 copies of the weights are saved too.
    assert 0.4 < ratio < 0.7


def test_meter_adds_nothing_to_the_result():
    plain, metered = gpt(0.1), gpt(0.1)
    apply_recompute(metered, "full")
    torch.manual_seed(3)
    step(plain)
    torch.manual_seed(3)
    with ActivationMeter(metered):
        step(metered)
    for (name, p), q in zip(plain.named_parameters(), metered.parameters()):
        assert torch.equal(p.grad, q.grad), name


def test_ledger_and_table():
    model = gpt()
    opt = torch.optim.AdamW(model.parameters())
    with ActivationMeter(model) as meter:
        step(model)
    ledger = memory_ledger(model_bytes(model, opt), meter)
    assert ledger["activations_peak"] == meter.peak > 0
    assert "cuda_peak" not in ledger
    table = format_table(ledger)
    assert f"{ledger['params']:,}" in table and "activations_peak" in table and "cpu grads" in table
