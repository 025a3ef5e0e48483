"""Where a fine-tune starts (``--from``): the base run's model, tokenizer and weights.

A fine-tune trains on new data with the base's architecture and tokenizer,
so the model section, the tokenizer and the sequence length (the position
embedding's rows) come from the base run's ``config.toml``, whatever the
command line says of them. The base weights load into the freshly built
model before anything else touches it; then the base is frozen and adapters
are put beside the target layers (``--lora-rank``), its weights stored in 4
bits first with ``--quantize nf4``. The data-parallel and ZeRO wrappers that
follow see only the adapters as trainable.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from scaletrain.config import Config, FinetuneConfig, load_run_config
from scaletrain.errors import UserError
from scaletrain.export import find_checkpoint
from scaletrain.finetune.lora import apply_lora
from scaletrain.train.checkpoint import read_model_tensors

# What a fine-tune inherits from its base run: the model's shape and how text becomes tokens.
INHERITED = ("name", "n_layers", "n_heads", "d_model", "vocab_multiple", "moe_experts", "moe_top_k",
             "moe_every", "tokenizer", "vocab_size", "seq_len")


def base_checkpoint(finetune: FinetuneConfig) -> Path:
    return find_checkpoint(Path(finetune.base))


def as_finetune(cfg: Config) -> Config:
    """``cfg`` with the model, tokenizer and sequence length of its ``--from`` base run,
    its layout checked; ``cfg`` as it is when it has no base."""
    if not cfg.finetune.base:
        return cfg
    cfg = with_base(cfg)
    check_layout(cfg)
    return cfg


def with_base(cfg: Config) -> Config:
    """``cfg`` with the model, tokenizer and sequence length of the base run."""
    base = load_run_config(base_checkpoint(cfg.finetune).parent.parent)
    if base.model.name == "mlp":
        raise UserError(f"--from {cfg.finetune.base} is an mlp run; fine-tuning adapts the GPT models' layers.")
    if base.data.tokenizer != "byte":
        raise UserError(f"--from {cfg.finetune.base} tokenized its corpus with a BPE trained on it, which this "
                        f"version cannot carry over to new data; fine-tune a run of the byte tokenizer.")
    flat = {name: getattr(section, name) for section in (base.model, base.data) for name in INHERITED
            if hasattr(section, name)}
    return cfg.replace(**flat)


def check_layout(cfg: Config) -> None:
    """Fine-tuning composes with data parallelism and ZeRO-1/2; one sentence for anything else."""
    p, f = cfg.parallel, cfg.finetune
    for flag, used in (("--tp", p.tp > 1), ("--pp", p.pp > 1), ("--cp", p.cp > 1), ("--ep", p.ep > 1),
                       ("--zero 3", p.zero == 3)):
        if used:
            raise UserError(f"{flag} does not combine with --from in this version: fine-tuning runs on data "
                            f"parallelism and ZeRO-1/2; drop {flag}.")
    if f.quantize == "nf4" and f.lora_rank < 1:
        raise UserError("--quantize nf4 freezes the base in 4 bits, so only adapters can train; add --lora-rank.")
    unknown = set(f.lora_targets.split(",")) - {"qkv", "proj", "fc"}
    if unknown:
        raise UserError(f"--lora-targets {f.lora_targets} names {', '.join(sorted(unknown))}; choose among "
                        f"qkv, proj and fc.")


@torch.no_grad()
def start_from_base(model: nn.Module, finetune: FinetuneConfig) -> None:
    """Load the base weights into ``model``; with ``--lora-rank``, freeze them (in 4 bits
    with ``--quantize nf4``) and add the adapters."""
    tensors = read_model_tensors(base_checkpoint(finetune))
    model.load_state_dict(tensors)
    if not finetune.lora_rank:
        return
    targets = finetune.lora_targets.split(",")
    if finetune.quantize == "nf4":
        from scaletrain.finetune.nf4 import quantize_linears
        quantize_linears(model, targets)
    apply_lora(model, targets, finetune.lora_rank, finetune.lora_alpha, finetune.lora_dropout)
