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
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING

import torch
from torch import nn

from scaletrain.parallel.hybrid import ShardCollectives

if TYPE_CHECKING:
    from scaletrain.parallel.zero_units import Unit


class StageThreeGathering:
    """The gather and free hooks of ZeRO-3's ``units`` (parallel/zero_units.py's `Unit`, each with
    its ``module``) on ``model``, whose root unit comes first in ``units`` (the module docstring).
    ``before_forward`` runs at the start of every forward of the model (zero.py launches
    the reductions a backward left incomplete). Frees every unit: the forward gathers them."""

    def __init__(self, model: nn.Module, units: list[Unit], collectives: ShardCollectives,
                 before_forward: Callable[[], None]):
        self.collectives, self.before_forward = collectives, before_forward
        for unit in units:
            self.free(unit)
        self.in_backward = False
        self._finished_forward: list[Unit] = []  # units in the order their forward ended
        self._forward = units[::-1]
        self._next_in_forward = dict(zip(map(id, self._forward), self._forward[1:]))
        # The unit whose forward ends last is needed first by backward: it stays.
        self._held = self._forward[0] if self._forward[0].module is model else self._forward[-1]
        model.register_forward_pre_hook(self._begin_forward)
        for unit in self._forward:
            unit.module.register_forward_pre_hook(partial(self._pre_forward, unit))
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

    def _post_forward(self, unit: Unit, module: nn.Module, args: tuple, output) -> None:
        if self.in_backward:
            return
        self._finished_forward.append(unit)
        outputs = [t for t in torch.utils._pytree.tree_leaves(output)
                   if isinstance(t, torch.Tensor) and t.requires_grad]
        if outputs:
            torch.autograd.graph.register_multi_grad_hook(outputs, partial(self._pre_backward, unit), mode="any")
        if unit is not self._held or not outputs:
            self.free(unit)

    def _pre_backward(self, unit: Unit, _grad) -> None:
        """Gradients of the unit's outputs are ready: its backward is next."""
        self.in_backward = True
        self.gather(unit)
        order = self._finished_forward[::-1]
        position = order.index(unit)
        if position + 1 < len(order):
            self.gather(order[position + 1], wait=False)  # prefetch

    def gather(self, unit: Unit, wait: bool = True) -> None:
        """The unit's full parameters, all-gathered from the shards (``wait=False``: started only)."""
        if not unit.gathered:
            unit.full.untyped_storage().resize_(unit.full.numel() * unit.full.element_size())
            # every rank's S-element shard of the unit's weights, into the regrown full buffer the layer runs on
            unit.gathering = self.collectives.all_gather(unit.full, unit.shard)
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
