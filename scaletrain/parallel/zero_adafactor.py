"""Adafactor (Shazeer & Stern 2018; optim/adafactor.py) on ZeRO's flat shards (parallel/zero.py).

Adafactor estimates the second moment of an n x m matrix from the row and column sums of G^2,
V = R C^T / (1^T R), and clips its update U = G / sqrt(V) by the RMS of the whole matrix's U. ZeRO
gives each rank a contiguous range of the matrix's row-major flattening, which cuts rows between
ranks and holds a part of every column. What a rank lacks is small: per matrix, the sums of G^2 over
the elements the other ranks hold, by row and by column (n + m numbers), and per tensor one number,
the sum of U^2 over them. So each step takes two all-reduces over the ZeRO group, each one flat
buffer in a fixed order of the group's tensors (a rank that holds no piece of one adds zeros):

    1. every matrix's partial row and column sums of G^2 + eps1     4 (n + m) bytes a matrix
    2. every tensor's partial sum of U^2                            4 bytes a tensor

after which every rank holding a piece of a matrix keeps its whole R and C (n + m fp32 numbers,
the same on each: the factored state is not worth sharding) and computes, at its own elements,
the V and the clipped update one device computes there. The step equals one device's but for the
order of the sums; vectors keep their full statistics per element, in the shard. The updates wait
between the two all-reduces (fp32, the rank's shard: transient). The trainer's Adafactor takes the
absolute step (its learning rate from the schedule), so the relative step, which would need a third
sum (of X^2 per tensor), is not offered here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from scaletrain.optim.adafactor import Adafactor
from scaletrain.parallel.zero import ZeroDataParallel
from scaletrain.parallel.zero_experts import JointZero
from scaletrain.runtime.comm import Comm


@dataclass(frozen=True)
class _Held:
    """One piece a rank steps: its parameter's shape, where its elements start in the parameter's
    flattening, and where the parameter's sums lie in the two all-reduced buffers."""

    shape: torch.Size
    start: int
    stats: int  # first of its rows' then its columns' sums in buffer 1 (-1: a vector, which has none)
    slot: int  # its sum's place in buffer 2

    @property
    def rows(self) -> int:
        return self.shape.numel() // self.shape[-1]


class _Part:
    """The buffers' layout over one ZeRO instance's tensors, and this rank's pieces of them."""

    def __init__(self, zero: ZeroDataParallel):
        self.group = zero.group
        # the sums are taken where the pieces live (the host, offloaded), reduced where the network is
        self.device, self.network = zero.master_device, zero.device
        self.held: dict[int, _Held] = {}  # by id of the piece the optimizer steps
        self.stats_numel = self.tensors = 0
        for unit in zero.units:
            pieces = {id(piece.param): piece.tensor for piece in unit.pieces}
            for i, param in enumerate(unit.params):
                stats = self.stats_numel if param.dim() >= 2 else -1
                if param.dim() >= 2:
                    self.stats_numel += param.numel() // param.shape[-1] + param.numel() // param.shape[-2]
                if id(param) in pieces:
                    self.held[id(pieces[id(param)])] = _Held(param.shape, unit.span(i, self.group.rank)[0], stats,
                                                             self.tensors)
                self.tensors += 1


