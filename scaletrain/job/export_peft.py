"""Export a LoRA fine-tune's adapters as a PEFT folder: ``scaletrain export --from RUN --to DIR --format peft``.

PEFT keeps a LoRA adapter apart from its base model, in a folder that
``peft.PeftModel.from_pretrained(base, DIR)`` loads over the base:

    adapter_config.json          peft_type LORA, r, lora_alpha, lora_dropout, target_modules (the
                                 base's module names), fan_in_fan_out (true where the family's
                                 layers store their weights transposed, as Conv1D does), the
                                 base folder the run started from
    adapter_model.safetensors    base_model.model.<module>.lora_A.weight [r, d_in] and
                                 .lora_B.weight [d_out, r] for every adapted layer

PEFT's update is finetune/lora.py's, ``(alpha / r) x A^T B^T`` beside the frozen weight, with
A and B of the same shapes, so the adapters cross as they are, renamed: each adapted layer's
module is named as the family's spec names its weight in a Hugging Face folder
(``HFAdapter.names``; ``blocks.0.attn.q`` is ``model.layers.0.self_attn.q_proj``), the mapping
finetune/peft_adapter.py reads such a folder back with (``finetune --adapter``). Over the base
the run fine-tuned (its ``--from`` folder, or ``--format hf``'s export of a base of our own) the
adapted model computes the logits of the run's, which ``--format hf`` merges into one folder.
"""

from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import save_file

from scaletrain.config import load_run_config
from scaletrain.errors import UserError
from scaletrain.finetune.hf import is_hf_folder
from scaletrain.finetune.lora import ADAPTER_PARAMS
from scaletrain.finetune.peft_adapter import CONFIG_FILE, WEIGHTS_FILE, adapter_key, hf_modules
from scaletrain.job.data_setup import run_tokenizer
from scaletrain.job.export import DTYPES, Exported, _prepared, _read, find_checkpoint
from scaletrain.job.export_hf import check_folder_target, folder_in_place
from scaletrain.models import spec_for


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
    step, ours = _read(checkpoint)
    tensors, modules, transposed = {}, set(), set()
    for key in sorted(k for k in ours if k.endswith(".lora_A")):
        layer = key.removesuffix(".lora_A")
        module, flipped = modules_of[layer]
        for part in ADAPTER_PARAMS:
            tensors[adapter_key(module, part)] = ours[f"{layer}.{part}"]
        modules.add(module.rsplit(".", 1)[-1])
        transposed.add(flipped)
    if len(transposed) > 1:  # PEFT takes one fan_in_fan_out for all of an adapter's layers
        raise UserError(f"the run adapted layers stored both ways in the folder format ({', '.join(sorted(modules))}),"
                        f" which one PEFT adapter cannot hold; fine-tune with --lora-targets of one kind.")
    tensors = _prepared(tensors, DTYPES[dtype] if dtype else None)
    base = f.base if f.base and is_hf_folder(Path(f.base)) else None
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": f.lora_rank, "lora_alpha": f.lora_alpha,
              "lora_dropout": f.lora_dropout, "target_modules": sorted(modules), "fan_in_fan_out": transposed.pop(),
              "bias": "none", "inference_mode": True, "base_model_name_or_path": str(Path(base).resolve()) if base
              else None}
    with folder_in_place(target) as partial:
        (partial / CONFIG_FILE).write_text(json.dumps(config, indent=2))
        save_file({key: value.contiguous() for key, value in tensors.items()}, partial / WEIGHTS_FILE,
                  metadata={"format": "pt", "step": str(step)})
    return Exported(path=target, step=step, tensors=len(tensors),
                    parameters=sum(t.numel() for t in tensors.values()),
                    bytes=sum(path.stat().st_size for path in target.iterdir()))
