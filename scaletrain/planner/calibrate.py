"""``scaletrain plan --calibrate``: this machine measured, in about a minute, into a machine profile
(planner/profile.py) that the planner's clock reads instead of a datasheet.

N processes are started as ``--nproc N`` starts a run's (runtime/spawn.py; under
mpirun with ``--backend mpi4py``, the processes mpirun started), each on its
device as a run's rank would be: its GPU with nccl, else its share of the CPU's
cores (runtime/launch.py). On GPUs every rank measures its own at once and rank
0's figures are kept; a CPU's arithmetic is measured by rank 0 alone, its
threads undisturbed, since the processes of a run share the cores in a way
planner/hardware.py `shared_cpu` computes for any number of them. Then every
rank measures the collectives together:

    matrix products   TFLOP/s of [m, k] @ [k, k] over a grid of m and k (bf16 on a GPU, fp32 on a
                      CPU): the device's MatmulCurve (planner/curves.py)
    attention         torch's scaled_dot_product_attention, causal, forward and backward, over a few
                      shapes (batch, heads, positions, head size), counted as the FLOPs formula counts
                      it: 12·a·d·s per token per layer, the whole s x s square (planner/compute.py); and
                      context parallelism's ring blocks (parallel/context.py) on the same count, in fp32
                      as the ring computes them
    memory-bound      a large add's bytes moved a second (two read, one written) and torch's AdamW
                      over a large flat fp32 tensor (fused on a GPU), 28 bytes a weight: weights and
                      both moments read and written, the gradient read
    launches          one small block (norm, qkv, causal attention, output, norm, a GELU MLP, two
                      residuals; 16 positions of width 32) forward and backward: its kernels' launch
                      and dispatch with no arithmetic to speak of, which is what a block of any size
                      pays per micro-batch beyond its FLOPs (``block_overhead_s``)
    the engine        the trainer's fixed cost of a step beyond its blocks (``step_overhead_s``,
                      planner/calibrate_engine.py: the smallest preset trained by scaletrain train)
    collectives       every operation the layouts use, at each group size and message size
                      (planner/calibrate_collectives.py), fitted to alpha-beta
    sharing           on a CPU, how its cores serve the N processes at once: the share of the
                      turn-taking rates they reach and what a collective between computations waits
                      (planner/calibrate_sharing.py)

Each figure is the median of its repeats after one warm-up call, the clock read
after the device finishes (``torch.cuda.synchronize``). ``--quick`` measures
small ladders in a few seconds (the tests' mode); its figures are only a sanity check.
"""

from __future__ import annotations

import datetime
import os
import platform
import socket
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from scaletrain.errors import UserError
from scaletrain.parallel import context
from scaletrain.paths import writable_file
from scaletrain.planner import calibrate_collectives, calibrate_sharing
from scaletrain.planner.calibrate_engine import step_overhead_s
from scaletrain.planner.calibrate_sharing import Block
from scaletrain.planner.profile import FORMAT, chosen_path, device_name, device_of, save
from scaletrain.runtime.launch import (
    check_backend,
    connect,
    detect_environment,
    init_distributed,
    shutdown,
)
from scaletrain.runtime.mesh import ParallelDims
from scaletrain.runtime.spawn import spawn_local

KIB, MIB = 2**10, 2**20
TIMEOUT_S = 600.0  # a slow rank's products may keep the others waiting at the first collective
SHARING_LOOPS = 4  # iterations of calibrate_sharing's loops per repeat of the other figures
ADAMW_BYTES = 28  # per fp32 weight: weight, exp_avg, exp_avg_sq read and written, gradient read


@dataclass(frozen=True)
class Ladders:
    """What one calibration measures (module docstring)."""

    sides: tuple[int, ...]  # m and k of the products
    attention: tuple[tuple[int, int, int, int], ...]  # (batch, heads, positions, head size)
    elements: int  # of the add's and AdamW's fp32 tensors
    messages: tuple[int, ...]  # bytes of one collective call
    repeats: int


