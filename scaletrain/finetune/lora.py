"""LoRA: low-rank adapters beside frozen weights (Hu et al. 2022, "LoRA: Low-Rank
Adaptation of Large Language Models").

A frozen linear map ``W`` (``d_out x d_in``) is left as it is and a trainable
update of rank ``r`` is added beside it:

    y = x W^T + (alpha / r) * dropout(x) A^T B^T,     A: r x d_in,  B: d_out x r

``A`` starts Kaiming-uniform (``a = sqrt(5)``, as ``nn.Linear`` and PEFT do: uniform on
``[-1/sqrt(d_in), 1/sqrt(d_in)]``) and ``B`` at zero, so the adapted model starts as exactly the
base. Each ``A`` is drawn whole, on the host, by a generator of its own seeded from the run's
seed and the adapted layer's name (`initial_a`), not from the global stream after the model's
own initialization: a model built on the meta device and read slice by slice (finetune/sliced.py)
draws nothing while it is built, and draws each ``A`` only once its layout is known, each rank
keeping its slice. So whole or sliced, on one device or N ranks, every run of a seed starts
from the same adapters. Only ``A`` and
``B`` train: a layer's gradients and AdamW state shrink from ``d_in * d_out``
values to ``r * (d_in + d_out)``. Dividing by ``r`` keeps the update's size
(and the learning rate that suits it) roughly independent of the rank.

Merging folds the update into the base, ``W <- W + (alpha / r) B A``, so the
fine-tuned model runs (or exports) as a plain one at no extra cost; unmerging
subtracts it again. The base may also be a 4-bit ``NF4Linear`` (QLoRA,
nf4.py): the update then stays beside it, since merging needs float weights
(`merged_tensors` folds a saved model's adapters into float weights instead).

Under tensor parallelism (parallel/tensor.py) the adapter splits with its base, so that each
rank's update is exactly the slice of ``B A`` its slice of ``W`` holds (`split_with_base`):

    column-parallel base (W's output rows split):  B's rows split alike, A whole
    row-parallel base (W's input columns split):   A's columns split alike, B whole

and the update joins the base's output where the base's is summed: a column layer's slice of
the output is complete on its rank; a row layer's update ``x_r A_r^T B^T`` is a partial sum,
like ``x_r W_r^T``, and is added before the all-reduce (with sp, the reduce-scatter) that
completes the base's. The whole factor's gradient on each rank is then the share of its
slice (A's gradient through ``B_r`` only; B's through ``x_r A_r^T``), summed over the group.
With sp a column layer's input arrives gathered, so the adapter sees every position too, and
keeps for backward only this rank's chunk of it, as the base's product does (it gathers it again).
Dropout on the adapter's input draws inside the tensor-parallel region's stream, as the
attention's does: each rank its own mask, never one device's (parity runs without dropout).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterable
from functools import partial
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

ADAPTER_PARAMS = ("lora_A", "lora_B")
ADAPTER_FILE = "adapters.safetensors"  # in the run folder, written at the end of a LoRA fine-tune


def adapter_seed(seed: int, layer: str) -> int:
    """The seed of the generator that draws the adapter of ``layer`` in a run of ``seed``: a hash of
    both (stable across processes, unlike Python's ``hash``), below 2**63."""
    digest = hashlib.blake2b(f"{seed}:{layer}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def initial_a(seed: int, layer: str, rank: int, in_features: int) -> torch.Tensor:
    """The starting ``A`` (``rank x in_features``, whole, fp32 on the host) of the adapter of
    ``layer`` in a run of ``seed``: Kaiming-uniform from a generator of its own (module docstring)."""
    generator = torch.Generator().manual_seed(adapter_seed(seed, layer))
    return nn.init.kaiming_uniform_(torch.empty(rank, in_features, device="cpu"), a=math.sqrt(5),
                                    generator=generator)


class LoRALinear(nn.Module):
    """A frozen linear layer (``base``) with a trainable low-rank update beside it; ``layer``, its
    name in the model, and ``seed``, the run's, choose ``A``'s starting values (`initial_a`). A base
    on the meta device gets an ``A`` there too, without values: its reader draws them (sliced.py)."""

    def __init__(self, base: nn.Module, rank: int, alpha: float, dropout: float = 0.0, *, layer: str = "",
                 seed: int = 0):
        super().__init__()
        self.base = base.requires_grad_(False)
        self.rank, self.scaling = rank, alpha / rank
        device = self.base_weight().device
        first = torch.empty(rank, base.in_features, device=device) if device.type == "meta" else \
            initial_a(seed, layer, rank, base.in_features).to(device)
        self.lora_A = nn.Parameter(first)
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, rank, device=device))
        self.dropout = nn.Dropout(dropout)
        self.merged = False

    @property
    def in_features(self) -> int:  # a linear layer's shape, its base's: a tensor-parallel slice's is its own
        return self.base.in_features

    @property
    def out_features(self) -> int:
        return self.base.out_features

    def base_weight(self) -> torch.Tensor:
        """The base's weight as a float tensor (an NF4 base dequantizes it)."""
        return self.base.dequantized_weight() if hasattr(self.base, "dequantized_weight") else self.base.weight

    def delta(self) -> torch.Tensor:
        """The update ``(alpha / r) B A``, shaped like the base weight."""
        return (self.lora_B @ self.lora_A) * self.scaling

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.merged:
            return self.base(x)
        dropped = self.dropout(x)
        product = getattr(self.base, "adapter_product", None)  # a tensor-parallel column's: the module docstring
        first = product(dropped, self.lora_A) if product else dropped @ self.lora_A.t()
        update = (first @ self.lora_B.t()) * self.scaling
        if getattr(self.base, "adds_beside", False):  # a tensor-parallel base sums it with its own output
            return self.base(x, beside=update)
        return self.base(x) + update

    def split_with_base(self, column: bool, parts: int, split: Callable[[nn.Parameter, int, int], nn.Parameter]
                        ) -> nn.Parameter:
        """Split the adapter as its base is split over tensor parallelism (the module docstring):
        ``split(tensor, dim, parts)`` gives this rank's slice (``parts`` fused blocks, a fused q, k, v,
        each cut alike); the factor left whole, whose gradient the group sums."""
        if column:
            self.lora_B = split(self.lora_B, 0, parts)
            return self.lora_A
        self.lora_A = split(self.lora_A, 1, 1)
        return self.lora_B

    @torch.no_grad()
    def merge(self) -> None:
        if not hasattr(self.base, "weight"):
            raise ValueError("a 4-bit base cannot hold the merged update; merge a saved model's tensors into "
                             "float weights with merged_tensors instead")
        if not self.merged:
            self.base.weight += self.delta().to(self.base.weight.dtype)
            self.merged = True

    @torch.no_grad()
    def unmerge(self) -> None:
        if self.merged:
            self.base.weight -= self.delta().to(self.base.weight.dtype)
            self.merged = False


