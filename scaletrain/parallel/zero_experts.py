"""ZeRO with expert parallelism: the dense weights sharded over the ranks holding copies of them,
each expert over the ranks holding copies of it.

Rajbhandari et al. 2022, "DeepSpeed-MoE" (expert-data parallelism); Megatron-LM's distributed
optimizer does the same. With ``--ep`` the dense weights (attention, norms, routers, embeddings)
have a copy on every rank of the ``dense`` group (dp x ep), an expert only on the ranks of the
``experts`` group (dp: the ep ranks hold other experts; train/replicas.py). ZeRO shards a weight
over the ranks holding copies of it, so there are two ZeROs (parallel/zero.py), one per group,
each over its own parameters (``params``):

    dense     sharded over dp x ep    gradients summed there, divided by dp x ep
    experts   sharded over dp         gradients summed there, divided by dp x ep

An expert's gradient already sums the ep ranks' tokens (the combine's backward carries them
home, parallel/experts.py), so its sum over dp covers the losses of all dp x ep ranks: it is
divided by their count, as `JointDataParallel` does without ZeRO (parallel/data.py).

Under stage 3 a block holding experts is two units, its dense weights and this rank's experts,
each gathered before the block runs by the hooks of its own ZeRO (parallel/zero3.py), over its
own group, and freed after; a pipeline's round holds both ZeROs' units. Units reduce-scatter as
they complete, so an expert that routing gave no rows on one rank still gives a (zero) gradient
there, where the others give theirs (models/moe.py: `run_experts`).

The gradient norm: the dense shards partition the dense weights over dp x ep; the experts'
shards partition this ep rank's experts over dp, and the ep ranks hold different experts. So
over the ``dense`` group (`group`) every element of the model is counted once, by its shard's
holder, and the norm sums over that group alone, not over ep a second time (train/layout.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from scaletrain.parallel.data import JointDataParallel
from scaletrain.parallel.zero import FlatShard, ZeroDataParallel
from scaletrain.parallel.zero3 import PipelineGathering
from scaletrain.parallel.zero_units import Unit
from scaletrain.runtime.comm import Comm
from scaletrain.runtime.mesh import Group


class JointZero(JointDataParallel):
    """ZeRO over ``dense`` (the model's dense weights) and ``experts`` (this rank's experts, or None
    where it holds none, as a pipeline stage without MoE layers), driven as one `ZeroDataParallel`:
    the step, the update (train/step_weights.py) and the checkpoint call the same methods
    (`no_sync`, `finish_gradient_sync` and `zero_grad` each part's in turn, as `JointDataParallel`)."""

    def __init__(self, dense: ZeroDataParallel, experts: ZeroDataParallel | None):
        super().__init__([dense] if experts is None else [dense, experts])
        # the group over which both parts' shards hold the whole model once (module docstring)
        self.group: Group = dense.group
        self.units: list[Unit] = [unit for part in self.parts for unit in part.units]
        self._part_of = {id(p): part for part in self.parts for unit in part.units for p in unit.params}
        # ZeRO-3 inside pipeline stages: the round that holds both parts' units (train/layout.py)
        rounds = [part.gathering for part in self.parts if isinstance(part.gathering, PipelineGathering)]
        self.gathering = RoundOfBoth(rounds) if rounds else None

    # -- what the optimizer and the checkpoint see ---------------------------
    def optimizer_groups(self, param_groups: list[dict]) -> list[dict]:
        """The same optimizer groups holding both parts' pieces of their parameters."""
        per_part = [part.optimizer_groups(param_groups) for part in self.parts]
        return [{**group, "params": [t for groups in per_part for t in groups[i]["params"]]}
                for i, group in enumerate(param_groups)]

    def flat_shards(self, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
        """Both parts' shards by ``state_dict`` key, and their optimizer state by name. Each part
        lists every key, its own as shards and the other's as the model holds them (under stage 3,
        empty storage): the shard is the entry that counts."""
        model: dict = {}
        optim: dict = {}
        for part in self.parts:
            weights, state = part.flat_shards(optimizer)
            for key, value in weights.items():
                if isinstance(value, FlatShard) or key not in model:
                    model[key] = value
            optim.update(state)
        return model, optim

    def memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        """Both parts' tensors by ledger entry (a storage both list is counted once: train/memory.py)."""
        tensors: dict[str, list[torch.Tensor]] = {}
        for part in self.parts:
            for entry, listed in part.memory_tensors().items():
                tensors.setdefault(entry, []).extend(listed)
        return tensors

    # -- the per-step protocol -------------------------------------------------
    def gradient(self, param: nn.Parameter) -> torch.Tensor:
        return self._part_of[id(param)].gradient(param)

    def copy_grads_to_master(self) -> None:
        for part in self.parts:
            part.copy_grads_to_master()

    def publish(self) -> None:
        for part in self.parts:
            part.publish()


class RoundOfBoth:
    """ZeRO-3 inside pipeline stages: a run of the schedule holds both parts' round units."""

    def __init__(self, gatherings: list[PipelineGathering]):
        self.gatherings = gatherings

    @contextmanager
    def round(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for gathering in self.gatherings:
                stack.enter_context(gathering.round())
            yield


def zero_with_experts(model: nn.Module, comm: Comm, dense: Group, experts: Group,
                      expert_params: dict[nn.Parameter, str], **options) -> JointZero:
    """ZeRO (``options``: `ZeroDataParallel`'s) over ``dense`` for the model's weights but its
    ``expert_params``, which it shards over ``experts``; both divide their sums by the size of
    ``dense`` (module docstring). Weights tied across pipeline stages (``own_units``) are dense."""
    dense_part = ZeroDataParallel(model, comm, dense, **options,
                                  params=[q for q in model.parameters() if q not in expert_params])
    held = [q for q in model.parameters() if q in expert_params]
    experts_part = ZeroDataParallel(model, comm, experts, **{**options, "own_units": ()}, params=held,
                                    average_over=dense.size) if held else None
    return JointZero(dense_part, experts_part)
