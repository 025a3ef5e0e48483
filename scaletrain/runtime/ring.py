"""Ring all-reduce from point-to-point transfers only (Patarasuk & Yuan 2009,
"Bandwidth optimal all-reduce algorithms for clusters of workstations").

The flat buffer of N elements (S bytes) is cut into n chunks c_0 .. c_{n-1}
whose sizes differ by at most one element, and member r talks only to its
neighbours: it sends to r+1 and receives from r-1 (mod n).

  reduce-scatter, n-1 steps: at step s member r sends chunk (r-s) mod n and
      adds the received chunk (r-s-1) mod n into its own; afterwards it holds
      chunk (r+1) mod n summed over every member.
  all-gather, n-1 steps: at step s member r sends chunk (r+1-s) mod n and
      receives chunk (r-s) mod n straight into place.

That is 2(n-1) steps. Member r sends every chunk but c_{(r+1) mod n} in the
first phase and every chunk but c_{(r+2) mod n} in the second, and receives
what its left neighbour sends:

  sent by r      2N - c_{(r+1) mod n} - c_{(r+2) mod n}   elements
  received by r  2N - c_{r} - c_{(r+1) mod n}             elements

which is 2(n-1)/n x N when n divides N: each member moves about twice the
buffer whatever n, the lower bound for any all-reduce. With a latency alpha
per step and a link bandwidth beta:

  t = 2(n-1) alpha + 2(n-1)/n x S / beta

Benchmarks report the bus bandwidth of the nccl-tests convention,
busbw = algbw x 2(n-1)/n with algbw = S / t. algbw falls as n grows even when
every link is equally busy, because each member moves more than S; busbw is
the rate one link actually carried, which tends to beta for a bandwidth-bound
ring at any n, so it is the figure comparable across group sizes.

This is the teaching version: it shows where the 2(n-1)/n comes from, and it
is selectable with ``--allreduce ring`` in place of the backend's all-reduce
(which runs its steps in native code, with no Python between them, and on
NCCL picks rings or trees by topology).
"""

from __future__ import annotations

import torch

from scaletrain.runtime.comm import Comm
from scaletrain.runtime.mesh import Group

OPS = ("sum", "avg")


def ring_all_reduce(comm: Comm, tensor: torch.Tensor, group: Group, op: str = "sum",
                    scratch: torch.Tensor | None = None) -> None:
    """Reduce the contiguous `tensor` in place across `group` with "sum" or "avg".

    ``scratch`` receives the incoming chunks: a 1-D tensor of `tensor`'s
    dtype and device with at least ceil(numel / n) elements, or None to
    allocate one for this call (`RingAllReduce` keeps one between calls).
    Only the arguments are touched, so a communication thread may run it
    while the main thread computes.
    """
    if op not in OPS:
        raise ValueError(f"unknown reduction {op!r}; the ring does {list(OPS)}")
    if op == "avg" and not tensor.is_floating_point():
        raise TypeError(f"avg needs a floating-point tensor, got {tensor.dtype}")
    if not tensor.is_contiguous():
        raise ValueError("ring_all_reduce works on the tensor's memory in place, so it must be contiguous")
    n = group.size
    if n == 1:
        return
    # Views, so that reducing a chunk reduces the tensor itself. tensor_split
    # gives the first N mod n chunks one element more, the same split on
    # every member, which is what lets both ends of a transfer agree on it.
    chunks = tensor.view(-1).tensor_split(n)
    # Chunk 0 is never smaller than another.
    if scratch is None:
        scratch = torch.empty_like(chunks[0])
    elif scratch.numel() < chunks[0].numel() or scratch.dtype != tensor.dtype or scratch.device != tensor.device:
        raise ValueError(f"the scratch buffer needs {chunks[0].numel()} elements of {tensor.dtype} on "
                         f"{tensor.device}, got {scratch.numel()} of {scratch.dtype} on {scratch.device}")
    me, right, left = group.rank, (group.rank + 1) % n, (group.rank - 1) % n
    for step in range(n - 1):
        incoming = chunks[(me - step - 1) % n]
        received = scratch[: incoming.numel()]
        _exchange(comm, group, chunks[(me - step) % n], received, right, left)
        incoming.add_(received)
    for step in range(n - 1):
        _exchange(comm, group, chunks[(me + 1 - step) % n], chunks[(me - step) % n], right, left)
    if op == "avg":
        tensor.div_(n)


def _exchange(comm: Comm, group: Group, send: torch.Tensor, recv: torch.Tensor, right: int, left: int) -> None:
    """Send `send` to the right while receiving `recv` from the left.

    Both are posted together, so that no member waits for its neighbour to
    receive before it can receive itself. Empty chunks are skipped: the left
    neighbour computes the same chunk sizes, so it skips the matching send.
    """
    transfers = []
    if send.numel():
        transfers.append(("send", send, right))
    if recv.numel():
        transfers.append(("recv", recv, left))
    if transfers:
        comm.batch_isend_irecv(transfers, group).wait()


class RingAllReduce:
    """`ring_all_reduce` over one group with its scratch buffer kept between
    calls: at tens of MiB, the first touch of a fresh buffer's pages is a
    visible part of a call's time (a third of it at 64 MiB on two CPU ranks)."""

    def __init__(self, comm: Comm, group: Group):
        self.comm, self.group = comm, group
        self._scratch: torch.Tensor | None = None

    def __call__(self, tensor: torch.Tensor, op: str = "sum") -> None:
        need = -(-tensor.numel() // self.group.size)
        kept = self._scratch
        if kept is None or kept.numel() < need or kept.dtype != tensor.dtype or kept.device != tensor.device:
            kept = self._scratch = torch.empty(need, dtype=tensor.dtype, device=tensor.device)
        ring_all_reduce(self.comm, tensor, self.group, op, scratch=kept)
