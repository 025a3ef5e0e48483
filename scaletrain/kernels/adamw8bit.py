"""One 8-bit AdamW step of one tensor in a single Triton kernel: dequantize, step, quantize.

8-bit AdamW (Dettmers et al. 2021, "8-bit Optimizers via Block-wise Quantization"; the
pure-PyTorch reference and the maps are optim/adamw8bit.py) keeps each moment as uint8 codes
into a sorted map Q of values in [-1, 1], and one fp32 absolute maximum N_b per block of
2048 elements. At step t, for an element of block b with gradient g::

    m = Q_signed[code_m] * N_m,b                   v = Q_unsigned[code_v] * N_v,b
    m <- b1 m + (1 - b1) g                         (torch: m.lerp_(g, 1 - b1))
    v <- b2 v + (1 - b2) g^2
    p <- p (1 - lr wd) - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
    N_m,b <- max |m| over the block,               code_m <- argmin_j |Q_signed[j] - m / N_m,b|

and the same for v on the unsigned map. One program takes one block, so the block's new
maximum is a reduction in registers, and each element is re-coded by a binary search over
the map's midpoints (8 halvings of a 256-entry table).

Why fuse. The step is memory-bound: a few dozen flops per element. The kernel reads p and g
and the two codes, and writes p and the two codes: 16 B per fp32 parameter, plus 16 B per
block for the maxima, and never holds a moment in fp32 outside registers. Unfused, each fp32
moment must at least be written by one pass and read back by the next (the step's output by
the quantization): 2 x (4 + 4) = 16 B more per element, double the kernel's traffic at best.
The reference, a dozen whole-tensor torch operations (dequantize, AdamW, quantize), moves
several times that, and holds the largest tensor's two moments in fp32 as scratch.

Numerics: the reference's operations in its order, in fp32 (IEEE division and square root),
the parameter rounded once to its dtype (fp32, bf16 or fp16). Codes are the reference's
``torch.searchsorted`` over the midpoints, side 'left': a value exactly on a midpoint takes
the lower code. A code can still differ from the reference's by one where the two fp32
normalized values, computed with different instruction choices (a fused multiply-add), fall
on either side of a midpoint within a rounding error. A NaN makes its block's maxima NaN, as
in the reference (the codes of such a block may differ; they decode to NaN either way).
"""

from __future__ import annotations

import math

import torch

try:
    import triton
    import triton.language as tl

    from scaletrain.kernels.adamw import _store as store_rounded
except ImportError:  # lookup_table needs no Triton; the step does (kernels.unavailable says so)
    triton = None

MAP_SIZE = 256  # 8-bit codes: the table holds 256 map values, then 256 midpoints
# Warps per 2048-element program: the fastest on an H200 (64M elements; 4 and 16 were 10% and 6% slower).
NUM_WARPS = 8
_STORAGE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_STATE_KEYS = ("exp_avg_codes", "exp_avg_absmax", "exp_avg_sq_codes", "exp_avg_sq_absmax")


def lookup_table(qmap: torch.Tensor) -> torch.Tensor:
    """The kernel's view of a sorted map of at most 256 values: 512 fp32 entries, the values
    (the last repeated up to 256: no code points past it) then the midpoints between neighbours,
    computed as the reference computes them and padded with +inf, which no value lies above."""
    qmap = qmap.float()
    bounds = (qmap[1:] + qmap[:-1]) / 2
    return torch.cat([qmap, qmap[-1:].expand(MAP_SIZE - len(qmap)),
                      bounds, bounds.new_full((MAP_SIZE - len(bounds),), math.inf)]).contiguous()


