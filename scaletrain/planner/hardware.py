"""The machines the planner plans for: one device's arithmetic and memory,
and the links between devices.

A link moves ``b`` bytes in ``alpha + b / beta`` seconds (Hockney's alpha-beta
model): ``alpha`` the latency of one message, ``beta`` the bandwidth one
device can drive in one direction. A collective's wire bytes (runtime/comm.py:
what one rank sends under the ring algorithm) go over the slowest link its
group spans, in ``steps`` messages (a ring all-reduce of n ranks: 2(n-1)).

Figures are the vendors' datasheets, per device, dense (no sparsity):

    device   bf16 TFLOP/s  fp32*  memory  bandwidth  NVLink/dir  network/device
    A100       312         156    80 GB  2.0 TB/s   300 GB/s    25 GB/s (200 Gb/s InfiniBand)
    H100       989         495    80 GB  3.35 TB/s  450 GB/s    50 GB/s (400 Gb/s)
    H200       989         495   141 GB  4.8 TB/s   450 GB/s    50 GB/s (400 Gb/s)

(* tf32 tensor cores, as torch uses them for fp32 matmuls when allowed; the
MFU peaks of job/metrics.py.) Latencies: about 5 us within a node, 10 us
across. ``cpu`` is the machine the command runs on: its peak is measured
(a large fp32 matmul, as ``--peak-tflops measure`` does) and its "links" are
gloo over loopback TCP, whose figures were measured on this project's
two-core test machine (docs/planner.md) and are only a rough guide elsewhere.

Overhead. Every block of every micro-batch launches about a hundred kernels
(operators, on a CPU) forward and backward whatever its size; at a few
microseconds each that is ``block_overhead_s`` (0.3 ms on a GPU, 2 ms for
eager PyTorch on a CPU). It is why many small micro-batches run slower than
a few large ones of the same FLOPs.

Achievable fractions. No training step runs at the datasheet peak. A device
carries the rates its step's parts reach (planner/compute.py): its matrix
products' curve by size (planner/curves.py; a GPU without a curve of its own
reads the H200's as shares of its peak; the A100's is the H200's capped at its
published best, planner/curves.py), attention's share of the peak on the
formula's count, and its memory-bound work's share of the memory's bandwidth.
On an uncalibrated CPU every FLOP runs at ``CPU_EFFICIENCY`` (0.6) of the
measured peak (its smaller layers run far from it) and there is no separate
memory-bound term. The links' bandwidths are multiplied by 0.8 (bus bandwidth
that NCCL's all-reduce tests reach of the link's rate).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from scaletrain.errors import UserError
from scaletrain.planner.collective_fits import CollectiveTable
from scaletrain.planner.curves import A100_BF16, H200_BF16, MatmulCurve, flat

GB = 10**9


@dataclass(frozen=True)
class Device:
    """One accelerator (or the host CPU) and its links."""

    name: str
    tflops: dict[str, float]  # peak per precision: "bf16", "fp16", "fp32", "fp8" (dense, datasheet)
    memory_bytes: int
    intra_node_gbps: float  # GB/s one direction, per device (NVLink)
    inter_node_gbps: float  # GB/s per device across nodes (network)
    memory_gbps: float = 0.0  # GB/s of the device's own memory (planner/compute.py; 0: no memory-bound term)
    intra_latency_s: float = 5e-6
    inter_latency_s: float = 10e-6
    block_overhead_s: float = 3e-4  # launching one block's forward and backward kernels, per micro-batch
    step_overhead_s: float = 0.0  # the trainer's fixed cost of a step beyond its blocks (measured by calibration)
    link_efficiency: float = 0.8  # share of the link's rate a collective reaches
    matmul: MatmulCurve = H200_BF16  # the matrix products' rate by size (planner/curves.py)
    # cuDNN's flash kernels forward and backward on an H200 at head size 64: 364 and 342 TFLOP/s on the
    # causal half of the square, 0.36 of the peak; twice that on the formula's whole square
    attention_share: float = 0.72
    # context parallelism's ring attention (parallel/context.py: explicit scores, block by block) on the same
    # count; None where unmeasured: the fused kernels' share
    ring_attention_share: float | None = None
    memory_share: float = 0.68  # torch's fused AdamW moved 3.28 of the H200's 4.8 TB/s
    materialized_attention: bool = False  # scores written out, as before flash attention (planner/compute.py)
    # every collective timed on this node, per group size (planner/collective_fits.py; None: the links' figures)
    collectives: CollectiveTable | None = None
    # A CPU's collectives (gloo's copies and loopback transfers) run on the cores the compute uses: none hides
    # behind it. Where a node's processes outnumber its cores, a rank idle in a pipeline's bubble lends its core
    # to a busy one: the bubble costs no time (`shared_cpu`).
    hides_communication: bool = True
    lends_idle_cores: bool = False
    # what a collective between two computations waits, beyond its own time, for its group's processes to
    # take their turns on shared cores and reach it (planner/calibrate_sharing.py; 0 on a GPU)
    sync_s: float = 0.0


DEVICES = {
    # the A100 has no float8 tensor cores: an fp8 run's products go at its bf16 rate
    "A100": Device("A100", {"bf16": 312.0, "fp16": 312.0, "fp32": 156.0, "fp8": 312.0}, 80 * GB, 300.0, 25.0,
                   2039.0, matmul=A100_BF16),
    "H100": Device("H100", {"bf16": 989.4, "fp16": 989.4, "fp32": 494.7, "fp8": 1978.9}, 80 * GB, 450.0, 50.0,
                   3350.0),
    "H200": Device("H200", {"bf16": 989.4, "fp16": 989.4, "fp32": 494.7, "fp8": 1978.9}, 141 * GB, 450.0, 50.0,
                   4800.0),
}

# gloo over loopback on the two-core test machine: 1.27 GB/s bus bandwidth at 64 MiB
# and about 1 ms a small message (scaletrain bench allreduce --nproc 2; docs/planner.md).
# The CPU's peak is measured at planning time.
CPU_LINK_GBPS = 1.27
CPU_LATENCY_S = 1e-3
CPU_BLOCK_OVERHEAD_S = 2e-3  # eager PyTorch, ~100 operators a block forward and backward
CPU_EFFICIENCY = 0.6  # the share of the measured peak an uncalibrated CPU's training step reaches


def cpu_device(peak_tflops: float, memory_bytes: int) -> Device:
    """This machine as a device: ``peak_tflops`` measured (or given), host memory."""
    peaks = dict.fromkeys(("bf16", "fp16", "fp32", "fp8"), peak_tflops)
    return Device("cpu", peaks, memory_bytes, CPU_LINK_GBPS, CPU_LINK_GBPS, intra_latency_s=CPU_LATENCY_S,
                  inter_latency_s=CPU_LATENCY_S, block_overhead_s=CPU_BLOCK_OVERHEAD_S,
                  link_efficiency=1.0,  # a measured bus bandwidth already
                  matmul=flat(CPU_EFFICIENCY, "an assumed share of one measured product"),
                  attention_share=CPU_EFFICIENCY, hides_communication=False)


def run_threads(cores: int, processes: int) -> int:
    """The threads a run gives each of its ``processes`` processes on ``cores`` (runtime/launch.py)."""
    return max(1, cores // processes)


def sharing_turns(cores: int, processes: int) -> float:
    """How many turns the run's threads take on each core: ``processes * threads / cores``, at least 1."""
    return max(1.0, processes * run_threads(cores, processes) / cores)


