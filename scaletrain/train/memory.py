"""The memory ledger: where one rank's bytes go during training.

Four entries, each in bytes on this rank:

``params``, ``grads``, ``optimizer``
    Counted from the tensors themselves (``model_bytes``). With fp32 master
    weights (optim/masters.py) the masters count under ``optimizer`` (as in
    the ZeRO paper's K = 12 bytes: master, momentum, variance) and their fp32
    gradients under ``grads``; ``by_device`` then shows what ``--offload``
    moved to the host. Each storage counts once and in full, since that is
    what stays allocated: a tied weight (a tied head and token embedding)
    counts once, and a view counts the storage it looks into. For
    mixed-precision AdamW in fp32 this gives the familiar 4N + 4N + 8N (plus
    a 4-byte step counter per tensor).
``activations_peak``
    The most bytes of saved activations alive at one moment during forward and
    backward of one micro-batch (``ActivationMeter``); with ``--pp``, of a
    whole round of the schedule on this rank's stages.
``cuda_peak``
    ``torch.cuda.max_memory_allocated`` over the same micro-batch, on a GPU: the
    allocator's view, which also holds temporaries, gradients of activations and
    fragmentation, so it is the number to budget with; the entries above say what
    it is made of.

What ``ActivationMeter`` counts: a storage is a saved activation from the
moment autograd saves a tensor on it for backward until the storage is freed;
parameters and buffers of the metered module are excluded (a Linear saves its
weight, already counted under ``params``; a weight copy made by autocast is
not a parameter and is counted).

Why more than saved-tensor hooks: only the innermost hooks run, and
non-reentrant ``torch.utils.checkpoint`` installs its own in every checkpointed
region, in the forward and again when it reruns the region in backward, so
plain hooks would miss exactly the recomputation whose memory this meter exists
to show. A ``TorchFunctionMode`` sees every torch call, in backward too, and
puts the meter in front of whatever hooks are on top, leaving them unchanged.

Why storage lifetimes rather than autograd's references: a saved storage also
counts while the program holds it in some other way, as in a checkpointed
forward, where the tensors checkpoint drops stay counted until the region's own
code lets go of them, within that one block. That is memory really in use, and
why the measured peak of ``full`` recompute is the block inputs plus one block's
activations (reached when a block is recomputed in backward), not the inputs alone.

Compiled code (``--compile``): Dynamo cannot trace through saved-tensor hooks,
so the meter reports the eager saved set. Inductor's partitioner saves the same
tensors or fewer (it may recompute cheap elementwise results instead of saving
them), so for a compiled model the figure is an upper bound.

Compressed activations (``--compress-activations``, techniques/compress_activations.py):
the compression hooks sit above the meter's and hand it what they keep (the
bf16 copy, or the int8 blocks and their scales), so the meter counts the
compressed bytes, which is what stays allocated.

Limits: calls that bypass torch's function API inside a checkpointed region
(a custom ``autograd.Function`` saving with ``ctx.save_for_backward``) are not
seen there, unless they make themselves torch functions as the models' own do
(models/lean_saves.py); outside such regions the meter's base hooks see them.
Gradients of activations and other temporaries of backward are not saved
tensors and are left out on purpose; ``cuda_peak`` includes them.
"""

from __future__ import annotations

import resource
import weakref
from collections.abc import Iterable
from typing import Any, Self

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from scaletrain.optim.masters import MasterWeights

CATEGORIES = ("params", "grads", "optimizer")
ROWS = (*CATEGORIES, "activations_peak", "cuda_peak", "host_peak_at_start")


