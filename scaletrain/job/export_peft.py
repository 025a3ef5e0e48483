"""Export a LoRA fine-tune's adapters as a PEFT folder: ``scaletrain export --from RUN --to DIR --format peft``.

PEFT keeps a LoRA adapter apart from its base model, in a folder that
``peft.PeftModel.from_pretrained(base, DIR)`` loads over the base:

    adapter_config.json          peft_type LORA, r, lora_alpha, lora_dropout, target_modules (the
                                 base's module names), fan_in_fan_out (true where the family's
                                 layers store their weights transposed, as Conv1D does),
                                 modules_to_save (the modules trained whole) and
                                 ensure_weight_tying (true where they are a tied pair), the
                                 base folder the run started from
    adapter_model.safetensors    base_model.model.<module>.lora_A.weight [r, d_in] and
                                 .lora_B.weight [d_out, r] for every adapted layer;
                                 base_model.model.<module>.weight for every module trained whole

PEFT's update is finetune/lora.py's, ``(alpha / r) x A^T B^T`` beside the frozen weight, with
A and B of the same shapes, so the adapters cross as they are, renamed: each adapted layer's
module is named as the family's spec names its weight in a Hugging Face folder
(``HFAdapter.names``; ``blocks.0.attn.q`` is ``model.layers.0.self_attn.q_proj``), the mapping
finetune/peft_adapter.py reads such a folder back with (``finetune --adapter``). Both lists of
names are the shortest that PEFT's rules match to exactly those modules and no other: the last part
(``q_proj``) where that is enough, more (``attn.c_proj``, where the MLP's output layer has the
same last name) where not. A head tied to the embedding is one tensor: it is written under both
modules, with ``ensure_weight_tying``, so that PEFT keeps training them as one. Over the base
the run fine-tuned (its ``--from`` folder, or ``--format hf``'s export of a base of our own) the
adapted model computes the logits of the run's, which ``--format hf`` merges into one folder.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from scaletrain.config import load_run_config
from scaletrain.errors import UserError
from scaletrain.finetune.adapters import whole_parameters
from scaletrain.finetune.hf import is_hf_folder
from scaletrain.finetune.lora import ADAPTER_PARAMS
from scaletrain.finetune.peft_adapter import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    adapter_key,
    hf_modules,
    saved_whole,
    targeted,
    whole_holders,
)
from scaletrain.job.data_setup import run_tokenizer
from scaletrain.job.export import DTYPES, Exported, _prepared, _read, find_checkpoint, saved_names
from scaletrain.job.export_hf import check_folder_target, folder_in_place
from scaletrain.models import spec_for


def peft_names(chosen: list[str], modules: list[str], rule) -> list[str]:
    """For each chosen module the shortest name, its last parts, that ``rule`` (PEFT's, for a list of
    names) matches to chosen modules only among ``modules``: together they name exactly ``chosen``."""
    wanted = set(chosen)

    @functools.cache
    def exact(name: str) -> bool:
        return all(module in wanted for module in modules if rule([name], module))

    def shortest(module: str) -> str:
        parts = module.split(".")
        return next((name for name in (".".join(parts[-depth:]) for depth in range(1, len(parts) + 1))
                     if exact(name)), module)

    return sorted({shortest(module) for module in chosen})


def export_peft(source: Path, target: Path, dtype: str | None = None, force: bool = False) -> Exported:
    """Write the adapters of ``source`` (a LoRA fine-tune's checkpoint or run folder) as a PEFT folder."""
    check_folder_target(target, force, form="peft")
    checkpoint = find_checkpoint(source)
    run_dir = checkpoint.parent.parent
    cfg = load_run_config(run_dir)
    f = cfg.finetune
    if not f.lora_rank:
        raise UserError(f"--format peft writes a LoRA fine-tune's adapters, and the run of {source} trained "
                        f"every weight (no --lora-rank); export it with --format hf.")
    family = spec_for(cfg.model.name)
    family_cfg = family.configure(cfg.model, run_tokenizer(run_dir).vocab_size, cfg.data.seq_len)
    modules_of = hf_modules(family, family_cfg)
    with torch.device("meta"):
        model = family.build(family_cfg)
    holders = whole_holders(model, family, family_cfg)
    whole = {name: holders[name] for name in whole_parameters(model, family, f.lora_modules_to_save)}
    # the adapters and the modules trained whole, not the base (a 70B's 4-bit codes are 36 GB)
    step, ours = _read(checkpoint, [name for name in saved_names(checkpoint)
                                    if name.endswith(ADAPTER_PARAMS) or name in whole])
    tensors, adapted, transposed = {}, [], set()
    for key in sorted(k for k in ours if k.endswith(".lora_A")):
        layer = key.removesuffix(".lora_A")
        module, flipped = modules_of[layer]
        for part in ADAPTER_PARAMS:
            tensors[adapter_key(module, part)] = ours[f"{layer}.{part}"]
        adapted.append(module)
        transposed.add(flipped)
    if len(transposed) > 1:  # PEFT takes one fan_in_fan_out for all of an adapter's layers
        raise UserError(f"the run adapted layers stored both ways in the folder format ({', '.join(adapted[:2])}), "
                        f"which one PEFT adapter cannot hold; fine-tune with --lora-targets of one kind.")
    for name, holding in whole.items():
        tensors.update({adapter_key(module, None): ours[name] for module in holding})
    tensors = _prepared(tensors, DTYPES[dtype] if dtype else None)  # a tied pair's copies made apart
    modules = [module for module, _ in modules_of.values()] + [module for holding in holders.values()
                                                                 for module in holding]
    saved = [module for holding in whole.values() for module in holding]
    base = f.base if f.base and is_hf_folder(Path(f.base)) else None
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": f.lora_rank, "lora_alpha": f.lora_alpha,
              "lora_dropout": f.lora_dropout, "target_modules": peft_names(adapted, modules, targeted),
              "fan_in_fan_out": transposed.pop(), "bias": "none",
              "modules_to_save": peft_names(saved, modules, saved_whole) if saved else None,
              "ensure_weight_tying": any(len(holding) > 1 for holding in whole.values()),
              "inference_mode": True, "base_model_name_or_path": str(Path(base).resolve()) if base else None}
    with folder_in_place(target) as partial:
        (partial / CONFIG_FILE).write_text(json.dumps(config, indent=2))
        save_file({key: value.contiguous() for key, value in tensors.items()}, partial / WEIGHTS_FILE,
                  metadata={"format": "pt", "step": str(step)})
    return Exported(path=target, step=step, tensors=len(tensors),
                    parameters=sum(t.numel() for t in tensors.values()),
                    bytes=sum(path.stat().st_size for path in target.iterdir()))
