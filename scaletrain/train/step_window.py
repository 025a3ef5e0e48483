"""Reading a step's numbers without stalling the device: ``--log-every K``.

A GPU runs what the host has queued, and the host runs ahead of it. Reading
a device value on the host (``loss.item()``, ``bool(flag)``) makes the host
wait until the device has finished everything queued so far, so nothing is
queued while the host then prepares the next step: the device idles for the
host's share of every step (Python, kernel launches), a gap that is a large
part of a small model's step. PyTorch's own guide names these host syncs as
the first thing to remove from a training loop.

So the trainer keeps each step's scalars (the loss, the gradient norm, the
non-finite flag) as device tensors and reads a window of K steps in one
transfer, at the window's end: one wait per K steps instead of several per
step. ``metrics.jsonl`` still gets one record per step. Throughput is
measured over the window, from its first step's start to the read,

    tokens_per_s = K * tokens_per_step / (t_read - t_start)

because a step's host time under deferred reads measures how fast the host
queues work, not how fast the device does it. With K = 1 this is the
per-step figure, read at every step. K defaults to ``GPU_LOG_EVERY`` on a GPU,
where each read empties the device's queue, and to 1 on a CPU, where the host
does the work itself and nothing waits.

What still reads the device at every step, and why (docs/kernels.md):
fp16's loss scaler and ``--on-nan skip`` (whether to update depends on the
flag), a mixture of experts (the all-to-all sizes are the router's counts).
Under ``--on-nan stop`` with K > 1 the flag is read with the window: a
non-finite step's update is then applied and the run stops at the window's
end, which a checkpoint or an evaluation ends early, so no checkpoint ever
holds weights of a non-finite step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

GPU_LOG_EVERY = 10  # steps read at once on a GPU when --log-every is not given


def default_log_every(device: torch.device) -> int:
    """``--log-every`` when not given (module docstring)."""
    return GPU_LOG_EVERY if device.type == "cuda" else 1


@dataclass
class PendingStep:
    """One step's record: host values now, device scalars read with the window."""
    step: int
    host: dict
    device: dict[str, torch.Tensor] = field(default_factory=dict)
    nonfinite: torch.Tensor | None = None  # the world's flag, when --on-nan stop reads it late


@dataclass
class ReadStep:
    record: dict
    nonfinite: bool


class StepWindow:
    """Steps queued since the last read, and the clock since the window opened."""

    def __init__(self, every: int, tokens_per_step: int):
        self.every = every
        self.tokens_per_step = tokens_per_step
        self._pending: list[PendingStep] = []
        self._opened = time.perf_counter()

    def open_if_empty(self) -> None:
        """Start the window's clock at its first step (the time between windows is not training)."""
        if not self._pending:
            self._opened = time.perf_counter()

    def add(self, pending: PendingStep) -> None:
        self._pending.append(pending)

    def due(self, step: int) -> bool:
        """Whether the window ends after ``step`` (counted from 1)."""
        return bool(self._pending) and step % self.every == 0

    def read(self) -> list[ReadStep]:
        """Every pending step with its device values, read in one transfer; the window emptied."""
        if not self._pending:
            return []
        scalars = [value.detach().float().reshape(()) for p in self._pending
                   for value in (*p.device.values(), *([p.nonfinite] if p.nonfinite is not None else []))]
        values = iter(torch.stack(scalars).tolist() if scalars else [])
        seconds = (time.perf_counter() - self._opened) / len(self._pending)
        read = []
        for p in self._pending:
            record = {"step": p.step, **{name: next(values) for name in p.device}, **p.host}
            nonfinite = p.nonfinite is not None and next(values) > 0
            record.update(tokens_per_s=self.tokens_per_step / seconds, step_s=seconds)
            if "trained_tokens" in record:  # masked or packed data: the tokens the loss counted, per second
                record["trained_tokens_per_s"] = record["trained_tokens"] / seconds
            read.append(ReadStep(record, nonfinite))
        self._pending = []
        return read
