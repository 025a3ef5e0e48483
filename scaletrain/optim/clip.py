"""Gradient-norm clipping when the model's gradients are spread over ranks.

torch's ``clip_grad_norm_`` rule over the whole model: with ``||g||`` the
2-norm of every gradient element counted once, scale all gradients by
``min(1, max_norm / (||g|| + 1e-6))``. When a group of ranks holds the model
in parts (tensor-parallel slices, pipeline stages), each rank's sum of squares
over its own part is summed over the group with one all-reduce of a scalar;
gradients that every rank of the group holds alike (replicated norms, say) are
added once, locally, and not summed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from scaletrain.dist.comm import Comm
from scaletrain.dist.mesh import Group


def _square_sum(grads: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    norms = torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32) for g in grads])
    return torch.linalg.vector_norm(norms).square()


@torch.no_grad()
def clip_grad_norm_(grads: Sequence[torch.Tensor], max_norm: float, *, parts: Sequence[torch.Tensor],
                    replicated: Sequence[torch.Tensor], comm: Comm, group: Group) -> torch.Tensor:
    """Scale ``grads`` (every gradient this rank holds) so the whole model's
    norm is at most ``max_norm``; returns the norm before clipping. ``parts``:
    this rank's share of gradients split over ``group``; ``replicated``:
    gradients identical on every rank of it. A gradient in neither (a copy of
    one another rank counts, such as a tied weight) is scaled, not counted."""
    device = grads[0].device
    total = _square_sum(parts, device)
    comm.all_reduce(total, group)
    total = (total + _square_sum(replicated, device)).sqrt()
    if math.isfinite(max_norm):
        coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
        for g in grads:
            g.mul_(coef.to(g.device, g.dtype))
    return total
