"""Parts of a decoder block as autograd functions that keep only what their backward cannot redo cheaply.

Autograd keeps, for every operation, what that operation's own backward reads, so a
chain of elementwise operations keeps a tensor per link. Three parts of a Llama block
keep more than their backward needs (docs/techniques.md tabulates a block's saved
tensors):

RMSNorm (Zhang & Sennrich 2019), in fp32 on the fp32 residual stream,

    y = w * x * r,   r = (mean(x^2) + eps)^(-1/2)

keeps x (read by x^2 and by x * r), r, and x * r (for w's gradient): 8 bytes an
element and 4 a position. `rms_norm` keeps x alone and computes r and x * r again in
backward, where

    dw = sum over positions of g * x * r,   dx = r * w * g - x * r^3 * mean(w * g * x)

SwiGLU's gate (Shazeer 2020, "GLU Variants Improve Transformer"), p = silu(a) * b, keeps
a (for silu's backward), silu(a) and b (for the product's). `silu_mul` keeps a and b
and computes silu(a) again, as Liger Kernel's SwiGLU does (Hsu et al. 2024, "Liger
Kernel: Efficient Triton Kernels for LLM Training"):

    da = g * b * s(a) * (1 + a * (1 - s(a))),   db = g * silu(a),   s the sigmoid

A norm's output read by n linear layers (q, k and v; gate and up): under autocast each
layer casts it to 16 bits on its own and keeps its own copy. `shared_cast` casts it once
and hands every layer a view of that copy: n - 1 copies fewer. A module that does so says
``shares_autocast_copy``, which --precision fp8 turns off (techniques/fp8.py): a float8
layer casts its input itself, from full precision, and keeps its own 8-bit codes anyway.

Each backward runs the operations autograd runs on the plain formulation, on the same
values, in the same order (the shared cast sums its layers' fp32 gradients as autograd
summed those of n casts, the last layer's first), so each part's output and gradients are
bitwise the plain code's. In a block the norm's input is also the residual stream, whose
gradient autograd summed from three terms, the norm's two parts one by one, where it now
adds the norm's share as one: the block's gradients agree to fp32's rounding
(tests/test_lean_saves.py). The price: the recomputed elementwise parts, a few passes
over b*s*h and b*s*f elements in backward, no matmul.

`rms_norm` and `silu_mul` are torch functions (``torch.overrides.handle_torch_function``)
while a TorchFunctionMode is on: the memory meter (train/memory.py) is one, and within
a checkpointed region it sees a save only through a torch function call.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.overrides import handle_torch_function, has_torch_function_variadic


def _normalized(x32: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(r, x * r) of fp32 ``x32``, normalized over its last dimension."""
    r = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return r, x32 * r


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        ctx.eps = eps
        ctx.save_for_backward(x, weight)
        # Normalize, then scale: the order of Hugging Face's LlamaRMSNorm, which the logits match.
        return weight.float() * _normalized(x.float(), eps)[1]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        x32, w32 = x.float(), weight.float()
        r, y = _normalized(x32, ctx.eps)
        grad_weight = grad_x = None
        if ctx.needs_input_grad[1]:
            # w is broadcast over the positions: its gradient summed over them, as autograd's sum_to does
            leading = tuple(range(grad.dim() - w32.dim()))
            grad_weight = (grad * y).sum(leading, keepdim=True).view(weight.shape).to(weight.dtype)
        if ctx.needs_input_grad[0]:
            grad_y = grad * w32
            grad_r = (grad_y * x32).sum(-1, keepdim=True)
            grad_square = (-0.5 * grad_r * r.pow(3)).expand_as(x32) / x32.shape[-1]  # through rsqrt and mean
            grad_x = (grad_y * r + grad_square * (2.0 * x32)).to(x.dtype)
        return grad_x, grad_weight, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``w * x / sqrt(mean(x^2) + eps)`` in fp32 whatever the dtypes of x and w, its output fp32;
    backward keeps x and w alone (module docstring)."""
    if has_torch_function_variadic(x, weight):
        return handle_torch_function(rms_norm, (x, weight), x, weight, eps)
    return _RMSNorm.apply(x, weight, eps)


class _SiluMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        gate, up = ctx.saved_tensors
        grad_gate = torch.ops.aten.silu_backward(grad * up, gate) if ctx.needs_input_grad[0] else None
        grad_up = grad * F.silu(gate) if ctx.needs_input_grad[1] else None
        return grad_gate, grad_up


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up``, backward keeping gate and up alone (module docstring)."""
    if has_torch_function_variadic(gate, up):
        return handle_torch_function(silu_mul, (gate, up), gate, up)
    return _SiluMul.apply(gate, up)


class _SharedCast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, dtype: torch.dtype, readers: int) -> tuple[torch.Tensor, ...]:
        ctx.dtype = x.dtype
        low = x.to(dtype)
        return tuple(low.view_as(low) for _ in range(readers))

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        total = None
        for grad in reversed(grads):  # autograd's order: the last reader's cast ran backward first
            grad = grad.to(ctx.dtype)
            total = grad if total is None else total + grad
        return total, None, None


def shared_cast(x: torch.Tensor, readers: int) -> tuple[torch.Tensor, ...]:
    """``x`` for ``readers`` linear layers: under autocast, views of one cast to its dtype, which
    autocast would otherwise make (and each layer keep) once per layer; else x itself each time."""
    device = x.device.type
    if not torch.is_autocast_enabled(device):
        return (x,) * readers
    dtype = torch.get_autocast_dtype(device)
    if not x.is_floating_point() or x.dtype in (dtype, torch.float64):  # what autocast leaves as it is
        return (x,) * readers
    return _SharedCast.apply(x, dtype, readers)
