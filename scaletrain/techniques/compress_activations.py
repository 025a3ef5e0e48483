"""Activation compression: tensors saved for backward are stored in fewer bits.

Between forward and backward, training keeps the tensors each backward needs.
Recomputation (recompute.py) drops some and computes them again; compression keeps them
all, smaller, and restores them when backward asks (Chen et al. 2021, "ActNN: Reducing
Training Memory Footprint via 2-Bit Activation Compressed Training"; Liu et al. 2022,
"GACT: Activation Compressed Training for Generic Network Architectures"). Both papers
show that the gradient tolerates a lossy copy of the activations: an error in a saved
tensor only perturbs the gradient, while the step's loss is computed on exact ones.

Modes (``compress_activations(model, mode)``, ``--compress-activations``):

``none``
    No hooks at all: the plain arithmetic, bit for bit.
``bf16``
    fp32 tensors saved as bfloat16 (8 significant bits; relative error at most 2^-9
    per element): half the bytes.
``int8``
    Per-block absmax: each block b of ``BLOCK`` = 128 elements stored as
    ``q = round(x / s_b)`` in int8 with ``s_b = max|x_b| / 127`` in fp32, and restored
    as ``q * s_b``. The error is at most s_b / 2 = max|x_b| / 254 per element; the bytes
    are 1 + 4/128 per element, 3.88x fewer than fp32 (1.94x fewer than bf16). ActNN
    rounds stochastically, which makes its 2-bit gradient unbiased; at 8 bits the bias
    of rounding to nearest is below the step's own noise, and nearest keeps a run a
    function of its seed (no random draw shifts the dropout stream).

Compressed: floating tensors of at least ``MIN_ELEMENTS`` elements that require grad
(activations computed from trained weights; frozen weights and buffers require none).
Weights, their views (``weight.t()``) and casts (autocast's bf16 copy) are left alone:
the model holds them anyway, so a compressed copy would add bytes and change the weight
backward multiplies by. So are tensors outside the graph (indices, dropout masks, layer
norm's mean and 1/std, attention's log-sum-exp): small (b*s or b*h*s, against b*s*d for
an activation) and precise, as an error e in a saved log-sum-exp scales every
recomputed attention probability of its row by exp(e). A storage is
compressed once per forward however many saved tensors fill it (the log-softmax output
cross-entropy saves twice; attention's output and its reshape); views covering part
of a storage (q, k and v, slices of one qkv product) are compressed each on its own.

The hooks are ``torch.autograd.graph.saved_tensors_hooks`` around the forward
(job/trainer.py enters them with autocast, for every micro-batch and pipeline stage).
Hooks entered before them (the memory meter's, train/memory.py) are composed, not
shadowed, so the meter counts the int8 blocks and scales the run really holds. Within
a checkpointed region (``--recompute``) checkpoint's own hooks are innermost and drop
the tensors anyway; the region's inputs, which checkpoint saves through the hooks
outside it, are compressed, so the two techniques multiply: full recompute keeps the
block inputs, compression stores them in a quarter of the bytes, and the recomputation
in backward runs on the restored (lossy) inputs.
"""

from __future__ import annotations

import weakref
from typing import Any, NamedTuple

import torch
from torch import nn

MODES = ("none", "bf16", "int8")
BLOCK = 128  # int8: elements per absmax scale
MIN_ELEMENTS = 1024  # smaller tensors are kept as they are: their bytes are not worth a kernel launch

# grad_fn nodes that only view or cast their single input: a tensor reached from a
# parameter through these alone is that parameter in another shape or dtype.
_VIEWS_AND_CASTS = frozenset({
    "TBackward0", "TransposeBackward0", "PermuteBackward0", "ViewBackward0", "UnsafeViewBackward0",
    "ReshapeAliasBackward0", "ExpandBackward0", "SliceBackward0", "SelectBackward0", "AliasBackward0",
    "UnsqueezeBackward0", "SqueezeBackward0", "SqueezeBackward1", "ToCopyBackward0", "UnbindBackward0",
})


class Stored:
    """One compressed buffer: bf16 ``data``, or int8 blocks and their fp32 ``scale``, of ``numel``
    elements of ``dtype``; ``data`` and ``scale`` are what the hooks beneath kept of them."""

    __slots__ = ("data", "scale", "dtype", "numel")

    def __init__(self, data: Any, scale: Any, dtype: torch.dtype, numel: int):
        self.data, self.scale, self.dtype, self.numel = data, scale, dtype, numel


