"""Batch normalization under data parallelism: the statistics of the whole batch, and one
set of running statistics.

Batch normalization (Ioffe & Szegedy 2015, "Batch Normalization: Accelerating Deep Network
Training by Reducing Internal Covariate Shift") normalizes each channel c in training by the
statistics of the batch itself, over its n values of c (samples x positions):

    y = (x - mean_c) / sqrt(var_c + eps) * weight_c + bias_c
    mean_c = sum(x) / n,    var_c = sum((x - mean_c)^2) / n

and keeps running estimates, which eval mode normalizes by instead:

    running_mean <- (1 - m) * running_mean + m * mean_c
    running_var  <- (1 - m) * running_var  + m * var_c * n / (n - 1)     (unbiased)

with m the momentum, or 1/t at the t-th batch when momentum is None (a cumulative average).

Under data parallelism each rank holds only its own samples, so a plain BatchNorm normalizes
every rank's micro-batch by that micro-batch's statistics: the function trained depends on
how many ranks share the batch, and each rank's running estimates drift their own way.

`SyncedBatchNorm` (``sync_batchnorm=True``) computes the statistics of the whole
data-parallel batch, the synchronized form of Peng et al. 2018 ("MegDet: A Large Mini-Batch
Object Detector", section 3.3) and Zhang et al. 2018 ("Context Encoding for Semantic
Segmentation", section 3.3): two all-reduces over the ranks that read different samples,
first each rank's per-channel sums with its count (C + 1 values) for the global mean, then
its per-channel sums of squared deviations from that mean (C values) for the global variance.
The two passes, as one device computes them, keep the agreement with one device to rounding,
where a single pass of sum(x) and sum(x^2) would lose digits to cancellation. Every rank's
loss depends on every rank's sums, so backward all-reduces the gradients of both sums too:
4 all-reduces and 2(2C + 1) values per layer per training micro-batch.

`RunningStatistics` (always; all that is needed without ``sync_batchnorm``) makes the copies
of every running estimate equal: broadcast from the first rank of the group holding copies,
once the step's forwards are done and before each checkpoint, as torch DDP's
``broadcast_buffers=True`` does before each forward, so every replica and every checkpoint
holds rank 0's statistics, not a mix of the ranks'.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.autograd import Function
from torch.nn.modules.batchnorm import _BatchNorm, _NormBase

from scaletrain.errors import UserError
from scaletrain.runtime.autograd import all_reduced
from scaletrain.runtime.comm import Comm
from scaletrain.runtime.mesh import Group


class _SummedOverRanks(Function):
    """The sum of ``x`` over the group, forward; the sum of the gradients over the group, backward.

    Not the tensor-parallel ``reduce_from_group`` (runtime/autograd.py), whose backward is the
    identity because every rank there computes the same loss from the sum: here each rank's loss
    is its own samples', and rank r's ``x`` reaches every rank's loss through the sum, so
    d(sum of the losses)/dx_r = sum over ranks of d(loss_q)/d(sum)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Comm, group: Group) -> torch.Tensor:
        ctx.comm, ctx.group = comm, group
        return all_reduced(x, comm, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # What crosses: each rank's gradient of the summed statistics (C + 1 or C values); summed,
        # it is the gradient of all the ranks' losses, which this rank's samples fed.
        return all_reduced(grad, ctx.comm, ctx.group), None, None


class SyncedBatchNorm(_BatchNorm):
    """A BatchNorm whose training forward normalizes by, and updates its running estimates
    with, the statistics of the whole batch of ``group``'s ranks (module docstring), exactly as
    torch's BatchNorm does on one device holding that batch. Eval mode, and a group of one, is
    torch's own BatchNorm. Input [N, C, ...], as BatchNorm1d, 2d and 3d take."""

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1, affine: bool = True,
                 track_running_stats: bool = True, *, comm: Comm, group: Group,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None):
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype)
        self.comm, self.group = comm, group

    @classmethod
    def taking_over(cls, norm: _BatchNorm, comm: Comm, group: Group) -> SyncedBatchNorm:
        """A SyncedBatchNorm holding ``norm``'s own weight, bias and buffers (the same tensors,
        so an optimizer or a tied reference built on them still finds them) and its settings."""
        synced = cls(norm.num_features, norm.eps, norm.momentum, norm.affine, norm.track_running_stats,
                     comm=comm, group=group, device="meta")
        for name, tensor in [*norm.named_parameters(recurse=False), *norm.named_buffers(recurse=False)]:
            setattr(synced, name, tensor)
        return synced.train(norm.training)

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input [N, C, ...] (got {input.dim()}D input)")

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, group={self.group.name}"

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not self.training or self.group.size == 1:
            return super().forward(input)
        self._check_input_dim(input)
        factor = self._running_factor()
        channels = input.shape[1]
        dims = [0, *range(2, input.dim())]
        per_channel = (1, channels, *[1] * (input.dim() - 2))
        x = input.float()  # statistics in fp32, whatever the activations' precision
        local_count = input.numel() // channels
        # What crosses: this rank's per-channel sums and its count of values per channel (C + 1 floats);
        # summed over the ranks reading other samples, they are the whole batch's, as one device holds it.
        totals = _SummedOverRanks.apply(torch.cat([x.sum(dims), x.new_full((1,), local_count)]), self.comm,
                                        self.group)
        sums, count = totals[:-1], totals[-1].detach()
        if local_count <= 1 and count.item() <= 1:  # read only where this rank alone cannot rule it out
            raise ValueError(f"Expected more than 1 value per channel when training, got {int(count.item())} over "
                             f"the group {self.group.name} (input size {list(input.shape)})")
        mean = sums / count
        deviations = x - mean.view(per_channel)
        # What crosses: this rank's per-channel sums of squared deviations from the global mean (C floats);
        # summed, the whole batch's, for its variance.
        squares = _SummedOverRanks.apply(deviations.square().sum(dims), self.comm, self.group)
        out = deviations * torch.rsqrt(squares / count + self.eps).view(per_channel)
        if self.affine:
            out = out * self.weight.view(per_channel) + self.bias.view(per_channel)
        if self.track_running_stats:
            with torch.no_grad():
                self.running_mean.mul_(1 - factor).add_(mean.to(self.running_mean.dtype), alpha=factor)
                unbiased = squares / (count - 1)
                self.running_var.mul_(1 - factor).add_(unbiased.to(self.running_var.dtype), alpha=factor)
        return out.to(input.dtype)

    def _running_factor(self) -> float:
        """This training batch's weight in the running estimates, counting the batch (as torch's BatchNorm)."""
        if not self.track_running_stats:
            return 0.0
        self.num_batches_tracked.add_(1)
        return 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum


