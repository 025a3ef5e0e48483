"""FP8 training (``--precision fp8``): the blocks' linear layers multiply in float8, all else in bf16.

Micikevicius et al. 2022, "FP8 Formats for Deep Learning". Two 8-bit formats
(sign / exponent / stored mantissa bits):

    e4m3  1 / 4 / 3   largest 448,    smallest normal 2^-6,  subnormal step 2^-9
    e5m2  1 / 5 / 2   largest 57344,  smallest normal 2^-14, subnormal step 2^-16

e4m3 holds the forward's weights and activations (precision), e5m2 the
backward's output gradients (range). A tensor is scaled into the format's
range before the cast, by a power of two taken from its largest magnitude
(dynamic per-tensor scaling, torchao's "tensorwise" recipe, the scale rounded
down to a power of two as its ``round_scales_to_power_of_2`` does):

    s = 2^floor(log2(max_format / amax|x|)),   x_8 = saturate(round(x * s))

For a linear layer ``y = x W^T`` (x: [tokens, in], W: [out, in]):

    forward    y  = (x_8 W_8^T) / (s_x s_W)          x_8, W_8 in e4m3
    backward   dx = (g_8 W_8)   / (s_g s_W)          g = dL/dy in e5m2
               dW = (g_8^T x_8) / (s_g s_x)

each product accumulated in fp32 by the tensor cores (``torch._scaled_mm`` on
a GPU, twice the bf16 rate on H100 and H200), y and dx written in the
autocast dtype (bf16), dW in the weight's own dtype (fp32: the optimizer's
masters stay full precision). Backward reuses the forward's x_8 and W_8, so
a layer saves its input in one byte per element instead of two.

Why powers of two: multiplying by 2^k is exact, so a value's rounding to the
format does not depend on k unless the scaled value falls below the smallest
normal or is saturated. Two layouts whose ranks see different parts of a
tensor (dp's and ep's samples, cp's positions, tp's slices) choose scales that differ
by a few powers of two and round every element alike, except those under
about ``amax * 2^-6 / 448`` (e4m3) in magnitude, which move by at most one
subnormal step, 2^-9 over the scale (4.4e-6 to 8.7e-6 of amax). No amax is
all-reduced: a layout costs no collective more than bf16, and parity
(docs/parity.md) holds at bf16's tolerance, which the bf16 rounding of every
output dominates.

Where there is no ``torch._scaled_mm`` for the shapes (off a GPU, or a side
not a multiple of 16, as a mixture of experts' rows per expert), the product
is emulated exactly: the 8-bit values decoded to fp32, multiplied there, the
result rounded to the output dtype, as the tensor cores round it.

What stays in bf16 (or fp32): embeddings, norms, attention's own products
(softmax(QK^T)V), the output head and the loss (torchtitan's default leaves
the head out too: its logits feed the loss directly), and any layer outside
the blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.autograd import Function

E4M3 = torch.float8_e4m3fn  # weights and activations: more mantissa
E5M2 = torch.float8_e5m2  # output gradients: more range


def power_of_two_scale(amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The largest power of two s with amax * s at most the format's largest value (1 for a zero tensor)."""
    largest = torch.finfo(dtype).max
    amax = amax.float()
    exponent = torch.floor(torch.log2(largest / amax.clamp(min=torch.finfo(torch.float32).tiny)))
    return torch.where(amax > 0, torch.exp2(exponent), torch.ones_like(amax))


