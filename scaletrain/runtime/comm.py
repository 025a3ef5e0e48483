"""The one door to the network: every collective and point-to-point transfer
goes through `Comm`, which writes what it moved into a `Ledger`.

Ledger conventions, for a group of n ranks:

  bytes       the logical full buffer of the operation:
                all_reduce, broadcast, send, recv   the tensor
                all_gather                          the gathered output
                reduce_scatter, all_to_all          the full input
                all_gather_object                   n x the largest pickled object
                barrier                             0
  wire_bytes  what one rank sends under the ring / bandwidth-optimal algorithm:
                all_reduce                          2(n-1)/n x bytes
                all_gather, reduce_scatter,
                all_to_all, all_gather_object       (n-1)/n x bytes
                all_to_all with uneven splits       bytes less the rows it keeps for itself
                broadcast (pipelined)               (n-1)/n x bytes
                send                                bytes
                recv, barrier                       0

Operations on a group of one move nothing and record nothing.

gloo in torch 2.13 implements every operation used here, including the flat
all_gather and reduce_scatter and all_to_all, so each op moves exactly what
the ledger says; nothing falls back to a costlier substitute.

"avg" is computed as a sum followed by an exact division by n on every
backend. gloo in torch 2.13 does accept ReduceOp.AVG for floating tensors,
but older builds do not, and a backend's own average may round differently
(for example by scaling before summing); one definition everywhere keeps
parallel runs comparable with single-device runs.
"""

from __future__ import annotations

import copy
import math
import pickle
import threading
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.distributed as dist

from scaletrain.runtime.desync import Call, CollectiveTracker
from scaletrain.runtime.mesh import Group

FIELDS = ("calls", "bytes", "wire_bytes")

# (numerator, denominator) of wire_bytes / bytes as functions of the group size.
_WIRE_FRACTION: dict[str, Callable[[int], tuple[int, int]]] = {
    "all_reduce": lambda n: (2 * (n - 1), n),
    "all_gather": lambda n: (n - 1, n),
    "reduce_scatter": lambda n: (n - 1, n),
    "all_to_all": lambda n: (n - 1, n),
    "all_gather_object": lambda n: (n - 1, n),
    "broadcast": lambda n: (n - 1, n),
    "send": lambda n: (1, 1),
    "recv": lambda n: (0, 1),
    "barrier": lambda n: (0, 1),
}

_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}

# torch 2.13 renamed the flat-buffer collectives (the old names warn); older
# builds, which a GPU machine may keep, only have the old names.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def wire_bytes_of(op: str, group_size: int, nbytes: int) -> int:
    """What one rank of a group of ``group_size`` sends for ``op`` over ``nbytes`` (module docstring)."""
    numerator, denominator = _WIRE_FRACTION[op](group_size)
    return nbytes * numerator // denominator


def _format_bytes(n: int) -> str:
    units = ("B", "KiB", "MiB", "GiB", "TiB")
    power = 0
    while power < len(units) - 1 and n >= 1024 ** (power + 1):
        power += 1
    return f"{n} B" if power == 0 else f"{n / 1024**power:.2f} {units[power]}"