def _storage_key(t: torch.Tensor) -> tuple[str, int]:
    return str(t.device), t.untyped_storage().data_ptr()


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the storages behind ``tensors``, each storage counted once."""
    sizes = {_storage_key(t): t.untyped_storage().nbytes() for t in tensors}
    return sum(sizes.values())


def _tensors_in(obj: Any) -> Iterable[torch.Tensor]:
    """Every tensor in nested dicts, lists and tuples (an optimizer's state)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from _tensors_in(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _tensors_in(value)


def optimizer_state(optimizer: Any) -> list[torch.Tensor]:
    """Every tensor of an optimizer's ``.state`` (None: no optimizer)."""
    return list(_tensors_in(dict(optimizer.state))) if optimizer is not None else []


def bytes_by_entry(tensors: dict[str, list[torch.Tensor]]) -> dict:
    """Bytes of each entry's storages, in total and per device."""
    devices = sorted({str(t.device) for group in tensors.values() for t in group})
    ledger: dict = {name: tensor_bytes(group) for name, group in tensors.items()}
    ledger["by_device"] = {
        device: {name: tensor_bytes(t for t in group if str(t.device) == device)
                 for name, group in tensors.items()}
        for device in devices
    }
    return ledger


def model_bytes(model: nn.Module, optimizer: Any = None, masters: MasterWeights | None = None,
                grad_buffers: Iterable[torch.Tensor] = (), held: dict[str, list[torch.Tensor]] | None = None) -> dict:
    """Bytes of parameters, gradients and optimizer state of a replicated model,
    in total and per device.

    ``optimizer`` is any object with a ``.state`` of (nested) tensors; None
    counts no optimizer state. ``masters`` adds the fp32 master weights and
    their gradients; ``grad_buffers`` the data-parallel gradient buckets
    (which the gradients are views of, or which hold them in another dtype);
    ``held`` more "params" and "grads" (PipeDream-2BW's second weight
    version and its gradient). (A ZeRO-sharded model lists its own tensors:
    parallel/zero.py.)
    """
    params = list(model.parameters())
    master_params = masters.master_params if masters else []
    held = held or {}
    return bytes_by_entry({
        # buffers: a 4-bit base's codes and scales (finetune/nf4.py)
        "params": [*params, *model.buffers(), *held.get("params", ())],
        "grads": [*(p.grad for p in (*params, *master_params) if p.grad is not None), *grad_buffers,
                  *held.get("grads", ())],
        "optimizer": [*master_params, *optimizer_state(optimizer)],
    })


def peak_resident_bytes() -> int:
    """The largest resident set size this process has had (getrusage; Linux counts KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def memory_ledger(ledger: dict, meter: ActivationMeter | None = None, host_peak: int | None = None) -> dict:
    """A `bytes_by_entry` ledger plus ``activations_peak`` and, on a GPU, ``cuda_peak`` from ``meter``;
    ``host_peak_at_start``: the process's peak resident set once the weights were built or read,
    before the optimizer's and the gradients' buffers (under ZeRO-3 from a folder, after its units,
    which read their shards beside their gradient shards): what a slice-by-slice load keeps small
    (finetune/sliced.py)."""
    if host_peak is not None:
        ledger["host_peak_at_start"] = host_peak
    if meter is not None:
        ledger["activations_peak"] = meter.peak
        if meter.cuda_peak is not None:
            ledger["cuda_peak"] = meter.cuda_peak
    return ledger


def format_table(ledger: dict) -> str:
    """The ledger as aligned text: one row per entry, MiB and exact bytes, then per device."""
    lines = [f"{'memory':<18}{'MiB':>12}{'bytes':>16}"]
    lines += [f"{name:<18}{ledger[name] / 2**20:>12.2f}{ledger[name]:>16,}" for name in ROWS if name in ledger]
    for device, entry in ledger.get("by_device", {}).items():
        lines += [f"{device + ' ' + name:<18}{entry[name] / 2**20:>12.2f}{entry[name]:>16,}"
                  for name in CATEGORIES]
    return "\n".join(lines)


class ActivationMeter:
    """Peak bytes of saved activations during the ``with`` block (see the module docstring).

    Use around forward and backward of one micro-batch::

        with ActivationMeter(model) as meter:
            loss_fn(model(x), y).backward()
        meter.peak   # bytes
        meter.cuda_peak   # bytes, or None when the model is not on a GPU
    """

    def __init__(self, module: nn.Module):
        self.module = module
        self.peak = 0
        self.current = 0
        self.cuda_peak: int | None = None
        self.active = False
        self._live: dict[tuple[str, int], tuple[int, weakref.ref]] = {}
        self._excluded: dict[int, torch.UntypedStorage] = {}  # id -> storage, held so ids stay unique
        self._cuda: torch.device | None = None
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _identity)
        self._mode = _ChainSavedTensorHooks(self)
        # compiled modules run eager in the metered micro-batch only; their compiled code runs from the next one
        self._eager = torch.compiler.set_stance("force_eager")

    def __enter__(self) -> Self:
        tensors = [*self.module.parameters(), *self.module.buffers()]
        # keyed by storage object, which survives ZeRO-3 freeing and re-gathering it (resized, not replaced)
        self._excluded = {id(s): s for s in (t.untyped_storage() for t in tensors)}
        self._cuda = next((t.device for t in tensors if t.is_cuda), None)
        if self._cuda is not None:
            torch.cuda.synchronize(self._cuda)
            torch.cuda.reset_peak_memory_stats(self._cuda)
        self._eager.__enter__()
        self._hooks.__enter__()
        self._mode.__enter__()
        self.active = True
        return self

    def __exit__(self, *exc) -> None:
        self.active = False
        self._mode.__exit__(*exc)
        self._hooks.__exit__(*exc)
        self._eager.__exit__(*exc)
        if self._cuda is not None:
            torch.cuda.synchronize(self._cuda)
            self.cuda_peak = torch.cuda.max_memory_allocated(self._cuda)

    def note(self, t: torch.Tensor) -> None:
        """Count ``t``'s storage as a saved activation until it is freed."""
        key = _storage_key(t)
        storage = t.untyped_storage()
        if key in self._live or id(storage) in self._excluded:
            return
        nbytes = storage.nbytes()
        if nbytes == 0:
            return
        # fires when the storage itself is freed: torch keeps one Python object per live storage, not per tensor
        self._live[key] = (nbytes, weakref.ref(storage, lambda _, key=key: self._freed(key)))
        self.current += nbytes
        self.peak = max(self.peak, self.current)

    def _freed(self, key: tuple[str, int]) -> None:
        nbytes, _ = self._live.pop(key)
        self.current -= nbytes

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        self.note(t)
        return t


def _identity(x):
    return x


def _passes_saves_down(pack) -> bool:
    """Whether ``pack`` belongs to hooks that hand what they keep to the hooks beneath them
    (techniques/compress_activations.py): the meter's own hooks then see the kept bytes and need no chaining."""
    return getattr(getattr(pack, "__self__", None), "passes_saves_down", False)


class _ChainSavedTensorHooks(TorchFunctionMode):
    """Puts the meter in front of whatever saved-tensor hooks are innermost.

    Hooks are looked up when autograd saves, inside the torch call, so running
    the call under a pair that notes the tensor and then defers to the pair
    that was innermost sees every save of that call, checkpoint's included.
    """

    def __init__(self, meter: ActivationMeter):
        super().__init__()
        self.meter = meter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        hooks_disabled = torch._C._autograd._saved_tensors_hooks_get_disabled_error_message() is not None
        if top is None or top[0] == self.meter._pack or hooks_disabled or _passes_saves_down(top[0]):
            return func(*args, **kwargs)
        inner_pack, inner_unpack = top

        def pack(t):
            self.meter.note(t)
            return inner_pack(t)

        def unpack(packed):
            # Checkpoint recomputes inside its unpack hook, during backward,
            # where this mode is not otherwise on (it was switched off while
            # handling the call to backward itself): switch it on for that.
            if not self.meter.active:
                return inner_unpack(packed)
            with self:
                return inner_unpack(packed)

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            return func(*args, **kwargs)
