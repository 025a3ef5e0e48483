"""PipeDream-2BW: double-buffered weights and 1-stale updates, with no pipeline flush.

Narayanan et al. 2021, "Memory-Efficient Pipeline-Parallel DNN Training".
A pipeline that never drains has, on every stage, micro-batches in flight
whose backward is still to come while new ones are forwarded. Their
gradients are only right if each micro-batch's backward runs on the weights
its forward ran on (weight stashing). PipeDream-2BW makes a new weight
version every M micro-batches (M >= N stages) and keeps two:

    version t          used by the forward and the backward of micro-batches tM ... tM+M-1
    g(t)               their mean gradient, computed on W(t)
    W(t+1) = W(t) - lr * g(t-1)        (1-stale: the gradient of the version before)
    W(1) = W(0)                        (the first step has no complete gradient)

With M >= N, version t-1's last backward on a stage comes before version
t+1's first forward there (schedules.py: the backward trails the forward by
``N-r-1 < M`` micro-batches on rank r), so g(t-1) is complete when W(t+1) is
made, and only versions t and t+1 are ever in use: two buffers, where
PipeDream's original weight stashing keeps up to N. The trade-off against
1F1B: no drain (the bubble drops to the fill, schedules.py), for one more
copy of the weights and an update that lags one step behind the gradient,
which changes the training trajectory (docs/pipeline-parallel.md measures by
how much).

`WeightVersions` holds a rank's two versions. Its buffers are the tensors
the computations see: inside ``computing(action)`` every module slot of a
trainable weight holds the buffer of the micro-batch's version (both slots
of a tied weight), for the forward and again for the backward, so that
recomputation inside backward sees the same weights too. Gradients
accumulate into the buffer's ``.grad``. Version t's gradient is handed to
the model's parameters in step t+1's round, the one whose update applies it:
as soon as its last backward on the stage is done (the last stage finishes
it a round earlier and holds it until then). It goes in through autograd,
so data parallelism's hooks see it as any gradient, and the buffer's
gradient is freed: a rank accumulates one version's gradient at a time,
besides the one held. After each step's round, `advance` copies the
newest version into the free buffer and points the model's parameters at
it: the optimizer's in-place step then turns that copy into the next
version, while the micro-batches still in flight keep theirs.

`DelayedGradient` is the same 1-stale rule on one device, the reference
``scaletrain parity`` checks a 2BW pipeline against: each step computes
g(t) on W(t), then steps with the gradient it kept from the step before.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

from scaletrain.parallel.pipeline.schedules import PIPEDREAM_2BW, Action


class WeightVersions:
    """A pipeline rank's two weight versions (module docstring). ``trace``, when a list,
    records ``(kind, micro, stage, version, fingerprint)`` for every computation, the
    fingerprint a weighted sum of the weights it ran on, to test weight stashing."""

    def __init__(self, model: nn.Module, micro_batches: int):
        self.micro_batches = micro_batches
        seen: dict[int, int] = {}
        self.params: list[nn.Parameter] = []  # the optimizer's: the newest version between steps
        for p in model.parameters():
            if p.requires_grad and id(p) not in seen:
                seen[id(p)] = len(self.params)
                self.params.append(p)
        # Every (module, attribute) holding one of them; a tied weight has several.
        self.slots = [(module, name, seen[id(p)]) for module in model.modules()
                      for name, p in module._parameters.items() if p is not None and id(p) in seen]
        self.buffers: dict[int, list[nn.Parameter]] = {}
        self.step = 0  # the step whose round runs
        self.complete: set[int] = set()  # versions whose every backward on this stage is done
        self.handed_off: int | None = None  # the version whose gradient this step's update applies
        self.trace: list[tuple[str, int, int, int, float]] | None = None

    def version_of(self, micro: int) -> int:
        return micro // self.micro_batches

    def begin(self, step: int) -> None:
        """Step ``step``'s round starts (the first: version 0 is the parameters as they are now)."""
        self.step = step
        if not self.buffers:
            self.buffers[0] = [nn.Parameter(p.data) for p in self.params]
        self._hand_off_when_due()

    @contextmanager
    def computing(self, action: Action) -> Iterator[None]:
        """The module runs ``action`` (F or BW) on its micro-batch's version."""
        version = self.version_of(action.micro)
        weights = self.buffers[version]
        if self.trace is not None:
            self.trace.append((action.kind, action.micro, action.stage, version, _fingerprint(weights)))
        for module, name, i in self.slots:
            module._parameters[name] = weights[i]
        try:
            yield
        finally:
            for module, name, i in self.slots:
                module._parameters[name] = self.params[i]
        if action.kind == "BW" and action.micro % self.micro_batches == self.micro_batches - 1:
            self.complete.add(version)
            self._hand_off_when_due()

    def _hand_off_when_due(self) -> None:
        """The previous version's gradient, once complete on this stage, into the parameters' ``.grad``."""
        version = self.step - 1
        if version not in self.complete:
            return
        self.complete.remove(version)
        weights = self.buffers[version]
        pairs = [(p, w.grad) for p, w in zip(self.params, weights) if w.grad is not None]
        # A leaf's own backward accumulates into .grad and runs its hooks (data parallelism's buckets).
        torch.autograd.backward([p for p, _ in pairs], grad_tensors=[g for _, g in pairs])
        for w in weights:
            w.grad = None
        self.handed_off = version

    @torch.no_grad()
    def advance(self) -> None:
        """After the step's round: version step+1 starts as a copy of version
        ``step`` in the buffer version step-1 no longer needs, and the parameters
        now live there, for the optimizer to update in place."""
        step = self.step
        done = self.buffers.pop(step - 1, None)
        if done is not None and self.handed_off != step - 1:
            raise RuntimeError(f"weight version {step - 1} is still in use after step {step}")
        current = self.buffers[step]
        following = done or [nn.Parameter(torch.empty_like(w)) for w in current]
        for new, old, param in zip(following, current, self.params):
            new.copy_(old)
            param.data = new.data
        self.buffers[step + 1] = following

    def exchange(self, grad_of: Callable[[nn.Parameter], torch.Tensor | None]) -> bool:
        """Whether the parameters hold a gradient for this step's update (the first step's do not);
        it went in during the round, so ``grad_of`` (`DelayedGradient`'s) is not needed here."""
        ready, self.handed_off = self.handed_off is not None, None
        return ready

    def memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        """Both versions (the newest is the parameters' own storage) and their gradients, for the memory ledger."""
        weights = [w for version in self.buffers.values() for w in version]
        return {"params": weights, "grads": [w.grad for w in weights if w.grad is not None]}


