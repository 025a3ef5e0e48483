"""``scaletrain plan --calibrate``'s collectives: every operation the layouts use, timed on this
node's backend at each group size and over a ladder of message sizes.

The N processes of the calibration form, for each group size ``g`` that divides N
(the sizes a layout of N processes makes), the mesh ``tp = g, dp = N / g``
(runtime/mesh.py): groups of neighbouring ranks, all of them busy at once, as a
layout's tensor-parallel groups are. Each operation at each message size is
timed as ``scaletrain bench allreduce`` times its calls: every call starts after a
barrier of its group, its time is the slowest member's (a collective is done
when every member is) and the size keeps the median over the repeats. Sizes
are the ledger's bytes of one call (planner/collective_fits.py); buffers are
float32 zeros, which stay zeros under summation. A transfer (send and its
receive) is timed between the two ranks of each group of 2.

The fit of each (operation, group size) is planner/collective_fits.py's.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from scaletrain.planner.collective_fits import CollectiveFit, CollectiveTable, fit_alpha_beta
from scaletrain.runtime.comm import Comm
from scaletrain.runtime.launch import DistRuntime, connect
from scaletrain.runtime.mesh import Group, ParallelDims

OPERATIONS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send")
FLOAT_BYTES = 4


def group_sizes(world: int) -> list[int]:
    """The group sizes measured on ``world`` processes: every divisor from 2."""
    return [size for size in range(2, world + 1) if world % size == 0]


def measure(runtime: DistRuntime, messages: tuple[int, ...], repeats: int) -> dict:
    """{operation: {group size: {"bytes": [...], "seconds": [...]}}} as this rank's group saw it (each
    time its slowest member's median); every rank calls it."""
    measured: dict[str, dict[str, dict]] = {}
    for size in group_sizes(runtime.env.world_size):
        mesh, comm = connect(runtime, ParallelDims(tp=size, dp=runtime.env.world_size // size))
        group = mesh.group("tp")
        for op in OPERATIONS:
            if op == "send" and size != 2:
                continue
            rows = [_timed(comm, group, op, nbytes, repeats, runtime.device) for nbytes in messages]
            measured.setdefault(op, {})[str(size)] = {"bytes": [row[0] for row in rows],
                                                       "seconds": [row[1] for row in rows]}
    return measured


def fitted(measured: dict) -> CollectiveTable:
    """Each (operation, group size) of ``measured`` fitted to alpha-beta."""
    fits: list[tuple[str, int, CollectiveFit]] = []
    for op, sizes in measured.items():
        for size, points in sizes.items():
            fits.append((op, int(size), fit_alpha_beta(points["bytes"], points["seconds"])))
    return CollectiveTable(tuple(fits))


def _timed(comm: Comm, group: Group, op: str, nbytes: int, repeats: int, device: torch.device) -> tuple[int, float]:
    """(the ledger's bytes of one call, the median over ``repeats`` of its slowest member's time)."""
    call, ledger_bytes = _call(comm, group, op, nbytes, device)
    elapsed = repeat_times(call, device, repeats, before=lambda: comm.barrier(group))
    everyone = comm.all_gather_object(elapsed, group)
    return ledger_bytes, statistics.median(max(rank[i] for rank in everyone) for i in range(repeats))


def _call(comm: Comm, group: Group, op: str, nbytes: int, device: torch.device) -> tuple[Callable[[], None], int]:
    """One call of ``op`` over about ``nbytes`` ledger bytes (whole elements, as many as the group
    divides), and its exact ledger bytes."""
    n = group.size
    elements = max(nbytes // FLOAT_BYTES // n, 1) * n

    def zeros(count: int) -> torch.Tensor:
        return torch.zeros(count, dtype=torch.float32, device=device)

    whole, part, received = zeros(elements), zeros(elements // n), zeros(elements)
    calls = {
        "all_reduce": lambda: comm.all_reduce(whole, group),
        "all_gather": lambda: comm.all_gather(whole, part, group),
        "reduce_scatter": lambda: comm.reduce_scatter(part, whole, group),
        "all_to_all": lambda: comm.all_to_all(received, whole, group),
        "broadcast": lambda: comm.broadcast(whole, group),
        "send": lambda: comm.send(whole, group, 1) if group.rank == 0 else comm.recv(whole, group, 0),
    }
    return calls[op], elements * FLOAT_BYTES


def repeat_times(call: Callable[[], object], device: torch.device, repeats: int,
                 before: Callable[[], object] = lambda: None) -> list[float]:
    """Seconds of ``repeats`` calls, each after ``before`` and timed from an idle device to an idle
    device, after one untimed call that warms connections, buffers and kernels up."""
    elapsed = []
    for repeat in range(repeats + 1):
        before()
        _synchronize(device)
        start = time.perf_counter()
        call()
        _synchronize(device)
        if repeat:
            elapsed.append(time.perf_counter() - start)
    return elapsed


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":  # a GPU's collectives run on their stream: the clock waits for them
        torch.cuda.synchronize(device)
