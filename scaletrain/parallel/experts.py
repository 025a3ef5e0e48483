"""Expert parallelism: each rank of the ep group holds E/ep of every MoE layer's experts.

Lepikhin et al. 2020, "GShard" (experts sharded over devices, tokens moved
by all-to-all); Fedus et al. 2021, "Switch Transformers" section 2.2 and
appendix; Rajbhandari et al. 2022, "DeepSpeed-MoE" (expert parallelism
beside data parallelism, the dense weights replicated).

Ep rank r keeps experts [r*E/ep, (r+1)*E/ep) of every layer; the others
become empty placeholders, so the kept experts keep their names
(``blocks.{i}.moe.experts.{e}.fc.weight``), as pipeline stages do
(parallel/pipeline/partition.py). Every rank keeps the router and everything
dense, and feeds its own sequences. The plain layer routes its tokens and
groups the kept assignments by expert as on one device (models/moe.py); only
the experts' computation becomes a dispatch: the per-expert row counts are
all-gathered first, so that the two all-to-alls (to the experts' ranks and
back) carry only tokens.

ep = 2, E = 4: rank 0 holds experts 0 and 1, rank 1 experts 2 and 3. A row
is written as its expert's number.

          grouped by expert    dispatch             arrived, by source   by local expert
  rank 0  0 0 1 | 2 3   -- 0 0 1 --> rank 0 (self)   0 0 1 | 0 1          0 0 0 | 1 1
                        -- 2 3 ----> rank 1
  rank 1  0 1 | 2 2     -- 0 1 ----> rank 0          2 3 | 2 2            2 2 2 | 3
                        -- 2 2 ----> rank 1 (self)
  combine: each rank's outputs, back in arrival order, retrace the arrows.

ep = 4, E = 8: rank j holds experts 2j and 2j+1. Rank i's input is cut by
destination; block (i, j) holds i's rows for j's experts:

                 to 0    to 1    to 2    to 3
        rank 0   (0,0)   (0,1)   (0,2)   (0,3)      the diagonal stays home
        rank 1   (1,0)   (1,1)   (1,2)   (1,3)
        rank 2   (2,0)   (2,1)   (2,2)   (2,3)
        rank 3   (3,0)   (3,1)   (3,2)   (3,3)

  rank j receives column j in source order, (0,j) (1,j) (2,j) (3,j); the
  combine sends the transpose: block (i, j)'s outputs from j back to i.

Bytes, per MoE layer and micro-batch, with N_r the kept assignments rank r
routed and R_r those it received for its experts (summed over the group,
both are the group's kept assignments N), d = d_model, w the element size
(the layer's input for the dispatch, the experts' output for the combine:
16-bit under autocast):

    dispatch  input N_r x d x w        combine  input R_r x d x w
    forward: dispatch + combine; backward: the two reverse all-to-alls
    per rank  2 (N_r + R_r) x d x w    the group  4 N x d x w

(the ledger's bytes; its wire bytes leave out the diagonal blocks, the rows a
rank keeps for its own experts), plus the [ep, E] int64 counts, gathered once
in forward. The backward reuses the forward's counts.

Gradients. Routing, capacity and the balance loss are per sequence, so a
rank computes for its sequences exactly what one device computes for them.
An expert's gradient arrives complete on its rank through the combine's
backward (every rank's tokens' share), so across data-parallel replicas it is
reduced over dp only; the dense weights (router, attention, norms) saw only
this rank's tokens and are reduced over dp and ep together (``dp_ep``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from scaletrain.models.moe import moe_layers, run_experts
from scaletrain.runtime.autograd import exchange_rows
from scaletrain.runtime.comm import Comm
from scaletrain.runtime.mesh import Group


class DispatchedExperts(nn.ModuleList):
    """A layer's experts spread over the ep group: this rank's own, empty placeholders for
    the rest (names kept); ``forward(rows, counts)`` as ``Experts.forward``, by dispatch."""

    def __init__(self, experts: nn.ModuleList, comm: Comm, group: Group):
        if len(experts) % group.size:
            raise ValueError(f"{group.size} expert-parallel ranks must divide the {len(experts)} experts")
        per_rank = len(experts) // group.size
        mine = range(group.rank * per_rank, (group.rank + 1) * per_rank)
        super().__init__(expert if e in mine else nn.Module() for e, expert in enumerate(experts))
        self.comm, self.group, self.mine = comm, group, mine

    def forward(self, rows: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
        ep, per_rank = self.group.size, len(self.mine)
        table = rows.new_empty((ep, len(self)), dtype=torch.int64)  # [i, e]: rows rank i routes to expert e
        # every rank's row count per expert (ep x experts integers), so each knows what it will receive
        self.comm.all_gather(table, torch.tensor(counts, dtype=torch.int64, device=rows.device), self.group)
        to_mine = table[:, self.mine.start:self.mine.stop]  # [source, local expert]
        send = table[self.group.rank].view(ep, per_rank).sum(1).tolist()
        recv = to_mine.sum(1).tolist()
        # dispatch of the [N_r, d] rows: to rank j those for j's experts; they arrive by source, then expert
        arrived = exchange_rows(rows, send, recv, self.comm, self.group)
        local_expert = torch.arange(per_rank, device=rows.device).repeat(ep).repeat_interleave(to_mine.flatten())
        by_expert = torch.argsort(local_expert, stable=True)  # regrouped so each local expert runs once
        out = run_experts([self[e] for e in self.mine], arrived[by_expert], to_mine.sum(0).tolist())
        in_arrival_order = torch.empty_like(out).index_copy(0, by_expert, out)
        # combine: the [R_r, d] outputs go back by the reverse all-to-all, each to its row's rank and place
        return exchange_rows(in_arrival_order, recv, send, self.comm, self.group)


class ExpertParallel:
    """What expert parallelism gives the trainer: this rank's expert parameters and its
    share of the gradient norm.

    ``expert_params`` maps each of this rank's expert parameters to its name, in model
    order: membership is by identity (``param in expert_params``; a list would compare
    tensors by value) and iteration is alike on the ranks holding the same experts.
    """

    def __init__(self, group: Group, expert_params: dict[nn.Parameter, str], expert_buffers: list[torch.Tensor]):
        self.group = group
        self.expert_params = expert_params
        self.expert_buffers = expert_buffers  # a 4-bit expert's codes (finetune/nf4.py): its own, as its weights

    def counts(self, param: nn.Parameter) -> bool:
        """Whether this rank counts ``param``'s gradient towards the model's norm
        (optim/clip.py): its own experts', and a replicated one's on ep rank 0."""
        return param in self.expert_params or self.group.rank == 0

    def keep_held(self, model: nn.Module) -> None:
        """Forget the experts ``model`` no longer holds (a pipeline cut their layers away), so
        that nothing keeps their weights alive, replicates or reduces them."""
        held = {id(p) for p in (*model.parameters(), *model.buffers())}
        self.expert_params = {p: name for p, name in self.expert_params.items() if id(p) in held}
        self.expert_buffers = [b for b in self.expert_buffers if id(b) in held]


def parallelize_experts(model: nn.Module, comm: Comm, group: Group) -> ExpertParallel:
    """Spread the experts of every MoE layer of ``model`` (built whole, alike on every
    rank) over ``group``, in place."""
    layers = moe_layers(model)
    for layer in layers:
        layer.experts = DispatchedExperts(layer.experts, comm, group)
    kept = {p for layer in layers for p in layer.experts.parameters()}
    return ExpertParallel(group, {p: name for name, p in model.named_parameters() if p in kept},
                          [b for layer in layers for b in layer.experts.buffers()])