class ShardedAdafactor(Adafactor):
    """Adafactor over ``zero``'s pieces (its `optimizer_groups`), the statistics of every matrix
    completed over the ZeRO group through ``comm`` (module docstring); absolute step only."""

    # State of the whole matrix on every rank holding a piece: saved as it is, not as a shard.
    whole_state = ("row", "col")

    def __init__(self, param_groups: list[dict], lr: float, zero: ZeroDataParallel | JointZero, comm: Comm):
        super().__init__(param_groups, lr=lr)
        self.comm = comm
        self.parts = [_Part(part) for part in (zero.parts if isinstance(zero, JointZero) else [zero])]

    @staticmethod
    def _new_state(p: torch.Tensor, beta1: float | None, held: _Held) -> dict:
        state = {"step": torch.zeros((), dtype=torch.float32)}
        if held.stats >= 0:  # the whole matrix's factors, shaped as one device keeps them
            state["row"] = torch.zeros(held.shape[:-1], dtype=torch.float32, device=p.device)
            state["col"] = torch.zeros(held.shape[:-2] + held.shape[-1:], dtype=torch.float32, device=p.device)
        else:
            state["sq"] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
        if beta1 is not None:
            state["exp_avg"] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
        return state

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("the sharded Adafactor takes no closure: its step is collective")
        for part in self.parts:
            self._step_part(part)

    def _mine(self, part: _Part) -> list[tuple[dict, nn.Parameter, _Held]]:
        return [(group, p, part.held[id(p)]) for group in self.param_groups for p in group["params"]
                if id(p) in part.held and p.grad is not None]

    def _step_part(self, part: _Part) -> None:
        mine = self._mine(part)
        stats = torch.zeros(part.stats_numel, dtype=torch.float32, device=part.device)
        squares = torch.zeros(part.tensors, dtype=torch.float32, device=part.device)
        where: list[tuple[torch.Tensor, torch.Tensor] | None] = []
        for group, p, held in mine:
            g2 = p.grad.float().square().add_(group["eps1"])
            if held.stats >= 0:
                index = torch.arange(held.start, held.start + p.numel(), device=p.device)
                row, col = index // held.shape[-1], index // held.shape[-2:].numel() * held.shape[-1] \
                    + index % held.shape[-1]
                stats.index_add_(0, held.stats + row, g2)
                stats.index_add_(0, held.stats + held.rows + col, g2)
                where.append((row, col))
            else:
                where.append(None)
        if part.stats_numel:
            stats = self._summed(stats, part)  # 1: every matrix's row and column sums, whole
        updates = []
        for (group, p, held), index in zip(mine, where):
            updates.append(self._unclipped(group, p, held, stats, index))
            squares[held.slot] += updates[-1].square().sum()
        squares = self._summed(squares, part)  # 2: every tensor's sum of U^2, whole
        for (group, p, held), update in zip(mine, updates):
            rms = (squares[held.slot] / held.shape.numel()).sqrt()
            update.div_((rms / group["clip_threshold"]).clamp_(min=1.0))
            if group["beta1"] is not None:
                update = self.state[p]["exp_avg"].lerp_(update, 1.0 - group["beta1"])
            if group["weight_decay"] != 0.0:
                p.mul_(1.0 - group["lr"] * group["weight_decay"])
            p.sub_((update * group["lr"]).to(p.dtype))

    def _summed(self, values: torch.Tensor, part: _Part) -> torch.Tensor:
        """``values`` summed over the part's group (on the network's device, and back)."""
        if part.group.size == 1:
            return values
        moved = values.to(part.network)
        self.comm.all_reduce(moved, part.group)
        return moved.to(part.device)

    def _unclipped(self, group: dict, p: torch.Tensor, held: _Held, stats: torch.Tensor,
                   index: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        """U = G / sqrt(V) at this piece's elements, its statistics updated from the reduced sums."""
        if group["relative_step"]:
            raise ValueError("the sharded Adafactor takes the absolute step (module docstring)")
        state = self.state[p]
        if not state:
            state.update(self._new_state(p, group["beta1"], held))
        state["step"] += 1
        weight = state["step"].item() ** -group["decay_rate"]  # 1 - beta2_t
        g = p.grad.float()
        if index is None:
            v = state["sq"].lerp_(g.square().add_(group["eps1"]), weight)
        else:
            row, col = state["row"], state["col"]
            row.view(-1).lerp_(stats[held.stats:held.stats + held.rows], weight)
            col.view(-1).lerp_(stats[held.stats + held.rows:held.stats + held.rows + col.numel()], weight)
            matrix = index[0] // held.shape[-2]  # which matrix of a batch of them each element is in
            v = row.view(-1)[index[0]] * col.view(-1)[index[1]] / row.view(-1, held.shape[-2]).sum(-1)[matrix]
        return g / v.sqrt()
