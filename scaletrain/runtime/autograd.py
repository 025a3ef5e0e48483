"""Differentiable collectives: communication as autograd operations.

A collective inside a model's forward has a conjugate in backward, and
autograd runs it when it is written as an ``autograd.Function``. These are
the operators of Megatron-LM's tensor parallelism (Shoeybi et al. 2019,
section 3, "f" and "g") and sequence parallelism (Korthikanti et al. 2022,
section 4.2.2, "g" and "g-bar"), over a group of t ranks:

    operator                  forward                        backward
    copy_to_group      (f)    identity                       all-reduce (sum)
    reduce_from_group  (g)    all-reduce (sum)               identity
    gather_sequence           all-gather along the sequence  reduce-scatter along the sequence
    scatter_sequence          reduce-scatter along it        all-gather along it
    exchange_rows             all-to-all of rows, sending    the reverse all-to-all: receiving
                              send[j] to member j and        send[j] from member j and sending
                              receiving recv[i] from i       recv[i] back to i

Each pair is conjugate: the backward of an operator is the forward of its
partner, so a region entered with ``f`` and left with ``g`` costs one
all-reduce each way, and sequence parallelism swaps every all-reduce for a
reduce-scatter plus an all-gather, which move the same bytes: a ring
all-reduce *is* a reduce-scatter followed by an all-gather.

Activations are [batch, sequence, hidden]; "along the sequence" means dim 1,
split into t equal contiguous chunks, rank r holding chunk r. The flat
collectives move rank-major buffers, so gathering along dim 1 costs one
permuting copy each way (a layout with the sequence first, as Megatron's
[s, b, h], would not, at the price of a model that differs from the plain one).

``exchange_rows`` is its own conjugate with the row counts swapped: expert
parallelism's dispatch and combine (parallel/experts.py), whose counts
change with every batch's routing.

Every transfer goes through `Comm`, so the ledger counts what these moved.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import torch
from torch.autograd import Function

from scaletrain.runtime.comm import Comm
from scaletrain.runtime.mesh import Group


def all_reduced(x: torch.Tensor, comm: Comm, group: Group) -> torch.Tensor:
    """A summed copy of ``x`` (autograd may still need ``x`` itself)."""
    out = x.clone(memory_format=torch.contiguous_format)
    comm.all_reduce(out, group)
    return out


def gathered_sequence(x: torch.Tensor, comm: Comm, group: Group) -> torch.Tensor:
    """[b, s/t, ...] on each rank -> [b, s, ...], the chunks in rank order."""
    parts = x.new_empty((group.size, *x.shape))
    comm.all_gather(parts, x.contiguous(), group)
    return parts.movedim(0, 1).flatten(1, 2)


def scattered_sequence(x: torch.Tensor, comm: Comm, group: Group) -> torch.Tensor:
    """[b, s, ...] partial sums on each rank -> [b, s/t, ...]: rank r's chunk, summed."""
    chunk = x.shape[1] // group.size
    parts = x.unflatten(1, (group.size, chunk)).movedim(1, 0).contiguous()
    out = x.new_empty((x.shape[0], chunk, *x.shape[2:]))
    comm.reduce_scatter(out, parts, group)
    return out


def exchanged_rows(x: torch.Tensor, comm: Comm, group: Group, send: Sequence[int],
                   recv: Sequence[int]) -> torch.Tensor:
    """[sum(send), ...] -> [sum(recv), ...]: ``send[j]`` rows to member j, ``recv[i]`` rows
    from member i, received in member order."""
    out = x.new_empty((sum(recv), *x.shape[1:]))
    comm.all_to_all(out, x.contiguous(), group, output_splits=recv, input_splits=send)
    return out


def _identity(x: torch.Tensor, comm: Comm, group: Group) -> torch.Tensor:
    return x.view_as(x)


class _Conjugate(Function):
    """``forward(x)`` forward and ``backward(grad)`` backward: one of the pairs above."""

    @staticmethod
    def forward(ctx, x, forward, backward, comm, group):
        ctx.backward_op, ctx.comm, ctx.group = backward, comm, group
        return forward(x, comm, group)

    @staticmethod
    def backward(ctx, grad):
        return ctx.backward_op(grad, ctx.comm, ctx.group), None, None, None, None


def copy_to_group(x: torch.Tensor, comm: Comm, group: Group) -> torch.Tensor:
    """f: identity forward, all-reduce of the gradient backward."""
    return _Conjugate.apply(x, _identity, all_reduced, comm, group)


def reduce_from_group(x: torch.Tensor, comm: Comm, group: Group) -> torch.Tensor:
    """g: all-reduce forward, identity backward."""
    return _Conjugate.apply(x, all_reduced, _identity, comm, group)


def gather_sequence(x: torch.Tensor, comm: Comm, group: Group) -> torch.Tensor:
    """All-gather along the sequence forward, reduce-scatter of the gradient backward."""
    return _Conjugate.apply(x, gathered_sequence, scattered_sequence, comm, group)


def scatter_sequence(x: torch.Tensor, comm: Comm, group: Group) -> torch.Tensor:
    """Reduce-scatter along the sequence forward, all-gather of the gradient backward."""
    return _Conjugate.apply(x, scattered_sequence, gathered_sequence, comm, group)


def exchange_rows(x: torch.Tensor, send: Sequence[int], recv: Sequence[int], comm: Comm,
                  group: Group) -> torch.Tensor:
    """All-to-all of rows with uneven counts forward, the reverse all-to-all of the gradient backward."""
    return _Conjugate.apply(x, partial(exchanged_rows, send=send, recv=recv),
                            partial(exchanged_rows, send=recv, recv=send), comm, group)
