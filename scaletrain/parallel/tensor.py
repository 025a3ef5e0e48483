"""Tensor parallelism (Megatron-LM) and sequence parallelism, applied to a plain model.

Shoeybi et al. 2019, "Megatron-LM: Training Multi-Billion Parameter Language
Models Using Model Parallelism"; Korthikanti et al. 2022, "Reducing
Activation Recomputation in Large Transformer Models".

A transformer block's weights are split over the t ranks of the tp group so
that each rank computes 1/t of every matrix product:

    attention   qkv  column-parallel: rank r holds heads [r*a/t, (r+1)*a/t) of q, k and v
                proj row-parallel: the matching 1/t of its input features
    MLP         fc   column-parallel: 4h/t of the hidden features
                proj row-parallel: the matching 4h/t inputs

Between a column-parallel layer (whole input, a slice of the output features)
and its row-parallel partner (partial sums of the whole output) all is local.
The region is entered with f (identity forward, all-reduce backward) and left
with g (all-reduce forward, identity backward): per block 2 all-reduces of
b*s*h elements forward and 2 backward (runtime/autograd.py).

Vocabulary parallel: the token embedding's rows, and so the tied output head,
are split by vocabulary, each rank getting the logits of its slice. The
cross-entropy never gathers them: per position, z the logits, y the target,

    loss = log sum_v exp(z_v - m) - (z_y - m),   m = max_v z_v

needs the global max (all-reduce max), then the global sum of exponentials and
the target's logit, which lives on one rank (one all-reduce of the pair); its
gradient, softmax(z) - onehot(y), is computed from local values.

Sequence parallelism (``--sp``) splits the [b, s, h] activations outside the
regions (layer norms, dropout, residual adds), otherwise replicated, along the
sequence: f becomes an all-gather (backward a reduce-scatter) and g a
reduce-scatter (backward an all-gather), the bytes of the all-reduces they
replace. A column-parallel layer keeps only its own chunk of the gathered input
and gathers it again in backward, overlapping the input gradient's product
(Korthikanti et al. section 4.2.2). Replicated weights there (layer norms, the
position embedding) see 1/t of the positions: their gradients are summed over tp.

Activation memory per block, Korthikanti's formula in 16-bit units (a heads,
dropout masks 1 byte, the s x s attention scores kept):

    tp only   s*b*h*(10 + 24/t + 5*a*s/(h*t))
    tp + sp   s*b*h*(34/t + 5*a*s/(h*t))

This model in fp32 with dropout 0 saves exactly twice those terms less the two
1-byte masks, with a fused attention kernel's output and log-sum-exp (b*a*s)
instead of the scores, plus the layer norms' mean and 1/std (b*s each, two norms):

    tp only   s*b*h*(16 + 48/t) + 4*b*s*(4 + a/t)     bytes
    tp + sp   s*b*h*64/t        + 4*b*s*(4 + a)/t     bytes

that is 4 replicated elements per position and feature (the two norms'
inputs, the qkv and fc inputs: Korthikanti's 10 less the masks) and 12 split
ones (qkv output 3, attention output 1, which is also the projection's input,
fc output 4, GELU output 4: his 24); with sp every one of them is split.
tests/test_tensor.py measures these exactly with the memory ledger's meter.

The plan is data: a family's spec (models/spec.py) names, by module path, what
each part of its plain model becomes; `parallelize_tensor` cuts the full model, built
with the same seed as on one device, so a tp run starts from exactly its weights.

Dropout randomness. Without sp, activations outside the regions are replicated
and their masks must agree, so the trainer seeds every tp rank alike; inside a
region each rank holds different heads and draws its own masks (`RegionRNG`)
from a seed drawn from the shared stream, which recomputation replays. With sp
every activation is split (by heads or by positions), so every tp rank is simply
seeded differently.
"""

from __future__ import annotations

import fnmatch
import inspect
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd import Function

from scaletrain.data.batches import IGNORE_INDEX
from scaletrain.models.spec import (
    Column,
    PositionEmbedding,
    Region,
    Row,
    TensorPlan,
    VocabEmbedding,
    VocabHead,
)
from scaletrain.optim.clip import clip_grad_norm_
from scaletrain.parallel.pipeline.weight_grad import WeightGradStore, linear
from scaletrain.parallel.tensor_plan_checks import check_tensor_plan
from scaletrain.runtime.autograd import (
    all_reduced,
    copy_to_group,
    gather_sequence,
    reduce_from_group,
    scatter_sequence,
)
from scaletrain.runtime.comm import Comm
from scaletrain.runtime.mesh import Group
from scaletrain.runtime.rng import reseed
from scaletrain.techniques.fp8 import Float8

