"""ZeRO stage 3's parameters: gathered just before a unit runs, freed just after.

Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion
Parameter Models", stage 3 (P_os+g+p). parallel/zero.py shards a unit's
flattened parameters over the ``N`` ranks of the group and keeps each rank's
``S = ceil(numel / N)`` elements; this module is how the full parameters exist
only while they are used, so a rank holds ``4P/N`` bytes of fp32 weights
instead of ``4P``, plus the units in flight:

    forward:   gather a unit before its module runs (prefetching the next unit
               while this one computes), free it after
    backward:  gather it again when the gradients of its outputs are ready
               (prefetching the unit whose backward comes next); zero.py frees
               it once its last gradient has arrived and its reduce-scatter starts

The unit whose forward ends last is the first that backward needs, so it stays
gathered from forward into backward: one all-gather fewer per step, which is
why ZeRO-3 moves ``1.5 x`` DP's bytes less one gather of that unit. A gather
is an all-gather of every rank's shard into the unit's full buffer, whose
storage is resized to nothing on free; the parameters stay views of it, so
the module code never learns that its weights come and go.

Activation recomputation re-runs a unit's forward inside backward: the hooks
see that (``in_backward``) and neither prefetch nor free then.

A fine-tune's frozen base is sharded too, in frozen units (parallel/zero_units.py) gathered and
freed as above just before the trained unit of the same module (its adapters), but never
reduced: no gradient of its own says when backward is done with it. As in torch's FSDP2, an
identity on the module's inputs that need a gradient frees it when their gradient is complete
(every use of the frozen weights inside the module lies on the way to it); a module whose inputs
need none (the first block over a frozen embedding, the root) frees it when backward ends.

Inside pipeline stages (`PipelineGathering`) there is no one forward and one
backward: a rank runs its stages' forwards and backwards micro-batch by
micro-batch in the schedule's order (1F1B: F1 F2 B1 F3 B2 ...), and the model's
own forward never runs (the stages call its parts). So each block is gathered
for a micro-batch's forward and freed after it, gathered again for that
micro-batch's backward and freed once its gradients are in (``gather="micro-batch"``:
the least memory, ``2M`` gathers per block per round of M micro-batches), or
gathered when the round begins and held across its micro-batches
(``gather="round"``, torchtitan's ``reshard_after_forward=False`` for
pipelines: one gather per block per round, the stage's weights whole for the
round). The units outside the blocks (the first stage's embeddings, the last
stage's norm and head, a tied weight) are held for the round either way, as
the root unit is held from forward into backward above. Prefetching follows
each stage's blocks in order, forward, and in reverse, backward.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from typing import TYPE_CHECKING

import torch
from torch import nn

from scaletrain.parallel.hybrid import ShardCollectives

if TYPE_CHECKING:
    from scaletrain.parallel.zero_units import Unit


class Gathering:
    """A unit's full parameters regrown and all-gathered from the shards, and released."""

    def __init__(self, collectives: ShardCollectives):
        self.collectives = collectives

    def gather(self, unit: Unit, wait: bool = True) -> None:
        """The unit's full parameters, all-gathered from the shards (``wait=False``: started only)."""
        if not unit.gathered:
            unit.full.untyped_storage().resize_(unit.full.numel() * unit.full.element_size())
            # an offloaded shard (--offload base) comes to the device first
            shard = unit.shard.to(unit.full.device, non_blocking=True)
            # every rank's S-element shard of the unit's weights, into the regrown full buffer the layer runs on
            unit.gathering = self.collectives.all_gather(unit.full, shard)
            unit.gathered = True
        if wait and unit.gathering is not None:
            unit.gathering.wait()
            unit.gathering = None

    def free(self, unit: Unit) -> None:
        """Release the unit's full parameters; the parameters stay views of the
        (now empty) storage, which the next gather fills again."""
        if unit.gathering is not None:
            unit.gathering.wait()
            unit.gathering = None
        unit.full.untyped_storage().resize_(0)
        unit.gathered = False