def shared_cpu(device: Device, measured_threads: int, cores: int, processes: int) -> Device:
    """A CPU whose figures one process of ``measured_threads`` threads measured alone, as each of a run's
    ``processes`` processes on its ``cores`` sees it. Each process computes with its threads' share of the
    measured ones, and where the run's threads outnumber the cores they take turns on them:

        rate = measured * (threads / measured_threads) / max(1, processes * threads / cores)

    for the arithmetic and the memory traffic alike; launching a block's operators (one thread) waits its
    turn only, as does the trainer's fixed cost of a step. The processes then also lend their cores in a
    pipeline's bubble (`Device.lends_idle_cores`)."""
    threads = run_threads(cores, processes)
    turns = sharing_turns(cores, processes)
    rate = threads / measured_threads / turns
    return replace(device, tflops={name: value * rate for name, value in device.tflops.items()},
                   memory_gbps=device.memory_gbps * rate, block_overhead_s=device.block_overhead_s * turns,
                   step_overhead_s=device.step_overhead_s * turns, lends_idle_cores=turns > 1)


def contended(device: Device, efficiency: float, sync_s: float) -> Device:
    """`shared_cpu`'s device as a run of the calibration's process count measured it
    (planner/calibrate_sharing.py): every rate at ``efficiency`` of the turn-taking one, every fixed
    cost stretched alike, and each collective call waiting ``sync_s`` more."""
    return replace(device, tflops={name: value * efficiency for name, value in device.tflops.items()},
                   memory_gbps=device.memory_gbps * efficiency,
                   block_overhead_s=device.block_overhead_s / efficiency,
                   step_overhead_s=device.step_overhead_s / efficiency, sync_s=sync_s)


@dataclass(frozen=True)
class Cluster:
    """``gpus`` devices, ``gpus_per_node`` of them joined by the fast link."""

    device: Device
    gpus: int
    gpus_per_node: int

    def with_memory(self, memory_bytes: int) -> Cluster:
        return replace(self, device=replace(self.device, memory_bytes=memory_bytes))

    def link(self, spans_nodes: bool) -> tuple[float, float]:
        """(latency s, bytes/s) of the link a group uses."""
        d = self.device
        if spans_nodes:
            return d.inter_latency_s, d.inter_node_gbps * GB * d.link_efficiency
        return d.intra_latency_s, d.intra_node_gbps * GB * d.link_efficiency


SIZE_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
              "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str) -> int:
    """``--gpu-memory``'s ``80GB``, ``40GiB``, ``512MB``: decimal and binary units, a unit required
    (80 alone is ambiguous)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B)\s*", text.upper())
    if match is None or match[2] not in SIZE_UNITS or float(match[1]) <= 0:
        raise UserError(f"--gpu-memory {text!r} is not a size; write a positive number with a unit, such as "
                        f"80GB, 40GiB or 512MB.")
    return int(float(match[1]) * SIZE_UNITS[match[2]])
