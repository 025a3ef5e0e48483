"""Local SGD: every rank steps on its own gradients; the replicas are averaged every N steps.

Stich 2019, "Local SGD Converges Fast and Communicates Little"; Lin et al. 2020,
"Don't Use Large Mini-Batches, Use Local SGD". The n ranks of the dp group read
their shares of each global batch exactly as under data parallelism, but no
gradient crosses the network. Rank r holds a replica theta_r and its own
optimizer state, and with N = ``--sync-every``:

    theta_r <- opt_r(theta_r, g_r(theta_r))      every step: the local gradient, clipped by its
                                                 own norm, the local AdamW moments
    theta_r <- (1/n) sum_s theta_s               after step t when t % N == 0, and after the
                                                 run's last step

One all-reduce of the parameter bytes P every N steps, P / N per step in the
ledger, against data parallelism's P of gradients every step (wire bytes
2(n-1)/n of either). N = 1 is plain data parallelism (parallel/data.py), not
this loop with an average after every step: for SGD the two are the same
(the mean of the steps is the step of the mean gradient), but Adam divides by
each rank's own running magnitude, so an average of Adam steps is not the
Adam step of the averaged gradient.

Optimizer state stays local: the AdamW moments m_r and v_r are never
averaged, only the parameters (the tensors the optimizer steps: the fp32
master weights with ``--param-dtype bf16``, rounded into the model after the
average). Averaging the moments as well would triple the bytes of each
average; Lin et al. keep their momentum buffers local too. A checkpoint
therefore holds each rank's own moments (train/checkpoint.py), so a resumed
run continues exactly.

DiLoCo (Douillard et al. 2023, "DiLoCo: Distributed Low-Communication Training
of Language Models") is the same loop with an outer optimizer: the averaged
change Delta = theta_start - (1/n) sum_r theta_r is a pseudo-gradient for
Nesterov momentum (outer learning rate 0.7, momentum 0.9, N = 500 inner AdamW
steps). The average here is DiLoCo with outer SGD at learning rate 1 and no
momentum.

The trade-off: N times fewer bytes and averages, against replicas that drift
apart for N steps on different data, so a step is worth less than a
data-parallel one of the same global batch; the gap grows with N and with the
learning rate (Lin et al. start from data parallelism and switch later,
"post-local SGD"). Every step still meets the others once for the 4-byte loss
average and the 4-byte non-finite flag, so a slow rank still holds the others
up each step: what local SGD saves here is bandwidth, not the rendezvous.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from scaletrain.parallel.data import plan_buckets, summer
from scaletrain.runtime.comm import Comm
from scaletrain.runtime.mesh import Group


class LocalSGD:
    """The trainer's gradient-synchronisation protocol (`no_sync`, `finish_gradient_sync`,
    `zero_grad`, `gradient`, as `DataParallel` has it) with gradients left local, and the
    periodic average of ``stepped`` (the tensors the optimizer steps) over ``group``.

    ``every`` is N; ``last_step`` (the run's ``--steps``) is averaged too, so a
    run ends with one model. ``bucket_mb`` bounds the flat buffers the average
    packs the tensors into, ``allreduce`` picks the backend's sum or the ring.
    """

    def __init__(self, model: nn.Module, stepped: list[torch.Tensor], comm: Comm, group: Group, *, every: int,
                 last_step: int, bucket_mb: float = 25.0, allreduce: str = "backend"):
        if every < 2:
            raise ValueError(f"local SGD averages every N >= 2 steps (N = 1 is data parallelism), not {every}")
        self._sum = summer(comm, group, allreduce)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.group, self.every, self.last_step = group, every, last_step
        self.buckets = plan_buckets(stepped, int(bucket_mb * 2**20), None)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Every micro-batch is local already."""
        yield

    def finish_gradient_sync(self) -> None:
        """Nothing to wait for: each rank steps on its own gradient."""

    def zero_grad(self) -> None:
        for param in self.params:
            param.grad = None

    def gradient(self, param: nn.Parameter) -> torch.Tensor | None:
        return param.grad

    def gradient_buffers(self) -> list[torch.Tensor]:
        """No buckets: the gradients live in the parameters' ``.grad``."""
        return []

    def due(self, step: int) -> bool:
        """Whether the replicas are averaged after ``step`` (counted from 1)."""
        return step % self.every == 0 or step == self.last_step

    @torch.no_grad()
    def average(self) -> None:
        """theta <- (1/n) sum_r theta_r, bucket by bucket; every rank ends with the same bits."""
        for bucket in self.buckets:
            flat = torch.cat([tensor.reshape(-1) for tensor in bucket])
            self._sum(flat)
            flat.div_(self.group.size)
            for tensor, chunk in zip(bucket, flat.split([t.numel() for t in bucket])):
                tensor.copy_(chunk.view_as(tensor))

    def average_if_due(self, step: int) -> bool:
        """Average after ``step`` when the schedule says so; whether it did."""
        if not self.due(step):
            return False
        self.average()
        return True
