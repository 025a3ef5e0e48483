"""``scaletrain bench allreduce``: the ring all-reduce of runtime/ring.py against the backend's.

Local workers sum float32 buffers from 4 KiB to 64 MiB, alternating call by
call between the ring and the backend's all_reduce, so that machine noise
falls on both alike. Every call starts after a barrier; a call's time is the
slowest rank's, since an all-reduce is done only when every member is, and
each size reports the median over the repeats.

Bandwidth follows the nccl-tests convention:

  algbw = S / t        busbw = algbw x 2(n-1)/n

An all-reduce of S bytes makes each rank send and receive 2(n-1)/n x S
bytes at best (see runtime/ring.py), so busbw is the rate one link carried: a
figure comparable across rank counts and against the link's own bandwidth,
where algbw would fall as ranks are added.

What to expect: on CPU with gloo both are bounded by memory copies and
loopback TCP rather than a network, so the curves flatten at a few GB/s at
most. The ring pays 2(n-1) latency steps of its own (a batch of send and
receive per step, from Python), so small messages favour the backend; at
large sizes both move the same bytes and the gap narrows to the ring's
Python between steps (its scratch buffer is kept between calls, as the data-
parallel reducer keeps it). Below about 1 MiB the times
are mostly latency and barrier skew on a busy machine, and vary run to run.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from scaletrain.bench import machine, median
from scaletrain.errors import UserError
from scaletrain.runtime.comm import Comm
from scaletrain.runtime.launch import detect_environment, init_distributed, shutdown
from scaletrain.runtime.mesh import Group, Mesh, ParallelDims
from scaletrain.runtime.ring import RingAllReduce
from scaletrain.runtime.spawn import spawn_local

KIB, MIB = 2**10, 2**20
SIZES = [4 * KIB, 16 * KIB, 64 * KIB, 256 * KIB, 1 * MIB, 4 * MIB, 16 * MIB, 64 * MIB]
OURS = "ring all-reduce (send/recv, runtime/ring.py)"


def run(nproc: int, sizes: list[int] = SIZES, repeats: int = 10, warmup: int = 2,
        plot: Path | None = None, timeout_s: float = 300) -> dict:
    """Measure both all-reduces over `nproc` local processes; the results as ``bench --json`` prints them."""
    if nproc < 2:
        raise UserError("bench allreduce needs --nproc 2 or more: an all-reduce over one process moves nothing.")
    if any(size <= 0 or size % 4 for size in sizes):
        raise UserError(f"bench allreduce sizes are bytes of float32 buffers, so positive multiples of 4; "
                        f"got {sizes}.")
    if repeats < 1:
        raise UserError(f"bench allreduce needs at least one timed repeat, got {repeats}.")
    measured = spawn_local(nproc, _worker, (sizes, repeats, warmup, timeout_s))[0]
    result = _report(nproc, measured)
    if plot is not None:
        _plot(result, measured["backend"], plot)
        result["plot"] = str(plot)
    return result


def _worker(sizes: list[int], repeats: int, warmup: int, timeout_s: float) -> dict | None:
    """One rank: every size's slowest-rank call times; rank 0 returns them."""
    env = detect_environment()
    runtime = init_distributed(env, timeout_s)
    try:
        # Each rank gets one core's worth; more threads per rank would only contend.
        torch.set_num_threads(1)
        group = Mesh.build(ParallelDims(dp=env.world_size), env.rank, env.world_size).group("world")
        comm = Comm()
        ring = RingAllReduce(comm, group)
        rows = [_measure(comm, group, ring, size, repeats, warmup) for size in sizes]
        if env.rank != 0:
            return None
        # Named here, not in the parent, so the thread count is the measuring ranks'.
        return {"machine": machine(), "backend": runtime.backend, "rows": rows}
    finally:
        shutdown(runtime)


