"""Fused row softmax: one Triton program per row, forward and backward.

Softmax is memory-bound: a few flops per element against the bytes moved.
The naive PyTorch formula (`softmax_reference`) launches one kernel per step
and goes to memory between them; for x of M rows of N elements it reads
5MN + 2M elements and writes 3MN + 2M:

    max over the row     read MN          write M
    x - max              read MN + M      write MN
    exp                  read MN          write MN
    sum over the row     read MN          write M
    exp / sum            read MN + M      write MN

A fused kernel reads x and writes y once each, MN elements both ways, when
the row fits in one block held in registers. A row longer than the block is
done in two passes (online softmax, Milakov & Gimelshein 2018, "Online
normalizer calculation for softmax"): the first keeps a running maximum m and
a running sum d of exp(x - m), rescaling d by exp(m_old - m_new) whenever the
maximum grows, so max and sum come out of one read; the second writes
exp(x - m) / d. That reads 2MN and writes MN, still under half the naive
traffic.

Backward, from y = softmax(x) saved by the forward (as torch saves it):

    dx = y * (dy - sum(dy * y))        (the sum along the row)

reads y and dy and writes dx once each for a one-block row (3MN), and reads
y and dy twice for a longer one. Every element is computed in fp32, whatever
the input's dtype (bf16 too); y and dx have the input's dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_BLOCK = 8192  # the longest row kept in registers whole; longer rows go in blocks of this size


@triton.jit
def online_max_sum(row_ptr, n_cols, BLOCK: tl.constexpr):
    """(m, d): the maximum of a row and the sum of exp(x - m), in one read of it, block by block."""
    m = float("-inf")
    d = 0.0
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(row_ptr + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        # A row whose blocks so far are all -inf (fully masked) keeps m = -inf;
        # shifting by 0 instead keeps exp(-inf - -inf) = nan out of d.
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        d = d * tl.exp(m - shift) + tl.sum(tl.exp(x - shift), axis=0)
        m = m_new
    return m, d


@triton.jit
def _softmax_forward(x_ptr, y_ptr, x_stride, y_stride, n_cols, BLOCK: tl.constexpr, ONE_BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_stride
    y_row = y_ptr + row * y_stride
    if ONE_BLOCK:
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(x_row + cols, mask=mask, other=float("-inf")).to(tl.float32)
        e = tl.exp(x - tl.max(x, axis=0))
        tl.store(y_row + cols, (e / tl.sum(e, axis=0)).to(y_ptr.dtype.element_ty), mask=mask)
    else:
        m, d = online_max_sum(x_row, n_cols, BLOCK)
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < n_cols
            x = tl.load(x_row + cols, mask=mask, other=float("-inf")).to(tl.float32)
            tl.store(y_row + cols, (tl.exp(x - m) / d).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _softmax_backward(y_ptr, dy_ptr, dx_ptr, y_stride, dy_stride, dx_stride, n_cols,
                      BLOCK: tl.constexpr, ONE_BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    y_row = y_ptr + row * y_stride
    dy_row = dy_ptr + row * dy_stride
    dx_row = dx_ptr + row * dx_stride
    if ONE_BLOCK:
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        y = tl.load(y_row + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_row + cols, mask=mask, other=0.0).to(tl.float32)
        dx = y * (dy - tl.sum(dy * y, axis=0))
        tl.store(dx_row + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)
    else:
        dot = 0.0
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < n_cols
            y = tl.load(y_row + cols, mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(dy_row + cols, mask=mask, other=0.0).to(tl.float32)
            dot += tl.sum(dy * y, axis=0)
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < n_cols
            y = tl.load(y_row + cols, mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(dy_row + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(dx_row + cols, (y * (dy - dot)).to(dx_ptr.dtype.element_ty), mask=mask)


def launch_config(n_cols: int, max_block: int) -> tuple[int, int]:
    """(block, num_warps) for rows of ``n_cols``: the row's width rounded up to a
    power of two, at most ``max_block``; more warps for wider blocks, so each
    thread holds a bounded number of elements."""
    block = min(triton.next_power_of_2(n_cols), max_block)
    return block, 4 if block < 2048 else 8 if block < 8192 else 16


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a matrix of its last dim's rows, elements of a row adjacent (a copy only if they are not)."""
    return t.reshape(-1, t.shape[-1]) if t.stride(-1) == 1 else t.contiguous().reshape(-1, t.shape[-1])


class _Softmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, max_block: int) -> torch.Tensor:
        rows = _rows(x)
        y = torch.empty_like(rows)
        block, warps = launch_config(rows.shape[1], max_block)
        _softmax_forward[(rows.shape[0],)](rows, y, rows.stride(0), y.stride(0), rows.shape[1],
                                           BLOCK=block, ONE_BLOCK=block >= rows.shape[1], num_warps=warps)
        ctx.save_for_backward(y)
        ctx.max_block, ctx.shape = max_block, x.shape
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy: torch.Tensor) -> tuple[torch.Tensor, None]:
        (y,) = ctx.saved_tensors
        dy = _rows(dy)
        dx = torch.empty_like(y)
        block, warps = launch_config(y.shape[1], ctx.max_block)
        _softmax_backward[(y.shape[0],)](y, dy, dx, y.stride(0), dy.stride(0), dx.stride(0), y.shape[1],
                                         BLOCK=block, ONE_BLOCK=block >= y.shape[1], num_warps=warps)
        return dx.view(ctx.shape), None


def softmax(x: torch.Tensor, dim: int = -1, *, max_block: int = MAX_BLOCK) -> torch.Tensor:
    """Softmax of ``x`` along ``dim`` by the fused kernels, differentiable.

    Another dim than the last is moved last first (a copy). ``max_block``
    bounds the elements a program holds at once; rows longer than it take the
    two-pass online path (the tests lower it to reach that path on small rows).
    """
    if dim % x.dim() != x.dim() - 1:
        return softmax(x.movedim(dim, -1), max_block=max_block).movedim(-1, dim)
    if x.numel() == 0:
        return torch.empty_like(x)
    return _Softmax.apply(x, max_block)


def softmax_reference(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """The naive formula step by step in fp32 (max, subtract, exp, sum, divide), in ``x``'s dtype."""
    z = x.float()
    numerator = torch.exp(z - z.amax(dim=dim, keepdim=True))
    return (numerator / numerator.sum(dim=dim, keepdim=True)).to(x.dtype)