# -- how a weight is split -----------------------------------------------------


def split_sizes(n: int, ranks: int) -> tuple[int, ...]:
    """n split as evenly as possible, the first n % ranks ranks one larger."""
    return tuple(n // ranks + (r < n % ranks) for r in range(ranks))


@dataclass(frozen=True)
class Split:
    """A weight cut along ``dim``, which holds ``parts`` equal blocks (the fused
    q, k, v of an attention projection), each block cut across the ranks by
    ``sizes``: rank r holds, of every block, the slice ``[sum(sizes[:r]), +sizes[r])``."""

    full_shape: tuple[int, ...]
    dim: int
    parts: int
    sizes: tuple[int, ...]

    @property
    def block(self) -> int:
        return self.full_shape[self.dim] // self.parts

    def start(self, rank: int) -> int:
        return sum(self.sizes[:rank])

    def chunks(self, rank: int) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
        """Rank ``rank``'s pieces: (offsets in the full tensor, sizes, start in its local tensor)."""
        pieces = []
        for part in range(self.parts):
            offsets = [0] * len(self.full_shape)
            offsets[self.dim] = part * self.block + self.start(rank)
            sizes = list(self.full_shape)
            sizes[self.dim] = self.sizes[rank]
            pieces.append((tuple(offsets), tuple(sizes), part * self.sizes[rank]))
        return pieces

    def local(self, full: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank ``rank``'s slices of ``full``, in a tensor of their own."""
        return torch.cat([full.narrow(self.dim, offsets[self.dim], sizes[self.dim])
                          for offsets, sizes, _ in self.chunks(rank)], dim=self.dim).contiguous()


# -- randomness inside the regions ---------------------------------------------


class RegionRNG:
    """Per-rank dropout streams inside the tp regions (see the module docstring)."""

    def __init__(self, rank: int, device: torch.device):
        self.rank, self.device = rank, device
        self._saved: tuple[torch.Tensor, torch.Tensor | None] | None = None

    def _state(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        cuda = torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None
        return torch.get_rng_state(), cuda

    def enter(self) -> None:
        # Drawn from the shared stream, so equal on every tp rank and redrawn
        # identically when recomputation replays the forward.
        seed = int(torch.randint(2**62, ()).item())
        self._saved = self._state()
        reseed(seed + self.rank, self.device)

    def exit(self) -> None:
        if self._saved is None:
            return
        cpu, cuda = self._saved
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda, self.device)
        self._saved = None


# -- the layers ----------------------------------------------------------------


class _SequenceGatheredLinear(Function):
    """y = x @ w.T for an input all-gathered along the sequence; keeps only this rank's chunk
    of x for backward (none for a frozen weight) and gathers it again there."""

    @staticmethod
    def forward(ctx, x, weight, comm, group):
        y = F.linear(x, weight)  # under autocast: in its dtype
        chunk = x.shape[1] // group.size
        ctx.comm, ctx.group, ctx.dtype = comm, group, y.dtype
        mine = x.narrow(1, group.rank * chunk, chunk).to(y.dtype, copy=True) if weight.requires_grad else None
        ctx.save_for_backward(mine, weight)
        return y

    @staticmethod
    def backward(ctx, grad):
        mine, weight = ctx.saved_tensors
        if mine is None:
            return grad.to(ctx.dtype) @ weight.to(ctx.dtype), None, None, None
        comm, group = ctx.comm, ctx.group
        parts = mine.new_empty((group.size, *mine.shape))
        # every tp rank's chunk of the input, b x s/t x h each, gathered again for the weight's
        # gradient (forward kept only its own chunk); it crosses while the input's gradient computes
        pending = comm.all_gather(parts, mine, group, async_op=True)
        grad = grad.to(ctx.dtype)
        grad_x = grad @ weight.to(ctx.dtype)
        pending.wait()
        x = parts.movedim(0, 1).flatten(1, 2)
        grad_w = grad.flatten(0, -2).T @ x.flatten(0, -2)
        return grad_x, grad_w.to(weight.dtype), None, None


class _SlicedLinear(nn.Module):
    """A linear layer holding a tp slice of its weight (and of a column-parallel
    bias; a row-parallel bias stays whole, added once after the sum). Under zero
    bubble's split backward its weight gradient waits for W (``store``:
    parallel/pipeline/weight_grad.py), except where sp gathers its input."""

    defers_weight_grad = True
    adds_beside = True  # forward(x, beside): a LoRA update added where this rank's output is (finetune/lora.py)
    store: WeightGradStore | None = None
    float8: Float8 | None = None  # --precision fp8: the product in float8 (techniques/fp8.py)

    def __init__(self, weight: nn.Parameter, tp: TensorParallel, bias: nn.Parameter | None = None):
        super().__init__()
        self.weight, self.bias = weight, bias
        self.tp = tp
        self.out_features, self.in_features = weight.shape  # local sizes: the attention reads them

    def biased(self, y: torch.Tensor) -> torch.Tensor:
        return y if self.bias is None else y + self.bias

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """x @ this rank's slice of the weight: in float8 with --precision fp8, its scales from the
        slice's own largest values (techniques/fp8.py says why no amax crosses the group)."""
        return self.float8.linear(x, self.weight) if self.float8 else linear(x, self.weight, self.store)


class ColumnParallelLinear(_SlicedLinear):
    """Holds a slice of the output features; its input is whole."""

    def adapter_product(self, x: torch.Tensor, lora_A: torch.Tensor) -> torch.Tensor:
        """A LoRA adapter's ``x A^T`` (finetune/lora.py): under sp only this rank's chunk of x kept, as here."""
        sp = self.tp.sequence_parallel
        return _SequenceGatheredLinear.apply(x, lora_A, self.tp.comm, self.tp.group) if sp else x @ lora_A.t()

    def forward(self, x: torch.Tensor, beside: torch.Tensor | None = None) -> torch.Tensor:
        if not self.tp.sequence_parallel:
            y = self.biased(self.product(x))
        elif self.float8:
            y = self.biased(self.float8.sequence_gathered_linear(x, self.weight, self.tp.comm, self.tp.group))
        else:
            y = self.biased(_SequenceGatheredLinear.apply(x, self.weight, self.tp.comm, self.tp.group))
        return y if beside is None else y + beside


class RowParallelLinear(_SlicedLinear):
    """Holds a slice of the input features; its partial outputs are summed, leaving the region."""

    def forward(self, x: torch.Tensor, beside: torch.Tensor | None = None) -> torch.Tensor:
        if self.tp.rng is not None:
            self.tp.rng.exit()
        partial = self.product(x)
        return self.biased(self.tp.leave(partial if beside is None else partial + beside))


class VocabParallelHead(ColumnParallelLinear):
    """The output head: its own region, logits split by vocabulary (gathered
    whole only while generating text)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = super().forward(self.tp.enter(x))
        return self.tp.gathered_vocab(logits) if self.tp.full_logits else logits


class VocabParallelEmbedding(nn.Module):
    def __init__(self, weight: nn.Parameter, tp: TensorParallel, start: int):
        super().__init__()
        self.weight = weight
        self.tp = tp
        self.start = start

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        rows = F.embedding(local.masked_fill(outside, 0), self.weight)
        # zeros for ids outside this rank's vocabulary slice; leaving the region sums the ranks' rows
        return self.tp.leave(rows.masked_fill(outside.unsqueeze(-1), 0.0))


class SequenceShardedEmbedding(nn.Module):
    """A replicated position embedding; under sp a rank looks up only its positions."""

    def __init__(self, weight: nn.Parameter, tp: TensorParallel):
        super().__init__()
        self.weight = weight
        self.tp = tp

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        if self.tp.sequence_parallel:  # [s] or, in packed rows, [b, s]: cut along the sequence
            positions = positions.chunk(self.tp.group.size, dim=-1)[self.tp.group.rank]
        return F.embedding(positions, self.weight)


# -- the loss ------------------------------------------------------------------


class _VocabParallelCrossEntropy(Function):
    @staticmethod
    def forward(ctx, logits, targets, start, comm, group):
        z = logits.to(torch.promote_types(logits.dtype, torch.float32))  # 16-bit logits: in fp32
        top = z.max(dim=-1).values
        comm.all_reduce(top, group, op="max")  # each row's largest logit over the vocabulary slices: N floats
        z = z - top.unsqueeze(-1)
        local = targets - start
        inside = (local >= 0) & (local < z.shape[-1])
        local = local.masked_fill(~inside, 0)
        exp = z.exp()
        sums = torch.stack([exp.sum(dim=-1), z.gather(-1, local.unsqueeze(-1)).squeeze(-1) * inside])
        # each row's sum of exponentials and its target's logit (on the one rank holding it): 2N
        # floats cross, never the logits
        comm.all_reduce(sums, group)
        exp.div_(sums[0].unsqueeze(-1))  # now the softmax
        trained = targets != IGNORE_INDEX  # a masked target adds nothing, to the loss or the gradient
        ctx.save_for_backward(exp, local, inside, trained)
        ctx.dtype = logits.dtype
        return ((sums[0].log() - sums[1]) * trained).sum() / targets.shape[0]

    @staticmethod
    def backward(ctx, grad):
        softmax, local, inside, trained = ctx.saved_tensors
        grad_logits = softmax.clone()
        rows = torch.arange(local.shape[0], device=local.device)
        grad_logits[rows, local] -= inside.to(grad_logits.dtype)
        grad_logits.mul_(trained.unsqueeze(-1) * (grad / local.shape[0]))
        return grad_logits.to(ctx.dtype), None, None, None, None


# -- the transform -------------------------------------------------------------


class TensorParallel:
    """A model split over the tp group by a plan; what the trainer needs from it."""

    def __init__(self, comm: Comm, group: Group, *, sequence_parallel: bool, rng: RegionRNG | None):
        self.comm, self.group = comm, group
        self.sequence_parallel = sequence_parallel
        self.rng = rng
        self.full_logits = False
        self.splits: dict[nn.Parameter, Split] = {}
        self.partial_gradients: set[nn.Parameter] = set()  # adapters' whole factors (finetune/lora.py)
        self.vocab: Split | None = None

    # region entry and exit
    def enter(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            # every rank's [b, s/t, h] chunk gathered to [b, s, h]; backward reduce-scatters its gradient
            return gather_sequence(x, self.comm, self.group)
        # f: nothing crosses forward; backward all-reduces the input's [b, s, h] gradient
        return copy_to_group(x, self.comm, self.group)

    def leave(self, y: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            # the [b, s, h] partial sums reduce-scattered to this rank's [b, s/t, h]; backward all-gathers
            return scatter_sequence(y, self.comm, self.group)
        # g: the [b, s, h] partial sums all-reduced; nothing crosses backward
        return reduce_from_group(y, self.comm, self.group)

    def _region_entry_hook(self, first: str, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        # The region's input is the forward's first argument, by position or by its name ``first``:
        # transformers calls its attention and MLP by keyword (self_attn(hidden_states=...)).
        if args:
            args = (self.enter(args[0]), *args[1:])
        else:
            kwargs = {**kwargs, first: self.enter(kwargs[first])}
        if self.rng is not None and module.training:
            self.rng.enter()
        return args, kwargs

    def gathered_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Every rank's logits, whole (for sampling; the slices may differ by one)."""
        sizes = self.vocab.sizes
        widest = max(sizes)
        padded = F.pad(logits, (0, widest - logits.shape[-1])).contiguous()
        parts = padded.new_empty((self.group.size, *padded.shape))
        # each rank's [b, s, V/t] slice of the logits, padded to the widest, so every rank samples from all V
        self.comm.all_gather(parts, padded, self.group)
        return torch.cat([parts[r, ..., :size] for r, size in enumerate(sizes)], dim=-1)

    @contextmanager
    def generation(self) -> Iterator[None]:
        """Whole logits on every rank, and no sequence split (prompts of any length)."""
        sequence_parallel = self.sequence_parallel
        self.sequence_parallel, self.full_logits = False, True
        try:
            yield
        finally:
            self.sequence_parallel, self.full_logits = sequence_parallel, False

    # loss and gradients
    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The cross-entropy summed over the trained positions (targets not IGNORE_INDEX) and divided by
        the number of positions, from vocabulary-split logits (train/layout.py's `loss_fn`)."""
        start = self.vocab.start(self.group.rank)
        return _VocabParallelCrossEntropy.apply(logits.flatten(0, -2), targets.flatten(), start,
                                                self.comm, self.group)

    def hook_replicated_gradients(self, model: nn.Module) -> None:
        """Sum over the group the gradients of what sees part of the work: under sp a replicated weight
        (this rank's positions: the module docstring), an adapter's whole factor (finetune/lora.py)."""
        for param in model.parameters():
            partial = self.sequence_parallel or param in self.partial_gradients
            if partial and param.requires_grad and param not in self.splits:
                # its gradient from this rank's s/t positions or slice, summed over the tp group
                param.register_hook(lambda grad: all_reduced(grad, self.comm, self.group))

    def counts(self, param: nn.Parameter) -> bool:
        """Whether this rank counts ``param``'s gradient towards the model's norm
        (optim/clip.py): its own slice of a split weight, or a replicated one on tp rank 0."""
        return param in self.splits or self.group.rank == 0

    def clip_grad_norm_(self, params: Iterable[nn.Parameter], max_norm: float) -> torch.Tensor:
        """torch's clip_grad_norm_ over the whole model (the slices' squares summed over the group)."""
        params = [p for p in params if p.grad is not None]
        return clip_grad_norm_([p.grad for p in params], max_norm,
                               counted=[p.grad for p in params if self.counts(p)],
                               comm=self.comm, groups=[self.group])


def _matches(plan: TensorPlan, name: str) -> object | None:
    return next((style for pattern, style in plan if fnmatch.fnmatchcase(name, pattern)), None)


def _set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, attr, module)


def parallelize_tensor(model: nn.Module, plan: TensorPlan, comm: Comm, group: Group, *, sequence_parallel: bool,
                       dropout: float, hook_gradients: bool = True) -> TensorParallel:
    """Split ``model`` (built whole, on every rank alike) over ``group`` by ``plan``, in place.
    ``hook_gradients=False`` leaves `TensorParallel.hook_replicated_gradients` to the caller: a
    model on the meta device gets its storage later, and a tensor's hooks do not move with it."""
    check_tensor_plan(model, plan)
    rng = RegionRNG(group.rank, next(model.parameters()).device) if dropout > 0 and not sequence_parallel \
        else None
    tp = TensorParallel(comm, group, sequence_parallel=sequence_parallel, rng=rng)
    shards: dict[int, nn.Parameter] = {}  # full weight -> its shard, so a tied weight stays one

    def shard(weight: nn.Parameter, split: Split) -> nn.Parameter:
        if id(weight) not in shards:
            piece = nn.Parameter(split.local(weight.detach(), group.rank), requires_grad=weight.requires_grad)
            shards[id(weight)] = piece
            tp.splits[piece] = split
        return shards[id(weight)]

    def split_along(weight: nn.Parameter, dim: int, parts: int) -> nn.Parameter:
        """``weight`` cut along ``dim`` over the ranks, each of its ``parts`` blocks alike."""
        sizes = split_sizes(weight.shape[dim] // parts, group.size)
        return shard(weight, Split(tuple(weight.shape), dim, parts, sizes))

    for name, module in list(model.named_modules()):
        style = _matches(plan, name)
        if style is None:
            continue
        if isinstance(style, Region):
            first = next(iter(inspect.signature(module.forward).parameters))
            module.register_forward_pre_hook(partial(tp._region_entry_hook, first), with_kwargs=True)
            continue
        adapter = module if hasattr(module, "split_with_base") else None  # LoRA: its base splits, then it alike
        module, name = (adapter.base, f"{name}.base") if adapter is not None else (module, name)
        weight, bias = module.weight, getattr(module, "bias", None)
        if isinstance(style, (VocabEmbedding, VocabHead)):  # a tied pair: one split, one shard
            piece = split_along(weight, 0, 1)
            tp.vocab = tp.splits[piece]
            new = (VocabParallelEmbedding(piece, tp, tp.vocab.start(group.rank)) if isinstance(style, VocabEmbedding)
                   else VocabParallelHead(piece, tp))
        elif isinstance(style, PositionEmbedding):
            new = SequenceShardedEmbedding(weight, tp)
        elif isinstance(style, Column):
            new = ColumnParallelLinear(split_along(weight, 0, style.parts), tp,
                                       None if bias is None else split_along(bias, 0, style.parts))
        elif isinstance(style, Row):
            new = RowParallelLinear(split_along(weight, 1, 1), tp, bias)
        else:
            raise TypeError(f"unknown tensor-parallel style {style!r} for {name}")
        _set_module(model, name, new)
        if adapter is not None:
            tp.partial_gradients.add(adapter.split_with_base(isinstance(style, Column), getattr(style, "parts", 1),
                                                             split_along))
    if hook_gradients:
        tp.hook_replicated_gradients(model)
    return tp
