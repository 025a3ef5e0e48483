"""Data parallelism: replicate the model, shard the batch, average gradients,
with the communication hidden behind the backward pass.

Each of the ``n`` ranks of the dp group holds the whole model and computes the
loss on its share of the global batch. Because the loss is a mean over the
batch, the global gradient is the sample-weighted mean of the ranks' gradients:

    g = sum_r (b_r / B) * g_r        b_r samples on rank r, B = sum_r b_r
      = (1/n) * sum_r g_r            when every rank has the same b_r

one all-reduce of the gradient bytes per optimizer step, after which every
rank takes the same step and the replicas stay equal (they start equal:
`replicate` broadcasts rank 0's weights). A ring all-reduce sends 2(n-1)/n
times the gradient bytes per rank (Patarasuk & Yuan 2009).

Overlap (Li et al. 2020, "PyTorch Distributed: Experiences on Accelerating
Data Parallel Training"). Gradients are packed into buckets of about
``bucket_mb`` MiB in the reverse order of parameter registration, roughly the
order backward produces them; a bucket's reduction starts when its last
gradient arrives, while backward goes on. Buckets launch strictly in index
order, so every rank issues the same collectives in the same order even if
their hooks fire in a different one. Small buckets overlap sooner but pay the
per-call latency more often; large ones the reverse (25 MiB is torch DDP's
default too). Communication happens once per optimizer step, whatever
``--grad-accum`` is.

Gradient memory. When the bucket dtype is the parameter dtype, each
parameter's ``.grad`` is a view into its bucket, so backward accumulates
straight into the buffer that is reduced: no copy per step. With
``--reduce-dtype fp32`` and bf16 weights, accumulation over micro-batches and
the reduction both run in fp32 (Megatron's "main_grad"), and the optimizer's
fp32 master gradients are filled from the bucket (`gradient`), never rounded
to bf16 on the way. One rank alone, averaging over itself in the gradients'
own dtype, has nothing to reduce and keeps autograd's gradients, with no
bucket (a copy of every gradient a step saved: 4.4 GB on a 1.1B model,
docs/performance.md).

Each rank's bucket is multiplied by its weight b_r / B (1/n by default)
before the sum, rather than divided after: low-precision sums then stay in
range, and a short last batch (`weigh_by`) is averaged correctly.

The reduction is pluggable: the backend's all-reduce, the ring of
runtime/ring.py, or a gradient compressor (optim/compression.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from scaletrain.optim.compression import GradientCompressor
from scaletrain.runtime.comm import Comm, Pending
from scaletrain.runtime.mesh import Group
from scaletrain.runtime.ring import RingAllReduce

# What a bucket's reduction may be: the backend's all-reduce, the ring, or
# a compressor's `reduce(key, flat, shapes)` (optim/compression.py).
ALLREDUCE_KINDS = ("backend", "ring")


def summer(comm: Comm, group: Group, allreduce: str) -> Callable[[torch.Tensor], None]:
    """A blocking in-place sum over ``group`` by the chosen algorithm ("backend" or "ring")."""
    if allreduce not in ALLREDUCE_KINDS:
        raise ValueError(f"allreduce must be one of {ALLREDUCE_KINDS}, not {allreduce!r}")
    if allreduce == "ring":
        return RingAllReduce(comm, group)
    # the caller's flat tensor (local SGD's weights, PowerSGD's P's or Q's), summed in place over the group
    return lambda tensor: comm.all_reduce(tensor, group, op="sum")


@torch.no_grad()
def replicate(tensors: Iterable[torch.Tensor], comm: Comm, group: Group) -> None:
    """Broadcast every tensor (a module's parameters and buffers) from the group's first member,
    so all replicas start equal."""
    for tensor in tensors:
        # one parameter or buffer, whole, from member 0 to every replica: all start from the same values
        comm.broadcast(tensor, group, src=0)


@dataclass
class Bucket:
    """A flat buffer holding the gradients of some parameters, reduced with one collective."""

    index: int
    params: list[nn.Parameter]
    flat: torch.Tensor
    views: list[torch.Tensor]  # views[i] is params[i]'s gradient, shaped like it, inside `flat`
    filled: set[int] = field(default_factory=set)  # ids of the params with a gradient since zero_grad
    ready: set[int] = field(default_factory=set)  # ids of the params whose final gradient arrived
    pending: Pending | None = None

    @property
    def grads_are_views(self) -> bool:
        """Whether the parameters' ``.grad`` live in the bucket (same dtype), or are added into it."""
        return self.flat.dtype == self.params[0].dtype

    @property
    def nbytes(self) -> int:
        return self.flat.numel() * self.flat.element_size()

    @property
    def shapes(self) -> list[torch.Size]:
        return [p.shape for p in self.params]


def plan_buckets(params: list[nn.Parameter], cap_bytes: int, dtype: torch.dtype | None) -> list[list[nn.Parameter]]:
    """Consecutive runs of ``params`` of at most ``cap_bytes`` each (a single larger
    tensor gets a bucket of its own), never mixing parameter dtypes."""
    buckets: list[list[nn.Parameter]] = []
    size = 0
    for param in params:
        nbytes = param.numel() * (dtype or param.dtype).itemsize
        if not buckets or size + nbytes > cap_bytes or param.dtype != buckets[-1][-1].dtype:
            buckets.append([])
            size = 0
        buckets[-1].append(param)
        size += nbytes
    return buckets


class DataParallel:
    """Bucketed, overlapped gradient averaging over a dp group (see the module docstring).

    Per optimizer step::

        for each micro-batch but the last:  with dp.no_sync(): loss.backward()
        final micro-batch:                  loss.backward()     (buckets launch as they fill)
        dp.finish_gradient_sync()           (every parameter's gradient is now the average)
        ... optimizer step ...
        dp.zero_grad()

    ``reduce_dtype`` is the dtype of the buckets (default: each parameter's
    own); ``allreduce`` is "backend" or "ring"; ``compressor`` replaces the
    plain sum with a compressed one. ``params`` (default: all the model's)
    are the ones this instance averages; ``average_over`` is the count their
    sum is divided by (default: the group's size; an expert's gradient, which
    already sums the expert-parallel ranks' tokens, is divided by all the
    data ranks: parallel/experts.py).
    """

    def __init__(self, model: nn.Module, comm: Comm, group: Group, *, bucket_mb: float = 25.0,
                 reduce_dtype: torch.dtype | None = None, allreduce: str = "backend",
                 compressor: GradientCompressor | None = None, params: list[nn.Parameter] | None = None,
                 average_over: int | None = None):
        self._sum = summer(comm, group, allreduce)  # also validates the name, before any hook is in place
        self.comm, self.group, self.compressor = comm, group, compressor
        params = [p for p in (model.parameters() if params is None else params) if p.requires_grad]
        device = params[0].device if params else torch.device("cpu")
        self.buckets: list[Bucket] = []
        self._slot: dict[int, tuple[Bucket, torch.Tensor]] = {}
        alone = group.size == 1 and (average_over or 1) == 1 and compressor is None
        # (module docstring) nothing to reduce: these gradients need no bucket
        self._unbucketed = [p for p in params if alone and reduce_dtype in (None, p.dtype)]
        unbucketed = {id(p) for p in self._unbucketed}
        bucketed = [p for p in params if id(p) not in unbucketed]
        for index, members in enumerate(plan_buckets(bucketed[::-1], int(bucket_mb * 2**20), reduce_dtype)):
            flat = torch.zeros(sum(p.numel() for p in members), dtype=reduce_dtype or members[0].dtype,
                               device=device)
            views = [chunk.view_as(p) for chunk, p in zip(flat.split([p.numel() for p in members]), members)]
            bucket = Bucket(index, members, flat, views)
            self.buckets.append(bucket)
            for param, view in zip(members, views):
                self._slot[id(param)] = (bucket, view)
                param.register_post_accumulate_grad_hook(self._on_gradient)
        self._syncing = True  # False inside no_sync()
        self._next = 0  # the first bucket not launched yet in this step
        self._average_over = average_over or group.size
        self._scale = 1.0 / self._average_over
        # The ring and compressors are blocking Python; one thread runs them
        # in bucket order while backward continues on this one.
        threaded = group.size > 1 and (allreduce == "ring" or compressor is not None)
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="dp-comm") if threaded else None
        self.zero_grad()

    # -- the per-step protocol -------------------------------------------------
    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients without communicating (every micro-batch but the last)."""
        self._syncing = False
        try:
            yield
        finally:
            self._syncing = True

    def weigh_by(self, local_samples: int) -> None:
        """Average this step's gradients by sample count, for ranks holding
        unequal shares of the batch (a short last batch); call before the
        final backward. Costs one small all-reduce of the counts."""
        counts = torch.tensor([float(local_samples)], device=self.buckets[0].flat.device
                              if self.buckets else "cpu")
        # one float per rank (its sample count), summed into B, the group's total, for the weight b_r / B
        self.comm.all_reduce(counts, self.group, op="sum")
        if counts.item() <= 0:
            raise ValueError("weigh_by: the dp group holds no samples in this step")
        self._scale = local_samples / counts.item()

    def finish_gradient_sync(self) -> None:
        """Launch what has not launched (parameters without a gradient this
        step contribute zeros), then wait for every bucket."""
        for bucket in self.buckets[self._next:]:
            self._launch(bucket)
        for bucket in self.buckets:
            bucket.pending.wait()
            bucket.pending = None
            bucket.ready.clear()
        for bucket in self.buckets:
            if bucket.grads_are_views:  # also for parameters that got no gradient this step
                for param, view in zip(bucket.params, bucket.views):
                    param.grad = view
        for param in self._unbucketed:  # a zero gradient where none came, as a bucket's slot holds
            if param.grad is None:
                param.grad = torch.zeros_like(param)
        self._next = 0
        self._scale = 1.0 / self._average_over

    def zero_grad(self) -> None:
        """Forget the gradients. Nothing is zeroed: each parameter's first
        gradient of the next step is copied over its slot (as torch DDP does),
        which saves a pass over the buckets; slots left unwritten are zeroed
        when their bucket launches."""
        for bucket in self.buckets:
            bucket.filled.clear()
            for param in bucket.params:
                param.grad = None
        for param in self._unbucketed:
            # autograd's own gradient, accumulated in place over micro-batches and freed here: no bucket holds it
            param.grad = None

    def holds(self, param: nn.Parameter) -> bool:
        """Whether ``param`` is one of the parameters this instance averages."""
        return id(param) in self._slot

    def gradient(self, param: nn.Parameter) -> torch.Tensor | None:
        """``param``'s averaged gradient after `finish_gradient_sync`, in the bucket dtype."""
        slot = self._slot.get(id(param))
        return slot[1] if slot is not None else param.grad

    def gradient_buffers(self) -> list[torch.Tensor]:
        """The buckets' flat buffers (for the memory ledger)."""
        return [bucket.flat for bucket in self.buckets]

    # -- inside backward -----------------------------------------------------
    @torch.no_grad()
    def _on_gradient(self, param: nn.Parameter) -> None:
        if param.grad is None:  # a backward that holds this weight's gradient back (zero bubble's B)
            return
        bucket, view = self._slot[id(param)]
        # The first gradient of a step arrives as a tensor of autograd's: it is
        # copied into the slot, and with views the parameter's .grad becomes the
        # slot, so autograd adds later micro-batches in place. In another dtype,
        # every micro-batch is added into the slot and its own gradient freed.
        if param.grad.data_ptr() != view.data_ptr():
            if id(param) in bucket.filled:
                view.add_(param.grad)
            else:
                view.copy_(param.grad)
            param.grad = view if bucket.grads_are_views else None
        bucket.filled.add(id(param))
        if not self._syncing:  # inside no_sync(): accumulate only; nothing is sent before the final micro-batch
            return
        if id(param) in bucket.ready or bucket.pending is not None:
            raise RuntimeError("a parameter's gradient arrived twice in one step, after its bucket "
                               "was complete; run the extra backward inside no_sync()")
        bucket.ready.add(id(param))
        while self._next < len(self.buckets) and \
                len(self.buckets[self._next].ready) == len(self.buckets[self._next].params):
            self._launch(self.buckets[self._next])

    def _launch(self, bucket: Bucket) -> None:
        """Start summing this rank's weighted share of ``bucket`` over the group."""
        self._next = bucket.index + 1
        for param, view in zip(bucket.params, bucket.views):
            if id(param) not in bucket.filled:  # no gradient this step: it contributes zeros
                view.zero_()
        if self._scale != 1.0:
            bucket.flat.mul_(self._scale)
        if self.group.size == 1:
            bucket.pending = Pending()
            return
        if self._thread is None:
            # the full bucket's gradients summed over the replicas while backward goes on (the ledger
            # counts 2(n-1)/n of its bytes on the wire per rank, a ring all-reduce's cost)
            bucket.pending = self.comm.all_reduce(bucket.flat, self.group, op="sum", async_op=True)
            return
        future = self._thread.submit(self._reduce_blocking, bucket)
        bucket.pending = Pending(finish=future.result)

    def _reduce_blocking(self, bucket: Bucket) -> None:
        if self.compressor is not None:
            self.compressor.reduce(bucket.index, bucket.flat, bucket.shapes)
        else:
            self._sum(bucket.flat)


class JointDataParallel:
    """Several `DataParallel`s, each over its own parameters and group, driven as one
    (expert parallelism: the experts' gradients are averaged over fewer ranks
    than the rest; parallel/experts.py)."""

    def __init__(self, parts: list[DataParallel]):
        self.parts = parts

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for part in self.parts:
                stack.enter_context(part.no_sync())
            yield

    def finish_gradient_sync(self) -> None:
        for part in self.parts:
            part.finish_gradient_sync()

    def zero_grad(self) -> None:
        for part in self.parts:
            part.zero_grad()

    def gradient(self, param: nn.Parameter) -> torch.Tensor | None:
        for part in self.parts:
            if part.holds(param):
                return part.gradient(param)
        return param.grad

    def gradient_buffers(self) -> list[torch.Tensor]:
        return [flat for part in self.parts for flat in part.gradient_buffers()]
