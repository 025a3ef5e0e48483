"""Backward split in two, for zero-bubble schedules (Qi et al. 2024).

For a linear layer ``y = x W^T`` backward is two independent products:

    B:  dL/dx = dL/dy . W          the previous stage waits for this
    W:  dL/dW = (dL/dy)^T . x      only the optimizer step needs this

`DeferrableLinear` computes both as usual, except inside
``store.deferring(key)``: there it computes ``dL/dx`` and hands ``(x, dL/dy)``
to the `WeightGradStore` under ``key``; ``store.flush(key)`` later computes
every held-back ``dL/dW``. Other layers built on a linear product (tensor
parallelism's column and row layers) defer the same way through `linear`,
when they declare ``defers_weight_grad``. Linear layers hold nearly all of a transformer's
weight-gradient work; the norms' and embeddings' small gradients stay in B.

A flushed gradient enters the weight through autograd (a one-node graph whose
backward is the product above), so it is accumulated into ``.grad`` by
autograd's own AccumulateGrad, as any gradient: across micro-batches, and
through the post-accumulate hooks that data parallelism's buckets listen to.

The price is memory: ``x`` and ``dL/dy`` live from B until W, which is why
ZB-H1 bounds how many W's a rank may postpone.

Mixed precision: under autocast the forward casts ``x`` and ``W`` to the
autocast dtype as ``F.linear`` would, and backward computes in that dtype;
the weight's gradient is returned in the weight's own dtype, as autocast's.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator
from contextlib import contextmanager

import torch
from torch import nn


class WeightGradStore:
    """Held-back (x, dL/dy, weight) triples, by the key of the backward that produced them."""

    def __init__(self) -> None:
        self.key: Hashable | None = None  # set inside `deferring`
        self.pending: dict[Hashable, list[tuple[torch.Tensor, torch.Tensor, nn.Parameter]]] = {}

    @contextmanager
    def deferring(self, key: Hashable) -> Iterator[None]:
        self.key = key
        self.pending.setdefault(key, [])
        try:
            yield
        finally:
            self.key = None

    def hold(self, x: torch.Tensor, grad_output: torch.Tensor, weight: nn.Parameter) -> None:
        self.pending[self.key].append((x, grad_output, weight))

    def flush(self, key: Hashable) -> None:
        """Compute the weight gradients held under ``key`` and accumulate them."""
        held = self.pending.pop(key)
        if held:
            torch.autograd.backward([_WeightGradient.apply(w, x, g) for x, g, w in held])


def _weight_grad(x: torch.Tensor, grad_output: torch.Tensor) -> torch.Tensor:
    return grad_output.flatten(0, -2).t().matmul(x.flatten(0, -2))


class _WeightGradient(torch.autograd.Function):
    """A scalar whose backward gives ``weight`` the gradient (dL/dy)^T x."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, x: torch.Tensor, grad_output: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, grad_output)
        ctx.weight_dtype = weight.dtype
        return weight.new_zeros(())

    @staticmethod
    def backward(ctx, _: torch.Tensor):
        x, grad_output = ctx.saved_tensors
        return _weight_grad(x, grad_output).to(ctx.weight_dtype), None, None


class _DeferrableLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, store: WeightGradStore) -> torch.Tensor:
        device = x.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
        x_c, w_c = x.to(dtype), weight.to(dtype)
        ctx.save_for_backward(x_c if weight.requires_grad else None, w_c)  # a frozen weight's needs no input
        ctx.store, ctx.weight, ctx.x_dtype = store, weight, x.dtype
        return x_c.matmul(w_c.t())

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        x_c, w_c = ctx.saved_tensors
        grad_output = grad_output.to(w_c.dtype)
        grad_x = grad_output.matmul(w_c).to(ctx.x_dtype)
        if not ctx.needs_input_grad[1]:
            return grad_x, None, None
        if ctx.store.key is not None:
            ctx.store.hold(x_c.detach(), grad_output.detach(), ctx.weight)
            return grad_x, None, None
        return grad_x, _weight_grad(x_c, grad_output).to(ctx.weight.dtype), None


def linear(x: torch.Tensor, weight: torch.Tensor, store: WeightGradStore | None) -> torch.Tensor:
    """``x @ weight.T``, its weight gradient deferrable to ``store`` (plain when None)."""
    if store is None:
        return torch.nn.functional.linear(x, weight)
    return _DeferrableLinearFunction.apply(x, weight, store)


class DeferrableLinear(nn.Linear):
    """``nn.Linear`` (no bias) whose weight gradient a `WeightGradStore` may hold back."""

    store: WeightGradStore

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.store)


def make_deferrable(module: nn.Module, store: WeightGradStore) -> int:
    """Turn every bias-free ``nn.Linear`` in ``module`` into a `DeferrableLinear`
    in place (same object, same parameters), and hand ``store`` to every layer
    that declares ``defers_weight_grad``; returns how many layers defer."""
    count = 0
    for m in module.modules():
        if type(m) is nn.Linear and m.bias is None:
            m.__class__ = DeferrableLinear
        elif not getattr(m, "defers_weight_grad", False):
            continue
        m.store = store
        count += 1
    return count
