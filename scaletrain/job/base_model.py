"""Where a fine-tune starts (``--from``): the base's model, tokenizer and weights.

A fine-tune trains on new data with the base's architecture and tokenizer,
so the model section, the tokenizer and the sequence length (the position
embedding's rows) come from the base, whatever the command line says of them.
The base is one of our runs (its ``config.toml`` and newest complete
checkpoint, a LoRA fine-tune's adapters merged in) or a Hugging Face folder
of a family scaletrain reads (finetune/hf.py: the architecture its
``config.json`` gives, as the family's spec reads it; ``--seq-len`` stays the
user's, at most its positions). The new data is tokenized by the base's
tokenizer (``--tokenizer-from`` set to the base: the run's saved
``tokenizer.json``, or the folder's); a byte-level base needs none.

The base weights load into the freshly built model before anything else
touches it; then the base is frozen and adapters are put beside the target
layers (``--lora-rank``), its weights stored in 4 bits first with
``--quantize nf4``. A Hugging Face folder as base is not loaded here: the
model is built on the meta device, the adapters (and a 4-bit base's layers) put
in there, and each rank reads its slices of the base after the layout's splits,
coding a 4-bit base one matrix at a time (finetune/sliced.py). The data-parallel and ZeRO wrappers that follow see only
the adapters as trainable.

``--adapter DIR`` continues a PEFT LoRA adapter over the base
(finetune/peft_adapter.py): its rank, alpha, dropout, target layers and modules
trained whole become the run's ``--lora-*`` settings, set before anything is
written (a flag that says otherwise is refused; a ``--lora-dropout`` of the
user's own stands, as it shapes training only), and its A and B (and the
modules' weights) replace the fresh values as soon as the adapters are added,
before any wrapper sees them. A flag counts as given when it means other than
its default (``--lora-targets`` by the layers it names): the configuration
keeps values, not where they came from. Without ``--from`` there is no base to adapt, and a ``--lora-*`` or
``--quantize`` flag is refused rather than left to train every weight of a fresh model.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from scaletrain.config import Config, FinetuneConfig, load_run_config
from scaletrain.errors import UserError
from scaletrain.finetune.adapters import add_adapters, whole_parameters, words
from scaletrain.finetune.hf import (
    folder_tensors,
    is_hf_folder,
    load_hf_tokenizer,
    read_hf_model,
    read_hf_weights,
)
from scaletrain.finetune.lora import load_adapters, target_names
from scaletrain.finetune.peft_adapter import CONFIG_FILE, WEIGHTS_FILE, read_adapter
from scaletrain.finetune.sliced import FolderSource
from scaletrain.job.data_setup import run_tokenizer
from scaletrain.job.export import find_checkpoint, without_adapters
from scaletrain.models import spec_for
from scaletrain.models.spec import ModelSpec
from scaletrain.paths import readable_dir
from scaletrain.train.checkpoint import read_model_tensors

# What a fine-tune inherits from its base run: the model's shape and how text becomes tokens.
INHERITED = ("name", "n_layers", "n_heads", "n_kv_heads", "d_model", "ffn_hidden", "rope_theta", "rope_scaling",
             "tie_embeddings", "sliding_window", "vocab_multiple", "moe_experts", "moe_top_k", "moe_every", "bias",
             "norm_eps", "n_positions", "n_vocab", "tokenizer", "vocab_size", "seq_len")
# The flags of adapters over a base, by field (--adapter's own check is config_checks.py's).
ADAPTER_FLAGS = {"lora_rank": "--lora-rank", "lora_alpha": "--lora-alpha", "lora_dropout": "--lora-dropout",
                 "lora_targets": "--lora-targets", "lora_modules_to_save": "--lora-modules-to-save",
                 "quantize": "--quantize"}


def base_checkpoint(finetune: FinetuneConfig) -> Path:
    return find_checkpoint(Path(finetune.base))


def as_finetune(cfg: Config) -> Config:
    """``cfg`` with the model, tokenizer and sequence length of its ``--from`` base run,
    its layout checked; ``cfg`` as it is when it has no base, and asks for no adapters."""
    check_adapters_have_base(cfg.finetune)
    if not cfg.finetune.base:
        return cfg
    cfg = with_base(cfg)
    check_words(cfg)
    if cfg.finetune.adapter:
        cfg = with_adapter(cfg)
    check_layout(cfg)
    return cfg


def check_adapters_have_base(finetune: FinetuneConfig) -> None:
    """One sentence for adapter flags given without a base (module docstring)."""
    default = FinetuneConfig()
    given = [flag for name, flag in ADAPTER_FLAGS.items() if getattr(finetune, name) != getattr(default, name)]
    if given and not finetune.base:
        named = " and ".join([", ".join(given[:-1]), given[-1]] if len(given) > 1 else given)
        raise UserError(f"{named} {'adapts' if len(given) == 1 else 'adapt'} a base model, and there is none without "
                        f"--from: add --from BASE (a run folder or a Hugging Face model folder), or drop "
                        f"{named if len(given) == 1 else 'them'}.")


def with_base(cfg: Config) -> Config:
    """``cfg`` with the model, tokenizer and sequence length of the base."""
    source = readable_dir("--from", cfg.finetune.base, "a run folder, one of its checkpoints/step_NNNNNN folders or "
                                                       "a Hugging Face model folder")
    if is_hf_folder(source):
        return with_hf_base(cfg, source)
    try:
        run_dir = base_checkpoint(cfg.finetune).parent.parent
    except UserError:  # neither kind of base: name both
        raise UserError(f"--from {source} is neither a Hugging Face model folder (with a config.json) nor a run "
                        f"folder with a complete checkpoint; give one of those, or a checkpoints/step_NNNNNN "
                        f"folder.") from None
    base = load_run_config(run_dir)
    if base.model.name == "mlp":
        raise UserError(f"--from {cfg.finetune.base} is an mlp run; fine-tuning adapts a decoder's layers.")
    flat = {name: getattr(section, name) for section in (base.model, base.data) for name in INHERITED
            if hasattr(section, name)}
    # A base's own BPE (trained on its corpus, or taken from a Hugging Face folder) tokenizes the new data too.
    bytes_only = base.data.tokenizer == "byte" and not base.data.tokenizer_from
    return cfg.replace(**flat, tokenizer_from=None if bytes_only else str(run_dir))


def with_hf_base(cfg: Config, folder: Path) -> Config:
    """``cfg`` with the architecture of the model in ``folder`` and its tokenizer; the folder's
    config, tokenizer and weights checked before anything is written."""
    hf_model = read_hf_model(folder)
    tokenizer = load_hf_tokenizer(folder)
    vocab = hf_model.values["n_vocab"]
    if tokenizer.vocab_size > vocab:
        raise UserError(f"the tokenizer in {folder} has {tokenizer.vocab_size} tokens, more than the "
                        f"vocab_size {vocab} of its config.json; the tokenizer files belong to another model.")
    cfg = cfg.replace(**hf_model.values, tokenizer="bpe", vocab_size=tokenizer.vocab_size,
                      tokenizer_from=str(folder))
    folder_tensors(hf_model, hf_model.family_cfg(cfg.model, cfg.data.seq_len))
    return cfg


def with_adapter(cfg: Config) -> Config:
    """``cfg`` with the LoRA settings of its ``--adapter`` folder, checked over the base's model
    (built on the meta device) before anything is written."""
    f, default = cfg.finetune, FinetuneConfig()
    folder = readable_dir("--adapter", f.adapter, f"a PEFT adapter folder, with {CONFIG_FILE} and {WEIGHTS_FILE}")
    family = spec_for(cfg.model.name)
    family_cfg = family.configure(cfg.model, base_vocab(cfg), cfg.data.seq_len)
    with torch.device("meta"):
        model = family.build(family_cfg)
    adapter = read_adapter(folder, model, family, family_cfg)

    def as_is(value: object) -> object:
        return value

    def layers(targets: str) -> set[str]:
        return set(target_names(model, family.lora_layers(words(targets))))

    def trained_whole(modules: str | None) -> set[str]:
        return set(whole_parameters(model, family, modules))

    # A flag counts as given where it means other than its default (module docstring).
    for flag, given, unset, theirs, meaning in (
            ("--lora-rank", f.lora_rank, default.lora_rank, adapter.rank, as_is),
            ("--lora-alpha", f.lora_alpha, default.lora_alpha, adapter.alpha, as_is),
            ("--lora-targets", f.lora_targets, default.lora_targets, adapter.targets, layers),
            ("--lora-modules-to-save", f.lora_modules_to_save, default.lora_modules_to_save, adapter.modules_to_save,
             trained_whole)):
        if meaning(given) not in (meaning(unset), meaning(theirs)):
            raise UserError(f"{flag} {given} contradicts the adapter in {folder}, which sets it to {theirs}; drop "
                            f"{flag}.")
    dropout = f.lora_dropout if f.lora_dropout != default.lora_dropout else adapter.dropout
    return cfg.replace(lora_rank=adapter.rank, lora_alpha=adapter.alpha, lora_dropout=dropout,
                       lora_targets=adapter.targets, lora_modules_to_save=adapter.modules_to_save)


def base_vocab(cfg: Config) -> int:
    """The rows of the base's embedding and head: a Hugging Face folder's config.json gives them
    (``n_vocab``), a run of ours its tokenizer."""
    if is_hf_folder(Path(cfg.finetune.base)):
        return cfg.model.n_vocab
    return run_tokenizer(base_checkpoint(cfg.finetune).parent.parent).vocab_size


def check_layout(cfg: Config) -> None:
    """A full fine-tune takes any layout (the base loads before the model is split); adapters
    compose with data parallelism, ZeRO-1/2/3, tp (with sp), pp, cp and ep, a 4-bit base with all
    of those but tp: one sentence for anything else."""
    p, f = cfg.parallel, cfg.finetune
    if f.quantize == "nf4" and p.tp > 1:
        raise UserError("--quantize nf4 does not combine with --tp: its 4-bit codes are scaled in blocks of 64 "
                        "weights and their scales quantized again in groups of 256 over each whole matrix, which "
                        "a rank's slice of rows or columns would cut through; drop --tp (QLoRA trains under --pp, "
                        "--cp, --ep and data parallelism), or --quantize nf4 for LoRA over a float base.")
    if f.quantize == "nf4" and f.lora_rank < 1:
        raise UserError("--quantize nf4 freezes the base in 4 bits, so only adapters can train; add --lora-rank.")
    if f.lora_modules_to_save and f.lora_rank < 1:
        raise UserError("--lora-modules-to-save trains modules whole beside LoRA's adapters, and without "
                        "--lora-rank every weight trains already; add --lora-rank, or drop --lora-modules-to-save.")
    check_words(cfg)


def check_words(cfg: Config) -> None:
    """One sentence for a ``--lora-targets`` or ``--lora-modules-to-save`` word the model's family does
    not know, listing those it accepts."""
    f, family = cfg.finetune, spec_for(cfg.model.name)
    for flag, given, accepted in (("--lora-targets", f.lora_targets, family.lora_words()),
                                  ("--lora-modules-to-save", f.lora_modules_to_save, tuple(family.whole_modules))):
        unknown = [word or "an empty name" for word in dict.fromkeys((given or "").split(",")) if word not in accepted]
        if given is not None and unknown:
            raise UserError(f"{flag} {given} names {', '.join(unknown)}; choose among {', '.join(accepted)}.")


@torch.no_grad()
def start_from_base(model: nn.Module, finetune: FinetuneConfig, family: ModelSpec, seed: int,
                    source: FolderSource | None = None) -> None:
    """Load the base weights into ``model``; with ``--lora-rank``, freeze them (in 4 bits
    with ``--quantize nf4``) and add the adapters (``A`` drawn for the run's ``seed``), set from
    ``--adapter``'s folder if given. With ``source`` (a Hugging Face folder read slice by slice,
    finetune/sliced.py) ``model`` is on the meta device: the adapters go in there, and what the
    base and the adapter folder hold is left to ``source``, which the layout reads after the splits."""
    if source is None:
        model.load_state_dict(base_tensors(finetune, model.cfg))
    # Read over the plain model, whose layers the folder's modules name.
    adapter = read_adapter(Path(finetune.adapter), model, family, model.cfg) if finetune.adapter else None
    add_adapters(model, finetune, family, seed)
    if source is not None:
        source.adapt(model, seed, adapter.tensors if adapter else {})
    elif adapter:
        load_adapters(model, adapter.tensors)


def base_tensors(finetune: FinetuneConfig, family_cfg) -> dict[str, torch.Tensor]:
    """The base's weights, whole, by our names: a Hugging Face folder's, or a run's newest checkpoint's
    (a LoRA fine-tune's adapters merged)."""
    source = Path(finetune.base)
    if is_hf_folder(source):
        return read_hf_weights(read_hf_model(source), family_cfg)
    checkpoint = base_checkpoint(finetune)
    return without_adapters(read_model_tensors(checkpoint), checkpoint)