def _ladder(smallest: int, factor: int, count: int) -> tuple[int, ...]:
    return tuple(smallest * factor**i for i in range(count))


LADDERS = {  # (on a GPU, quick)
    (False, False): Ladders((128, 256, 512, 1024, 2048), ((1, 4, 256, 64), (1, 8, 512, 64), (1, 8, 1024, 64)),
                            2**24, _ladder(4 * KIB, 4, 8), 5),
    (False, True): Ladders((64, 256), ((1, 4, 128, 32),), 2**20, _ladder(4 * KIB, 64, 3), 3),
    (True, False): Ladders(_ladder(256, 2, 6), ((8, 16, 1024, 64), (4, 16, 2048, 64), (2, 16, 4096, 128)),
                           2**27, _ladder(4 * KIB, 4, 10), 20),
    (True, True): Ladders((256, 1024, 4096), ((4, 16, 1024, 64),), 2**24, _ladder(4 * KIB, 64, 3), 5),
}


def calibrate(nproc: int | None, backend: str | None, given: str | None, quick: bool) -> tuple[dict | None, Path]:
    """Measure this machine on ``nproc`` processes (default: its GPUs, or 2 on a CPU) and write the
    profile to ``given``, else where planner/profile.py looks for it; (the profile, its path), the
    profile None on an mpirun rank other than 0."""
    env = detect_environment()
    chosen = check_backend(backend, env)
    on_gpu = chosen == "nccl"
    if chosen == "mpi4py":
        if nproc not in (None, env.world_size):
            raise UserError(f"--nproc {nproc} with --backend mpi4py: mpirun started {env.world_size} processes; "
                            f"drop --nproc, or run mpirun -n {nproc}.")
        nproc = env.world_size
    elif env.world_size > 1:
        raise UserError("plan --calibrate starts its own processes; run it with --nproc N, not under a launcher.")
    nproc = nproc or (torch.cuda.device_count() if on_gpu else 2)
    if nproc < 1 or (on_gpu and nproc > torch.cuda.device_count()):
        raise UserError(f"--nproc {nproc} is not a number of processes this machine runs with {chosen}; give 1 to "
                        f"{torch.cuda.device_count() if on_gpu else 'any number'}.")
    device = device_name(on_gpu)
    path, named_by = chosen_path(given, device, chosen)
    writable_file(named_by, path)
    started = time.perf_counter()
    request = (chosen, LADDERS[on_gpu, quick])
    measured = _worker(*request) if chosen == "mpi4py" else spawn_local(nproc, _worker, request)[0]
    if measured is None:
        return None, path
    # mpirun's variables would make the timed run one of its ranks: an MPI machine's steps go unpriced
    measured["step_overhead_s"] = 0.0 if chosen == "mpi4py" else step_overhead_s(measured["block_overhead_s"])
    machine = {"device": device, "on_gpu": on_gpu, "backend": chosen, "processes": nproc,
               "threads_per_process": measured.pop("threads"), "dtype": "bf16" if on_gpu else "fp32",
               "memory_bytes": _memory_bytes(on_gpu), "hostname": socket.gethostname(),
               "cpus": os.cpu_count(), "gpus": torch.cuda.device_count(), "torch": torch.__version__,
               "python": platform.python_version(), "date": datetime.date.today().isoformat(), "quick": quick,
               "seconds": round(time.perf_counter() - started, 1)}
    fits = calibrate_collectives.fitted(measured["collectives"]).to_json()
    profile = {"format": FORMAT, "machine": machine, **measured,
               "collectives": {"measured": measured["collectives"], "fits": fits}}
    device_of(profile)  # the figures make a device before they are written
    save(profile, path)
    return profile, path


