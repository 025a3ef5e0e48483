"""What ``--lora-rank`` and ``--quantize nf4`` do to a built model: the base frozen (in 4
bits, nf4.py: QLoRA, Dettmers et al. 2023) and LoRA's adapters put beside the layers the
family names (lora.py: Hu et al. 2022), before any parallel transform sees the model."""

from __future__ import annotations

from torch import nn

from scaletrain.config import FinetuneConfig
from scaletrain.finetune.lora import apply_lora
from scaletrain.finetune.nf4 import quantize_linears
from scaletrain.models.spec import ModelSpec


def add_adapters(model: nn.Module, finetune: FinetuneConfig, family: ModelSpec) -> None:
    """With ``--lora-rank``: freeze ``model`` (in 4 bits with ``--quantize nf4``) and put the adapters
    beside its target layers; the model a fine-tune trains and checkpoints."""
    if not finetune.lora_rank:
        return
    targets = family.lora_layers(finetune.lora_targets.split(","))
    if finetune.quantize == "nf4":
        quantize_linears(model, targets)
    apply_lora(model, targets, finetune.lora_rank, finetune.lora_alpha, finetune.lora_dropout)
