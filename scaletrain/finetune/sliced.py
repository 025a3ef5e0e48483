"""A Hugging Face folder loaded slice by slice: no full copy of the model anywhere.

The plain way to start from released weights builds the whole model, reads
every tensor, and only then splits the model over the ranks: each rank holds
the whole model once (twice, with the freshly initialized weights beside the
read ones) before it keeps its share. For a 70B model that is 280 GB of host
memory per rank in fp32.

Here the model is built on the meta device (shapes, no storage), split there
(tensor parallelism keeps each rank's slices, the pipeline prunes the other
stages, expert parallelism the other experts, all on meta), and only then
does each weight get storage, filled straight from the safetensors files
with the slice this rank keeps:

    a replicated weight          the whole tensor
    a tp-split weight            its chunks: ``Split.chunks(rank)``, each a
                                 rectangle of the full tensor, read as a slice
                                 (safetensors reads a slice from the file's
                                 mapping without touching the rest)
    a weight of a pruned stage   nothing: it is gone before anything is read
    a ZeRO-3 unit                its flat range on this rank (`read_flat`),
                                 read into the unit as zero.py builds it, one
                                 unit at a time

so a rank's peak is its own share plus one unit, not the model
(docs/models.md gives the measured figures and the command). A weight the
folder stores transposed (a Conv1D layer's [in, out]) is sliced on the transposed
indices and turned back. Every rank reads the same file, so the replicas
start equal without a broadcast.

LoRA over a float base reads the same way (`FolderSource.adapt`): the adapters
are put in on the meta device before the splits, each frozen ``X.base.weight``
is read under the plain model's ``X.weight``, and each adapter's A and B are
not read but made, whole, as the model built whole makes them (lora.py's
`starting_values`: A drawn by a generator of the run's seed and the layer's
name, B zero), then cut like any weight: a tp rank keeps its slice, ZeRO-3 its
range. A PEFT adapter continued with ``--adapter`` gives its A and B (and the
modules it trained whole) from its own file instead.

A 4-bit base (``--quantize nf4``, QLoRA) reads one matrix at a time: its codes
(nf4.py) are a function of the whole matrix (its mean block scale ``mu`` and the
groups of 256 scales span it), so a rank reads each quantized matrix whole,
codes it exactly as the whole load does, and keeps what its layout keeps:
under ZeRO-3 its bytes of each block's unit of codes (parallel/zero_units.py's
`code_unit`), elsewhere the codes whole. The float matrix is dropped as soon
as it is coded, so a rank's peak is its share plus one matrix in fp32, never
the model: every rank reads every quantized matrix (the reads are I/O, not
memory), each the same codes, so the replicas start equal without a broadcast.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from scaletrain.finetune.hf import HFModel, folder_tensors, is_hf_folder, read_hf_model
from scaletrain.finetune.lora import LoRALinear, plain_names, starting_values
from scaletrain.finetune.nf4 import NF4Linear, quantized_buffers


class FolderSource:
    """Our model's weights as slices of a Hugging Face folder, by our parameter names."""

    def __init__(self, hf_model: HFModel, family_cfg: Any):
        self.reader, hf_of_ours = folder_tensors(hf_model, family_cfg)
        transposed = {name for name, (_, t) in hf_model.spec.hf.names(family_cfg).items() if t}
        self.where = {ours: (name, name in transposed) for name, ours in hf_of_ours.items()}
        self.plain: dict[str, str] = {}  # an adapted layer's frozen weight -> the plain model's name of it
        self.made: dict[str, Callable[[], torch.Tensor]] = {}  # weights made, not read: the adapters'
        self.coded: dict[str, tuple[str, str]] = {}  # a 4-bit layer's buffer -> (the weight it codes, which)
        self._codes: dict[str, dict[str, torch.Tensor]] = {}  # each coded weight's buffers not yet taken

    def adapt(self, model: nn.Module, seed: int, given: dict[str, torch.Tensor]) -> None:
        """Read ``model`` (whole, on the meta device, its adapters in) for a LoRA fine-tune: the
        frozen base under the plain model's names (a 4-bit one coded from them), the adapters made
        as the run of ``seed`` starts them (module docstring), and the tensors ``given`` (a PEFT
        adapter's, by our names) as given."""
        self.plain = plain_names(model)
        self.made = {**starting_values(model, seed), **{name: partial(torch.Tensor.clone, tensor)
                                                        for name, tensor in given.items()}}
        for name, layer in model.named_modules():
            if isinstance(layer, LoRALinear) and isinstance(layer.base, NF4Linear):
                self.plain[f"{name}.base.bias"] = f"{name}.bias"
                self.coded.update({f"{name}.base.{key}": (f"{name}.weight", key)
                                   for key, _ in layer.base.named_buffers() if key != "bias"})

    def buffer(self, name: str) -> torch.Tensor:
        """Our buffer ``name`` whole: a 4-bit layer's codes, or its bias."""
        if name not in self.coded:
            return self.read(name, (slice(None),))
        weight, key = self.coded[name]
        if weight not in self._codes:  # the whole matrix, coded as the whole load codes it, then dropped
            self._codes[weight] = quantized_buffers(self.read(weight, (slice(None),)).float())
        codes = self._codes[weight]
        values = codes.pop(key)  # each buffer is taken once: what is left of the matrix is its codes not yet taken
        if not codes:
            del self._codes[weight]
        return values

    def read(self, name: str, index: tuple[slice, ...]) -> torch.Tensor:
        """``ours[index]`` of our weight ``name`` in its full, single-device layout."""
        if name in self.made:
            return self.made[name]()[index]
        hf_name, transposed = self.where[self.plain.get(name, name)]
        if not transposed:
            return self.reader.read(hf_name, index)
        theirs = tuple(reversed((*index, *[slice(None)] * (2 - len(index)))))
        return self.reader.read(hf_name, theirs).t()

    def read_flat(self, name: str, shape: tuple[int, ...], lo: int, hi: int) -> torch.Tensor:
        """Elements [lo, hi) of our weight ``name`` (full shape ``shape``) flattened: the rows
        that hold them are read, the ends cut."""
        row = math.prod(shape[1:])
        first, last = lo // row, -(-hi // row)
        rows = self.read(name, (slice(first, last),)).reshape(-1)
        return rows[lo - first * row:hi - first * row]