class Ledger:
    """Counts of calls, bytes and wire bytes per (operation, group name)."""

    def __init__(self) -> None:
        self._counts: dict[str, dict[str, dict[str, int]]] = {}
        # A communication thread (data parallelism's ring and compressors) records too.
        self._lock = threading.Lock()

    def record(self, op: str, group: Group, nbytes: int, wire_bytes: int | None = None) -> None:
        """One call of ``op`` over ``nbytes``; its wire bytes by the op's fraction of them
        unless ``wire_bytes`` gives the figure (an uneven all-to-all's depends on its splits)."""
        wire = wire_bytes_of(op, group.size, nbytes) if wire_bytes is None else wire_bytes
        with self._lock:
            entry = self._counts.setdefault(op, {}).setdefault(group.name, dict.fromkeys(FIELDS, 0))
            entry["calls"] += 1
            entry["bytes"] += nbytes
            entry["wire_bytes"] += wire

    def reset(self) -> None:
        self._counts.clear()

    def snapshot(self) -> dict[str, dict[str, dict[str, int]]]:
        """A copy of the counts, shaped like `to_json`."""
        with self._lock:
            return copy.deepcopy(self._counts)

    def since(self, before: dict[str, dict[str, dict[str, int]]]) -> dict[str, dict[str, dict[str, int]]]:
        """What was recorded after the snapshot `before`, shaped like `to_json`."""
        delta: dict[str, dict[str, dict[str, int]]] = {}
        for op, groups in self.snapshot().items():
            for name, entry in groups.items():
                old = before.get(op, {}).get(name, dict.fromkeys(FIELDS, 0))
                change = {field: entry[field] - old[field] for field in FIELDS}
                if change["calls"]:
                    delta.setdefault(op, {})[name] = change
        return delta

    def to_json(self) -> dict[str, dict[str, dict[str, int]]]:
        """{op: {group name: {"calls", "bytes", "wire_bytes"}}}."""
        return self.snapshot()

    @staticmethod
    def totals(counts: dict[str, dict[str, dict[str, int]]]) -> dict[str, int]:
        """Each field summed over every op and group of a `to_json`-shaped dict."""
        return {
            field: sum(entry[field] for groups in counts.values() for entry in groups.values())
            for field in FIELDS
        }

    @staticmethod
    def _cells(entry: dict[str, int]) -> tuple[str, str, str]:
        return str(entry["calls"]), _format_bytes(entry["bytes"]), _format_bytes(entry["wire_bytes"])

    def table(self) -> str:
        """An aligned text table of the counts, with a total row."""
        rows = [("op", "group", "calls", "bytes", "wire bytes")]
        for op in sorted(self._counts):
            for name in sorted(self._counts[op]):
                rows.append((op, name, *self._cells(self._counts[op][name])))
        rows.append(("total", "", *self._cells(self.totals(self._counts))))
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        # Names align left, numbers right.
        lines = [
            "  ".join([*(c.ljust(w) for c, w in zip(row[:2], widths[:2], strict=True)),
                       *(c.rjust(w) for c, w in zip(row[2:], widths[2:], strict=True))])
            for row in rows
        ]
        lines.insert(1, "-" * len(lines[0]))
        lines.insert(len(lines) - 1, "-" * len(lines[0]))
        return "\n".join(lines)


class Pending:
    """Handle of an asynchronous operation; `wait()` blocks until it is done.

    `finish` runs once after the transfer completes: an async "avg" divides
    there, because the sum is not there to divide before.
    """

    def __init__(self, works: Sequence[Any] = (), finish: Callable[[], Any] | None = None,
                 blocked: Callable[[], AbstractContextManager] = nullcontext):
        self._works = list(works)
        self._finish = finish
        self._blocked = blocked  # marks the wait for the desync record (Comm's tracker)

    def wait(self) -> None:
        with self._blocked():
            for work in self._works:
                work.wait()
        self._works = []
        if self._finish is not None:
            self._finish()
            self._finish = None


def _check_reduction(op: str, tensor: torch.Tensor, allowed: Sequence[str]) -> None:
    if op not in allowed:
        raise ValueError(f"unknown reduction {op!r}; use one of {list(allowed)}")
    if op == "avg" and not tensor.is_floating_point():
        raise TypeError(f"avg needs a floating-point tensor, got {tensor.dtype}")


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _check_splits(tensor: torch.Tensor, splits: Sequence[int], n: int, side: str) -> None:
    if len(splits) != n or sum(splits) != len(tensor):
        raise ValueError(
            f"all_to_all over {n} ranks needs {n} {side} splits summing to the {side}'s "
            f"{len(tensor)} rows, got {list(splits)}"
        )


def _check_parts(whole: torch.Tensor, part: torch.Tensor, n: int, op: str) -> None:
    if whole.numel() != n * part.numel():
        raise ValueError(
            f"{op} over {n} ranks needs a buffer of {n} x {part.numel()} elements, got {whole.numel()}"
        )


