"""NF4 with double quantization (QLoRA): the code book, the packing, round-trip error
against int4, the stored bits, odd shapes, and the frozen NF4Linear layer."""

from __future__ import annotations

import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from scaletrain.finetune.nf4 import (BLOCK_SIZE, SCALE_GROUP_SIZE, NF4Linear, dequantize_blocks,
                                     dequantize_nf4, dequantize_saved, nf4_code, pack_indices,
                                     quantize_blocks, quantize_linears, quantize_nf4, uniform_code,
                                     unpack_indices)

# QLoRA (Dettmers et al. 2023), Appendix E: the NF4 data type's published values.
PAPER_NF4 = [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
             -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
             0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
             0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0]

# Symmetric int4 as round(7 w / absmax): 15 levels with an exact zero.
SYMMETRIC_INT4 = torch.arange(-7, 8) / 7


@pytest.fixture(scope="module")
def gaussian() -> torch.Tensor:
    return torch.randn(4096, 1024, generator=torch.Generator().manual_seed(0))


def _single_quantized(weight: torch.Tensor) -> torch.Tensor:
    """NF4 with fp32 block absmaxes: the format before double quantization."""
    indices, absmax = quantize_blocks(weight, nf4_code(), BLOCK_SIZE)
    return dequantize_blocks(indices, absmax, nf4_code(), weight.shape)


def _mse(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).square().mean().item()


def test_code_book_is_the_papers():
    code = nf4_code()
    torch.testing.assert_close(code, torch.tensor(PAPER_NF4), atol=1e-4, rtol=0)
    assert (code[0].item(), code[7].item(), code[15].item()) == (-1.0, 0.0, 1.0)
    assert (code[1:] > code[:-1]).all()


