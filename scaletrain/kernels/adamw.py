"""Fused multi-tensor AdamW: one Triton launch updates every tensor of a set.

AdamW (Loshchilov & Hutter 2019, "Decoupled Weight Decay Regularization"),
exactly as torch.optim.AdamW computes it, at step t (counted from 1) with
gradient g::

    p <- p * (1 - lr * wd)                       decoupled weight decay
    m <- b1 m + (1 - b1) g                       (torch: m.lerp_(g, 1 - b1))
    v <- b2 v + (1 - b2) g^2
    p <- p - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)

The arithmetic is fp32 whatever the storage dtype (fp32, bf16 or fp16):
each element is loaded, widened, updated and rounded once on the way out.

Why fuse. The update is a handful of flops per element, so its time is the
bytes it moves. Per fp32 parameter it must read p, g, m, v (16 B) and write
p, m, v (12 B): 28 B, plus 2 B when it also writes the bf16 working copy of
an fp32 master (see optim/masters.py), which otherwise costs a separate pass
reading the master again (4 B read, 2 B written). torch's foreach AdamW runs
about a dozen multi-tensor passes, each reading or writing whole lists, and
moves several times the minimum; its fused=True CUDA kernel moves the
minimum but leaves the working-copy cast to a separate pass.

Multi-tensor launch. A model has hundreds of tensors, many tiny (biases,
norm gains), and one launch per tensor would be bound by launch latency. The
kernel instead takes

* a pointer table: an int64 tensor of rows [params | grads | exp_avgs |
  exp_avg_sqs | working copies], one column per tensor, holding data_ptr()s;
* a block table: rows [tensor index | first element | tensor numel], one
  column per BLOCK-element block of every tensor,

and runs one program per block, so a single launch covers every element of
the set. Both tables are kept between steps: the block table depends only
on the shapes, and the pointer table is rebuilt only when some tensor's
data_ptr() changed (a new gradient buffer, a state dict load). Scalars (lr,
bias corrections) are kernel arguments, so a step uploads nothing when the
pointers are unchanged. A set shares the step t, the hyper-parameters and
the dtypes; the optimizer (optim/fused_adamw.py) makes one set per
(parameter group, dtypes) in the usual case of every tensor at the same
step.

`adamw_reference` is the same update in plain PyTorch, with the same
operations in the same order as torch's AdamW, for testing the kernel and for
machines without Triton.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from scaletrain.kernels import interpreted

try:
    import triton
    import triton.language as tl
except ImportError:  # the reference needs no Triton; AdamWLaunch does (kernels.unavailable says so)
    triton = None

# Elements per program: 2048 x 28 B = 56 KiB of traffic per program amortizes its
# two dependent table look-ups (block, then pointers) before the element loads.
BLOCK = 2048
_STORAGE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_ALIGNMENT = 16  # bytes: pointers aligned to this allow vectorized loads and stores


def _bias_corrections(step: int, beta1: float, beta2: float) -> tuple[float, float]:
    """(1 - b1^t, sqrt(1 - b2^t)), in Python floats as torch computes them."""
    return 1 - beta1 ** step, (1 - beta2 ** step) ** 0.5


@torch.no_grad()
def adamw_reference(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                    exp_avgs: Sequence[torch.Tensor], exp_avg_sqs: Sequence[torch.Tensor],
                    workings: Sequence[torch.Tensor] | None = None, *, step: int, lr: float,
                    beta1: float, beta2: float, eps: float, weight_decay: float) -> None:
    """One AdamW step in place, in fp32, with torch.optim.AdamW's operations; each
    ``workings[i]`` (when given) receives ``params[i]`` rounded to its dtype."""
    bias_correction1, bias_correction2_sqrt = _bias_corrections(step, beta1, beta2)
    for i, (param, grad, exp_avg, exp_avg_sq) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs,
                                                                strict=True)):
        p, g, m, v = (t.float() for t in (param, grad, exp_avg, exp_avg_sq))
        p.mul_(1 - lr * weight_decay)
        m.lerp_(g, 1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        denom = (v.sqrt() / bias_correction2_sqrt).add_(eps)
        p.addcdiv_(m, denom, value=-lr / bias_correction1)
        # .float() of an fp32 tensor is the tensor itself; the copies write back narrower storage.
        for target, value in ((param, p), (exp_avg, m), (exp_avg_sq, v)):
            if target is not value:
                target.copy_(value)
        if workings is not None:
            workings[i].copy_(p)


if triton is not None:
    @triton.jit
    def _pointer(table, row, t, like, ALIGNED: tl.constexpr):
        """Column t of row ``row`` of the pointer table, typed like the pointer ``like``."""
        ptr = tl.load(table + row + t).to(like.dtype)
        if ALIGNED:
            ptr = tl.multiple_of(ptr, 16)
        return ptr

    @triton.jit
    def _store(ptrs, x, mask):
        """Store fp32 ``x`` rounded to nearest-even in the pointers' dtype. bf16 is
        rounded by hand: Triton's interpreter truncates in the cast, and the
        result must match torch's rounding on every backend. NaN stays NaN
        (adding the rounding bias to an all-ones NaN pattern would wrap it)."""
        if ptrs.dtype.element_ty == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
            rounded = tl.where((bits & 0x7FFFFFFF) > 0x7F800000, 0x7FC0, rounded)  # NaN
            tl.store(ptrs, rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True), mask=mask)
        else:
            tl.store(ptrs, x.to(ptrs.dtype.element_ty), mask=mask)

    @triton.jit
    def _adamw_kernel(pointers, blocks, n_tensors, p_like, g_like, w_like,
                      decay, beta1, beta2, eps, step_size, bias_correction2_sqrt,
                      HAS_WORKING: tl.constexpr, ALIGNED: tl.constexpr, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        n_blocks = tl.num_programs(0)
        t = tl.load(blocks + pid)
        # Every block starts at a multiple of BLOCK: with aligned pointers, the
        # compiler may then vectorize the accesses.
        start = tl.multiple_of(tl.load(blocks + n_blocks + pid), BLOCK)
        numel = tl.load(blocks + 2 * n_blocks + pid)
        offsets = start + tl.arange(0, BLOCK)
        mask = offsets < numel
        p_ptrs = _pointer(pointers, 0, t, p_like, ALIGNED) + offsets
        g_ptrs = _pointer(pointers, n_tensors, t, g_like, ALIGNED) + offsets
        m_ptrs = _pointer(pointers, 2 * n_tensors, t, p_like, ALIGNED) + offsets
        v_ptrs = _pointer(pointers, 3 * n_tensors, t, p_like, ALIGNED) + offsets
        # Widen on load: all arithmetic in fp32 (the interpreter also mishandles bf16 arithmetic).
        p = tl.load(p_ptrs, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(g_ptrs, mask=mask, other=0.0).to(tl.float32)
        m = tl.load(m_ptrs, mask=mask, other=0.0).to(tl.float32)
        v = tl.load(v_ptrs, mask=mask, other=0.0).to(tl.float32)
        p = p * decay
        m = m + (1.0 - beta1) * (g - m)  # torch's lerp, for weights below 1/2
        v = v * beta2 + (1.0 - beta2) * g * g
        # IEEE sqrt and division (Triton's defaults are approximate on GPUs): free
        # in a memory-bound kernel, and they keep it within rounding of torch's.
        denom = tl.div_rn(tl.sqrt_rn(v), bias_correction2_sqrt) + eps
        p = p + tl.div_rn(step_size * m, denom)
        _store(p_ptrs, p, mask)
        _store(m_ptrs, m, mask)
        _store(v_ptrs, v, mask)
        if HAS_WORKING:
            _store(_pointer(pointers, 4 * n_tensors, t, w_like, ALIGNED) + offsets, p, mask)


def _launch(grid: tuple[int], *args, **meta) -> None:
    """The one place the kernel is launched (tests count launches here)."""
    _adamw_kernel[grid](*args, **meta)


def block_table(numels: Sequence[int], device: torch.device) -> torch.Tensor:
    """Rows [tensor index | first element | tensor numel], a column per BLOCK-element block."""
    numels_t = torch.tensor(numels, dtype=torch.int64)
    counts = (numels_t + BLOCK - 1) // BLOCK
    tensor = torch.repeat_interleave(torch.arange(len(numels), dtype=torch.int64), counts)
    first_block = torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
    start = (torch.arange(len(tensor), dtype=torch.int64) - first_block) * BLOCK
    return torch.stack([tensor, start, numels_t[tensor]]).to(device)


class AdamWLaunch:
    """The fused step for one set of tensors, with its launch tables kept between calls.

    Call it like `adamw_reference`. Every tensor must be contiguous, on one
    CUDA device (or the CPU under TRITON_INTERPRET=1); the moments share the
    parameters' dtype, as torch's AdamW keeps them. This is checked whenever
    the tables are built, that is, whenever a tensor is new.
    """

    def __init__(self) -> None:
        self._shapes: tuple | None = None
        self._blocks: torch.Tensor | None = None
        self._ptrs: tuple | None = None
        self._pointers: torch.Tensor | None = None
        self._aligned = False

    def __call__(self, params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                 exp_avgs: Sequence[torch.Tensor], exp_avg_sqs: Sequence[torch.Tensor],
                 workings: Sequence[torch.Tensor] | None = None, *, step: int, lr: float,
                 beta1: float, beta2: float, eps: float, weight_decay: float) -> None:
        roles = [params, grads, exp_avgs, exp_avg_sqs, *([workings] if workings is not None else [])]
        ptrs = tuple(t.data_ptr() for role in roles for t in role)
        if ptrs != self._ptrs:
            self._rebuild(roles, ptrs)
        if not self._blocks.shape[1]:  # every tensor empty: nothing to launch over
            return
        bias_correction1, bias_correction2_sqrt = _bias_corrections(step, beta1, beta2)
        first = workings[0] if workings is not None else params[0]
        _launch((self._blocks.shape[1],), self._pointers, self._blocks, len(params), params[0], grads[0],
                first, 1 - lr * weight_decay, beta1, beta2, eps, -lr / bias_correction1,
                bias_correction2_sqrt, HAS_WORKING=workings is not None, ALIGNED=self._aligned, BLOCK=BLOCK)

    def _rebuild(self, roles: list[Sequence[torch.Tensor]], ptrs: tuple) -> None:
        _check(roles)
        device = roles[0][0].device
        shapes = tuple(p.numel() for p in roles[0])
        if shapes != self._shapes:
            self._shapes, self._blocks = shapes, block_table(shapes, device)
        self._pointers = torch.tensor(ptrs, dtype=torch.int64).to(device)
        self._aligned = all(ptr % _ALIGNMENT == 0 for ptr in ptrs)
        self._ptrs = ptrs


def _check(roles: list[Sequence[torch.Tensor]]) -> None:
    """What the kernel assumes of its tensors; each broken assumption would corrupt memory silently."""
    params = roles[0]
    if not params:
        raise ValueError("fused AdamW needs at least one tensor")
    device = params[0].device
    if interpreted() and device.type != "cpu":
        raise ValueError("under TRITON_INTERPRET=1 the kernel reads host memory through its pointer "
                         "tables; give it CPU tensors")
    for role in roles:
        if len(role) != len(params):
            raise ValueError("fused AdamW needs one gradient, state and working copy per parameter")
        dtypes = {t.dtype for t in role}
        if len(dtypes) != 1 or not dtypes <= set(_STORAGE_DTYPES):
            raise TypeError(f"fused AdamW takes one dtype per role among {_STORAGE_DTYPES}, got {dtypes}")
        for t, p in zip(role, params):
            if t.device != device or not t.is_contiguous() or t.numel() != p.numel():
                raise ValueError("fused AdamW needs contiguous tensors on one device, each the size "
                                 "of its parameter")
    if roles[2][0].dtype != params[0].dtype or roles[3][0].dtype != params[0].dtype:
        raise TypeError("fused AdamW keeps the moments in the parameters' dtype")