class SavedView(NamedTuple):
    """A saved tensor: its buffer, and its shape, with its strides when it is a view of that buffer."""

    stored: Stored
    shape: torch.Size
    stride: tuple[int, ...] | None  # None: the buffer is the tensor's elements in order


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 blocks [n_blocks, BLOCK], fp32 scales [n_blocks, 1]) of ``x`` flattened and zero-padded."""
    flat = x.detach().reshape(-1).float()
    if flat.numel() % BLOCK:
        flat = torch.nn.functional.pad(flat, (0, -flat.numel() % BLOCK))
    blocks = flat.view(-1, BLOCK)
    low, high = torch.aminmax(blocks, dim=1, keepdim=True)  # one pass, no |x| copy
    scale = torch.maximum(-low, high).div_(127)
    scale = torch.where(scale == 0, 1.0, scale)  # an all-zero block stays zero; a NaN stays NaN
    return blocks.div(scale).round_().to(torch.int8), scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """The flat tensor `quantize_int8` took, to its rounding, in ``dtype``."""
    return q.to(torch.float32).mul_(scale).view(-1)[:numel].to(dtype)


def fills_its_storage(t: torch.Tensor) -> bool:
    """Whether ``t`` is every element of its storage exactly once (a contiguous tensor, or a
    transpose or permutation of one): then its storage, compressed once, serves every such view."""
    if t.storage_offset() or t.numel() * t.element_size() != t.untyped_storage().nbytes():
        return False
    expected = 1
    for size, stride in sorted(zip(t.shape, t.stride(), strict=True), key=lambda pair: pair[1]):
        if size > 1:
            if stride != expected:
                return False
            expected *= size
    return True


class ActivationCompression:
    """Saved-tensor hooks that compress activations while the ``with`` block runs (module docstring).

    One object per model, entered around each forward (not nested); ``seen_bytes``
    and ``stored_bytes`` add up, over every forward, the bytes of the tensors it
    compressed and of what it stored in their place.
    """

    passes_saves_down = True  # what it keeps goes to the hooks beneath (train/memory.py reads this)

    def __init__(self, mode: str):
        if mode not in MODES:
            raise ValueError(f"activation compression {mode!r} is not one of {', '.join(MODES)}")
        self.mode = mode
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._beneath: tuple | None = None
        self._this_forward: dict[tuple, tuple[weakref.ref, Stored]] = {}
        self.seen_bytes = 0
        self.stored_bytes = 0

    def __enter__(self) -> ActivationCompression:
        if self.mode != "none":
            # The hooks entered before these (the memory meter's): composed with them, not shadowed.
            self._beneath = torch._C._autograd._top_saved_tensors_default_hooks(False)
            self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.mode != "none":
            self._hooks.__exit__(*exc)
            self._this_forward.clear()

    def compresses(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is an activation worth compressing, not a weight (module docstring)."""
        if not t.is_floating_point() or t.numel() < MIN_ELEMENTS or not t.requires_grad:
            return False
        if self.mode == "bf16" and t.element_size() <= 2:
            return False  # already 16 bits
        return not self._is_weight(t)

    @staticmethod
    def _is_weight(t: torch.Tensor) -> bool:
        """A parameter, or a view or cast of one (``grad_fn`` walked to its ``AccumulateGrad``)."""
        if t.is_leaf:
            return isinstance(t, nn.Parameter)
        node = t.grad_fn
        while node.name() in _VIEWS_AND_CASTS:
            inputs = [n for n, _ in node.next_functions if n is not None]
            if len(inputs) != 1:
                return False
            node = inputs[0]
        return isinstance(getattr(node, "variable", None), nn.Parameter)

    # -- the hooks -------------------------------------------------------------
    def _pass_down(self, t: torch.Tensor) -> Any:
        return self._beneath[0](t) if self._beneath else t

    def _bring_up(self, kept: Any) -> torch.Tensor:
        return self._beneath[1](kept) if self._beneath else kept

    def _pack(self, t: torch.Tensor) -> Any:
        if not self.compresses(t):
            return self._pass_down(t)
        whole = fills_its_storage(t)
        storage = t.untyped_storage()
        # Views that fill one storage (the attention output and its reshape for the
        # projection) share one compressed copy; other views are compressed on their own.
        shape_key = () if whole else (t.storage_offset(), t.shape, t.stride())
        key = (storage.data_ptr(), t.dtype, t._version, *shape_key)
        earlier = self._this_forward.get(key)
        if earlier is not None and earlier[0]() is storage:  # the same live tensor, saved again
            stored = earlier[1]
        else:
            stored = self._compress(t.detach().as_strided((t.numel(),), (1,)) if whole else t.detach())
            self._this_forward[key] = (weakref.ref(storage), stored)
        return SavedView(stored, t.shape, t.stride() if whole else None)

    def _compress(self, x: torch.Tensor) -> Stored:
        if self.mode == "bf16":
            data, scale = x.to(torch.bfloat16).reshape(-1), None
        else:
            data, scale = quantize_int8(x)
        self.seen_bytes += x.numel() * x.element_size()
        self.stored_bytes += sum(y.numel() * y.element_size() for y in (data, scale) if y is not None)
        # The bf16 copy, or the int8 blocks and their scales, go to the hooks beneath: the meter counts these.
        return Stored(self._pass_down(data), None if scale is None else self._pass_down(scale), x.dtype,
                      x.numel())

    def _unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, SavedView):
            return self._bring_up(packed)
        stored = packed.stored
        data = self._bring_up(stored.data)
        if stored.scale is None:
            flat = data.to(stored.dtype)
        else:
            flat = dequantize_int8(data, self._bring_up(stored.scale), stored.numel, stored.dtype)
        # A view of a shared buffer is rebuilt with its own strides.
        return flat.view(packed.shape) if packed.stride is None else flat.as_strided(packed.shape, packed.stride)