def _measure(comm: Comm, group: Group, ring: RingAllReduce, size: int, repeats: int, warmup: int) -> dict:
    """Median over repeats of the slowest rank's time, for the ring and the backend at one size."""
    # Zeros stay zeros under summation: no overflow to inf over many calls, no denormals.
    buffer = torch.zeros(size // 4, dtype=torch.float32)
    calls = {"ours": lambda: ring(buffer, "sum"),
             "peer": lambda: comm.all_reduce(buffer, group, "sum")}
    times: dict[str, list[float]] = {name: [] for name in calls}
    for repeat in range(warmup + repeats):
        for name, call in calls.items():
            comm.barrier(group)
            start = time.perf_counter()
            call()
            elapsed = time.perf_counter() - start
            if repeat >= warmup:
                times[name].append(elapsed)
    everyone = comm.all_gather_object(times, group)
    slowest = {name: [max(rank[name][i] for rank in everyone) for i in range(repeats)] for name in calls}
    return {"bytes": size, "ours_s": median(slowest["ours"]), "peer_s": median(slowest["peer"])}


def busbw_gbps(nbytes: int, seconds: float, ranks: int) -> float:
    """Bus bandwidth in GB/s (1e9 bytes): algbw x 2(n-1)/n."""
    return nbytes / seconds * 2 * (ranks - 1) / ranks / 1e9


def _report(ranks: int, measured: dict) -> dict:
    rows = [{**row,
             "ours_busbw_gbps": busbw_gbps(row["bytes"], row["ours_s"], ranks),
             "peer_busbw_gbps": busbw_gbps(row["bytes"], row["peer_s"], ranks),
             "ratio": row["ours_s"] / row["peer_s"]}
            for row in measured["rows"]]
    largest = max(rows, key=lambda row: row["bytes"])
    return {
        "what": "allreduce",
        "machine": measured["machine"],
        "ranks": ranks,
        "ours": {"name": OURS, "median_s": largest["ours_s"], "busbw_gbps": largest["ours_busbw_gbps"]},
        "peer": {"name": f"{measured['backend']} all_reduce", "median_s": largest["peer_s"],
                 "busbw_gbps": largest["peer_busbw_gbps"]},
        "ratio": largest["ratio"],
        "sizes": rows,
        "plot": None,
    }


def size_label(nbytes: int) -> str:
    """4096 -> "4K", 1048576 -> "1M": the axis labels of message-size plots."""
    for unit, scale in (("G", 2**30), ("M", MIB), ("K", KIB)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale}{unit}"
    return str(nbytes)


def _plot(result: dict, backend: str, path: Path) -> None:
    """Bus bandwidth against message size, both all-reduces, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")  # no display: write files only
    import matplotlib.pyplot as plt

    sizes = [row["bytes"] for row in result["sizes"]]
    figure, axes = plt.subplots(figsize=(7, 4.5))
    for key, entry in (("ours", result["ours"]), ("peer", result["peer"])):
        axes.plot(sizes, [row[f"{key}_busbw_gbps"] for row in result["sizes"]], marker="o", label=entry["name"])
    axes.set_xscale("log", base=2)
    axes.set_xticks(sizes, [size_label(size) for size in sizes])
    axes.set_xlabel("message size (bytes)")
    axes.set_ylabel("bus bandwidth (GB/s)")
    axes.set_title(f"all-reduce over {result['ranks']} ranks, {backend} backend\n"
                   f"{result['machine']}", fontsize=9)
    axes.grid(True, alpha=0.3)
    axes.legend()
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, format="png", dpi=120)
    plt.close(figure)


def format_table(result: dict) -> str:
    title = (f"bench allreduce: {result['ranks']} ranks, {result['peer']['name']} vs {result['ours']['name']}, "
             f"on {result['machine']}")
    header = f"{'size':>6}{'ring ms':>11}{'backend ms':>12}{'ring GB/s':>11}{'backend GB/s':>14}{'ring/backend':>14}"
    lines = [title, header]
    for row in result["sizes"]:
        lines.append(f"{size_label(row['bytes']):>6}{row['ours_s'] * 1e3:>11.3f}{row['peer_s'] * 1e3:>12.3f}"
                     f"{row['ours_busbw_gbps']:>11.3f}{row['peer_busbw_gbps']:>14.3f}{row['ratio']:>14.2f}")
    lines.append("ms: median over repeats of the slowest rank's call; GB/s: bus bandwidth, "
                 "size / time x 2(n-1)/n.")
    if result["plot"]:
        lines.append(f"plot: {result['plot']}")
    return "\n".join(lines)
