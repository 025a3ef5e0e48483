"""Fused cross-entropy over the vocabulary, and the fused output head + loss computed in chunks.

The mean cross-entropy of logits z [N, V] against targets t [N] is

    loss = 1/N sum_i (log sum_j exp(z_ij) - z_i,t_i)
    dloss/dz_ij = (softmax(z_i)_j - [j = t_i]) / N

where a row whose target is negative (IGNORE_INDEX: a prompt token, padding)
adds nothing, to the sum or the gradient, and still counts in N: the trainer
rescales by the positions over the trained tokens (job/trainer.py).

A Triton program per row makes one read of the row for its maximum and sum of
exponentials together (online softmax, Milakov & Gimelshein 2018; the helper
is softmax.py's), and a second read in which it writes the gradient above,
block by block, in place of the logits or into a buffer: the gradient is
ready when the forward is done, and the backward only scales it by the
incoming gradient (the loss is a scalar). What the kernel writes is
softmax - onehot, without the mean's 1/N, which the backward applies along
with the incoming gradient: with 16-bit logits, p/N of a small probability p
would round to zero in fp16 (not in bf16) before fp16's loss scale could lift it. In place, nothing [N, V] is held
but the logits themselves (else one gradient beside them, in their dtype),
where F.cross_entropy on fp32 logits keeps its log-softmax output and then
makes a gradient of the same size beside it.

For a language model the logits are the head's product h W^T of hidden
states h [N, d] and the (tied) embedding W [V, d], and at a 50k-token vocabulary
they dominate the memory of the loss: 8192 tokens x 50304 words are 1.6 GB in
fp32, and the trainer's ``.float()`` copy and the gradient add as much again
each. `fused_linear_cross_entropy` never forms them whole (as in Liger Kernel,
Hsu et al. 2024, and Wijmans et al. 2024, "Cut Your Losses in Large-
Vocabulary Language Models"): it takes the rows of h in chunks, and for each
computes the chunk's logits by a matmul, the loss and the logits' gradient in
place by the kernel above, and from that gradient the chunk's share of the
gradients of h (rows of its own) and of W (summed over the chunks, in fp32).
The trade: the head's matmuls run in chunks of fewer rows, and all of the
backward's work moves into the forward, so a forward without a backward (an
evaluation) must say so by needing no gradient, else it pays for them too.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from scaletrain.kernels import head_loss
from scaletrain.kernels.softmax import launch_config, online_max_sum

MAX_BLOCK = 4096  # vocabulary entries a program holds at once


@triton.jit
def _cross_entropy_rows(z_ptr, z_stride, targets_ptr, loss_ptr, grad_ptr, grad_stride, n_cols,
                        BLOCK: tl.constexpr, WRITE_GRAD: tl.constexpr):
    """Row i's loss into loss[i]; with WRITE_GRAD, its gradient softmax - onehot
    into row i of grad, which may be the logits themselves (each block is read
    before it is overwritten)."""
    row = tl.program_id(0).to(tl.int64)
    z_row = z_ptr + row * z_stride
    target = tl.load(targets_ptr + row)
    trained = target >= 0  # a negative target (IGNORE_INDEX) is left out: loss 0, gradient 0
    m, d = online_max_sum(z_row, n_cols, BLOCK)
    z_target = tl.load(z_row + tl.where(trained, target, 0)).to(tl.float32)
    tl.store(loss_ptr + row, tl.where(trained, tl.log(d) + m - z_target, 0.0))
    if WRITE_GRAD:
        grad_row = grad_ptr + row * grad_stride
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < n_cols
            z = tl.load(z_row + cols, mask=mask, other=0.0).to(tl.float32)
            grad = tl.where(trained, tl.exp(z - m) / d - tl.where(cols == target, 1.0, 0.0), 0.0)
            tl.store(grad_row + cols, grad.to(grad_ptr.dtype.element_ty), mask=mask)


def cross_entropy_rows(logits: torch.Tensor, targets: torch.Tensor, grad: torch.Tensor | None,
                       max_block: int = MAX_BLOCK) -> torch.Tensor:
    """Each row's loss (fp32 [rows]); when ``grad`` is given, writes each row
    loss's gradient into it (``grad`` may be ``logits``)."""
    loss = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
    block, warps = launch_config(logits.shape[1], max_block)
    out = logits if grad is None else grad  # not written without WRITE_GRAD
    _cross_entropy_rows[(logits.shape[0],)](logits, logits.stride(0), targets, loss, out, out.stride(0),
                                            logits.shape[1], BLOCK=block,
                                            WRITE_GRAD=grad is not None, num_warps=warps)
    return loss


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, inplace: bool, max_block: int,
                grad_enabled: bool) -> torch.Tensor:
        logits = logits if logits.stride(-1) == 1 else logits.contiguous()
        grad = None
        if grad_enabled and ctx.needs_input_grad[0]:
            grad = logits if inplace else torch.empty_like(logits)
        loss = cross_entropy_rows(logits, targets.contiguous(), grad, max_block)
        ctx.save_for_backward(grad)
        return loss.mean()

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:
        (grad,) = ctx.saved_tensors
        # In place: the gradient is as large as the logits, and a backward runs once.
        return grad.mul_((grad_loss / grad.shape[0]).to(grad.dtype)), None, None, None, None


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, *, inplace: bool = False,
                  max_block: int = MAX_BLOCK) -> torch.Tensor:
    """Mean cross-entropy of ``logits`` [N, V] (fp32 or bf16) against ``targets`` [N], differentiable.

    The gradient, in the logits' dtype, is computed in the forward, into a
    new buffer, or with ``inplace`` over the logits themselves, which then
    must not be read again (nor be needed by another op's backward).
    """
    # Inside a Function's forward grad mode is off, and ctx.needs_input_grad says
    # only whether the inputs require grad: whether a backward can follow at all
    # (no torch.no_grad() around the call) is read here and passed in.
    return _CrossEntropy.apply(logits, targets, inplace, max_block, torch.is_grad_enabled())


