"""Master weights: the optimizer steps on fp32 copies of the parameters, kept
apart from the working weights. One mechanism, two uses.

``--param-dtype bf16`` (Micikevicius et al. 2018, "Mixed Precision
Training"). Storing the working parameters in bf16 halves their memory and
the bytes moved by every forward and backward (and every all-gather of them).
But an optimizer update cannot be applied to a bf16 weight directly: with 8
significant bits, the spacing between neighbouring bf16 values near w lies in
(2^-8|w|, 2^-7|w|], and w + du rounds back to w whenever |du| is under half
that spacing: always below 2^-9|w|, and up to 2^-8|w| at the bottom of a
binade (w = 1 with lr*g = 1e-3 stays 1 forever). Late in training most
updates are that small. The optimizer therefore updates an fp32 master copy,
where such updates accumulate, and the bf16 weight is re-rounded from it
after each step.

``--offload optimizer`` (ZeRO-Offload, Ren et al. 2021). The same masters,
placed in host memory: the model's weights and the forward/backward stay on
the accelerator; the fp32 masters, their fp32 gradients and the optimizer's
state live on the host, and the optimizer step runs on the CPU.

Per optimizer step, after the backward pass (and the data-parallel
gradient average)::

    g_master <- g_model (as fp32)          copy_grads_to_master (device -> host
                                           when offloaded, 4 B/param); the
                                           model's gradients are freed
    optimizer.step() on (x_master, g_master)
    x_model <- round(x_master)             copy_master_to_model (host -> device)

Bytes per parameter with AdamW (the optimizer state holds exp_avg and
exp_avg_sq, 4 B each):

    layout                         device                         host
    fp32, no masters               4 w + 4 g + 8 state = 16       0
    --param-dtype bf16             2 w + 4 master + 4 g + 8 = 18  0
    --offload optimizer            4 w + 4 g (backward only)      4 + 4 + 8 = 16
    --param-dtype bf16 --offload   2 w + 2 g (backward only)      16

The bf16 row is the 2 + 4 + 12 of the literature (12 = fp32 gradient and two
moments, at the moment of the step; the bf16 gradient, 2 B, lives during
backward and is freed by `copy_grads_to_master`). On one device it does not
shrink the parameter-side total; the gain is bandwidth and activation memory,
and under ZeRO-style sharding, where the fp32 master and moments are divided
across ranks while the bf16 copy is the only thing gathered. Offload removes
12 B/param from the device for two PCIe transfers of the model per step and a
CPU-speed optimizer step: it pays when memory, not step time, limits the
model size. Host buffers are pinned when CUDA is present, so the copies run
as DMA without a staging copy.

Gradients accumulate over micro-batches in the data-parallel buckets (in
fp32 by default, see parallel/data.py: ``--reduce-dtype``), and the copy to
the master runs once per optimizer step, after the data-parallel reduction,
because the reduction needs device tensors.

Checkpoints save the masters, under the model's parameter names, as the
model weights (see train/checkpoint.py): a run's checkpoint is full fp32
whatever the working dtype, and a bf16 run resumes from it exactly.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from scaletrain.errors import UserError


class MasterWeights:
    """fp32 master copies of a model's parameters, on ``device`` (default: the parameter's own).

    Build the optimizer over `master_groups(...)`, then per step: backward on
    the model, `copy_grads_to_master()`, optimizer step on the masters,
    `copy_master_to_model()`. The working parameters are cast to ``dtype``
    in place (the same ``Parameter`` objects, so references to them hold).
    """

    def __init__(self, model: nn.Module, dtype: torch.dtype = torch.bfloat16,
                 device: torch.device | str | None = None):
        self.dtype = dtype
        self.names: list[str] = []
        self.model_params: list[nn.Parameter] = []
        self.master_params: list[torch.Tensor] = []
        # Pinned host memory lets device<->host copies run asynchronously.
        host = device is not None and torch.device(device).type == "cpu"
        self._pinned = host and torch.cuda.is_available()
        # named_parameters() yields a tied weight once, so it gets one master.
        for name, param in model.named_parameters():
            if not param.is_floating_point():
                continue
            if not param.requires_grad:  # a fine-tune's frozen base: never stepped, so no master
                param.data = param.detach().to(dtype)
                continue
            # The master is taken before rounding: it starts from the exact
            # fp32 initialisation, not from its bf16 image.
            master = torch.empty(param.shape, dtype=torch.float32, device=device or param.device,
                                 pin_memory=self._pinned)
            master.copy_(param.detach())
            # Assigning .data keeps the same Parameter object, so optimizer
            # groups and tied references built from the model still match.
            param.data = param.detach().to(dtype)
            self.names.append(name)
            self.model_params.append(param)
            self.master_params.append(master)
        self._master_of = {id(p): m for p, m in zip(self.model_params, self.master_params)}
        # Gradient buffers of the masters, made on first need and kept: pinning is expensive.
        self._grad_buffers: list[torch.Tensor | None] = [None] * len(self.master_params)

    def master_of(self, param: torch.Tensor) -> torch.Tensor | None:
        """The master of a model parameter, or None for any other tensor."""
        return self._master_of.get(id(param))

    def master_groups(self, param_groups: list[dict]) -> list[dict]:
        """The same optimizer groups with each model parameter replaced by its master."""
        groups = []
        for group in param_groups:
            try:
                masters = [self._master_of[id(p)] for p in group["params"]]
            except KeyError:
                raise UserError("A parameter group holds a tensor that is not a floating "
                                "parameter of the model these master weights wrap.") from None
            groups.append({**group, "params": masters})
        return groups

    @torch.no_grad()
    def copy_grads_to_master(self, gradient_of: Callable[[nn.Parameter], torch.Tensor | None]
                             = lambda param: param.grad) -> None:
        """Each model gradient, as fp32, into its master's gradient; the model's are freed.

        ``gradient_of(param)`` says where a parameter's reduced gradient lives
        (by default ``.grad``; the data-parallel buckets when they keep it in
        fp32). An fp32 gradient on the master's device becomes the master's
        gradient as it is, without a copy; others are copied into a buffer
        of the master's. A parameter without a gradient leaves its master
        without one too, so the optimizer skips it as it would the model
        parameter.
        """
        synced = set()
        for i, (param, master) in enumerate(zip(self.model_params, self.master_params)):
            grad = gradient_of(param)
            param.grad = None
            if grad is None or (grad.dtype == torch.float32 and grad.device == master.device):
                master.grad = grad
                continue
            if self._grad_buffers[i] is None:
                self._grad_buffers[i] = torch.empty(master.shape, dtype=torch.float32, device=master.device,
                                                    pin_memory=self._pinned)
            master.grad = self._grad_buffers[i]
            master.grad.copy_(grad, non_blocking=self._pinned)
            if grad.is_cuda:
                synced.add(grad.device)
        # Asynchronous device->host copies must land before the CPU reads them.
        for device in synced:
            torch.cuda.synchronize(device)

    def working_pairs(self) -> list[tuple[torch.Tensor, nn.Parameter]]:
        """(master, working parameter) pairs, for an optimizer that rounds the
        masters into the model in the pass that steps them (the fused AdamW)."""
        return list(zip(self.master_params, self.model_params))

    @torch.no_grad()
    def copy_master_to_model(self) -> None:
        """Round every master to the working dtype (nearest-even) into the model's parameter."""
        for param, master in zip(self.model_params, self.master_params):
            # Safe without waiting: the master is next written by the next
            # step, after copy_grads_to_master's synchronize.
            param.copy_(master, non_blocking=self._pinned)
