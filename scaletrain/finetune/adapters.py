"""What ``--lora-rank`` and ``--quantize nf4`` do to a built model: the base frozen (in 4 bits,
nf4.py: QLoRA, Dettmers et al. 2023), LoRA's adapters put beside the layers ``--lora-targets``
names (lora.py: Hu et al. 2022), and the modules ``--lora-modules-to-save`` names (PEFT's
``modules_to_save``: the token embedding, the output head) trained whole beside them, before any
parallel transform sees the model. A module trained whole is an ordinary trainable tensor from
there on: data parallelism reduces its gradient, ZeRO shards its optimizer state, checkpoints
hold it. A head tied to the embedding is one tensor, so naming either trains it in both roles
(as PEFT's ``ensure_weight_tying`` does)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from scaletrain.config import FinetuneConfig
from scaletrain.finetune.lora import adapter_state, apply_lora
from scaletrain.finetune.nf4 import quantize_linears
from scaletrain.models.spec import ModelSpec


def words(value: str | None) -> list[str]:
    """A comma-separated flag's words (none for an unset one)."""
    return [word for word in (value or "").split(",") if word]


def whole_parameters(model: nn.Module, family: ModelSpec, modules_to_save: str | None) -> dict[str, nn.Parameter]:
    """The parameters ``--lora-modules-to-save`` trains whole, by name (a tied pair under its first)."""
    modules = {family.whole_modules[word] for word in words(modules_to_save)}
    chosen = {id(param) for name, param in model.named_parameters(remove_duplicate=False)
              if name.rsplit(".", 1)[0] in modules}
    return {name: param for name, param in model.named_parameters() if id(param) in chosen}


def add_adapters(model: nn.Module, finetune: FinetuneConfig, family: ModelSpec, seed: int = 0) -> None:
    """With ``--lora-rank``: freeze ``model`` (in 4 bits with ``--quantize nf4``), put the adapters
    beside its target layers (their ``A`` drawn for the run's ``seed``: lora.py's `initial_a`; a
    model on the meta device draws none) and let the modules to save train; the model a fine-tune
    trains and checkpoints."""
    if not finetune.lora_rank:
        return
    targets = family.lora_layers(words(finetune.lora_targets))
    if finetune.quantize == "nf4":
        quantize_linears(model, targets)
    apply_lora(model, targets, finetune.lora_rank, finetune.lora_alpha, finetune.lora_dropout, seed)
    for param in whole_parameters(model, family, finetune.lora_modules_to_save).values():
        param.requires_grad_(True)


def trained_names(finetune: FinetuneConfig, family: ModelSpec, family_cfg: Any) -> list[str]:
    """The names of the tensors a fine-tune trains (adapters and modules trained whole), as
    `adapter_state` gives them on the whole model (built on the meta device: names only, so its base
    stays unquantized), whatever layout split them: what a reader takes from its checkpoint."""
    with torch.device("meta"):
        model = family.build(family_cfg)
    add_adapters(model, dataclasses.replace(finetune, quantize="none"), family)
    return list(adapter_state(model))
