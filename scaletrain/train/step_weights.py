"""What the optimizer steps, and how gradients reach it and updated values leave it.

Three answers, one interface. The engine's update (train/stepper.py) calls the
same three hooks whatever the layout chose, and tests nothing:

    take_gradients()    the averaged gradients onto the tensors the optimizer steps
    give_weights(step)  after the optimizer's step: the stepped values into the model's
                        weights (and with local SGD, the replicas averaged when due)
    zero_grad()         every gradient the step used, cleared for the next

`ModelWeights`     the optimizer steps the model's weights themselves: fp32, or
                   pure bf16 (optim/stochastic_rounding.py rounds its updates);
                   nothing to copy either way
`MasterCopies`     fp32 masters beside 16-bit working weights, or in host memory
                   with --offload (optim/masters.py, Micikevicius et al. 2018):
                   gradients copied up into fp32, the masters rounded back down
                   (unless the fused AdamW wrote the working copies itself)
`ZeroShards`       ZeRO's flat shards, each rank stepping its own (parallel/zero.py,
                   Rajbhandari et al. 2020): the reduced gradient shard into the
                   masters, the updated shards published to every rank's weights
"""

from __future__ import annotations

from typing import Protocol

import torch

from scaletrain.optim.masters import MasterWeights
from scaletrain.parallel.local_sgd import LocalSGD
from scaletrain.parallel.zero import ZeroDataParallel
from scaletrain.parallel.zero_experts import JointZero


class StepWeights(Protocol):
    """The three hooks of the update (module docstring)."""

    def take_gradients(self) -> None: ...

    def give_weights(self, step: int) -> bool: ...

    def zero_grad(self) -> None: ...


class ModelWeights:
    """The optimizer steps the model's own weights, their gradients those the data-parallel
    wrapper averaged (with ``local_sgd``, the stepped tensors averaged every N steps instead)."""

    def __init__(self, data_parallel, local_sgd: LocalSGD | None):
        self.data_parallel, self.local_sgd = data_parallel, local_sgd

    def take_gradients(self) -> None:
        pass  # the gradients are already where the optimizer reads them

    def give_weights(self, step: int) -> bool:
        """After optimizer step ``step`` (from 1): whether local SGD averaged the weights now."""
        return self.local_sgd is not None and self.local_sgd.average_if_due(step)

    def zero_grad(self) -> None:
        self.data_parallel.zero_grad()


class MasterCopies(ModelWeights):
    """fp32 masters beside the model's working weights: the optimizer steps the masters."""

    def __init__(self, data_parallel, local_sgd: LocalSGD | None, masters: MasterWeights,
                 optimizer: torch.optim.Optimizer, fused_working_copy: bool):
        super().__init__(data_parallel, local_sgd)
        self.masters, self.optimizer, self.fused_working_copy = masters, optimizer, fused_working_copy

    def take_gradients(self) -> None:
        self.masters.copy_grads_to_master(self.data_parallel.gradient)  # up to fp32 (to the host with offload)

    def give_weights(self, step: int) -> bool:
        averaged = super().give_weights(step)
        # The masters' update rounded down into the working weights, unless the fused AdamW wrote
        # them in its pass; masters local SGD has just averaged must reach them either way.
        if averaged or not self.fused_working_copy:
            self.masters.copy_master_to_model()
        return averaged

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)  # the masters' gradients
        super().zero_grad()  # the model's


class ZeroShards:
    """ZeRO's shards: each rank steps the elements it owns and publishes them."""

    def __init__(self, zero: ZeroDataParallel | JointZero):
        self.zero = zero

    def take_gradients(self) -> None:
        self.zero.copy_grads_to_master()  # this rank's reduced shard into its fp32 masters

    def give_weights(self, step: int) -> bool:
        self.zero.publish()  # stages 1 and 2 all-gather the updated shards; stage 3 gathers before use
        return False

    def zero_grad(self) -> None:
        self.zero.zero_grad()