def _fingerprint(weights: list[torch.Tensor]) -> float:
    """A number that changes when any weight does (each tensor weighted by its position)."""
    return sum((i + 1) * w.detach().double().sum().item() for i, w in enumerate(weights))


class DelayedGradient:
    """The 1-stale rule on one device: the update of step t applies g(t-1) (module docstring)."""

    def __init__(self, params: list[nn.Parameter]):
        self.params = params
        self.kept: list[torch.Tensor | None] | None = None

    @torch.no_grad()
    def exchange(self, grad_of: Callable[[nn.Parameter], torch.Tensor | None]) -> bool:
        """Keep this step's gradients and put the previous step's in their place;
        False on the first step, which has none to apply."""
        grads = [grad_of(p) for p in self.params]
        previous, self.kept = self.kept, [None if g is None else g.clone() for g in grads]
        if previous is None:
            return False
        for grad, old in zip(grads, previous):
            if grad is None:
                continue
            if old is None:
                grad.zero_()
            else:
                grad.copy_(old)
        return True

    def memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The gradient kept for the next step, for the memory ledger."""
        return {"grads": [g for g in self.kept or () if g is not None]}


def delayed_update(schedule: str, model: nn.Module,
                   versions: WeightVersions | None) -> WeightVersions | DelayedGradient | None:
    """What makes a step's update the 1-stale one under PipeDream-2BW: a pipeline's weight
    ``versions``, or without a pipeline (None) a `DelayedGradient` of the model's trainable weights."""
    if schedule != PIPEDREAM_2BW:
        return None
    if versions is not None:
        return versions
    return DelayedGradient([p for p in model.parameters() if p.requires_grad])