if triton is not None:
    @triton.jit
    def _nearest_code(x, table, MAP_SIZE: tl.constexpr):
        """How many midpoints lie strictly below each ``x``: the code of its nearest map value.
        Branch-free binary search: after trying steps 128, 64, ..., 1, midpoints [0, code) are
        below x and the others not (the +inf padding never is)."""
        code = tl.zeros(x.shape, dtype=tl.int32)
        for level in tl.static_range(1, 9):
            step = MAP_SIZE >> level
            probe = tl.load(table + MAP_SIZE + code + (step - 1))
            code = tl.where(probe < x, code + step, code)
        return code

    @triton.jit
    def _requantize(x, mask, code_ptrs, absmax_ptr, table, MAP_SIZE: tl.constexpr):
        """Store the block's absolute maximum and each element's code, as the reference's quantize."""
        # Lanes past the tensor's end decoded code 0 (-1 on the signed map): the reference pads with zeros.
        x = tl.where(mask, x, 0.0)
        # The maximum of the bit patterns: for non-negative floats they order as the values, and a
        # NaN's lies above infinity's, so a NaN poisons the block's maximum as torch's amax does
        # (a NaN-blind float max was 6% faster on an H200).
        absmax = tl.max(tl.abs(x).to(tl.int32, bitcast=True), axis=0).to(tl.float32, bitcast=True)
        tl.store(absmax_ptr, absmax)
        # The smallest normal fp32 keeps an all-zero block at 0 / tiny = 0, as the reference clamps.
        normed = tl.div_rn(x, tl.maximum(absmax, 1.1754943508222875e-38))
        tl.store(code_ptrs, _nearest_code(normed, table, MAP_SIZE).to(tl.uint8), mask=mask)

    @triton.jit
    def _adamw8bit_kernel(p_ptr, g_ptr, m_codes, m_absmax, v_codes, v_absmax, signed, unsigned, numel,
                          decay, m_weight, beta2, v_weight, eps, step_size, bias_correction2_sqrt,
                          BLOCK: tl.constexpr, MAP_SIZE: tl.constexpr):
        block = tl.program_id(0)
        # int64: a tensor may hold more than 2^31 elements.
        offsets = block.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < numel
        p = tl.load(p_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        m_code = tl.load(m_codes + offsets, mask=mask, other=0).to(tl.int32)
        v_code = tl.load(v_codes + offsets, mask=mask, other=0).to(tl.int32)
        # Each 2 KiB table stays in cache: these gathers add no DRAM traffic.
        m = tl.load(signed + m_code) * tl.load(m_absmax + block)
        v = tl.load(unsigned + v_code) * tl.load(v_absmax + block)
        m = m + m_weight * (g - m)  # torch's lerp, for weights below 1/2
        v = v * beta2 + v_weight * g * g
        # IEEE sqrt and division (Triton's defaults are approximate on GPUs), as in kernels/adamw.py.
        denom = tl.div_rn(tl.sqrt_rn(v), bias_correction2_sqrt) + eps
        p = p * decay + tl.div_rn(step_size * m, denom)
        store_rounded(p_ptr + offsets, p, mask)
        _requantize(m, mask, m_codes + offsets, m_absmax + block, signed, MAP_SIZE)
        _requantize(v, mask, v_codes + offsets, v_absmax + block, unsigned, MAP_SIZE)


@torch.no_grad()
def adamw8bit_step(param: torch.Tensor, grad: torch.Tensor, state: dict, signed_table: torch.Tensor,
                   unsigned_table: torch.Tensor, *, block: int, step: float, lr: float, beta1: float,
                   beta2: float, eps: float, weight_decay: float) -> None:
    """One 8-bit AdamW step of ``param`` in place, its ``state``'s codes and maxima (the keys of
    optim/adamw8bit.py, one maximum per ``block`` elements) updated in place; ``step`` is t,
    counted from 1; the tables are `lookup_table` of the signed and the unsigned map, on the
    parameter's device."""
    _check(param, grad, state, signed_table, unsigned_table, block)
    numel = param.numel()
    if not numel:
        return
    # The scalars as the reference computes them (Python doubles, rounded to fp32 by the launch).
    bias_correction1, bias_correction2_sqrt = 1 - beta1 ** step, math.sqrt(1 - beta2 ** step)
    _adamw8bit_kernel[(triton.cdiv(numel, block),)](
        param, grad, *(state[key] for key in _STATE_KEYS), signed_table, unsigned_table, numel,
        1 - lr * weight_decay, 1 - beta1, beta2, 1 - beta2, eps, -lr / bias_correction1, bias_correction2_sqrt,
        BLOCK=block, MAP_SIZE=MAP_SIZE, num_warps=NUM_WARPS)


def _check(param: torch.Tensor, grad: torch.Tensor, state: dict, signed_table: torch.Tensor,
           unsigned_table: torch.Tensor, block: int) -> None:
    """What the kernel assumes of its tensors; each broken assumption would corrupt memory silently."""
    numel, device = param.numel(), param.device
    if param.dtype not in _STORAGE_DTYPES or grad.dtype not in _STORAGE_DTYPES:
        raise TypeError(f"the 8-bit AdamW kernel takes parameters and gradients among {_STORAGE_DTYPES}, "
                        f"got {param.dtype} and {grad.dtype}")
    codes_m, absmax_m, codes_v, absmax_v = (state[key] for key in _STATE_KEYS)
    blocks = -(-numel // block)
    for t, dtype, size in [(param, param.dtype, numel), (grad, grad.dtype, numel), (codes_m, torch.uint8, numel),
                           (codes_v, torch.uint8, numel), (absmax_m, torch.float32, blocks),
                           (absmax_v, torch.float32, blocks), (signed_table, torch.float32, 2 * MAP_SIZE),
                           (unsigned_table, torch.float32, 2 * MAP_SIZE)]:
        if t.device != device or not t.is_contiguous() or t.dtype != dtype or t.numel() != size:
            raise ValueError("the 8-bit AdamW kernel needs contiguous tensors on the parameter's device: the "
                             "gradient its size, uint8 codes one per element, fp32 maxima one per block, "
                             "and 512-entry fp32 lookup tables")
