"""ZeRO's unit of sharding (parallel/zero.py): parameters flattened into one padded buffer and
split evenly over the data-parallel group, and the part of each parameter a rank's shard holds.

Of a unit of N elements over a group of g ranks, rank r keeps the S = ceil(N / g) elements
[r S, (r + 1) S) of the flat buffer (the last rank's padded), of its working weights, their
fp32 masters (none in pure bf16) and their reduced gradients; a parameter lies in one rank's shard or across
several, and each rank's `Piece` of it is what its optimizer updates. A frozen unit (ZeRO-3's share of
a fine-tune's frozen base) keeps only its working weights' shard: no gradient, master or piece.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from scaletrain.runtime.comm import Pending


@dataclass
class Piece:
    """The part of one parameter that lies in this rank's shard of its unit."""

    param: nn.Parameter  # the model's parameter
    name: str
    tensor: nn.Parameter  # what the optimizer updates: a view of the unit's master shard


@dataclass(eq=False)  # a unit is itself: compared by identity, never field by field (tensors)
class Unit:
    """Parameters flattened into one padded buffer, sharded evenly over the group (module docstring)."""

    params: list[nn.Parameter]
    offsets: list[int]  # each parameter's first element in the flat buffer
    shard_numel: int  # S
    full: torch.Tensor  # every element, working dtype; the parameters are views of it
    shard: torch.Tensor  # this rank's S elements of the working weights
    master: torch.Tensor  # the same in fp32, where the optimizer runs (`shard` itself in fp32 or pure bf16)
    grad: torch.Tensor  # this rank's S elements of the reduced gradient
    master_grad: torch.Tensor  # the same in fp32 beside the master (`grad` itself where the master is `shard`)
    grad_full: torch.Tensor | None  # stage 1: the unsharded gradients, kept across micro-batches
    module: nn.Module | None = None  # stage 3: the module whose forward uses the unit
    staging: torch.Tensor | None = None  # stages 2, 3: this micro-batch's unsharded gradients
    arrived: set[int] = field(default_factory=set)  # params whose gradient came since the last launch
    filled: set[int] = field(default_factory=set)  # stage 1: params with a gradient since zero_grad
    reduced: bool = False  # a reduce-scatter has written `grad` in this step
    launched: bool = False  # stage 1: its one reduce-scatter of the step has started
    gathered: bool = True
    gathering: Pending | None = None
    pieces: list[Piece] = field(default_factory=list)
    frozen: bool = False  # weights that do not train: gathered and freed, never reduced nor stepped

    def slot(self, buffer: torch.Tensor, i: int) -> torch.Tensor:
        """Parameter ``i``'s elements of a flat buffer of this unit, shaped like it."""
        return buffer[self.offsets[i]:self.offsets[i] + self.params[i].numel()].view_as(self.params[i])

    def in_shard(self, buffer: torch.Tensor, i: int, owner: int) -> torch.Tensor:
        """Parameter ``i``'s elements in rank ``owner``'s shard-sized ``buffer`` (empty where it holds none)."""
        first = owner * self.shard_numel
        lo, hi = (self.offsets[i] + end - first for end in self.span(i, owner))
        return buffer[lo:hi] if hi > lo else buffer[:0]

    def span(self, i: int, owner: int) -> tuple[int, int]:
        """The elements [start, stop) of parameter ``i``'s flattening that rank ``owner`` holds."""
        first, last = owner * self.shard_numel, (owner + 1) * self.shard_numel
        numel = self.params[i].numel()
        start = min(max(first - self.offsets[i], 0), numel)
        return start, max(start, min(last - self.offsets[i], numel))
