"""4-bit NormalFloat (NF4) with double quantization: QLoRA's storage for frozen base weights
(Dettmers et al. 2023, "QLoRA: Efficient Finetuning of Quantized LLMs").

Code book. Trained weights are close to zero-mean normal, so NF4's 16 levels are quantiles
of N(0, 1), each covering about the same share of the weights, not evenly spaced. With Q the
normal quantile function (``torch.special.ndtri``) and

    delta = ((1 - 1/(2*15)) + (1 - 1/(2*16))) / 2 ~= 0.9677

(Q(1) is infinite, so the outermost level sits at probability delta, the mean of the
centres of the last bin of 15 and of 16 equal-probability bins, as in the paper's
reference implementation), the levels are

    positive:  Q(1/2 + i (delta - 1/2) / 8),    i = 1..8
    negative: -Q(1/2 + j (delta - 1/2) / 7),    j = 1..7
    and 0,     all divided by Q(delta),

16 values in [-1, 1], -1, 0 and 1 exact: a symmetric set of 16 could not contain 0, and
zero weights and padding should dequantize to exactly 0.

Block-wise quantization, in blocks of B = 64 (small, so that an outlier coarsens at most
63 neighbours), each scaled by its absmax c_b = max |w|:

    k_i = argmin_k |w_i / c_b - q_k|,      w_i ~= c_b q_{k_i},      byte j: 16 k_{2j} + k_{2j+1}

Double quantization. One fp32 c_b per 64 weights would cost 32/64 = 0.5 bits per parameter,
so the c_b, minus their mean mu (all positive; centred, they fill a symmetric code), are
quantized block-wise too, in groups of G = 256 with the symmetric int8 levels k/127,
k = -127..127, and one fp32 absmax s_g per group:

    c_b ~= mu + s_g l_b / 127,             l_b in {-127..127}, stored in 8 bits

The paper stores the second level in FP8; centred, the scales span a narrow range around
zero (on N(0, 1) weights mu = 2.60 and every group of 256 lies within +-2.5), which evenly
spaced levels cover in steps under 0.8% of mu. Per 64 * 256 weights, 64*256 4-bit indices,
256 8-bit scale codes and one fp32 s_g:

    (16384 * 4 + 256 * 8 + 32) / 16384 = 4 + 0.125 + 0.00195 = 4.127 bits per parameter

plus one fp32 mu per tensor (4.5 bits with fp32 scales, 16 in bf16), and a small tensor's
padding (``NF4Tensor.bits_per_parameter`` counts it).

Dequantization, W = c(l) q_k, runs in fp32 and rounds once to the compute dtype.
``NF4Linear`` does it in forward and again in backward (y = x W^T + b, dL/dx = dL/dy W;
the base gets no gradient): a full-precision W kept for backward would hold every frozen
matrix in 16 bits from forward to backward, the memory QLoRA saves. ``uniform_code(16)``,
16 evenly spaced levels in [-1, 1], is plain int4 absmax at the same block size; on normal
weights NF4's round-trip mean squared error is lower (figures: docs/finetuning.md).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from scaletrain.finetune.lora import target_names

BLOCK_SIZE = 64         # weights per absmax c_b
SCALE_GROUP_SIZE = 256  # absmaxes c_b per second-level scale s_g


def _quantiles_above_median(delta: float, steps: int) -> torch.Tensor:
    """Q(p) at ``steps`` evenly spaced probabilities p in (1/2, delta], ascending."""
    probabilities = torch.linspace(0.5, delta, steps + 1, dtype=torch.float64)[1:]
    return torch.special.ndtri(probabilities)


def nf4_code() -> torch.Tensor:
    """The 16 NF4 levels, ascending, in [-1, 1] (fp32)."""
    delta = ((1 - 1 / (2 * 15)) + (1 - 1 / (2 * 16))) / 2
    positive = _quantiles_above_median(delta, 8)
    negative = -_quantiles_above_median(delta, 7).flip(0)
    levels = torch.cat([negative, torch.zeros(1, dtype=torch.float64), positive])
    return (levels / levels[-1]).float()


def uniform_code(levels: int) -> torch.Tensor:
    """``levels`` evenly spaced values in [-1, 1] (fp32): 16 is int4 absmax, 255 is symmetric int8."""
    return torch.linspace(-1.0, 1.0, levels)


def _scale_code() -> torch.Tensor:
    return uniform_code(255)


@functools.cache
def _code_on(build: Callable[[], torch.Tensor], device: torch.device) -> torch.Tensor:
    # Built once per device: a fresh code book in every forward would be a copy from
    # the host, and such a copy waits for all the work already queued on the device.
    # Built on the host whatever device a caller has made the default (the planner's meta
    # device, say), where its quantiles are computed.
    with torch.device("cpu"):
        book = build()
    return book.to(device)


def pack_indices(indices: torch.Tensor) -> torch.Tensor:
    """Pairs of 4-bit indices (uint8 values 0..15) as one byte each, the first in the high nibble."""
    pairs = indices.flatten().view(-1, 2)
    return pairs[:, 0] << 4 | pairs[:, 1]


def unpack_indices(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of ``pack_indices``: twice as many uint8 values 0..15."""
    return torch.stack([packed >> 4, packed & 0xF], dim=1).flatten()


