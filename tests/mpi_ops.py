"""Every `Comm` operation once, on inputs that depend on the rank: run over gloo by a test and over
MPI by ``mpirun -n N python -m tests.mpi_ops OUT_DIR``, which saves each rank's results and ledger
as ``OUT_DIR/rank<r>.pt`` (tests/test_mpi.py compares the two)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

from scaletrain.runtime import Comm, Group, ParallelDims
from scaletrain.runtime.ring import RingAllReduce


def _rows(sender: int, receiver: int) -> int:
    """Rows rank ``sender`` sends rank ``receiver`` in the uneven all-to-all."""
    return sender + receiver + 1


def exercise(comm: Comm, group: Group) -> dict[str, Any]:
    r, n = group.rank, group.size
    seen: dict[str, Any] = {}
    base = torch.arange(10, dtype=torch.float32) * (r + 1) + 0.5
    for op in ("sum", "avg", "max", "min"):
        tensor = base.clone()
        comm.all_reduce(tensor, group, op=op)
        seen[f"all_reduce_{op}"] = tensor
    tensor = base.clone()
    comm.all_reduce(tensor, group, op="avg", async_op=True).wait()
    seen["all_reduce_avg_async"] = tensor
    counts = torch.tensor([r, 2 * r], dtype=torch.int64)
    comm.all_reduce(counts, group)
    seen["all_reduce_int"] = counts
    scalar = torch.tensor(float(r))
    comm.all_reduce(scalar, group, op="max")
    seen["all_reduce_scalar"] = scalar

    tensor = base.clone()
    comm.broadcast(tensor, group, src=n - 1)
    seen["broadcast"] = tensor

    gathered = torch.empty(3 * n)
    comm.all_gather(gathered, torch.full((3,), float(r)), group)
    seen["all_gather"] = gathered
    for op in ("sum", "avg"):
        out = torch.empty(4)
        comm.reduce_scatter(out, torch.arange(4 * n, dtype=torch.float32) * (r + 1), group, op=op,
                            async_op=True).wait()
        seen[f"reduce_scatter_{op}"] = out

    out = torch.empty(2 * n)
    comm.all_to_all(out, torch.arange(2 * n, dtype=torch.float32) + 100 * r, group)
    seen["all_to_all"] = out
    sends = [_rows(r, j) for j in range(n)]
    receives = [_rows(i, r) for i in range(n)]
    rows = torch.cat([torch.tensor([[r, j, k] for k in range(sends[j])], dtype=torch.float32) for j in range(n)])
    out = torch.empty(sum(receives), 3)
    comm.all_to_all(out, rows, group, output_splits=receives, input_splits=sends)
    seen["all_to_all_uneven"] = out

    mine = torch.full((5,), float(r))
    if r == 0:
        comm.send(mine, group, dst=n - 1)
    if r == n - 1:
        received = torch.empty(5)
        comm.recv(received, group, src=0)
        seen["recv"] = received
    left = torch.empty(5)
    comm.batch_isend_irecv([("send", mine, (r + 1) % n), ("recv", left, (r - 1) % n)], group).wait()
    seen["ring_exchange"] = left

    long = torch.arange(1001, dtype=torch.float32) * (r + 1)
    RingAllReduce(comm, group)(long)
    seen["ring_all_reduce"] = long
    comm.barrier(group)
    seen["objects"] = comm.all_gather_object({"rank": r, "text": "x" * r}, group)
    return seen


if __name__ == "__main__":
    from scaletrain.runtime.launch import connect, detect_environment, init_distributed

    env = detect_environment()
    runtime = init_distributed(env, timeout_s=60, backend="mpi4py")
    mesh, comm = connect(runtime, ParallelDims(dp=env.world_size))
    results = exercise(comm, mesh.group("world"))
    torch.save({"results": results, "ledger": comm.ledger.to_json(), "comm": type(comm).__name__},
               Path(sys.argv[1]) / f"rank{env.rank}.pt")