def _memory_bytes(on_gpu: bool) -> int:
    if on_gpu:
        return torch.cuda.get_device_properties(0).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _worker(backend: str, ladders: Ladders) -> dict | None:
    """One rank: the device's figures and every collective's; rank 0 returns them."""
    env = detect_environment()
    runtime = init_distributed(env, TIMEOUT_S, backend)
    try:
        device = runtime.device
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        # GPUs are measured all at once, each its own; a CPU's processes share its cores, so rank 0
        # measures one process's threads alone while the others wait (planner/hardware.py `shared_cpu`
        # shares them out for a run of any number of processes)
        alone = device.type == "cpu"
        figures = None
        if env.rank == 0 or not alone:
            figures = {"matmul": {"sides": list(ladders.sides), "tflops": _matmul_grid(device, dtype, ladders)},
                       "attention": _attention(device, dtype, ladders), "memory": _memory(device, ladders),
                       "block_overhead_s": _block_overhead(device, dtype, ladders.repeats)}
        if alone:
            mesh, comm = connect(runtime, ParallelDims(dp=env.world_size))
            comm.barrier(mesh.group("world"))
        collectives = calibrate_collectives.measure(runtime, ladders.messages, ladders.repeats)
        sharing = calibrate_sharing.measure(runtime, ladders.repeats * SHARING_LOOPS) if alone and env.world_size > 1 \
            else None
        if env.rank:
            return None
        return {**figures, "collectives": collectives, "sharing": sharing, "threads": torch.get_num_threads(),
                "ladders": asdict(ladders)}
    finally:
        shutdown(runtime)


def _seconds(call: Callable[[], object], device: torch.device, repeats: int) -> float:
    """The median of ``repeats`` timed calls after one untimed."""
    return statistics.median(calibrate_collectives.repeat_times(call, device, repeats))


def _matmul_grid(device: torch.device, dtype: torch.dtype, ladders: Ladders) -> list[list[float]]:
    """TFLOP/s of [m, k] @ [k, k], a row per m, a column per k."""
    grid = []
    for m in ladders.sides:
        row = []
        for k in ladders.sides:
            a = torch.randn(m, k, device=device, dtype=dtype)
            b = torch.randn(k, k, device=device, dtype=dtype)
            row.append(2 * m * k * k / _seconds(lambda: a @ b, device, ladders.repeats) / 1e12)
        grid.append(row)
    return grid


def _attention(device: torch.device, dtype: torch.dtype, ladders: Ladders) -> dict:
    """Causal attention forward and backward over every shape, in TFLOP/s on the formula's count: the
    fused kernel's, and context parallelism's ring blocks' (`_ring_rank`)."""
    flops = fused_s = ring_s = 0.0
    for batch, heads, positions, head_size in ladders.attention:
        q, k, v = (torch.randn(batch, heads, positions, head_size, device=device, dtype=dtype, requires_grad=True)
                   for _ in range(3))
        grad = torch.randn(batch, heads, positions, head_size, device=device, dtype=dtype)

        def step() -> None:
            F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad)

        fused_s += _seconds(step, device, ladders.repeats)
        ring_s += 2 * _seconds(_ring_rank(q.detach(), k.detach(), v.detach(), grad), device, ladders.repeats)
        flops += 12 * heads * head_size * positions * batch * positions
    return {"shapes": [list(shape) for shape in ladders.attention], "tflops": flops / fused_s / 1e12,
            "ring_tflops": flops / ring_s / 1e12}


def _ring_rank(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad: torch.Tensor) -> Callable[[], object]:
    """One rank's blocks of ring attention over two ranks (parallel/context.py: zigzag chunks of c
    positions, the rank's 2c queries against its own 2c keys causally and against c of the other's),
    forward and backward in fp32 as the ring computes them: half the sequence's work."""
    half, chunk = q.shape[-2] // 2, q.shape[-2] // 4
    q, k, v, grad = (t[:, :, :half].float() for t in (q, k, v, grad))
    scale = q.shape[-1] ** -0.5

    def blocks() -> None:
        out, lse = context.attention_block(q, k, v, scale, causal=True)
        context.attention_block(q, k[:, :, :chunk], v[:, :, :chunk], scale, causal=False)
        delta = (grad * out).sum(dim=-1)
        context.attention_block_backward(q, k, v, grad, lse, delta, scale, causal=True)
        context.attention_block_backward(q, k[:, :, :chunk], v[:, :, :chunk], grad, lse, delta, scale, causal=False)

    return blocks