def to_float8(x: torch.Tensor, dtype: torch.dtype, per_row: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` scaled by its power-of-two scale (one per row of the last dimension with ``per_row``: ZeRO-3's
    fp8 gathers, parallel/hybrid.py), saturated and cast to ``dtype``; and the inverse scale(s)."""
    amax = x.detach().abs().amax(dim=-1, keepdim=True) if per_row else x.detach().abs().amax()
    scale = power_of_two_scale(amax, dtype)
    largest = torch.finfo(dtype).max
    encoded = (x.detach().float() * scale).clamp(-largest, largest).to(dtype)
    return encoded, scale.reciprocal()


def scaled_matmul(a: torch.Tensor, a_inverse: torch.Tensor, b: torch.Tensor, b_inverse: torch.Tensor,
                  out_dtype: torch.dtype, tensor_cores: bool = False) -> torch.Tensor:
    """``(a @ b) * a_inverse * b_inverse`` for 8-bit ``a`` [m, k] and ``b`` [k, n], accumulated in
    fp32 and rounded to ``out_dtype``: on float8 ``tensor_cores`` where every side is a multiple of
    16, else its exact emulation."""
    if tensor_cores and all(size % 16 == 0 for size in (*a.shape, b.shape[1])):
        # the tensor cores take a row-major and b column-major
        return torch._scaled_mm(a.contiguous(), b.t().contiguous().t(), scale_a=a_inverse, scale_b=b_inverse,
                                out_dtype=out_dtype)
    return ((a.float() @ b.float()) * (a_inverse * b_inverse)).to(out_dtype)


def _product(x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype,
             tensor_cores: bool) -> tuple[torch.Tensor, ...]:
    """y = x W^T from x and W cast to e4m3 (module docstring); y, and the codes and inverse scales
    backward reuses."""
    rows = x.reshape(-1, x.shape[-1])
    x8, x_inverse = to_float8(rows, E4M3)
    w8, w_inverse = to_float8(weight, E4M3)
    y = scaled_matmul(x8, x_inverse, w8.t(), w_inverse, out_dtype, tensor_cores)
    return y.reshape(*x.shape[:-1], weight.shape[0]), x8, x_inverse, w8, w_inverse


def _gradients(grad: torch.Tensor, x8: torch.Tensor, x_inverse: torch.Tensor, w8: torch.Tensor,
               w_inverse: torch.Tensor, input_dtype: torch.dtype,
               tensor_cores: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """dL/dx (rows, in ``input_dtype``) and dL/dW (fp32) from the output gradient cast to e5m2."""
    g8, g_inverse = to_float8(grad.reshape(-1, grad.shape[-1]), E5M2)
    grad_x = scaled_matmul(g8, g_inverse, w8, w_inverse, input_dtype, tensor_cores)
    grad_w = scaled_matmul(g8.t(), g_inverse, x8, x_inverse, torch.float32, tensor_cores)
    return grad_x, grad_w


class _Float8Matmul(Function):
    """y = x W^T with x and W in e4m3, the output gradient in e5m2 (module docstring)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype,
                tensor_cores: bool) -> torch.Tensor:
        y, *codes = _product(x, weight, out_dtype, tensor_cores)
        ctx.save_for_backward(*codes)  # x and W in one byte an element, not bf16's two
        ctx.input_shape, ctx.input_dtype, ctx.weight_dtype = x.shape, x.dtype, weight.dtype
        ctx.tensor_cores = tensor_cores
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad_x, grad_w = _gradients(grad, *ctx.saved_tensors, ctx.input_dtype, ctx.tensor_cores)
        return grad_x.reshape(ctx.input_shape), grad_w.to(ctx.weight_dtype), None, None


class _SequenceGatheredFloat8Matmul(Function):
    """`_Float8Matmul` for an input all-gathered along the sequence (tensor parallelism's sp,
    parallel/tensor.py): this rank keeps only its chunk of the input's codes for backward and
    gathers the others again there, one byte an element where bf16 gathers two."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype, tensor_cores: bool, comm,
                group) -> torch.Tensor:
        y, x8, x_inverse, w8, w_inverse = _product(x, weight, out_dtype, tensor_cores)
        chunk = x.shape[1] // group.size
        mine = x8.view(x.shape).narrow(1, group.rank * chunk, chunk).contiguous()
        ctx.save_for_backward(mine, x_inverse, w8, w_inverse)
        ctx.comm, ctx.group, ctx.tensor_cores = comm, group, tensor_cores
        ctx.input_shape, ctx.input_dtype, ctx.weight_dtype = x.shape, x.dtype, weight.dtype
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        mine, x_inverse, w8, w_inverse = ctx.saved_tensors
        parts = torch.empty((ctx.group.size, *mine.shape), dtype=torch.uint8, device=mine.device)
        # every tp rank's chunk of the input's e4m3 codes, b x s/t x h bytes each, for the weight's gradient
        ctx.comm.all_gather(parts, mine.view(torch.uint8), ctx.group)
        x8 = parts.view(mine.dtype).movedim(0, 1).reshape(-1, mine.shape[-1])
        grad_x, grad_w = _gradients(grad, x8, x_inverse, w8, w_inverse, ctx.input_dtype, ctx.tensor_cores)
        return grad_x.reshape(ctx.input_shape), grad_w.to(ctx.weight_dtype), None, None, None, None


def _output_dtype(x: torch.Tensor) -> torch.dtype:
    """The autocast dtype where autocast is on, else x's."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


@dataclass(frozen=True)
class Float8:
    """How a converted layer multiplies: on float8 tensor cores (compute capability 8.9 on: Ada,
    Hopper) through ``torch._scaled_mm``, or by the exact emulation (module docstring)."""

    tensor_cores: bool

    @staticmethod
    def on(device: torch.device) -> Float8:
        return Float8(device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9))

    def linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """``x @ weight.T`` in float8, written in the autocast dtype where autocast is on (else in x's)."""
        out_dtype = _output_dtype(x)
        with torch.autocast(x.device.type, enabled=False):  # the emulation's fp32 product stays fp32
            return _Float8Matmul.apply(x, weight, out_dtype, self.tensor_cores)

    def sequence_gathered_linear(self, x: torch.Tensor, weight: torch.Tensor, comm, group) -> torch.Tensor:
        """`linear` of an input all-gathered along the sequence over ``group`` (parallel/tensor.py's
        sp), which backward gathers again from each rank's e4m3 chunk."""
        out_dtype = _output_dtype(x)
        with torch.autocast(x.device.type, enabled=False):
            return _SequenceGatheredFloat8Matmul.apply(x, weight, out_dtype, self.tensor_cores, comm, group)


class Float8Linear(nn.Linear):
    """An ``nn.Linear`` whose product runs in float8 (module docstring); made in place by
    `convert_to_float8`, the same object with the same parameters, so names, hooks, ZeRO's
    views and checkpoints are those of the linear layer it was."""

    float8: Float8

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.float8.linear(x, self.weight)
        return y if self.bias is None else y + self.bias.to(y.dtype)


def convert_to_float8(blocks: list[nn.Module], float8: Float8) -> int:
    """Inside ``blocks``, every plain ``nn.Linear`` made a `Float8Linear` and every layer that
    offers a float8 product (a ``float8`` class attribute: tensor parallelism's sliced layers)
    switched to it, in place; how many. A module that hands its layers one shared autocast copy
    of their input (``shares_autocast_copy``, models/lean_saves.py) hands them the input itself:
    a float8 layer casts it from full precision and writes its gradient in that precision."""
    count = 0
    for block in blocks:
        for module in block.modules():
            if hasattr(type(module), "shares_autocast_copy"):
                module.shares_autocast_copy = False
            if type(module) is nn.Linear:
                module.__class__ = Float8Linear
            elif not hasattr(type(module), "float8"):
                continue
            module.float8 = float8
            count += 1
    return count
