"""Non-finite steps (``--on-nan``): seen by every rank at once, then skipped or stopped at.

A NaN or an inf anywhere (the loss of one micro-batch, one gradient on one
rank: a bad batch, an overflow, a faulty device) must lead every rank to the
same decision, or the replicas drift apart (one updates, another does not)
and every later collective mixes weights of different steps. So each rank
checks its own loss and the gradients its optimizer steps (ZeRO shards, fp32
masters, after the gradient synchronisation), and one all-reduce of a flag
(max) over the whole world gives every rank the verdict before any update:

    found = max over ranks r of  [loss_r or any g in grads_r is inf or NaN]

The gradients are checked without a pass of their own: the model's gradient
norm, which the clipping computes anyway (optim/clip.py), sums the squares of
every element of every gradient some rank counts, so an inf or a NaN in any
of them makes it inf or NaN on every rank. What no rank's norm counts (a
weight's copy that tensor parallelism replicates, on the ranks past the first;
a tied embedding's copy on the last stage) is checked apart. A norm past fp32's
range (gradients of 1e19) is read as not finite too: clipping by it would have
zeroed the step.

fp16's loss scaler finds overflows this way (techniques/precision.py: the same flag,
read from its unscaling pass). ``--on-nan skip`` applies its rule, leave
the update out, to every precision; ``--on-nan stop`` ends the run before
the update, with a report: the step, the loss, and the first parameter whose
gradient is not finite, in the order of the lowest rank that holds one.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from scaletrain.errors import JobFailed
from scaletrain.runtime.comm import Comm
from scaletrain.runtime.mesh import Group


def local_flag(loss: torch.Tensor, grads: list[torch.Tensor], norm: torch.Tensor | None = None) -> torch.Tensor:
    """1.0 where ``loss``, the gradient ``norm`` (module docstring) or any of ``grads`` holds an inf
    or a NaN, else 0.0 (on the loss's device)."""
    # Max-abs per gradient, where it lives (host memory when offloaded): inf and NaN propagate.
    peaks = [peak.to(loss.device) for peak in torch._foreach_norm(grads, math.inf)] if grads else []
    norms = [] if norm is None else [norm.to(loss.device)]
    values = torch.stack([loss.detach().float().reshape(()), *[p.float().reshape(()) for p in [*norms, *peaks]]])
    return (~torch.isfinite(values)).any().float()


def agreed_flag(flag: torch.Tensor, comm: Comm, world: Group) -> torch.Tensor:
    """1.0 on every rank where any rank raised its flag (one all-reduce of four bytes); read
    at once before the update, or later with the step's other numbers (train/step_window.py)."""
    # one float per rank, 1.0 where it saw an inf or a NaN: the max makes every rank skip or stop alike
    comm.all_reduce(flag, world, op="max")
    return flag


def first_nonfinite(named_grads: Iterable[tuple[str, torch.Tensor | None]]) -> str | None:
    """The name of the first gradient holding an inf or a NaN."""
    for name, grad in named_grads:
        if grad is not None and not bool(torch.isfinite(grad).all()):
            return name
    return None


def stop_report(step: int, loss: float, culprits: list[str | None], checkpoint: str | None) -> JobFailed:
    """The sentence a stopped run ends with, from every rank's first non-finite gradient."""
    holders = [(rank, name) for rank, name in enumerate(culprits) if name is not None]
    where = (f"the first non-finite gradient is {holders[0][1]} (rank {holders[0][0]})" if holders
             else "every gradient is finite")
    resume = f"resume from {checkpoint}" if checkpoint else "start again"
    return JobFailed(f"step {step} is not finite: the loss is {loss:g} and {where}; the run stopped before "
                     f"updating, so {resume} with a lower --lr, or train through such steps with --on-nan skip.")


def late_stop_report(step: int, loss: float, read_at: int, log_every: int, checkpoint: str | None) -> JobFailed:
    """The sentence a run stops with when its non-finite flags are read a window at a time."""
    resume = f"resume from {checkpoint}" if checkpoint else "start again"
    return JobFailed(f"step {step} is not finite: the loss is {loss:g}, read at step {read_at} with "
                     f"--log-every {log_every}, and no checkpoint was written after it, so {resume} with a "
                     f"lower --lr, with --log-every 1 to stop before the update and name the first non-finite "
                     f"gradient, or with --on-nan skip.")
