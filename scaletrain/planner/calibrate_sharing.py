"""How a CPU's cores serve a run's N processes at once, for ``scaletrain plan --calibrate``.

planner/hardware.py `shared_cpu` lets N processes take turns on C cores at the
rates one process measured alone: each at ``threads / measured_threads / turns``
of them. Taking turns costs more than that: a process switched in finds its
caches cold and the memory's bandwidth shared, and a collective between two
computations waits until every process of its group has had its turn to reach
it. Both are measured here on a block of the default model's width
(models/ ``DEFAULT_PRESET``), its forward and backward run in a loop by

    t_alone      rank 0 alone, the others waiting
    t_together   every rank at once
    t_synced     every rank at once, an all-reduce of one element in groups of 2 after each block
    t_calls      every rank at once, the all-reduces alone

each the loop's wall time over its iterations (not a median of single ones: a
process's turn on a core spans several iterations, and only the whole loop sees
every turn), the ranks' mean:

    efficiency = min(1, turns * t_alone / t_together)      the share of `shared_cpu`'s rates reached
    sync_s     = max(0, t_synced - t_together - t_calls)   a collective's wait inside a step

(planner/hardware.py `contended` applies them to a run of the calibration's
process count; planner/step_time.py adds ``sync_s`` to every collective call).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from scaletrain.models import DEFAULT_PRESET, PRESETS
from scaletrain.planner.hardware import sharing_turns
from scaletrain.runtime.launch import DistRuntime, connect
from scaletrain.runtime.mesh import ParallelDims

POSITIONS = 512  # a CPU run's micro-batch: 4 sequences of 128


class Block(nn.Module):
    """A transformer block (norm, qkv, causal attention, output, norm, a GELU MLP, two residuals)."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norms = nn.ModuleList([nn.LayerNorm(width), nn.LayerNorm(width)])
        self.qkv, self.out = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, positions, width = x.shape
        q, k, v = (t.view(batch, positions, self.heads, -1).transpose(1, 2)
                   for t in self.qkv(self.norms[0](x)).chunk(3, dim=-1))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(attended.transpose(1, 2).reshape(batch, positions, width))
        return x + self.mlp(self.norms[1](x))


def measure(runtime: DistRuntime, iterations: int) -> dict | None:
    """{"processes", "efficiency", "sync_s"} of this CPU's ``runtime.env.world_size`` processes
    (module docstring), on rank 0; None elsewhere. Every rank calls it."""
    world = runtime.env.world_size
    pair = 2 if world % 2 == 0 else world
    mesh, comm = connect(runtime, ParallelDims(tp=pair, dp=world // pair))
    everyone, group = mesh.group("world"), mesh.group("tp")
    shape = PRESETS[DEFAULT_PRESET].presets[DEFAULT_PRESET]
    block = Block(shape["d_model"], shape["n_heads"])
    x = torch.randn(1, POSITIONS, shape["d_model"], requires_grad=True)
    one = torch.zeros(1)

    def compute() -> None:
        block(x).sum().backward()

    def synced() -> None:
        compute()
        comm.all_reduce(one, group)

    def loop(call: Callable[[], None], runs: bool) -> float:
        """Seconds per iteration of ``call`` on this rank, timed where ``runs``, after a barrier."""
        comm.barrier(everyone)
        if not runs:
            return 0.0
        call()  # warm
        start = time.perf_counter()
        for _ in range(iterations):
            call()
        return (time.perf_counter() - start) / iterations

    alone = loop(compute, runtime.env.rank == 0)
    times = [loop(call, True) for call in (compute, synced, lambda: comm.all_reduce(one, group))]
    means = [sum(column) / world for column in zip(*comm.all_gather_object(times, everyone))]
    if runtime.env.rank:
        return None
    together, with_calls, calls = means
    turns = sharing_turns(os.cpu_count() or 1, world)
    return {"processes": world, "efficiency": min(1.0, turns * alone / together),
            "sync_s": max(0.0, with_calls - together - calls)}
