"""What the mixture-of-experts routers did in a step, for metrics.jsonl.

Per MoE layer and expert, the token assignments the experts took (summed
over the step's micro-batches and over the ranks reading different samples,
so over the global batch), the share of assignments dropped at capacity,
and the auxiliary loss (balance and z-loss, weighted) averaged like the main
loss. A balanced router gives every expert about ``tokens * top_k / E``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from scaletrain.models.moe import MoE
from scaletrain.runtime.comm import Comm
from scaletrain.runtime.mesh import Group


@dataclass
class RoutingStats:
    tokens: torch.Tensor  # [MoE layers, experts], assignments the experts took
    dropped: torch.Tensor  # [MoE layers], assignments past capacity
    aux: torch.Tensor  # the auxiliary loss, summed over micro-batches / grad_accum

    @classmethod
    def empty(cls, layers: list[MoE], device: torch.device) -> RoutingStats:
        experts = len(layers[0].experts)
        return cls(torch.zeros(len(layers), experts, dtype=torch.long, device=device),
                   torch.zeros(len(layers), dtype=torch.long, device=device), torch.zeros((), device=device))

    def add(self, layers: list[MoE], aux: torch.Tensor) -> None:
        """Count the micro-batch the layers just routed."""
        self.tokens += torch.stack([layer.tokens_per_expert for layer in layers])
        self.dropped += torch.stack([layer.dropped for layer in layers])
        self.aux += aux.detach()

    def summed(self, comm: Comm, group: Group) -> dict:
        """The record for metrics.jsonl, summed over ``group`` (the ranks reading different samples)."""
        counts = torch.cat([self.tokens.flatten(), self.dropped])
        # per layer and expert the tokens taken, then per layer those dropped (ints): global-batch totals
        comm.all_reduce(counts, group)
        aux = self.aux.clone()
        comm.all_reduce(aux, group, op="avg")  # one float per rank, the aux loss: averaged like the main loss
        tokens, dropped = counts[:self.tokens.numel()].view_as(self.tokens), counts[self.tokens.numel():]
        return {"moe_aux": aux.item(), "moe_tokens": tokens.tolist(),
                "moe_dropped": dropped.sum().item() / max(1, tokens.sum().item() + dropped.sum().item())}