def synchronize_batchnorm(model: nn.Module, comm: Comm, group: Group) -> None:
    """Every BatchNorm1d, 2d and 3d inside ``model`` replaced, in place, by a `SyncedBatchNorm`
    over ``group`` (the ranks that read different samples: train/replicas.py)."""
    check_synchronizable(model)
    for parent, name, child in _batchnorms(model):
        setattr(parent, name, SyncedBatchNorm.taking_over(child, comm, group))


def _batchnorms(model: nn.Module) -> list[tuple[nn.Module, str, _BatchNorm]]:
    return [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
            if isinstance(child, _BatchNorm)]


def check_synchronizable(model: nn.Module, threaded_reduction: bool = False) -> None:
    """UserError, one sentence, where ``sync_batchnorm=True`` cannot apply: a model without
    BatchNorm, or gradients reduced on a side thread (``threaded_reduction``: the ring or a
    compressor, parallel/data.py), whose collectives on the same ranks could pass the
    synchronized backward's in another order on each rank."""
    if not _batchnorms(model):
        raise UserError("sync_batchnorm=True synchronizes BatchNorm statistics, but the model has none; drop it.")
    if threaded_reduction:
        raise UserError("sync_batchnorm=True all-reduces in backward on the ranks whose gradients allreduce='ring' "
                        "or compress reduce on a side thread, in an order the ranks would not share; use the "
                        "backend's all-reduce without compression, or drop sync_batchnorm.")


class RunningStatistics:
    """The running estimates of ``model``'s normalization layers (torch's BatchNorm and
    InstanceNorm with ``track_running_stats``; other buffers, such as rotary caches, are left
    alone), made equal over ``group``, the ranks holding copies of them (module docstring).
    Found once: a model without any pays nothing."""

    def __init__(self, model: nn.Module, comm: Comm, group: Group):
        self.comm, self.group = comm, group
        self.tensors = [tensor for module in model.modules()
                        if isinstance(module, _NormBase) and module.track_running_stats
                        for tensor in (module.running_mean, module.running_var, module.num_batches_tracked)
                        if tensor is not None]

    @torch.no_grad()
    def broadcast(self) -> None:
        """Every rank's estimates replaced by the group's first member's, in one broadcast."""
        if not self.tensors or self.group.size == 1:
            return
        # Packed as bytes, so the float estimates and the integer batch counts travel exactly, together.
        raw = [tensor.view(-1).view(torch.uint8) for tensor in self.tensors]
        flat = torch.cat(raw)
        # What crosses: member 0's running means, variances and batch counts, every layer's (their bytes);
        # every copy, and so every checkpoint, then holds one rank's statistics, not a mix of the ranks'.
        self.comm.broadcast(flat, self.group, src=0)
        if self.group.rank != 0:
            for part, received in zip(raw, flat.split([part.numel() for part in raw])):
                part.copy_(received)