def matches(name: str, pattern: str) -> bool:
    """Whether the dotted ``name`` ends with the parts of ``pattern``, ``*`` standing for any one part
    (``attn.proj`` is ``blocks.0.attn.proj``, not ``blocks.0.mlp.proj``; ``proj`` is both)."""
    parts, wanted = name.split("."), pattern.split(".")
    return len(parts) >= len(wanted) and all(w in ("*", part) for w, part in zip(wanted, parts[-len(wanted):]))


def target_names(model: nn.Module, targets: list[str]) -> list[str]:
    """The linear layers that a pattern of ``targets`` names (`matches`), in the model's order."""
    return [name for name, module in model.named_modules()
            if hasattr(module, "in_features") and any(matches(name, pattern) for pattern in targets)]


def apply_lora(model: nn.Module, targets: list[str], rank: int, alpha: float, dropout: float,
               seed: int = 0) -> list[str]:
    """Freeze every weight, then put an adapter beside each target layer, its ``A`` drawn for the
    run's ``seed`` (`initial_a`); the adapted names."""
    model.requires_grad_(False)
    names = target_names(model, targets)
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, child, LoRALinear(getattr(parent, child), rank, alpha, dropout, layer=name, seed=seed))
    return names


def starting_values(model: nn.Module, seed: int) -> dict[str, Callable[[], torch.Tensor]]:
    """For each adapter of ``model`` (whole, as `apply_lora` left it; on the meta device), by
    parameter name: what gives its whole starting value, ``A`` as `initial_a` draws it for
    ``seed``, ``B`` zero, the values a model built with real weights starts from."""
    values: dict[str, Callable[[], torch.Tensor]] = {}
    for name, layer in model.named_modules():
        if isinstance(layer, LoRALinear):
            values[f"{name}.lora_A"] = partial(initial_a, seed, name, layer.rank, layer.in_features)
            values[f"{name}.lora_B"] = partial(torch.zeros, layer.out_features, layer.rank, device="cpu")
    return values


def plain_names(model: nn.Module) -> dict[str, str]:
    """The adapted layers' frozen weights of ``model`` by their names there (``X.base.weight``) -> by
    the plain model's (``X.weight``), the names a base's files know them by."""
    return {f"{name}.base.{key}": f"{name}.{key}" for name, layer in model.named_modules()
            if isinstance(layer, LoRALinear) for key, _ in layer.base.named_parameters()}


def adapters(model: nn.Module) -> list[LoRALinear]:
    return [module for module in model.modules() if isinstance(module, LoRALinear)]