def test_pack_unpack_round_trip():
    indices = torch.randint(0, 16, (1000,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    packed = pack_indices(indices)
    assert packed.dtype == torch.uint8 and packed.numel() == 500
    assert torch.equal(unpack_indices(packed), indices)
    assert pack_indices(torch.tensor([1, 2, 15, 0], dtype=torch.uint8)).tolist() == [0x12, 0xF0]


# Measured ratios (seed 0): 0.838 and 0.730.
@pytest.mark.parametrize("int4_code, max_ratio", [(uniform_code(16), 0.87), (SYMMETRIC_INT4, 0.77)],
                         ids=["uniform-16", "symmetric-15"])
def test_nf4_round_trip_beats_int4_on_normal_weights(gaussian, int4_code, max_ratio):
    nf4_mse = _mse(dequantize_nf4(quantize_nf4(gaussian)), gaussian)
    indices, absmax = quantize_blocks(gaussian, int4_code, BLOCK_SIZE)
    int4_mse = _mse(dequantize_blocks(indices, absmax, int4_code, gaussian.shape), gaussian)
    assert nf4_mse < max_ratio * int4_mse


def test_double_quantization_moves_weights_little(gaussian):
    single = _single_quantized(gaussian)
    quantized = quantize_nf4(gaussian)
    double = dequantize_nf4(quantized)
    # Each block absmax is off by at most half a step of its group's int8 code, s_g / 127 / 2,
    # and a dequantized weight by at most that (its NF4 level is at most 1 in size).
    n_blocks = gaussian.numel() // BLOCK_SIZE
    scale_error = (quantized.absmax_scales / 254).repeat_interleave(SCALE_GROUP_SIZE)[:n_blocks]
    bound = scale_error.repeat_interleave(BLOCK_SIZE).view_as(gaussian)
    assert ((double - single).abs() <= bound * (1 + 1e-5) + 1e-7).all()
    # Stated bounds: against fp32 absmaxes the weights move by under 0.2% (relative norm;
    # measured 0.14%) and the round-trip error grows by under 0.1% (measured 0.02%).
    assert (double - single).norm() / single.norm() < 2e-3
    assert _mse(double, gaussian) < 1.001 * _mse(single, gaussian)


def test_bits_per_parameter_of_a_large_tensor(gaussian):
    bits = quantize_nf4(gaussian).bits_per_parameter()
    n = gaussian.numel()
    # 4-bit indices + one 8-bit code per 64 weights + one fp32 s_g per 64 * 256 + the fp32 mean.
    assert bits == pytest.approx((n * 4 + n / 64 * 8 + n / (64 * 256) * 32 + 32) / n)
    assert 4.12 < bits < 4.14


@pytest.mark.parametrize("shape", [(100, 37), (7,), (BLOCK_SIZE * SCALE_GROUP_SIZE + 3,), (3, 1, 5)])
def test_odd_shapes_round_trip(shape):
    weight = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    quantized = quantize_nf4(weight)
    restored = dequantize_nf4(quantized)
    assert restored.shape == weight.shape and restored.dtype == torch.float32
    # Within half the widest gap between levels (1 - 0.723) of the block absmax, plus a
    # little for the double-quantized absmax.
    assert ((restored - weight).abs() <= 0.1385 * weight.abs().max() * 1.01).all()
    torch.testing.assert_close(restored, _single_quantized(weight), rtol=0, atol=0.01)
    assert torch.equal(dequantize_nf4(quantized, torch.bfloat16), restored.to(torch.bfloat16))


def test_zero_blocks_stay_exactly_zero():
    weight = torch.randn(4, BLOCK_SIZE, generator=torch.Generator().manual_seed(2))
    weight[1] = 0
    restored = dequantize_nf4(quantize_nf4(weight))
    assert (restored[1] == 0).all()
    assert (dequantize_nf4(quantize_nf4(torch.zeros(3, 70))) == 0).all()


def test_non_finite_weights_are_refused():
    with pytest.raises(ValueError, match="inf or nan"):
        quantize_nf4(torch.tensor([1.0, float("nan")]))


def _linear(seed: int, bias: bool = True) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(96, 40, bias=bias)


def test_nf4_linear_is_frozen_and_matches_its_dequantized_weight():
    linear = _linear(0)
    layer = NF4Linear.from_linear(linear)
    assert (layer.in_features, layer.out_features) == (96, 40)
    assert list(layer.parameters()) == []
    assert not any(buffer.requires_grad for buffer in layer.buffers())

    x = torch.randn(3, 5, 96, requires_grad=True)
    weight = layer.dequantized_weight()
    y = layer(x)
    torch.testing.assert_close(y, F.linear(x, weight, linear.bias))
    grad_output = torch.randn_like(y)
    y.backward(grad_output)
    torch.testing.assert_close(x.grad, grad_output @ weight)
    assert all(buffer.grad is None for buffer in layer.buffers())


def test_nf4_linear_keeps_no_weight_for_backward():
    layer = NF4Linear.from_linear(_linear(0))
    x = torch.randn(2, 96, requires_grad=True)
    saved: list[torch.Size] = []

    def record(tensor: torch.Tensor) -> torch.Tensor:
        saved.append(tensor.shape)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(record, lambda tensor: tensor):
        layer(x)
        assert saved == []
        F.linear(x, layer.dequantized_weight())  # what a plain dequantize-then-linear would keep
        assert [shape.numel() for shape in saved] == [40 * 96]


def test_nf4_linear_compute_dtype():
    layer = NF4Linear.from_linear(_linear(0))
    x = torch.randn(4, 96, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert x.grad.dtype == torch.float32

    x16 = torch.randn(4, 96, dtype=torch.bfloat16)
    expected = F.linear(x16, layer.dequantized_weight(torch.bfloat16), layer.bias.to(torch.bfloat16))
    assert torch.equal(layer(x16), expected)


def test_nf4_linear_state_dict_round_trip():
    layer, other = NF4Linear.from_linear(_linear(0)), NF4Linear.from_linear(_linear(1))
    buffer = io.BytesIO()
    torch.save(layer.state_dict(), buffer)
    buffer.seek(0)
    other.load_state_dict(torch.load(buffer, weights_only=True))
    assert torch.equal(other.dequantized_weight(), layer.dequantized_weight())
    x = torch.randn(2, 96)
    assert torch.equal(other(x), layer(x))


def test_casting_the_module_keeps_the_fp32_scales():
    layer = NF4Linear.from_linear(_linear(0))
    weight = layer.dequantized_weight()
    layer.to(torch.bfloat16)
    assert layer.bias.dtype == torch.bfloat16
    assert torch.equal(layer.dequantized_weight(), weight)


def test_quantize_linears_and_reading_a_saved_layer():
    model = nn.ModuleDict({"fc": _linear(0, bias=False), "head": _linear(1)})
    assert quantize_linears(model, ["fc"]) == ["fc"]
    assert isinstance(model["fc"], NF4Linear) and isinstance(model["head"], nn.Linear)
    assert torch.equal(dequantize_saved(model.state_dict(), "fc."), model["fc"].dequantized_weight())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_nf4_linear_moves_to_cuda():
    layer = NF4Linear.from_linear(_linear(0))
    x = torch.randn(2, 96)
    expected = layer(x)
    layer.to("cuda")
    assert all(buffer.is_cuda for buffer in layer.buffers())
    torch.testing.assert_close(layer(x.cuda()).cpu(), expected)
    assert quantize_nf4(_linear(0).weight.cuda()).packed_indices.is_cuda
