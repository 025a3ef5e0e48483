"""Seconds per optimizer step: compute, recomputation, exposed communication, pipeline bubble.

Compute. The step's FLOPs are the trainer's MFU numerator (job/metrics.py,
the model's ``flops_per_token``: ``6N + 12*L*a*d*s`` per token, N the linear
layers' weights, grouped-query attention's narrower k and v as they are,
experts at top_k/E; models/spec.py) times the global batch's tokens, spread evenly over the
world (tp splits every matmul, pp the layers, cp the positions, dp and ep the
sequences), the matrix products' and the attention's each at its rate on the
busiest rank, plus that rank's memory-bound seconds (planner/compute.py):

    compute = F_matmul / (world * rate_matmul) + F_attention / (world * rate_attention) + memory_s

plus the launch overhead of every block of every micro-batch on the busiest
rank and the trainer's fixed cost of a step (planner/hardware.py; both
measured by ``scaletrain plan --calibrate``). Recomputation adds the forward
of what it reruns: a recomputed block's
``2*N_block + 4*a*d*s`` per token (its linear layers' weights, counted as
``flops_per_token`` counts them, and its attention), and under ``selective``
only the attention's ``4*a*d*s``; a whole block rerun also launches its
forward's operators and moves its forward's elementwise bytes again
(planner/compute.py ``FORWARD_SHARE`` of the block's).

Communication. Each collective of the step (planner/traffic.py) costs
``steps * alpha + wire_bytes / beta`` on the slowest link its group spans
(NVLink inside a node, the network across; which ranks a group holds
follows the mesh order, tp innermost: runtime/mesh.py). ``steps`` is the ring
algorithm's message count: ``2(n-1)`` for an all-reduce, ``n-1`` for the
other collectives, one per point-to-point message. What the step waits for:

    dp, ZeRO reduce-scatters     overlap the last micro-batch's backward (bucketed, launched as
                                 gradients complete): only what exceeds it is exposed, and at
                                 least the last bucket
    ZeRO-3 all-gathers           prefetched one unit ahead: overlap the forward and backward
    ring attention (cp)          the next hop is sent before the current block is computed
    everything else              exposed: tp's collectives sit between the layers that need
                                 them, the pipeline's hops between stages, all-to-alls between
                                 the router and the experts, ZeRO-1/2's parameter all-gather
                                 after the optimizer step

Bubble. The pipeline's schedule (schedules.py) is simulated with forward,
input-gradient and weight-gradient costs 1 : 1 : 1; the idle share ``beta``
of the simulated round stretches the busy time to ``busy / (1 - beta)``.

A CPU (planner/hardware.py `shared_cpu`) hides no collective (gloo's copies and
transfers need the cores the compute uses), and where a node's processes
outnumber its cores the bubble is free: a rank that waits lends its core to one
that computes. Each call there also waits ``sync_s`` for its group's processes to
take their turns and reach it (planner/calibrate_sharing.py).
"""

from __future__ import annotations

import functools

from scaletrain.config import Config
from scaletrain.parallel.pipeline.schedules import bubble, build, simulate
from scaletrain.planner.compute import Clock
from scaletrain.planner.hardware import Cluster
from scaletrain.planner.traffic import Groups
from scaletrain.runtime.mesh import ParallelDims

_MESSAGES = {"all_reduce": lambda n: 2 * (n - 1), "all_gather": lambda n: n - 1,
             "reduce_scatter": lambda n: n - 1, "all_to_all": lambda n: n - 1,
             "broadcast": lambda n: n - 1, "send": lambda n: 1, "recv": lambda n: 0}
OVERLAPPED_WITH_BACKWARD = ("all_reduce", "reduce_scatter")  # on the data-parallel groups


@functools.lru_cache(maxsize=1024)
def bubble_share(schedule: str, pp: int, microbatches: int, virtual: int) -> float:
    """The idle share of a simulated round of ``schedule``."""
    if pp == 1:
        return 0.0
    return bubble(simulate(build(schedule, pp, microbatches, virtual)))