def folder_source(cfg, family_cfg: Any) -> FolderSource | None:
    """The Hugging Face folder a fine-tune starts from, to read slice by slice: a full fine-tune's,
    or LoRA's base, float or coded in 4 bits (with ``--lora-modules-to-save`` and ``--adapter`` too:
    their tensors are read or given like any other, `FolderSource.adapt`). None for any other run:
    a base that is one of our runs (its checkpoint loads whole)."""
    base = cfg.finetune.base
    if not base or not is_hf_folder(Path(base)):
        return None
    return FolderSource(read_hf_model(Path(base)), family_cfg)


def materialize(model: nn.Module, source: FolderSource, device: torch.device, splits: dict, tp_rank: int,
                skip: set[int] = frozenset()) -> None:
    """Give every meta weight of ``model`` storage on ``device``, filled with this rank's slice
    from ``source`` (``splits``: tensor parallelism's Split of each split weight), and every meta
    buffer (a 4-bit layer's) its values whole; the tensors whose ids are in ``skip`` stay meta
    (ZeRO-3 fills them unit by unit)."""
    for name, buffer in list(model.named_buffers()):
        if buffer.is_meta and id(buffer) not in skip:
            values = source.buffer(name)
            torch.utils.swap_tensors(buffer, values.to(device, torch.float32 if values.is_floating_point() else None))
    for name, param in list(model.named_parameters()):
        if not param.is_meta or id(param) in skip:
            continue
        split = splits.get(param)
        if split is None:
            values = source.read(name, tuple(slice(0, n) for n in param.shape))
        else:
            values = torch.cat([source.read(name, tuple(slice(o, o + s) for o, s in zip(offsets, sizes)))
                                for offsets, sizes, _ in split.chunks(tp_rank)], dim=split.dim)
        tensor = values.to(device=device, dtype=torch.float32)
        torch.utils.swap_tensors(param, nn.Parameter(tensor, requires_grad=param.requires_grad))


def flat_reader(model: nn.Module, source: FolderSource):
    """For ZeRO-3: ``read(tensor, lo, hi)``, elements [lo, hi) of the meta weight ``tensor``
    flattened (one that tensor parallelism left whole), or of a 4-bit layer's meta code buffer."""
    names = {id(t): name for name, t in (*model.named_parameters(), *model.named_buffers())}

    def read(tensor: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        name = names[id(tensor)]
        if name in source.coded:
            return source.buffer(name).reshape(-1)[lo:hi]
        return source.read_flat(name, tuple(tensor.shape), lo, hi).float()

    return read


def load_hf_model(folder: Path) -> tuple[torch.nn.Module, Any]:
    """The model in a Hugging Face folder (fp32, in eval mode) and its family's config: built on
    the meta device, each weight read straight into its own storage."""
    from scaletrain.config import ModelConfig

    hf_model = read_hf_model(folder)
    family_cfg = hf_model.family_cfg(ModelConfig(**hf_model.values))
    source = FolderSource(hf_model, family_cfg)  # every name and shape checked before any weight is read
    with torch.device("meta"):
        model = hf_model.spec.build(family_cfg)
    materialize(model, source, torch.device("cpu"), splits={}, tp_rank=0)
    return model.eval(), family_cfg
