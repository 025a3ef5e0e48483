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
    t_synced     every rank at once, an all-reduce of one element in groups of 2 at each of the
                 4 points where a tensor-parallel block reduces (the spacing of the layouts whose
                 collectives are many)
    t_call       every rank at once, one such all-reduce alone

each the loop's wall time over its iterations (not a median of single ones: a
process's turn on a core spans several iterations, and only the whole loop sees
every turn), the ranks' mean:

    efficiency = min(1, turns * t_alone / t_together)      the share of `shared_cpu`'s rates reached
    sync_s     = max(0, (t_synced - t_together) / 4 - t_call)   a collective's wait inside a step

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
CALLS_PER_BLOCK = 4  # a tensor-parallel block's collectives, two forward and two backward


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
    plain, synced = (Block(shape["d_model"], shape["n_heads"]) for _ in range(2))
    x = torch.randn(1, POSITIONS, shape["d_model"], requires_grad=True)
    one = torch.zeros(1)

    def call() -> None:
        comm.all_reduce(one, group)

    _call_where_tensor_parallelism_does(synced, call)

    def loop(step: Callable[[], None], runs: bool) -> float:
        """Seconds per iteration of ``step`` on this rank, timed where ``runs``, after a barrier."""
        comm.barrier(everyone)
        if not runs:
            return 0.0
        step()  # warm
        start = time.perf_counter()
        for _ in range(iterations):
            step()
        return (time.perf_counter() - start) / iterations

    def run(block: Block) -> Callable[[], None]:
        return lambda: block(x).sum().backward()

    alone = loop(run(plain), runtime.env.rank == 0)
    times = [loop(step, True) for step in (run(plain), run(synced), call)]
    means = [sum(column) / world for column in zip(*comm.all_gather_object(times, everyone))]
    if runtime.env.rank:
        return None
    together, with_calls, one_call = means
    turns = sharing_turns(os.cpu_count() or 1, world)
    return {"processes": world, "efficiency": min(1.0, turns * alone / together),
            "sync_s": max(0.0, (with_calls - together) / CALLS_PER_BLOCK - one_call)}


def _call_where_tensor_parallelism_does(block: Block, call: Callable[[], None]) -> None:
    """``call`` at each of the block's ``CALLS_PER_BLOCK`` points where a tensor-parallel block
    reduces (parallel/tensor.py): after the attention's output and the MLP forward, before the
    gradients of their inputs backward."""
    for module in (block.out, block.mlp):
        module.register_forward_hook(lambda *_: call())
    for module in (block.qkv, block.mlp[0]):
        module.register_full_backward_hook(lambda *_: call())
