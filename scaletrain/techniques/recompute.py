"""Activation recomputation (checkpointing) applied to a decoder from the outside.

Training keeps, for every operation, the tensors its backward needs ("saved
activations"). Recomputation drops some of them in the forward pass and runs
that part of the forward again during backward, trading compute for memory.
Everything here is built on ``torch.utils.checkpoint.checkpoint`` in its
non-reentrant form (``use_reentrant=False``): only the inputs of a recomputed
region are kept, its saved tensors are replaced by placeholders, and the
first backward use of a placeholder reruns the region under the forward's RNG
state (``preserve_rng_state`` stays on, its default), so dropout draws the
same masks and gradients are bitwise those of the plain model.

Policies (``apply_recompute(model, policy)``):

``none``
    Keep everything. Activation memory grows as L * A, with A the bytes one
    block saves.
``full``
    Recompute every block: keep the L block inputs (b*s*d each) and, during
    backward, one block's activations at a time: L*|x| + A. Costs one extra
    forward of the blocks (about +33% of the step's FLOPs, 8N instead of 6N).
``every:K``
    Recompute blocks 0, K, 2K, ...: a ceil(L/K) share of the blocks pays the
    extra forward and the rest keep their activations; a knob between the two.
``sqrt``
    Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost": split
    the chain of L blocks into segments of n = ceil(sqrt(L)) consecutive
    blocks and checkpoint each segment as one unit, so only segment inputs are
    kept and one whole segment is live during its backward. Memory is
    ceil(L/n)*|x| + n*A, smallest at n = sqrt(L*|x|/A): that is sqrt(L)
    in the paper's setting, where a unit saves about the size of its input
    (A ~ |x|), and memory is then O(sqrt L). A transformer block saves many
    times its input (A >> |x|), so for it the optimum moves to n = 1, which is
    ``full``: same extra forward, less memory. ``sqrt`` is kept as the
    textbook rule and measured against the others, not as a recommendation.
``selective``
    Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
    Transformer Models": recompute only the attention core, softmax(QK^T/sqrt
    d_h) with its dropout applied to V, here the one
    ``F.scaled_dot_product_attention`` call. Its saved tensors grow as
    b*h*s^2 (5*a*s^2*b bytes per layer in the paper, against 34*s*b*h for the
    rest of the layer) while its FLOPs are a small share of the layer's, so it
    removes the quadratic term for a few percent of extra compute. With a
    fused kernel that saves no s^2 matrix the saving is just its output and
    log-sum-exp.

How it is applied: the model file is left as it is, and so are parameter
names and ``state_dict`` keys (``blocks.0.attn.qkv.weight``), because
checkpoints are keyed by name. Instead of wrapping modules (which would add a
level to every name), the chosen modules get an instance-level ``forward``:
a small callable object that calls the class's own forward under
``checkpoint``. ``nn.Module.__call__`` looks ``forward`` up on the instance
first, so hooks, ``state_dict`` and ``named_parameters`` are untouched; the
callable holds the module as a plain attribute, so deep copies rebind it to the
copy. ``selective`` runs the attention forward under a TorchFunctionMode that
turns the ``scaled_dot_product_attention`` call into a checkpointed one, so the
code around it (head count taken from the weight, so tensor-parallel shards
run it too) is the model's own and is not copied here.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.checkpoint import checkpoint

from scaletrain.errors import UserError

POLICY_FORMS = "none, full, selective, every:K with K >= 1, or sqrt"


def parse_policy(text: str) -> tuple[str, int]:
    """``text`` -> (kind, k): k is the stride for ``every`` (1 for ``full``), else 0."""
    if text in ("none", "selective", "sqrt"):
        return text, 0
    if text == "full":
        return "every", 1
    kind, colon, k = text.partition(":")
    if kind == "every" and colon and k.isdigit() and int(k) >= 1:
        return "every", int(k)
    raise UserError(f"Recompute policy {text!r} is not valid; use one of {POLICY_FORMS}.")


def apply_recompute(model: nn.Module, policy: str, blocks: Sequence[nn.Module] | None = None) -> None:
    """Make ``model`` recompute activations in backward according to ``policy``
    (over ``blocks``, by default all of ``model.blocks``: a pipeline stage gives its own)."""
    kind, k = parse_policy(policy)
    blocks = list(model.blocks if blocks is None else blocks)
    # a block without an attention module (a user's convolution, say) has only its own forward
    if any("forward" in m.__dict__ for block in blocks for m in (block, getattr(block, "attn", block))):
        raise UserError("This model already has a recompute policy; apply_recompute once, to a fresh model.")
    if kind == "every":
        for block in blocks[::k]:
            block.forward = _Recomputed(block)
    elif kind == "sqrt":
        size = math.ceil(math.sqrt(len(blocks)))
        for start in range(0, len(blocks), size):
            segment = _Segment(blocks[start:start + size])
            blocks[start].forward = segment
            for member in blocks[start + 1:start + size]:
                member.forward = _SegmentMember(segment, member)
    elif kind == "selective":
        for block in blocks:
            block.attn.forward = _AttentionCoreRecomputed(block.attn)


class _Recomputed:
    """A module's own forward, run under checkpoint."""

    def __init__(self, module: nn.Module):
        self.module = module

    def __call__(self, *args, **kwargs):
        return checkpoint(type(self.module).forward, self.module, *args, use_reentrant=False, **kwargs)


class _Segment:
    """Consecutive blocks checkpointed as one unit, run by the segment's first block.

    A decoder's forward calls every block in turn, so the first block's call runs
    the whole segment and hands its output on; the other blocks recognise that
    very tensor (kept by weak reference) and pass it through. Any other input
    is computed normally, so a later block called on its own is still itself.
    """

    def __init__(self, blocks: list[nn.Module]):
        self.blocks = tuple(blocks)
        self.handed_on = None

    def _run(self, x: torch.Tensor, *packed: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = type(block).forward(block, x, *packed)
        return x

    def __call__(self, x: torch.Tensor, *packed: torch.Tensor) -> torch.Tensor:
        # packed: a packed micro-batch's documents (models/decoder.py), which the recomputation needs too
        out = checkpoint(self._run, x, *packed, use_reentrant=False)
        self.handed_on = weakref.ref(out)
        return out


class _SegmentMember:
    """A later block of a segment: passes the segment's output through."""

    def __init__(self, segment: _Segment, block: nn.Module):
        self.segment = segment
        self.block = block

    def __call__(self, x: torch.Tensor, *packed: torch.Tensor) -> torch.Tensor:
        handed_on = self.segment.handed_on
        if handed_on is not None and handed_on() is x:
            if self.block is self.segment.blocks[-1]:
                self.segment.handed_on = None
            return x
        return type(self.block).forward(self.block, x, *packed)


class _AttentionCoreRecomputed:
    """Attention forward with only its scaled_dot_product_attention recomputed."""

    def __init__(self, attn: nn.Module):
        self.attn = attn

    def __call__(self, x: torch.Tensor, *packed: torch.Tensor) -> torch.Tensor:
        with _CheckpointAttentionCore():
            return type(self.attn).forward(self.attn, x, *packed)


class _CheckpointAttentionCore(TorchFunctionMode):
    """Runs every scaled_dot_product_attention call under checkpoint."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            return checkpoint(func, *args, use_reentrant=False, **kwargs)
        return func(*args, **kwargs)
