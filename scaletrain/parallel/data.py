"""Data parallelism: replicate the model, shard the batch, average gradients.

Each of the ``n`` ranks of the dp group holds the whole model and computes the
loss on its ``1/n`` slice of the global batch. Because the loss is a mean over
the batch, the global gradient is the mean of the ranks' gradients:

    g = (1/n) * sum_r g_r        (one all-reduce of the gradient bytes per step)

and every rank then takes the same optimizer step, so the replicas stay equal
(they start equal: rank 0's initialization is broadcast). A ring all-reduce
sends 2(n-1)/n times the gradient bytes per rank (Patarasuk & Yuan 2009).

This is the plain form: one flat all-reduce after the backward pass, no
overlap with computation.
"""

from __future__ import annotations

import itertools

import torch
from torch import nn

from scaletrain.dist.comm import Comm
from scaletrain.dist.mesh import Group


class DataParallel:
    def __init__(self, model: nn.Module, comm: Comm, group: Group):
        self.model = model
        self.comm = comm
        self.group = group
        with torch.no_grad():
            for tensor in itertools.chain(model.parameters(), model.buffers()):
                comm.broadcast(tensor, group, src=0)

    def sync_gradients(self) -> None:
        """Average every gradient over the dp group in one flat all-reduce."""
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        if self.group.size == 1 or not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        self.comm.all_reduce(flat, self.group, op="avg")
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