def _matmul_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype the head's matmul would run in: the caller's autocast's, else the inputs' own."""
    device = hidden.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return torch.promote_types(hidden.dtype, weight.dtype)


def _add_product(total: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """total += a @ b, ``total`` fp32: in place for fp32 factors; 16-bit ones
    make their product in their own dtype first (a [V, d] temporary per chunk:
    torch's mixed-dtype addmm, out_dtype=float32, exists on CUDA only)."""
    if a.dtype == total.dtype:
        total.addmm_(a, b)
    else:
        total += a @ b


class _FusedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                chunk_rows: int, max_block: int, grad_enabled: bool) -> torch.Tensor:
        n = hidden.shape[0]
        want_hidden, want_weight = (grad_enabled and wanted for wanted in ctx.needs_input_grad[:2])
        dtype = _matmul_dtype(hidden, weight)
        w = weight.to(dtype)  # cast once, not by autocast at every chunk's matmuls
        grad_hidden = torch.empty_like(hidden) if want_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_weight else None
        losses = []
        with torch.autocast(hidden.device.type, enabled=False):
            for start in range(0, n, chunk_rows):
                rows = slice(start, start + chunk_rows)
                h = hidden[rows].to(dtype)
                logits = h @ w.T
                grad = logits if want_hidden or want_weight else None  # the gradient replaces the logits
                losses.append(cross_entropy_rows(logits, targets[rows], grad, max_block))
                if want_hidden:
                    grad_hidden[rows] = grad @ w
                if want_weight:
                    _add_product(grad_weight, grad.T, h)
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.n, ctx.weight_dtype = n, weight.dtype
        return torch.cat(losses).mean()

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grad_hidden, grad_weight = ctx.saved_tensors
        scale = grad_loss / ctx.n  # the mean's 1/N, kept out of the forward's 16-bit products
        if grad_hidden is not None:
            grad_hidden = grad_hidden.mul_(scale.to(grad_hidden.dtype))
        if grad_weight is not None:
            grad_weight = grad_weight.mul_(scale).to(ctx.weight_dtype)
        return grad_hidden, grad_weight, None, None, None, None


def fused_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                               chunk_rows: int | None = None, max_block: int = MAX_BLOCK) -> torch.Tensor:
    """Mean cross-entropy of the logits ``hidden @ weight.T`` against ``targets``,
    differentiable in ``hidden`` [N, d] and ``weight`` [V, d], without ever
    holding the [N, V] logits: ``chunk_rows`` rows of them at a time
    (kernels/head_loss.py's rule when None)."""
    hidden = hidden.reshape(-1, hidden.shape[-1])
    targets = targets.reshape(-1).contiguous()
    if chunk_rows is None:
        chunk_rows = head_loss.chunk_rows(*hidden.shape, weight.shape[0])
    return _FusedLinearCrossEntropy.apply(hidden, weight, targets, chunk_rows, max_block,
                                          torch.is_grad_enabled())  # as in cross_entropy


def cross_entropy_reference(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The formula in plain PyTorch, in fp32: mean of logsumexp(z_i) - z_i,t_i, ignored rows 0."""
    z = logits.float()
    trained = targets >= 0
    picked = z.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return ((torch.logsumexp(z, dim=-1) - picked) * trained).mean()


def fused_linear_cross_entropy_reference(hidden: torch.Tensor, weight: torch.Tensor,
                                         targets: torch.Tensor) -> torch.Tensor:
    """The head's logits materialised whole, then `cross_entropy_reference`."""
    return cross_entropy_reference(hidden @ weight.T, targets)
