"""A step's memory at four points: before forward, after forward, after backward, after the step.

The four snapshots a memory lab takes of one training step, each split the way the memory
ledger splits a rank's bytes (train/memory.py):

``params``, ``grads``, ``optimizer``
    The bytes of the tensors themselves at that moment, each storage once.
``activations``
    The saved activations alive at that moment, as the ``ActivationMeter`` of the step's first
    micro-batch counts them: none before forward, the whole forward's after it, and after
    backward only what backward has not yet freed.
``cuda_allocated``, ``cuda_peak``, ``cuda_reserved`` (on a GPU)
    The allocator's figures: what is allocated now, the most allocated since the step began,
    and what the caching allocator holds from the driver (allocated plus its free blocks).

The moments, for a step of A micro-batches: before the first micro-batch's forward; between
its forward and its backward; after the last micro-batch's backward, before the gradient
synchronisation's end and the update; after the optimizer's step, before the gradients are
released. So "after forward" shows one micro-batch's activations on top of the weights and
(from the second micro-batch on) the gradients accumulating; a pipeline interleaves its
micro-batches' forwards and backwards, so it has no single "after forward" moment and that
point is left out (its saved activations' peak is the ledger's ``activations_peak``).

The step measured is the run's second (the first when the run has one step): from then on the
optimizer's state exists before forward (torch creates it lazily, in the first step), which
is the picture every later step repeats.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from scaletrain.train.memory import CATEGORIES, ActivationMeter

POINTS = ("before_forward", "after_forward", "after_backward", "after_step")
ENTRIES = (*CATEGORIES, "activations")  # what a point holds, cuda_* aside
CUDA = ("cuda_allocated", "cuda_peak", "cuda_reserved")


class StepMemory:
    """The four points of one step (module docstring), taken as the engine reaches them.

    ``ledger()`` gives the rank's bytes by entry (``Layout.bytes_ledger``); ``meter`` is the
    step's activation meter, created before its first forward."""

    def __init__(self, ledger: Callable[[], dict], meter: ActivationMeter, device: torch.device):
        self.ledger, self.meter, self.device = ledger, meter, device
        self.points: dict[str, dict[str, int]] = {}

    def take(self, point: str) -> None:
        """Record ``point`` (one of POINTS) as the rank stands now."""
        ledger = self.ledger()
        row = {name: ledger[name] for name in CATEGORIES}
        row["activations"] = self.meter.current
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            row.update(cuda_allocated=torch.cuda.memory_allocated(self.device),
                       cuda_peak=torch.cuda.max_memory_allocated(self.device),
                       cuda_reserved=torch.cuda.memory_reserved(self.device))
        self.points[point] = row


def total(row: dict[str, int]) -> int:
    """A point's tensors in all: parameters, gradients, optimizer state and saved activations."""
    return sum(row[name] for name in ENTRIES)


def format_points(points: dict[str, dict[str, int]]) -> str:
    """The points as aligned text, in MiB: one row per point, one column per entry."""
    columns = [*ENTRIES, "total",
               *(name for name in CUDA if any(name in row for row in points.values()))]
    lines = [f"{'step memory (MiB)':<18}" + "".join(f"{name:>16}" for name in columns)]
    for point in POINTS:
        if point in points:
            row = points[point] | {"total": total(points[point])}
            lines.append(f"{point:<18}" + "".join(f"{row[name] / 2**20:>16.2f}" for name in columns))
    return "\n".join(lines)
