"""A Llama block's saved tensors at their minimum (models/lean_saves.py): the same numbers as the
plain formulas, bit for bit, and, on Llama 2's shapes cut down, the bytes a token a layer the
memory meter measures equal to the planner's and within 10% of the least a block must keep
(docs/techniques.md's table)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from scaletrain.commands.parity import relative_diffs
from scaletrain.config import ModelConfig
from scaletrain.models import llama, spec_for
from scaletrain.planner import activations
from scaletrain.planner.inventory import Planned
from scaletrain.train.memory import ActivationMeter

VOCAB, SEQ, BATCH = 96, 128, 4


def _plain_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return weight.float() * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps))


def _block_numbers(precision: str) -> dict[str, torch.Tensor]:
    """One block of llama-tiny (grouped-query attention) at ``precision``: its output and the
    gradients of its input and of every weight, by name."""
    spec = spec_for("llama-tiny")
    torch.manual_seed(0)
    block = spec.build(spec.configure(ModelConfig(name="llama-tiny"), VOCAB, 32)).blocks[0]
    if precision == "bf16 weights":
        block.to(torch.bfloat16)
    x = torch.randn(2, 32, 64, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision != "fp32"):
        out = block(x)
    out.float().pow(2).sum().backward()
    return {"output": out.detach(), "input": x.grad, **{name: p.grad for name, p in block.named_parameters()}}


@pytest.mark.numerics
@pytest.mark.parametrize("precision", ["fp32", "bf16", "bf16 weights"])
def test_a_block_computes_and_differentiates_as_the_plain_formulas(precision, monkeypatch):
    """RMSNorm keeping its input alone, silu recomputed in backward and one autocast copy for
    q, k and v (and for gate and up) against autograd over the plain formulas (each linear layer
    its own autocast cast): the same output bit for bit, and gradients within fp32's rounding
    (the residual stream's gradient adds the norm's share as one term where autograd added its
    two parts one by one), at every precision."""
    lean = _block_numbers(precision)
    monkeypatch.setattr(llama, "rms_norm", _plain_rms_norm)
    monkeypatch.setattr(llama, "silu_mul", lambda gate, up: F.silu(gate) * up)
    monkeypatch.setattr(llama, "shared_cast", lambda x, readers: (x,) * readers)
    plain = _block_numbers(precision)
    assert torch.equal(lean.pop("output"), plain.pop("output"))
    assert all(lean[name].dtype == plain[name].dtype for name in plain)
    per_tensor, whole = relative_diffs(lean, plain)
    assert whole < 1e-6 and max(per_tensor.values()) < 1e-6, per_tensor


def _saved_peak(model_cfg: ModelConfig) -> int:
    """Saved-activation peak of one forward and backward, bf16 weights under bf16 autocast."""
    spec = spec_for(model_cfg.name)
    torch.manual_seed(0)
    model = spec.build(spec.configure(model_cfg, VOCAB, SEQ)).to(torch.bfloat16)
    ids, targets = torch.randint(0, VOCAB, (BATCH, SEQ)), torch.randint(0, VOCAB, (BATCH, SEQ))
    with ActivationMeter(model) as meter:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(ids)
        F.cross_entropy(logits.float().flatten(0, 1), targets.flatten()).backward()
    return meter.peak


def test_a_block_saves_what_the_planner_counts_within_10_percent_of_the_minimum():
    """Llama 2 7B's block cut to width 256 (4 heads of 64, SwiGLU 688 wide), bf16 weights under
    autocast, no recompute, SDPA: a block's bytes a token (two blocks' peak less one's) equal the
    planner's, and the table's minimum (the norms' fp32 inputs, one bf16 input for q, k, v and one
    for gate, up; q, k, v, the attention's output and log-sum-exp; gate's, up's outputs and
    their product) to 10%."""
    one, two = (ModelConfig(name="llama2-7b", n_layers=layers, d_model=256, n_heads=4, n_kv_heads=4,
                            ffn_hidden=688) for layers in (1, 2))
    tokens = BATCH * SEQ
    measured = (_saved_peak(two) - _saved_peak(one)) / tokens
    model = Planned.of(one, VOCAB, SEQ)
    x = activations.shape_of(model.shape, model.tensor_plan, BATCH, 1, False, 1, "bf16", "bf16")
    assert measured == activations.block(x) / tokens
    h, f, heads = 256, 688, 4
    minimum = 2 * 4 * h + 2 * 2 * h + 4 * 2 * h + 4 * heads + 3 * 2 * f
    assert minimum <= measured <= 1.1 * minimum, (measured, minimum)