def quantize_blocks(values: torch.Tensor, code: torch.Tensor,
                    block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``values`` flattened and zero-padded to whole blocks of ``block_size``: each value's index
    of the nearest level of ``code`` (ascending, in [-1, 1]) once divided by its block's absmax,
    as uint8 [n_blocks, block_size], and each block's absmax, fp32 [n_blocks]."""
    flat = values.detach().flatten().float()
    # Zero padding cannot raise the last block's absmax.
    blocks = F.pad(flat, (0, -flat.numel() % block_size)).view(-1, block_size)
    absmax = blocks.abs().amax(dim=1)
    # An all-zero block has absmax 0: dividing it by 1 instead keeps it finite, and
    # it dequantizes to 0 whichever level it maps to.
    normalized = blocks / torch.where(absmax > 0, absmax, 1.0)[:, None]
    # The nearest of sorted levels is found by binary search among the midpoints between them.
    midpoints = (code[1:] + code[:-1]) / 2
    return torch.bucketize(normalized, midpoints, out_int32=True).to(torch.uint8), absmax


def dequantize_blocks(indices: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor,
                      shape: torch.Size | tuple[int, ...]) -> torch.Tensor:
    """The inverse of ``quantize_blocks``, padding dropped, as fp32 of ``shape``."""
    # int32 indices: the int64 that plain indexing asks for would double the transient memory.
    levels = code.index_select(0, indices.flatten().int()).view(indices.shape)
    return (levels * absmax[:, None]).flatten()[:torch.Size(shape).numel()].view(shape)


@dataclass(frozen=True)
class NF4Tensor:
    """A tensor stored as NF4 with double-quantized block absmaxes (see the module docstring)."""

    packed_indices: torch.Tensor    # uint8 [n_blocks * 32]: two NF4 level indices per byte
    quantized_absmax: torch.Tensor  # uint8 [n_groups * 256]: int8-code index of each c_b - mu
    absmax_scales: torch.Tensor     # fp32 [n_groups]: s_g, the absmax of each group of c_b - mu
    absmax_mean: torch.Tensor       # fp32 []: mu
    shape: torch.Size

    def stored(self) -> tuple[torch.Tensor, ...]:
        return self.packed_indices, self.quantized_absmax, self.absmax_scales, self.absmax_mean

    def bits_per_parameter(self) -> float:
        """Bits held by the stored tensors, padding included, per element of the original tensor."""
        stored_bytes = sum(t.numel() * t.element_size() for t in self.stored())
        return 8 * stored_bytes / self.shape.numel()


def quantize_nf4(weight: torch.Tensor) -> NF4Tensor:
    """``weight`` (any shape, any float dtype) in NF4, blocks of 64, with double quantization."""
    if weight.device.type != "meta" and not torch.isfinite(weight).all():  # the planner's have no values
        raise ValueError("NF4 cannot store a tensor holding inf or nan values.")
    indices, absmax = quantize_blocks(weight, _code_on(nf4_code, weight.device), BLOCK_SIZE)
    mean = absmax.mean()  # mu: the c_b are all positive; minus mu, they fill the symmetric int8 code
    scale_indices, scale_absmax = quantize_blocks(absmax - mean, _code_on(_scale_code, weight.device),
                                                  SCALE_GROUP_SIZE)
    return NF4Tensor(pack_indices(indices), scale_indices.flatten(), scale_absmax, mean, weight.shape)


def dequantize_nf4(quantized: NF4Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The stored tensor back in ``dtype``, computed in fp32 and rounded once."""
    device = quantized.packed_indices.device
    n_blocks = 2 * quantized.packed_indices.numel() // BLOCK_SIZE
    absmax = quantized.absmax_mean + dequantize_blocks(
        quantized.quantized_absmax.view(-1, SCALE_GROUP_SIZE), quantized.absmax_scales,
        _code_on(_scale_code, device), (n_blocks,))
    indices = unpack_indices(quantized.packed_indices).view(n_blocks, BLOCK_SIZE)
    return dequantize_blocks(indices, absmax, _code_on(nf4_code, device), quantized.shape).to(dtype)


# NF4Linear's buffers. module.to(torch.bfloat16) casts every floating-point buffer, which
# would round the fp32 scales to 8 significant bits; their bits are therefore kept in
# int32 buffers (a reinterpretation, not a conversion), which dtype casts leave alone.

def _to_buffers(quantized: NF4Tensor) -> dict[str, torch.Tensor]:
    return {"packed_indices": quantized.packed_indices,
            "quantized_absmax": quantized.quantized_absmax,
            "absmax_scales": quantized.absmax_scales.view(torch.int32),
            "absmax_mean": quantized.absmax_mean.view(torch.int32),
            # Only for reading a saved layer without the module (dequantize_saved); the
            # module itself takes its shape from in_features and out_features.
            "weight_shape": torch.tensor(quantized.shape, dtype=torch.int64,
                                         device=quantized.packed_indices.device)}


def quantized_buffers(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """The buffers ``NF4Linear`` holds for ``weight``, by name (the bias aside): its 4-bit codes and
    scales as `quantize_nf4` computes them from the whole matrix."""
    return _to_buffers(quantize_nf4(weight))


def _from_buffers(buffers: Mapping[str, torch.Tensor], prefix: str, shape: torch.Size) -> NF4Tensor:
    return NF4Tensor(buffers[prefix + "packed_indices"], buffers[prefix + "quantized_absmax"],
                     buffers[prefix + "absmax_scales"].view(torch.float32),
                     buffers[prefix + "absmax_mean"].view(torch.float32), shape)


def dequantize_saved(tensors: Mapping[str, torch.Tensor], prefix: str,
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weight of an ``NF4Linear`` saved in ``tensors`` (a state dict) under ``prefix``
    (e.g. ``"blocks.0.mlp.fc.base."``), dequantized to ``dtype`` without building the module."""
    shape = torch.Size(tensors[prefix + "weight_shape"].tolist())
    return dequantize_nf4(_from_buffers(tensors, prefix, shape), dtype)


class _DequantizingLinear(torch.autograd.Function):
    """y = x W^T + b with W dequantized in forward and again in backward, so that no
    full-precision W is kept between them; only x receives a gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, quantized: NF4Tensor, bias: torch.Tensor | None,
                dtype: torch.dtype) -> torch.Tensor:
        ctx.quantized, ctx.input_dtype = quantized, x.dtype
        return F.linear(x, dequantize_nf4(quantized, dtype), bias)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        weight = dequantize_nf4(ctx.quantized, grad_output.dtype)
        return (grad_output @ weight).to(ctx.input_dtype), None, None, None


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the matmul runs in: autocast's where it is on for x's device, else x's."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


class NF4Linear(nn.Module):
    """A frozen linear layer whose weight is stored in NF4 (buffers, never parameters);
    the forward dequantizes it to the input's compute dtype."""

    # Read-only codes that ZeRO-3 may shard and gather as it does frozen weights (parallel/zero_units.py):
    # forward and backward read them through ``quantized`` each time, so views of a regathered buffer serve.
    # The 4-byte mean and the shape stay whole.
    shardable_buffers = ("packed_indices", "quantized_absmax", "absmax_scales")

    def __init__(self, quantized: NF4Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.out_features, self.in_features = quantized.shape
        for name, tensor in _to_buffers(quantized).items():
            self.register_buffer(name, tensor)
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> NF4Linear:
        return cls(quantize_nf4(linear.weight), linear.bias)

    @property
    def quantized(self) -> NF4Tensor:
        return _from_buffers(self._buffers, "", torch.Size((self.out_features, self.in_features)))

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight as a plain [out_features, in_features] tensor (e.g. to merge an adapter into)."""
        return dequantize_nf4(self.quantized, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = _compute_dtype(x)
        bias = None if self.bias is None else self.bias.to(dtype)
        return _DequantizingLinear.apply(x, self.quantized, bias, dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, bits_per_parameter={self.quantized.bits_per_parameter():.3f}")


def quantize_linears(model: nn.Module, targets: list[str]) -> list[str]:
    """Replace every ``nn.Linear`` named ``*.{target}`` with its ``NF4Linear``; the replaced names."""
    names = [name for name in target_names(model, targets) if isinstance(model.get_submodule(name), nn.Linear)]
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, child, NF4Linear.from_linear(getattr(parent, child)))
    return names
