"""What the mixture-of-experts routers did in a step, for metrics.jsonl.

Per MoE layer and expert, the token assignments the experts took (summed
over the step's micro-batches and over the ranks reading different samples,
so over the global batch), the share of assignments dropped at capacity,
and the auxiliary loss (balance and z-loss, weighted) averaged like the main
loss. A balanced router gives every expert about ``tokens * top_k / E``.

A pipeline rank holds only its stages' layers, so the record has a row for
every MoE layer of the whole model (`RouterRows`, read before the cut): each
rank fills its layers' rows, and the pp group's sum completes the record,
the same on every rank, with each stage's share of the auxiliary loss added.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from scaletrain.models.moe import MoE
from scaletrain.runtime.comm import Comm
from scaletrain.runtime.mesh import Group


@dataclass(frozen=True)
class RouterRows:
    """Every MoE layer of the whole model by name, in module order (a layer's row of the
    record), and the experts of each; read from the model before any transform cuts it."""

    names: tuple[str, ...]
    experts: int

    @classmethod
    def of(cls, model: nn.Module) -> RouterRows | None:
        """The rows of ``model``'s MoE layers; None without any."""
        layers = [(name, module) for name, module in model.named_modules() if isinstance(module, MoE)]
        if not layers:
            return None
        return cls(tuple(name for name, _ in layers), layers[0][1].cfg.experts)

    def held(self, model: nn.Module) -> dict[str, MoE]:
        """The layers of ``model`` (this rank's part: names survive every transform) by name."""
        return {name: module for name, module in model.named_modules() if isinstance(module, MoE)}


@dataclass
class RoutingStats:
    tokens: torch.Tensor  # [MoE layers of the whole model, experts], assignments the experts took
    dropped: torch.Tensor  # [MoE layers of the whole model], assignments past capacity
    aux: torch.Tensor  # the auxiliary loss, summed over micro-batches / micro-batches per step
    rows: dict[MoE, int]  # each MoE layer this rank holds -> its row
    _indices: dict[tuple[int, ...], torch.Tensor] = field(default_factory=dict)  # rows of the layers `add` met

    @classmethod
    def empty(cls, rows: RouterRows, model: nn.Module, device: torch.device) -> RoutingStats:
        held = rows.held(model)
        layers = len(rows.names)
        return cls(torch.zeros(layers, rows.experts, dtype=torch.long, device=device),
                   torch.zeros(layers, dtype=torch.long, device=device), torch.zeros((), device=device),
                   {held[name]: row for row, name in enumerate(rows.names) if name in held})

    def add(self, layers: list[MoE], aux: torch.Tensor) -> None:
        """Count the micro-batch ``layers`` just routed, and its (scaled) auxiliary loss."""
        key = tuple(map(id, layers))
        if key not in self._indices:  # the rows of one set of layers, sent to the device once a step
            self._indices[key] = torch.tensor([self.rows[layer] for layer in layers], device=self.tokens.device)
        index = self._indices[key]
        self.tokens.index_add_(0, index, torch.stack([layer.tokens_per_expert for layer in layers]))
        self.dropped.index_add_(0, index, torch.stack([layer.dropped for layer in layers]))
        self.aux += aux.detach()

    def summed(self, comm: Comm, group: Group, stages: Group | None = None) -> dict:
        """The record for metrics.jsonl, summed over ``group`` (the ranks reading different samples)
        and over ``stages`` (a pipeline's pp group, whose ranks hold different layers)."""
        counts = torch.cat([self.tokens.flatten(), self.dropped])
        aux = self.aux.clone()
        if stages is not None:
            # per layer and expert the tokens taken, then per layer those dropped (ints), each layer's
            # rows filled on the rank holding it, zero elsewhere: the sum is the whole model's record
            comm.all_reduce(counts, stages)
            comm.all_reduce(aux, stages)  # one float per stage, its layers' aux loss: the model's is their sum
        # per layer and expert the tokens taken, then per layer those dropped (ints): global-batch totals
        comm.all_reduce(counts, group)
        comm.all_reduce(aux, group, op="avg")  # one float per rank, the aux loss: averaged like the main loss
        tokens, dropped = counts[:self.tokens.numel()].view_as(self.tokens), counts[self.tokens.numel():]
        return {"moe_aux": aux.item(), "moe_tokens": tokens.tolist(),
                "moe_dropped": dropped.sum().item() / max(1, tokens.sum().item() + dropped.sum().item())}
