"""Optimizer offload to host memory (ZeRO-Offload, Ren et al. 2021).

The model's weights and the forward/backward stay on the accelerator; the
optimizer's state, an fp32 master copy of every parameter and its fp32
gradient live in host memory, and the optimizer step runs on the CPU:

    per step:  g_host <- g_device               (device -> host, 4 B/param)
               inner.step() on (x_host, g_host)  (CPU, e.g. AdamW)
               x_device <- x_host                (host -> device)

Device memory saved per parameter, with AdamW: 8 B of moments + 4 B of master
(when the device weights are lower precision) move to the host; the device
keeps only weights and gradients. Trade-off: two PCIe transfers of the full
model per step and a CPU-speed optimizer step, so it pays when memory, not
the step time, is what limits the model size (large models, large batches
over which the per-step transfer is amortized). Host buffers are pinned when
CUDA is present, which lets the copies run as DMA without a staging copy.

The wrapper presents the model's own parameters: ``param_groups[i]["params"]``
are the device parameters (checkpoint code names them via the model), group
options set on the wrapper (the trainer's ``lr``) are pushed to the inner
optimizer at every ``step``, and ``state[p]`` for a device parameter is the
inner optimizer's state of its host copy. ``state_dict``/``load_state_dict``
are the inner optimizer's: by position, so interchangeable with the same
optimizer built over the device parameters directly.

Masters follow outside writes: if a device parameter was modified in place
by anything but this optimizer (loading a checkpoint, a broadcast), its
autograd version counter moved, and the next ``step`` re-reads it into the
master first. With fp32 device weights that re-read is exact; with
lower-precision device weights it drops the master's extra bits, once.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any, Callable, Iterator

import torch


class _DeviceKeyedState(MutableMapping):
    """``optimizer.state`` seen through device parameters: reads and writes go
    to the inner optimizer's state of the matching host copy."""

    def __init__(self, inner: torch.optim.Optimizer, host_of: dict[torch.Tensor, torch.Tensor]):
        self._inner = inner
        self._host_of = host_of

    def __getitem__(self, p: torch.Tensor) -> dict:
        return self._inner.state[self._host_of[p]]

    def __setitem__(self, p: torch.Tensor, value: dict) -> None:
        host = self._host_of[p]
        # The inner step runs on the host: state arriving from the device
        # (a checkpoint loaded there) is moved next to the host copy.
        self._inner.state[host] = {k: v.to(host.device) if torch.is_tensor(v) else v
                                   for k, v in value.items()}

    def __delitem__(self, p: torch.Tensor) -> None:
        del self._inner.state[self._host_of[p]]

    def __contains__(self, p: object) -> bool:
        return p in self._host_of and self._host_of[p] in self._inner.state

    def __iter__(self) -> Iterator[torch.Tensor]:
        return (p for p, host in self._host_of.items() if host in self._inner.state)

    def __len__(self) -> int:
        return sum(1 for _ in self)


class OffloadedOptimizer:
    def __init__(self, model_param_groups: list[dict],
                 make_optimizer: Callable[[list[dict]], torch.optim.Optimizer]):
        self._pinned = torch.cuda.is_available()
        self._pairs: list[tuple[torch.Tensor, torch.Tensor]] = []  # (device, host)
        self._grad_buffer: dict[torch.Tensor, torch.Tensor] = {}  # host param -> its grad
        host_groups = []
        for group in model_param_groups:
            hosts = []
            for p in group["params"]:
                host = torch.empty(p.shape, dtype=torch.float32, pin_memory=self._pinned)
                host.copy_(p.detach())
                # The gradient buffer is allocated once: pinning is expensive
                # and must not happen every step.
                self._grad_buffer[host] = torch.zeros(p.shape, dtype=torch.float32,
                                                      pin_memory=self._pinned)
                hosts.append(host)
                self._pairs.append((p, host))
            host_groups.append({**group, "params": hosts})
        self._host_of = {dev: host for dev, host in self._pairs}
        self.inner = make_optimizer(host_groups)
        # The wrapper's groups carry the inner optimizer's options (its
        # defaults filled in) over the device parameters.
        self.param_groups = [{**inner, "params": list(group["params"])}
                             for inner, group in zip(self.inner.param_groups, model_param_groups)]
        self._versions = {dev: dev._version for dev, _ in self._pairs}

    @property
    def state(self) -> _DeviceKeyedState:
        return _DeviceKeyedState(self.inner, self._host_of)

    @torch.no_grad()
    def step(self, closure: Callable[[], torch.Tensor] | None = None) -> torch.Tensor | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for outer, inner in zip(self.param_groups, self.inner.param_groups):
            inner.update({k: v for k, v in outer.items() if k != "params"})

        synced_devices = set()
        for dev, host in self._pairs:
            if dev._version != self._versions[dev]:
                host.copy_(dev)  # written from outside since our last step
            if dev.grad is None:
                # No gradient on the device, none on the host: the inner
                # optimizer skips the parameter as it would on the device.
                host.grad = None
                continue
            host.grad = self._grad_buffer[host]
            host.grad.copy_(dev.grad, non_blocking=self._pinned)
            if dev.grad.is_cuda:
                synced_devices.add(dev.grad.device)
        # Non-blocking device->host copies must land before the CPU reads them.
        for device in synced_devices:
            torch.cuda.synchronize(device)

        self.inner.step()

        for dev, host in self._pairs:
            if host.grad is not None:
                # Non-blocking is safe: the host master is next written by the
                # next step, after its synchronize, which orders after this copy.
                dev.copy_(host, non_blocking=self._pinned)
            self._versions[dev] = dev._version
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for dev, _ in self._pairs:
            if dev.grad is None:
                continue
            if set_to_none:
                dev.grad = None
            else:
                dev.grad.zero_()

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.inner.load_state_dict(state_dict)
        for outer, inner in zip(self.param_groups, self.inner.param_groups):
            outer.update({k: v for k, v in inner.items() if k != "params"})

    def bytes_by_device(self) -> dict[str, int]:
        """Bytes this optimizer holds, by device: the inner optimizer's state
        tensors, the fp32 masters and the fp32 gradient buffers (all on the
        host here). The model's own weights and gradients are not counted."""
        tensors: dict[int, torch.Tensor] = {}
        for _, host in self._pairs:
            for t in (host, self._grad_buffer[host], *self.inner.state.get(host, {}).values()):
                if torch.is_tensor(t):
                    tensors[id(t)] = t
        totals: dict[str, int] = {}
        for t in tensors.values():
            totals[str(t.device)] = totals.get(str(t.device), 0) + t.numel() * t.element_size()
        return totals