def _memory(device: torch.device, ladders: Ladders) -> dict:
    """GB/s of a large add, and of torch's AdamW step over as many weights."""
    n = ladders.elements
    a, b, out = (torch.randn(n, device=device) for _ in range(3))
    add_s = _seconds(lambda: torch.add(a, b, out=out), device, ladders.repeats)
    weights = nn.Parameter(torch.randn(n, device=device))
    weights.grad = torch.randn(n, device=device)
    optimizer = torch.optim.AdamW([weights], lr=1e-4, fused=device.type in ("cuda", "cpu"))
    adamw_s = _seconds(optimizer.step, device, ladders.repeats)
    return {"elementwise_gbps": 3 * 4 * n / add_s / 1e9, "adamw_gbps": ADAMW_BYTES * n / adamw_s / 1e9}


def _block_overhead(device: torch.device, dtype: torch.dtype, repeats: int) -> float:
    """Seconds of the small block's forward and backward (module docstring)."""
    block = Block(width=32, heads=4).to(device=device, dtype=dtype)  # too small to compute: its launches
    x = torch.randn(1, 16, 32, device=device, dtype=dtype, requires_grad=True)
    return _seconds(lambda: block(x).sum().backward(), device, max(repeats, 10))


def summary(profile: dict, path: Path) -> str:
    """The profile's figures as a few lines, and where it was written."""
    machine, matmul, memory = profile["machine"], profile["matmul"], profile["memory"]
    device = device_of(profile)
    # a CPU's peak as its one measuring process reached it, before a run's processes share it out
    peak = device.tflops[machine["dtype"]] if machine["on_gpu"] else max(map(max, matmul["tflops"]))
    lines = [f"machine profile: {path} ({machine['seconds']:.0f} s{', quick' if machine['quick'] else ''})",
             f"  {machine['device']}, {machine['backend']}, {machine['processes']} processes of "
             f"{machine['threads_per_process']} threads, torch {machine['torch']}, {machine['hostname']}",
             f"  matrix products, {machine['dtype']} TFLOP/s of [m, k] @ [k, k] (rows m, columns k):",
             "  " + "m \\ k".rjust(8) + "".join(f"{side:>9}" for side in matmul["sides"])]
    lines += ["  " + f"{m:>8}" + "".join(f"{value:>9.3g}" for value in row)
              for m, row in zip(matmul["sides"], matmul["tflops"])]
    lines += [f"  attention (causal, forward and backward, on the formula's count): "
              f"{profile['attention']['tflops']:.3g} TFLOP/s, {device.attention_share:.2f} of the peak {peak:.3g}",
              f"  memory: an add {memory['elementwise_gbps']:.1f} GB/s; AdamW {memory['adamw_gbps']:.1f} GB/s "
              f"({device.memory_share:.2f} of it)",
              f"  launches: a small block forward and backward {profile['block_overhead_s'] * 1e3:.3f} ms",
              f"  the trainer's fixed cost of a step: {profile['step_overhead_s'] * 1e3:.1f} ms",
              f"  context parallelism's ring attention: {profile['attention']['ring_tflops']:.3g} TFLOP/s"]
    sharing = profile["sharing"]
    if sharing:
        lines.append(f"  {sharing['processes']} processes on {machine['cpus']} cores: {sharing['efficiency']:.2f} of "
                     f"the turn-taking rates, a collective in a step waits {sharing['sync_s'] * 1e3:.2f} ms more")
    if device.collectives:
        lines.append("  collectives, alpha + bytes / beta:  op  group  alpha (us)  beta (GB/s of the ledger's bytes)")
        lines += [f"    {op:<15}{size:>4}{fit.alpha_s * 1e6:>12.1f}{fit.bytes_per_s / 1e9:>10.3f}"
                  for op, size, fit in device.collectives.fits]
    return "\n".join(lines)