class StageThreeGathering(Gathering):
    """The gather and free hooks of ZeRO-3's ``units`` (parallel/zero_units.py's `Unit`, each with
    its ``module``) on ``model``, whose root unit comes first in ``units`` (the module docstring).
    ``before_forward`` runs at the start of every forward of the model (zero.py launches
    the reductions a backward left incomplete). Frees every unit: the forward gathers them."""

    def __init__(self, model: nn.Module, units: list[Unit], collectives: ShardCollectives,
                 before_forward: Callable[[], None]):
        super().__init__(collectives)
        self.before_forward = before_forward
        for unit in units:
            self.free(unit)
        self.in_backward = False
        self._finished_forward: list[Unit] = []  # units in the order their forward ended
        self._forward = units[::-1]
        self._next_in_forward = dict(zip(map(id, self._forward), self._forward[1:]))
        # The units of the module whose forward ends last are needed first by backward: they stay.
        held = self._forward[0].module if self._forward[0].module is model else self._forward[-1].module
        self._held = {id(unit) for unit in units if unit.module is held}
        model.register_forward_pre_hook(self._begin_forward)
        for unit in self._forward:
            pre_forward = self._pre_forward_frozen if unit.frozen else self._pre_forward
            unit.module.register_forward_pre_hook(partial(pre_forward, unit))
            unit.module.register_forward_hook(partial(self._post_forward, unit))

    def _begin_forward(self, *_) -> None:
        self.in_backward = False
        self._finished_forward = []
        self.before_forward()

    def _pre_forward(self, unit: Unit, *_) -> None:
        self.gather(unit)
        if self.in_backward:  # activation recomputation inside backward: gathered already
            return
        following = self._next_in_forward.get(id(unit))
        if following is not None:
            self.gather(following, wait=False)  # prefetch

    def _pre_forward_frozen(self, unit: Unit, module: nn.Module, args: tuple) -> tuple | None:
        """A frozen unit gathered, and the module's inputs that need a gradient passed through an
        identity whose backward frees it (module docstring)."""
        self._pre_forward(unit)
        if self.in_backward or id(unit) in self._held:
            return None
        needing = [i for i, arg in enumerate(args) if isinstance(arg, torch.Tensor) and arg.requires_grad]
        if not needing:
            return None
        passed = list(args)
        for i, tensor in zip(needing, _FreeAfterBackward.apply(partial(self.free, unit), *(args[i] for i in needing))):
            passed[i] = tensor
        return tuple(passed)

    def _post_forward(self, unit: Unit, module: nn.Module, args: tuple, output) -> None:
        if self.in_backward:
            return
        self._finished_forward.append(unit)
        outputs = [t for t in torch.utils._pytree.tree_leaves(output)
                   if isinstance(t, torch.Tensor) and t.requires_grad]
        if outputs:
            torch.autograd.graph.register_multi_grad_hook(outputs, partial(self._pre_backward, unit), mode="any")
        if id(unit) not in self._held or not outputs:
            self.free(unit)

    def _pre_backward(self, unit: Unit, _grad) -> None:
        """Gradients of the unit's outputs are ready: its backward is next."""
        self.in_backward = True
        self.gather(unit)
        if unit.frozen:  # freed when its module's inputs have their gradient, or else here at the latest
            torch.autograd.Variable._execution_engine.queue_callback(partial(self.free, unit))
        order = self._finished_forward[::-1]
        position = order.index(unit)
        if position + 1 < len(order):
            self.gather(order[position + 1], wait=False)  # prefetch

    def after_gradients(self, unit: Unit) -> None:
        """The unit's gradients are all in: backward needs it no more."""
        self.free(unit)


class _FreeAfterBackward(torch.autograd.Function):
    """The identity on a module's inputs whose backward, run once their gradient is complete,
    calls ``free`` (a frozen unit's: module docstring)."""

    @staticmethod
    def forward(ctx, free: Callable[[], None], *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.free = free
        return inputs

    @staticmethod
    def backward(ctx, *grads: torch.Tensor) -> tuple:
        ctx.free()
        return (None, *grads)


def in_backward() -> bool:
    """Whether autograd is running a backward pass now (a recomputed forward runs inside one)."""
    return torch._C._current_graph_task_id() != -1


class PipelineGathering(Gathering):
    """The gathers and frees of ZeRO-3's units inside this rank's pipeline stages (module
    docstring): ``stages`` the units of each stage's blocks in forward order, ``held`` the units
    held for a whole round (the rest of the stages' weights); ``gather`` "micro-batch" or "round".
    ``round()`` wraps every run of the pipeline's schedule (training, evaluation, generation)."""

    def __init__(self, stages: Sequence[Sequence[Unit]], held: Sequence[Unit], collectives: ShardCollectives,
                 gather: str):
        super().__init__(collectives)
        self.per_round = gather == "round"
        self.blocks = [unit for units in stages for unit in units]
        self._block_ids = {id(unit) for unit in self.blocks}
        self.held = list(held)
        self._next = {id(a): b for units in stages for a, b in zip(units, units[1:])}
        self._previous = {id(b): a for units in stages for a, b in zip(units, units[1:])}
        self._in_round = False
        for unit in [*self.blocks, *self.held]:
            self.free(unit)
        for unit in self.blocks:
            unit.module.register_forward_pre_hook(partial(self._pre_forward, unit))
            unit.module.register_forward_hook(partial(self._post_forward, unit))

    @contextmanager
    def round(self) -> Iterator[None]:
        """The held units gathered for one run of the schedule (every block too, per round), then freed."""
        held = self.held + (self.blocks if self.per_round else [])
        for unit in held:
            self.gather(unit, wait=False)  # started together: they overlap one another
        for unit in self.held:  # no hook waits for these: their modules are the stages' parts
            self.gather(unit)
        self._in_round = True
        try:
            yield
        finally:
            self._in_round = False
            for unit in [*self.blocks, *self.held]:
                self.free(unit)

    def _holds(self, unit: Unit) -> bool:
        return self._in_round and (self.per_round or id(unit) not in self._block_ids)

    def _pre_forward(self, unit: Unit, *_) -> None:
        self.gather(unit)
        following = self._next.get(id(unit))
        if following is not None and not in_backward():
            self.gather(following, wait=False)  # prefetch the stage's next block

    def _post_forward(self, unit: Unit, module: nn.Module, args: tuple, output) -> None:
        if in_backward():  # recomputed inside backward: its backward runs next, on these weights
            return
        outputs = [t for t in torch.utils._pytree.tree_leaves(output)
                   if isinstance(t, torch.Tensor) and t.requires_grad]
        if outputs:
            torch.autograd.graph.register_multi_grad_hook(outputs, partial(self._pre_backward, unit), mode="any")
        if not self._holds(unit):
            self.free(unit)

    def _pre_backward(self, unit: Unit, _grad) -> None:
        """Gradients of the block's outputs for one micro-batch are ready: its backward is next."""
        self.gather(unit)
        previous = self._previous.get(id(unit))
        if previous is not None:
            self.gather(previous, wait=False)  # prefetch: backward runs the stage's blocks in reverse

    def after_gradients(self, unit: Unit) -> None:
        """A micro-batch's gradients of ``unit`` are all in: free it unless the round holds it."""
        if not self._holds(unit):
            self.free(unit)
