"""Gradient-norm clipping when the model's gradients are spread over ranks.

torch's ``clip_grad_norm_`` rule over the whole model: with ``||g||`` the
2-norm of every gradient element counted once, scale all gradients by
``min(1, max_norm / (||g|| + 1e-6))``.

Spread over a mesh, each rank holds some gradients in part (tensor-parallel
slices, ZeRO shards), some whole (a pipeline stage's layers) and some as a
copy of what another rank holds too (a layer norm every tp rank keeps, the
tied embedding on the first and the last stage, every weight across
data-parallel replicas). Each rank *counts* a set of gradients chosen so
that, over the ranks of the groups summed, every element of the model is
counted exactly once:

    ||g||^2 = sum over the ranks of groups of  sum_{counted g} ||g||^2

one all-reduce of a scalar per group (sums over the groups one after the
other are the sum over their product). Copies are scaled, not counted.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from scaletrain.runtime.comm import Comm
from scaletrain.runtime.mesh import Group


def _square_sum(grads: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    # Summed where the gradients live (host memory, when offloaded), moved once; one multi-tensor
    # kernel per device rather than one per gradient (hundreds of launches in a large model).
    squares = [torch.linalg.vector_norm(torch.stack(torch._foreach_norm(same, 2, dtype=torch.float32))).square()
               for (_, same) in _grouped(grads)]
    return torch.stack([square.to(device) for square in squares]).sum()


def _grouped(grads: Sequence[torch.Tensor]) -> list[tuple[tuple[torch.device, torch.dtype], list[torch.Tensor]]]:
    """``grads`` by (device, dtype): what one multi-tensor (foreach) kernel takes."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for g in grads:
        groups.setdefault((g.device, g.dtype), []).append(g)
    return list(groups.items())


@torch.no_grad()
def global_grad_norm(counted: Sequence[torch.Tensor], *, comm: Comm, groups: Sequence[Group],
                     device: torch.device) -> torch.Tensor:
    """The whole model's gradient norm, the same on every rank: the squares of ``counted`` (the
    gradients this rank counts, module docstring) summed over each of ``groups`` in turn. An inf or
    a NaN in any counted element, on any rank, makes it inf or NaN everywhere (train/nonfinite.py
    reads that as the step's check)."""
    total = _square_sum(counted, device)
    for group in groups:
        if group.size > 1:
            # one float per rank (its counted sum of squares), summed so every rank clips by the same norm
            comm.all_reduce(total, group)
    return total.sqrt()


def folds_scale(optimizer: torch.optim.Optimizer | None, device: torch.device) -> bool:
    """Whether ``optimizer`` can scale the gradients in the pass that steps them: torch's fused Adam
    and AdamW divide every gradient by ``optimizer.grad_scale`` as they read it (the hook torch's
    GradScaler unscales through), where every weight it steps is on ``device`` (the scale's)."""
    return (isinstance(optimizer, torch.optim.Adam) and bool(optimizer.defaults.get("fused"))
            and all(p.device == device for group in optimizer.param_groups for p in group["params"]))


@torch.no_grad()
def scale_to_norm(grads: Sequence[torch.Tensor], max_norm: float, total: torch.Tensor,
                  optimizer: torch.optim.Optimizer | None = None) -> None:
    """Scale ``grads`` by ``min(1, max_norm / (total + 1e-6))`` (nothing for an infinite ``max_norm``).
    Given ``optimizer``, one stepping exactly ``grads`` that folds the scale (``folds_scale``, which
    its caller asks once, not every step), the scale is left to the optimizer's step: one read and
    write of every gradient fewer."""
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0) if math.isfinite(max_norm) else None
    if optimizer is not None:
        optimizer.grad_scale = None if coef is None else coef.reciprocal()  # set every step: none is stale
        return
    if coef is not None:
        for (where, dtype), same in _grouped(grads):
            torch._foreach_mul_(same, coef.to(where, dtype))


def clip_grad_norm_(grads: Sequence[torch.Tensor], max_norm: float, *, counted: Sequence[torch.Tensor],
                    comm: Comm, groups: Sequence[Group], device: torch.device | None = None) -> torch.Tensor:
    """Scale ``grads`` (every gradient this rank holds) so the whole model's
    norm is at most ``max_norm``; returns the norm before clipping.
    ``counted``: the gradients this rank counts (module docstring); their
    squares are summed over each of ``groups`` in turn. ``device``: where the
    collectives run (default: the first gradient's; host gradients of an
    offloaded optimizer are summed on the accelerator)."""
    total = global_grad_norm(counted, comm=comm, groups=groups, device=device or grads[0].device)
    scale_to_norm(grads, max_norm, total)
    return total
