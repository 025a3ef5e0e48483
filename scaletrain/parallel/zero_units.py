"""ZeRO's unit of sharding (parallel/zero.py): parameters flattened into one padded buffer and
split evenly over the data-parallel group, and the part of each parameter a rank's shard holds.

Of a unit of N elements over a group of g ranks, rank r keeps the S = ceil(N / g) elements
[r S, (r + 1) S) of the flat buffer (the last rank's padded), of its working weights, their
fp32 masters (none in pure bf16) and their reduced gradients; a parameter lies in one rank's shard or across
several, and each rank's `Piece` of it is what its optimizer updates. A frozen unit (ZeRO-3's share of
a fine-tune's frozen base) keeps only its working weights' shard: no gradient, master or piece.

A unit of codes (``in_bytes``: a 4-bit base's packed indices and scales, integer buffers) is a frozen
unit counted in bytes: each tensor's bytes lie in the flat uint8 buffer from an offset that is a
multiple of ``ALIGN``, and ``S`` is a multiple of ``ALIGN`` too, so no element of up to 8 bytes straddles
two shards and each rank's part of a tensor is whole elements, read back in the tensor's own dtype.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from scaletrain.runtime.comm import Pending

ALIGN = 8  # bytes: a unit of codes' offsets and shard size are multiples of the widest element


def aligned(n_bytes: int) -> int:
    """``n_bytes`` rounded up to a multiple of ``ALIGN``."""
    return -(-n_bytes // ALIGN) * ALIGN


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
    in_bytes: bool = False  # a frozen unit of integer buffers, flattened byte by byte (module docstring)

    def _width(self, i: int) -> int:
        """The flat buffer's elements per element of tensor ``i``: its bytes in a unit of codes, else 1."""
        return self.params[i].element_size() if self.in_bytes else 1

    def slot(self, buffer: torch.Tensor, i: int) -> torch.Tensor:
        """Parameter ``i``'s elements of a flat buffer of this unit, shaped like it (in its own dtype)."""
        param = self.params[i]
        view = buffer[self.offsets[i]:self.offsets[i] + param.numel() * self._width(i)]
        return view.view(param.dtype).view(param.shape) if self.in_bytes else view.view_as(param)

    def in_shard(self, buffer: torch.Tensor, i: int, owner: int) -> torch.Tensor:
        """Parameter ``i``'s elements in rank ``owner``'s shard-sized ``buffer`` (empty where it holds none)."""
        first = owner * self.shard_numel
        lo, hi = (self.offsets[i] + self._width(i) * end - first for end in self.span(i, owner))
        part = buffer[lo:hi] if hi > lo else buffer[:0]
        return part.view(self.params[i].dtype) if self.in_bytes else part

    def span(self, i: int, owner: int) -> tuple[int, int]:
        """The elements [start, stop) of parameter ``i``'s flattening that rank ``owner`` holds."""
        first, last = owner * self.shard_numel, (owner + 1) * self.shard_numel
        width = self._width(i)
        extent = self.params[i].numel() * width
        start = min(max(first - self.offsets[i], 0), extent)
        return start // width, max(start, min(last - self.offsets[i], extent)) // width


def shardable_buffers(module: nn.Module, skip: set[int] = frozenset()) -> list[torch.Tensor]:
    """The buffers of ``module``'s submodules (those whose ids are not in ``skip``) that declare
    them read-only codes ZeRO-3 may shard (a ``shardable_buffers`` tuple of names: a 4-bit base's)."""
    return [buffer for sub in module.modules() if id(sub) not in skip
            for name in getattr(sub, "shardable_buffers", ()) if (buffer := sub._buffers.get(name)) is not None]


def code_offsets(tensors: list[torch.Tensor]) -> tuple[list[int], int]:
    """A unit of codes' layout: each tensor's first byte in the flat buffer, and the bytes it spans."""
    offsets, end = [], 0
    for tensor in tensors:
        offsets.append(end)
        end = aligned(end + tensor.numel() * tensor.element_size())
    return offsets, end


def code_shard_bytes(tensors: list[torch.Tensor], n: int) -> int:
    """``S`` of a unit of codes of ``tensors`` over ``n`` ranks."""
    return aligned(-(-code_offsets(tensors)[1] // n))


@torch.no_grad()
def code_unit(module: nn.Module, tensors: list[torch.Tensor], n: int, rank: int, device: torch.device,
              read: Callable[[torch.Tensor], torch.Tensor] | None = None) -> Unit:
    """A frozen unit of ``tensors`` (integer buffers every rank holds whole, equal on all; or on the meta
    device, their values given by ``read``: a 4-bit base coded from its folder one matrix at a time,
    finetune/sliced.py) over ``n`` ranks, flattened byte by byte (module docstring); this rank keeps its
    shard, the tensors become views of the full buffer, whose storage is freed: ZeRO-3 gathers it before
    each use."""
    offsets, shard_numel = code_offsets(tensors)[0], code_shard_bytes(tensors, n)
    full = torch.zeros(shard_numel * n, dtype=torch.uint8, device=device)
    empty = full.new_zeros(0)
    unit = Unit(tensors, offsets, shard_numel, full, empty, empty, empty, empty, None, module, frozen=True,
                in_bytes=True)
    for i, tensor in enumerate(tensors):
        if tensor.is_meta:  # its values first: a meta tensor cannot take another device's storage as .data
            torch.utils.swap_tensors(tensor, read(tensor).reshape(tensor.shape))
        unit.slot(full, i).copy_(tensor)
        tensor.data = unit.slot(full, i)  # the module's own buffer objects, now views of the unit
    unit.shard = unit.master = full[rank * shard_numel:(rank + 1) * shard_numel].clone()
    full.untyped_storage().resize_(0)
    return unit


def moved_to(device: torch.device, values: torch.Tensor) -> torch.Tensor:
    """``values`` moved to ``device`` where that is another one (pinned when it is the host of a GPU, so
    that each gather's copy to the device can overlap)."""
    if device == values.device:
        return values
    pinned = device.type == "cpu" and torch.cuda.is_available()
    return torch.empty(values.shape, dtype=values.dtype, device=device, pin_memory=pinned).copy_(values)
