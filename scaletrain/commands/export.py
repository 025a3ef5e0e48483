"""``scaletrain export``: a checkpoint of any layout as one safetensors file (job/export.py), a
Hugging Face folder (job/export_hf.py), or a LoRA fine-tune's adapters as a PEFT folder
(job/export_peft.py)."""

from __future__ import annotations

import argparse
from pathlib import Path

from scaletrain.job.export import DTYPES


def add_parser(commands) -> None:
    export = commands.add_parser(
        "export", help="write a checkpoint's model as one safetensors file or a Hugging Face folder",
        description="Write the model of a checkpoint, whatever layout saved it (dp, ZeRO shards, tp "
                    "slices, pipeline stages; LoRA adapters merged). --format safetensors: one unsharded "
                    "safetensors file, every key of the model's state_dict with its single-device shape, "
                    "the tied head included, and the step and the run's config.toml in the header. "
                    "--format hf: a folder transformers' AutoModelForCausalLM.from_pretrained loads "
                    "(config.json, safetensors, tokenizer files, generation_config.json). --format peft: a "
                    "LoRA fine-tune's adapters alone, as a folder peft.PeftModel.from_pretrained loads over "
                    "the base (adapter_config.json, adapter_model.safetensors). Written beside "
                    "the target and renamed into place, so nothing partial is ever left under its name.")
    export.add_argument("--from", dest="source", metavar="CKPT", required=True,
                        help="a checkpoint folder (RUN/checkpoints/step_NNNNNN), or a run folder for its "
                             "latest complete checkpoint")
    export.add_argument("--to", dest="target", metavar="FILE.safetensors|DIR", required=True,
                        help="the file to write (its folder must exist), or with --format hf or peft the folder")
    export.add_argument("--format", choices=("safetensors", "hf", "peft"), default="safetensors",
                        help="one safetensors file, a Hugging Face model folder, or a PEFT adapter folder "
                             "[safetensors]")
    export.add_argument("--dtype", choices=DTYPES,
                        help="cast floating tensors to this dtype [as saved: fp32]")
    export.add_argument("--force", action="store_true", help="replace --to if it exists")
    export.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    if args.format == "hf":
        from scaletrain.job.export_hf import export_hf as export
    elif args.format == "peft":
        from scaletrain.job.export_peft import export_peft as export
    else:
        from scaletrain.job.export import export

    print(export(Path(args.source), Path(args.target), args.dtype, args.force).describe())
    return 0
