"""Recompute policies: bitwise the plain model's loss and gradients, names kept, work really redone."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from scaletrain.errors import UserError
from scaletrain.models.gpt import GPT, GPTConfig
from scaletrain.techniques.recompute import apply_recompute, parse_policy

# Compared bit for bit or within bounds derived in each test: CI reruns them on other vector kernels.
pytestmark = pytest.mark.numerics

POLICIES = ["none", "full", "every:2", "sqrt", "selective"]


def small_gpt(dropout: float, n_layers: int = 4) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=64, seq_len=32, n_layers=n_layers, n_heads=4, d_model=64, dropout=dropout))


def loss_and_grads(model: GPT) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    data = torch.Generator().manual_seed(1)
    idx = torch.randint(0, 64, (4, 32), generator=data)
    targets = torch.randint(0, 64, (4, 32), generator=data)
    torch.manual_seed(2)  # the dropout masks
    loss = F.cross_entropy(model(idx).flatten(0, 1), targets.flatten())
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters()}


class CountAttentionKernels(TorchDispatchMode):
    """Counts forward attention kernels run, in forward and in backward's recomputation.

    A dispatch mode, unlike a function mode, stays on inside the autograd
    engine, where checkpoint reruns the forward.
    """

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        self.calls += "scaled_dot_product" in name and "backward" not in name
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("policy", POLICIES)
def test_loss_and_every_gradient_bitwise_equal(policy, dropout):
    base = small_gpt(dropout)
    want_loss, want_grads = loss_and_grads(copy.deepcopy(base))
    model = copy.deepcopy(base)
    apply_recompute(model, policy)
    loss, grads = loss_and_grads(model)
    assert torch.equal(loss, want_loss)
    assert grads.keys() == want_grads.keys()
    for name, grad in grads.items():
        assert torch.equal(grad, want_grads[name]), name


@pytest.mark.parametrize("policy", POLICIES)
def test_names_and_state_dict_unchanged(policy):
    base = small_gpt(0.0)
    model = copy.deepcopy(base)
    apply_recompute(model, policy)
    assert list(model.state_dict()) == list(base.state_dict())
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in base.named_parameters()]
    model.load_state_dict(base.state_dict())  # checkpoints written before still load


@pytest.mark.parametrize("policy, n_layers, block_runs, attention_runs", [
    ("none", 4, 4, 4),
    ("full", 4, 8, 8),
    ("every:2", 4, 6, 6),   # blocks 0 and 2 again
    ("every:3", 5, 7, 7),   # blocks 0 and 3 again
    ("sqrt", 4, 8, 8),      # two segments of two, each rerun whole
    ("sqrt", 5, 10, 10),    # segments of 3 and 2
    ("selective", 4, 4, 8),  # only the attention core again
])
def test_backward_reruns_exactly_the_chosen_parts(policy, n_layers, block_runs, attention_runs):
    model = small_gpt(0.0, n_layers)
    apply_recompute(model, policy)
    ln1_runs = []
    for block in model.blocks:
        block.ln1.register_forward_hook(lambda *_: ln1_runs.append(1))
    with CountAttentionKernels() as sdpa:
        loss_and_grads(model)
    assert len(ln1_runs) == block_runs
    assert sdpa.calls == attention_runs


def test_sqrt_block_called_alone_is_still_that_block():
    base = small_gpt(0.0)
    model = copy.deepcopy(base)
    apply_recompute(model, "sqrt")
    x = torch.randn(2, 32, 64)
    assert torch.equal(model.blocks[1](x), base.blocks[1](x))


@pytest.mark.parametrize("text, parsed", [
    ("none", ("none", 0)), ("full", ("every", 1)), ("every:1", ("every", 1)),
    ("every:12", ("every", 12)), ("sqrt", ("sqrt", 0)), ("selective", ("selective", 0)),
])
def test_parse_policy(text, parsed):
    assert parse_policy(text) == parsed


@pytest.mark.parametrize("bad", ["", "Full", "every", "every:", "every:0", "every:-1", "every:x", "sqrt:2", "half"])
def test_bad_policies_raise_user_error_naming_the_forms(bad):
    model = small_gpt(0.0)
    with pytest.raises(UserError, match="every:K"):
        apply_recompute(model, bad)
    assert all("forward" not in block.__dict__ for block in model.blocks)


def test_applying_twice_is_refused():
    model = small_gpt(0.0)
    apply_recompute(model, "full")
    with pytest.raises(UserError, match="once"):
        apply_recompute(model, "selective")