@functools.lru_cache(maxsize=4096)
def spans_nodes(dims: ParallelDims, group: str, gpus_per_node: int) -> bool:
    """Whether the group (by ledger name, e.g. ``dp_cp``, ``dp_shard``) of rank 0 has ranks on two nodes."""
    ranks = dims.named_group_ranks(group, 0)
    return min(ranks) // gpus_per_node != max(ranks) // gpus_per_node


def collective_seconds(traffic: dict, sizes: dict[str, int], dims: ParallelDims, cluster: Cluster) -> dict:
    """{group: seconds} of every collective in ``traffic``: from the device's measured table where it
    has the operation at the group's size within a node (planner/collective_fits.py), else on its link."""
    seconds: dict[str, float] = {}
    table = cluster.device.collectives
    for op, groups in traffic.items():
        for group, entry in groups.items():
            spans = spans_nodes(dims, group, cluster.gpus_per_node)
            measured = table.lookup(op, sizes[group]) if table is not None and not spans else None
            if measured is not None:
                seconds[group] = seconds.get(group, 0.0) + measured.seconds(entry["calls"], entry["bytes"])
                continue
            alpha, beta = cluster.link(spans)
            messages = entry["calls"] * _MESSAGES[op](sizes[group])
            seconds[group] = seconds.get(group, 0.0) + messages * alpha + entry["wire_bytes"] / beta
    return seconds


def step_seconds(cfg: Config, world: int, flops: dict[str, float], traffic: dict, groups: Groups,
                 cluster: Cluster, block_runs: float, clock: Clock) -> dict[str, float]:
    """The step's time by part (module docstring). ``flops``: ``model``, ``recompute`` and
    ``attention`` (the part of ``model`` that is attention's, which ring attention overlaps)
    FLOPs of the whole step; ``clock``: the busiest rank's rates (planner/compute.py)."""
    p, t = cfg.parallel, cfg.train
    attention_s = flops["attention"] / (clock.attention_flops_s * world)
    compute = (flops["model"] - flops["attention"]) / (clock.matmul_flops_s * world) + attention_s \
        + clock.memory_s + block_runs * cluster.device.block_overhead_s + cluster.device.step_overhead_s
    recompute = flops["recompute"] / (clock.matmul_flops_s * world)
    micro, virtual = p.pipeline_sizes()
    share = bubble_share(p.pp_schedule, p.pp, micro, virtual)
    busy = compute + recompute
    bubble_s = 0.0 if cluster.device.lends_idle_cores else busy * share / (1 - share)
    dims = cfg.parallel.mesh_dims(world)
    data_groups = {groups.dense, groups.experts, groups.zero_shard, groups.zero_replica} - {None}
    sizes = groups.sizes
    hidden_behind = {  # group -> seconds of compute its collectives can hide behind
        group: busy * (2 / 3) / (t.grad_accum * (micro if p.pp > 1 else 1)) for group in data_groups}
    exposed = 0.0
    for op, groups in traffic.items():
        for group, entry in groups.items():
            seconds = collective_seconds({op: {group: entry}}, sizes, dims, cluster)[group]
            exposed += entry["calls"] * cluster.device.sync_s
            if not cluster.device.hides_communication:
                exposed += seconds
            elif group in data_groups and op in OVERLAPPED_WITH_BACKWARD:
                last = seconds / entry["calls"]
                exposed += max(last, seconds - hidden_behind[group])
            elif group in data_groups and op == "all_gather" and p.zero == 3:
                exposed += max(seconds / entry["calls"], seconds - busy)
            elif group == "cp":
                exposed += max(0.0, seconds - attention_s)
            else:
                exposed += seconds
    return {"compute": compute, "recompute": recompute, "comm": exposed, "bubble": bubble_s,
            "step": compute + recompute + exposed + bubble_s}