def rank_above_width(model: nn.Module, option: str = "--lora-rank {}") -> str | None:
    """A sentence when the adapters' rank exceeds min(in, out) of the narrowest layer they adapt: the
    update ``B A`` of that layer has rank at most min(in, out) whatever r is, so the rest of r adds
    memory there and no capacity. Warned, not refused (PEFT accepts it; wider layers may use it).
    ``option``: how the rank is given, the command's flag or the library's keyword."""
    layers = [(min(module.in_features, module.out_features), name, module)
              for name, module in model.named_modules() if isinstance(module, LoRALinear)]
    if not layers:
        return None
    width, name, narrowest = min(layers, key=lambda layer: layer[0])
    if narrowest.rank <= width:
        return None
    return (f"{option.format(narrowest.rank)} is above {width}, min(in, out) of {name} ({narrowest.in_features} "
            f"in, {narrowest.out_features} out), the narrowest layer it adapts: an update of that layer has rank at "
            f"most {width} whatever r is, so the rest of r costs memory there and adds nothing; "
            f"{option.format(width)} or less wastes none.")


def adapter_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """What a fine-tune trains beside its frozen base, by parameter name: the adapters, and any
    module trained whole beside them (finetune/adapters.py)."""
    return {name: param.detach() for name, param in model.named_parameters() if param.requires_grad}


@torch.no_grad()
def load_adapters(model: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Set every tensor of `adapter_state` from ``tensors`` (by its name, one for each), in place: a
    fine-tune that continues from saved adapters (peft_adapter.py)."""
    params = dict(model.named_parameters())
    if tensors.keys() != adapter_state(model).keys():
        raise ValueError(f"the tensors {sorted(tensors)} are not the model's adapters {sorted(adapter_state(model))}")
    for key, value in tensors.items():
        params[key].copy_(value)


def save_adapters(trained: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> int:
    """The adapters (and modules trained whole), by name, whole (`adapter_state`, or of a split
    model a checkpoint's: finetune/adapters.py), in one safetensors file (written beside, then renamed
    into place); their bytes."""
    tensors = {key: value.contiguous() for key, value in trained.items()}
    tmp = path.with_name(f".{path.name}.tmp")
    save_file(tensors, tmp, metadata=metadata)
    tmp.replace(path)
    return sum(t.numel() * t.element_size() for t in tensors.values())


def merge_sources(keys: Iterable[str]) -> dict[str, list[str]]:
    """A saved adapted model's tensors as the plain model's (`merged_tensors`), by the plain model's
    names: the saved keys each is made from, so that a reader may take one at a time."""
    keys = list(keys)
    layers = {key.rsplit(".", 1)[0] for key in keys if key.endswith(".lora_A")}
    sources: dict[str, list[str]] = {}
    for layer in sorted(layers):
        base = f"{layer}.base."
        sources[f"{layer}.weight"] = [key for key in keys if key.startswith(base) and key != base + "bias"] + \
            [f"{layer}.{part}" for part in ADAPTER_PARAMS]
    for key in keys:
        owner, adapted, part = key.rpartition(".base.")
        if adapted and owner in layers:
            if part == "bias":
                sources[f"{owner}.bias"] = [key]
        elif key.rsplit(".", 1)[0] not in layers:
            sources[key] = [key]
    return sources


def merged_tensor(name: str, saved: dict[str, torch.Tensor], scaling: float, dequantize=None) -> torch.Tensor:
    """The plain model's tensor ``name`` from ``saved``, the tensors `merge_sources` gives for it:
    ``X.weight = W + scaling B A`` for an adapted layer (an NF4 base's codes dequantized first, by
    ``dequantize(saved, prefix)``), else the one saved tensor as it is."""
    layer = name.removesuffix(".weight")
    if f"{layer}.lora_A" not in saved:
        (value,) = saved.values()
        return value
    base = f"{layer}.base."
    weight = saved[base + "weight"] if base + "weight" in saved else dequantize(saved, base)
    return weight.float() + scaling * (saved[f"{layer}.lora_B"].float() @ saved[f"{layer}.lora_A"].float())


def merged_tensors(tensors: dict[str, torch.Tensor], scaling: float,
                   dequantize=None) -> dict[str, torch.Tensor]:
    """A saved adapted model's tensors as the plain model's: every ``X.base.weight`` with
    ``X.lora_A`` and ``X.lora_B`` becomes ``X.weight = W + scaling B A`` (an NF4 base's
    codes dequantized first, by ``dequantize(tensors, prefix)``), other ``X.base.*`` become ``X.*``."""
    return {name: merged_tensor(name, {key: tensors[key] for key in keys}, scaling, dequantize)
            for name, keys in merge_sources(tensors).items()}
