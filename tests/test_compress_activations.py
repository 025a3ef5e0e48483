"""Activation compression: gradients close to exact, `none` bitwise plain, weights untouched,
and the memory ledger showing the bytes it saves (2x bf16, 3.88x int8, of what it compresses)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from scaletrain.commands.train import execute, prepare_run
from scaletrain.job.metrics import read_metrics
from scaletrain.models.gpt import GPT, GPTConfig
from scaletrain.techniques.compress_activations import (
    BLOCK,
    ActivationCompression,
    dequantize_int8,
    fills_its_storage,
    quantize_int8,
)
from scaletrain.techniques.recompute import apply_recompute
from scaletrain.train.memory import ActivationMeter

B, S, D, L, V = 4, 32, 64, 2, 64
# Largest relative L2 error of any parameter's gradient, fp32 on CPU, the model below
# (measured: bf16 2.6e-3, int8 9.4e-3, the worst over dropout and recompute policies).
TOLERANCE = {"bf16": 1e-2, "int8": 3e-2}


def gpt(dropout: float = 0.0) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=V, seq_len=S, n_layers=L, n_heads=4, d_model=D, dropout=dropout))


def step(model: nn.Module, mode: str, bf16: bool = False) -> ActivationCompression:
    """Forward and backward of one batch, the forward (and the loss) under compression ``mode``."""
    data = torch.Generator().manual_seed(1)
    idx = torch.randint(0, V, (B, S), generator=data)
    targets = torch.randint(0, V, (B, S), generator=data)
    torch.manual_seed(2)  # the dropout masks
    compression = ActivationCompression(mode)
    with compression, torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        loss = F.cross_entropy(model(idx).flatten(0, 1).float(), targets.flatten())
    loss.backward()
    return compression


def grads(base: GPT, mode: str, policy: str = "none") -> dict[str, torch.Tensor]:
    model = copy.deepcopy(base)
    apply_recompute(model, policy)
    step(model, mode)
    return {name: p.grad for name, p in model.named_parameters()}


def test_none_installs_no_hooks_and_is_bitwise_plain():
    base = gpt(0.1)
    with ActivationCompression("none"):
        assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    plain = copy.deepcopy(base)
    data = torch.Generator().manual_seed(1)
    idx, targets = torch.randint(0, V, (B, S), generator=data), torch.randint(0, V, (B, S), generator=data)
    torch.manual_seed(2)
    F.cross_entropy(plain(idx).flatten(0, 1), targets.flatten()).backward()
    for name, grad in grads(base, "none").items():
        assert torch.equal(grad, dict(plain.named_parameters())[name].grad), name


DEFAULT_CASES = {("bf16", "none", 0.1), ("int8", "full", 0.0)}


@pytest.mark.parametrize("mode, policy, dropout", [
    *sorted(DEFAULT_CASES),
    *(pytest.param(m, p, d, marks=pytest.mark.slow) for m in ("bf16", "int8") for p in ("none", "full", "every:2")
      for d in (0.0, 0.1) if (m, p, d) not in DEFAULT_CASES),
])
def test_gradients_close_to_exact(mode, policy, dropout):
    base = gpt(dropout)
    exact = grads(base, "none", policy)
    compressed = grads(base, mode, policy)
    errors = {name: ((compressed[name] - g).norm() / g.norm()).item() for name, g in exact.items()}
    assert max(errors.values()) < TOLERANCE[mode], errors
    assert max(errors.values()) > 1e-5  # lossy: the hooks did compress


def test_int8_error_within_half_a_step_of_each_block():
    x = torch.randn(5, 300) * torch.logspace(-3, 3, 300)  # blocks of very different scales
    q, scale = quantize_int8(x)
    assert q.dtype == torch.int8 and q.shape == (-(-x.numel() // BLOCK), BLOCK)
    restored = dequantize_int8(q, scale, x.numel(), x.dtype).view_as(x)
    blocks = F.pad(x.flatten(), (0, -x.numel() % BLOCK)).view(-1, BLOCK)
    step_size = (blocks.abs().amax(dim=1) / 127).repeat_interleave(BLOCK)[:x.numel()].view_as(x)
    assert ((restored - x).abs() <= step_size / 2 * (1 + 1e-6)).all()
    zeros = torch.zeros(BLOCK * 2)
    assert torch.equal(dequantize_int8(*quantize_int8(zeros), zeros.numel(), zeros.dtype), zeros)


def test_fills_its_storage():
    x = torch.randn(4, 6, 8)
    assert fills_its_storage(x) and fills_its_storage(x.transpose(0, 2)) and fills_its_storage(x.view(24, 8))
    assert not fills_its_storage(x[:2]) and not fills_its_storage(x[:, :, ::2]) and not fills_its_storage(x[1:])


class Beneath:
    """Hooks entered before the compression: they receive whatever it keeps."""

    def __init__(self):
        self.kept: list[torch.Tensor] = []
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        self.kept.append(t)
        return t


@pytest.mark.parametrize("bf16", [False, True])
def test_weights_are_neither_compressed_nor_copied(bf16):
    model = gpt()
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    beneath = Beneath()
    with beneath.hooks:
        step(model, "int8", bf16=bf16)
    kept_weights = [t for t in beneath.kept if t.untyped_storage().data_ptr() in weights]
    norms = 2 * (2 * L + 1)  # the layer norms' weights and biases, saved by layer_norm
    linears = 4 * L + 1  # each block's four linear weights (transposed views), and the tied head
    if not bf16:
        assert len(kept_weights) == norms + linears
    else:  # the linears save autocast's bf16 copies of their weights: kept as they are too
        assert len(kept_weights) == norms
        copies = [t for t in beneath.kept if t.dtype == torch.bfloat16]
        assert len(copies) == linears
        assert {tuple(t.shape) for t in copies} == {(D, 3 * D), (D, D), (D, 4 * D), (4 * D, D), (D, V)}
    assert any(t.dtype == torch.int8 for t in beneath.kept)


def test_a_tensor_saved_twice_is_compressed_once():
    x = torch.randn(64, 64, requires_grad=True)
    compression = ActivationCompression("int8")
    with compression:
        y = x * 2
        out = (y * y).sum()  # mul saves y for both operands' gradients
    assert compression.seen_bytes == 64 * 64 * 4
    out.backward()
    assert torch.allclose(x.grad, 8 * x, rtol=0, atol=8 * x.abs().max().item() / 127)


def peak(mode: str, policy: str = "none") -> tuple[int, ActivationCompression]:
    model = gpt()
    apply_recompute(model, policy)
    with ActivationMeter(model) as meter:
        compression = step(model, mode)
    return meter.peak, compression


def test_memory_ledger_shows_the_saving():
    """fp32 training: the meter's peak falls by exactly what compression saves on the bytes it
    compresses (nearly all activations here), so nothing is kept twice and nothing is missed."""
    plain, _ = peak("none")
    for mode, ratio in (("bf16", 2.0), ("int8", 4 / (1 + 4 / BLOCK))):
        compressed, compression = peak(mode)
        assert compression.seen_bytes > 0.95 * plain
        stored = compressed - (plain - compression.seen_bytes)  # the compressible bytes, as the meter saw them
        assert compression.seen_bytes / stored == pytest.approx(ratio, rel=1e-3), mode
        assert compression.stored_bytes == stored


def test_composes_with_full_recompute():
    """Checkpoint saves each block's input through the hooks outside it: those are compressed.
    The peak comes in backward, while the last block is recomputed from its restored input:
    every block input compressed, that one also whole."""
    plain, _ = peak("none", "full")
    compressed, compression = peak("int8", "full")
    block_inputs = L * B * S * D * 4
    ratio = 4 / (1 + 4 / BLOCK)
    assert compression.seen_bytes >= block_inputs
    assert plain - compressed == pytest.approx(block_inputs * (1 - 1 / ratio) - block_inputs / L, rel=1e-3)


def test_trainer_first_loss_exact_then_close(tiny_cfg, tmp_path):
    """The forward runs on exact activations, so step 1's loss is the plain one bit for bit;
    the lossy gradients then move the weights a little differently."""
    def losses(name, **changes):
        cfg = tiny_cfg.replace(out=str(tmp_path / name), steps=4, **changes)
        summary = execute(*prepare_run(cfg))
        return [r["loss"] for r in read_metrics(summary.run_dir / "metrics.jsonl")]

    plain = losses("plain", recompute="every:2")
    int8 = losses("int8", recompute="every:2", compress_activations="int8")
    assert int8[0] == plain[0]
    assert int8[1:] != plain[1:]
    assert max(abs(a - b) / b for a, b in zip(int8, plain, strict=True)) < 1e-2


def test_int8_keeps_a_nan_visible():
    x = torch.ones(2 * BLOCK)
    x[3] = float("nan")
    restored = dequantize_int8(*quantize_int8(x), x.numel(), x.dtype)
    assert restored[:BLOCK].isnan().all() and torch.equal(restored[BLOCK:], x[BLOCK:])