class Comm:
    """Collectives and point-to-point transfers over mesh `Group`s, recorded in `ledger`.

    Ranks given to an operation (src, dst, peers) are indices inside the group.
    The public methods check their arguments and write the ledger; the
    underscored ones below them move the bytes, here with torch.distributed
    over the group's process group. `MpiComm` (runtime/mpi.py) replaces only those.
    With a `tracker` (the trainer's), every call is also numbered per group
    and every wait noted, for desync detection (runtime/desync.py).
    """

    def __init__(self, ledger: Ledger | None = None, tracker: CollectiveTracker | None = None):
        self.ledger = ledger if ledger is not None else Ledger()
        self.tracker = tracker

    def _track(self, op: str, group: Group, transfer: bool = False) -> Call | None:
        """This call of ``op`` on ``group`` in the desync record (a point-to-point ``transfer``
        is noted but not numbered: the members of a group do not all take part in it)."""
        if self.tracker is None:
            return None
        return self.tracker.transfer(op, group) if transfer else self.tracker.start(op, group)

    def _blocked(self, call: Call | None) -> AbstractContextManager:
        """Around the wait for ``call``: this rank is in it until it completes."""
        return self.tracker.waiting(call) if call is not None else nullcontext()

    def _complete(self, work: Any, async_op: bool, after: Callable[[], Any] | None = None,
                  call: Call | None = None) -> Pending | None:
        pending = Pending([work] if work is not None else [], after, lambda: self._blocked(call))
        if async_op:
            return pending
        pending.wait()
        return None

    def all_reduce(self, tensor: torch.Tensor, group: Group, op: str = "sum", async_op: bool = False) -> Pending | None:
        """Reduce `tensor` in place across the group with "sum", "avg", "max" or "min"."""
        _check_reduction(op, tensor, tuple(_REDUCE_OPS))
        if group.size == 1:
            return Pending() if async_op else None
        self.ledger.record("all_reduce", group, _nbytes(tensor))
        call = self._track("all_reduce", group)
        with self._blocked(None if async_op else call):
            work = self._all_reduce(tensor, op, group, async_op)
        return self._complete(work, async_op, (lambda: tensor.div_(group.size)) if op == "avg" else None, call)

    def broadcast(self, tensor: torch.Tensor, group: Group, src: int = 0) -> None:
        """Copy `tensor` from the group's member `src` to every member."""
        if group.size == 1:
            return
        self.ledger.record("broadcast", group, _nbytes(tensor))
        with self._blocked(self._track("broadcast", group)):
            self._broadcast(tensor, group, src)

    def all_gather(
        self, output: torch.Tensor, input: torch.Tensor, group: Group, async_op: bool = False
    ) -> Pending | None:
        """Concatenate every member's `input`, in group order, into the contiguous `output`."""
        _check_parts(output, input, group.size, "all_gather")
        if group.size == 1:
            output.view(-1).copy_(input.reshape(-1))
            return Pending() if async_op else None
        self.ledger.record("all_gather", group, _nbytes(output))
        call = self._track("all_gather", group)
        with self._blocked(None if async_op else call):
            work = self._all_gather(output.view(-1), input.reshape(-1), group, async_op)
        return self._complete(work, async_op, call=call)

    def reduce_scatter(
        self, output: torch.Tensor, input: torch.Tensor, group: Group, op: str = "sum", async_op: bool = False
    ) -> Pending | None:
        """Reduce `input` across the group ("sum" or "avg"); member i keeps the i-th slice in `output`."""
        _check_reduction(op, input, ("sum", "avg"))
        _check_parts(input, output, group.size, "reduce_scatter")
        if group.size == 1:
            output.view(-1).copy_(input.reshape(-1))
            return Pending() if async_op else None
        self.ledger.record("reduce_scatter", group, _nbytes(input))
        call = self._track("reduce_scatter", group)
        with self._blocked(None if async_op else call):
            work = self._reduce_scatter(output.view(-1), input.reshape(-1), op, group, async_op)
        return self._complete(work, async_op, (lambda: output.div_(group.size)) if op == "avg" else None, call)

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, group: Group,
                   output_splits: Sequence[int] | None = None, input_splits: Sequence[int] | None = None) -> None:
        """Member i sends the j-th slice of `input` to member j, which stores it as slice i of `output`.

        Without splits the slices are n equal parts of the flat buffers. With
        them (both, or neither) they are rows along dim 0: `input_splits[j]`
        rows go to member j, `output_splits[i]` arrive from member i.
        """
        if (output_splits is None) != (input_splits is None):
            raise ValueError("all_to_all takes output_splits and input_splits together, or neither")
        if input_splits is None:
            if output.numel() != input.numel() or input.numel() % group.size:
                raise ValueError(
                    f"all_to_all over {group.size} ranks needs equal input and output sizes divisible by "
                    f"{group.size}, got {input.numel()} and {output.numel()}"
                )
        else:
            _check_splits(output, output_splits, group.size, "output")
            _check_splits(input, input_splits, group.size, "input")
        if group.size == 1:
            output.copy_(input)
            return
        wire_bytes = None
        if input_splits is not None:
            row_bytes = math.prod(input.shape[1:]) * input.element_size()
            wire_bytes = _nbytes(input) - input_splits[group.rank] * row_bytes
        self.ledger.record("all_to_all", group, _nbytes(input), wire_bytes)
        with self._blocked(self._track("all_to_all", group)):
            self._all_to_all(output, input, group, output_splits, input_splits)

    def send(self, tensor: torch.Tensor, group: Group, dst: int) -> None:
        """Send `tensor` to the group's member `dst`."""
        self._check_peer(group, dst)
        self.ledger.record("send", group, _nbytes(tensor))
        with self._blocked(self._track(f"send to rank {group.ranks[dst]}", group, transfer=True)):
            self._send(tensor, group, dst)

    def recv(self, tensor: torch.Tensor, group: Group, src: int) -> None:
        """Receive into `tensor` from the group's member `src`."""
        self._check_peer(group, src)
        self.ledger.record("recv", group, _nbytes(tensor))
        with self._blocked(self._track(f"recv from rank {group.ranks[src]}", group, transfer=True)):
            self._recv(tensor, group, src)

    def batch_isend_irecv(self, ops: Sequence[tuple[str, torch.Tensor, int]], group: Group) -> Pending:
        """Start ("send" | "recv", tensor, peer index) transfers together; one handle waits for all.

        Posting matching sends and receives together lets neighbours exchange
        without deadlocking on who sends first. On NCCL, the first such batch
        in a group must include every member of it.
        """
        for kind, _, peer in ops:
            if kind not in ("send", "recv"):
                raise ValueError(f"a transfer is 'send' or 'recv', not {kind!r}")
            self._check_peer(group, peer)
        for kind, tensor, _ in ops:
            self.ledger.record(kind, group, _nbytes(tensor))
        peers = ",".join(str(group.ranks[peer]) for peer in sorted({peer for _, _, peer in ops}))
        call = self._track(f"send/recv with rank(s) {peers}", group, transfer=True) if ops else None
        return Pending(self._batch_isend_irecv(ops, group) if ops else [], blocked=lambda: self._blocked(call))

    def barrier(self, group: Group) -> None:
        """Wait until every member of the group gets here."""
        if group.size == 1:
            return
        self.ledger.record("barrier", group, 0)
        with self._blocked(self._track("barrier", group)):
            self._barrier(group)

    def all_gather_object(self, obj: Any, group: Group) -> list[Any]:
        """Every member's picklable `obj`, in group order (for small metadata)."""
        if group.size == 1:
            return [obj]
        with self._blocked(self._track("all_gather_object", group)):
            gathered = self._all_gather_object(obj, group)
        # torch pads every pickle to the largest before gathering.
        largest = max(len(pickle.dumps(item)) for item in gathered)
        self.ledger.record("all_gather_object", group, group.size * largest)
        return gathered

    @staticmethod
    def _check_peer(group: Group, index: int) -> None:
        if index == group.rank:
            raise ValueError(f"rank {group.ranks[index]} cannot send to or receive from itself")

    # -- the transport: what moves the bytes, once the public method has checked and recorded --
    # Peers and roots are indices inside the group; an asynchronous call returns handles with wait().
    def _all_reduce(self, tensor: torch.Tensor, op: str, group: Group, async_op: bool) -> Any:
        return dist.all_reduce(tensor, op=_REDUCE_OPS[op], group=group.handle, async_op=async_op)

    def _broadcast(self, tensor: torch.Tensor, group: Group, src: int) -> None:
        dist.broadcast(tensor, src=group.ranks[src], group=group.handle)

    def _all_gather(self, output: torch.Tensor, input: torch.Tensor, group: Group, async_op: bool) -> Any:
        return _all_gather_flat(output, input, group=group.handle, async_op=async_op)

    def _reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: str, group: Group,
                        async_op: bool) -> Any:
        return _reduce_scatter_flat(output, input, op=_REDUCE_OPS[op], group=group.handle, async_op=async_op)

    def _all_to_all(self, output: torch.Tensor, input: torch.Tensor, group: Group,
                    output_splits: Sequence[int] | None, input_splits: Sequence[int] | None) -> None:
        dist.all_to_all_single(output, input, output_split_sizes=output_splits, input_split_sizes=input_splits,
                               group=group.handle)

    def _send(self, tensor: torch.Tensor, group: Group, dst: int) -> None:
        dist.send(tensor, dst=group.ranks[dst], group=group.handle)

    def _recv(self, tensor: torch.Tensor, group: Group, src: int) -> None:
        dist.recv(tensor, src=group.ranks[src], group=group.handle)

    def _batch_isend_irecv(self, ops: Sequence[tuple[str, torch.Tensor, int]], group: Group) -> list[Any]:
        return dist.batch_isend_irecv([
            dist.P2POp(dist.isend if kind == "send" else dist.irecv, tensor, peer=group.ranks[peer],
                       group=group.handle) for kind, tensor, peer in ops])

    def _barrier(self, group: Group) -> None:
        dist.barrier(group=group.handle)

    def _all_gather_object(self, obj: Any, group: Group) -> list[Any]:
        gathered: list[Any] = [None] * group.size
        dist.all_gather_object(gathered, obj, group=group.handle)
        return gathered
