"""The configuration's field helper and the sections that say what is trained: the model, its
data, and the base a fine-tune starts from (config.py holds how it is trained and run).

A field is declared with `option`, which carries its flag's help text and
choices, so that one declaration makes the dataclass field, its TOML key and
its command-line flag (config.py `add_field_flag`).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any

from scaletrain.models import DEFAULT_PRESET, PRESET_NAMES


def option(default: Any, help: str, *, flag: str | None = None, choices: tuple | None = None,
         auto: bool = False) -> Any:
    """A dataclass field that carries its flag's help text and choices; ``auto``: it also takes
    the word ``auto``, resolved before training (``--micro-batch auto``: planner/fit.py)."""
    meta = {"help": help, "flag": flag, "choices": choices, "auto": auto}
    return field(default=default, metadata=meta)


AUTO = "auto"


def count_or_auto(text: str) -> int | str:
    """A flag's value that is a whole number or the word ``auto``."""
    if text == AUTO:
        return AUTO
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid value {text!r}: give a whole number or 'auto'") from None


@dataclass
class ModelConfig:
    name: str = option(DEFAULT_PRESET, "model preset (docs/models.md)", flag="model", choices=PRESET_NAMES)
    n_layers: int | None = option(None, "transformer blocks (default: the preset's)")
    n_heads: int | None = option(None, "attention heads (default: the preset's)")
    n_kv_heads: int | None = option(None, "key/value heads of grouped-query attention, dividing --n-heads (1: "
                                          "multi-query; default: the preset's, where its family has them)")
    d_model: int | None = option(None, "hidden size (default: the preset's)")
    ffn_hidden: int | None = option(None, "hidden width of a SwiGLU MLP (default: the preset's)")
    rope_theta: float | None = option(None, "base of the rotary position frequencies (default: the "
                                            "preset's)")
    rope_scaling: str | None = option(None, "rotary frequency scaling of long contexts as FACTOR,LOW,HIGH,ORIGINAL "
                                            "(8,1,4,8192; default: the preset's)")
    tie_embeddings: bool | None = option(None, "the output head shares the token embedding's weight (default: "
                                               "the preset's, where its family may untie them)")
    sliding_window: int | None = option(None, "a Hugging Face folder's sliding attention window; sequences longer "
                                              "than it are refused")
    dropout: float = option(0.0, "dropout probability")
    vocab_multiple: int = option(1, "pad the embedding and head rows to a multiple of this (64 suits GPU "
                                    "matrix tiles); padded ids are never targets nor sampled")
    mlp_hidden: int = option(128, "hidden width of the mlp classifier")
    moe_experts: int = option(0, "experts in each mixture-of-experts block (0: dense MLPs only)")
    moe_top_k: int = option(2, "experts each token is routed to; every expert is 4 x d_model / top-k wide, "
                               "so a token meets as many weights as in the dense MLP")
    moe_capacity: float | None = option(None, "capacity factor: an expert takes at most ceil(C x seq_len x "
                                              "top-k / experts) tokens of a sequence, the others pass through "
                                              "the residual (default: dropless)")
    moe_every: int = option(1, "every this-many-th block is a mixture of experts (2: blocks 1, 3, ...)")
    moe_aux_coef: float = option(0.01, "weight of the load-balancing loss (Switch Transformer)")
    moe_z_coef: float = option(0.0, "weight of the router z-loss (ST-MoE uses 0.001)")
    bias: bool = option(False, "biases where the family's released weights have them (docs/models.md: on "
                               "every block linear layer, or on the queries, keys and values)")
    norm_eps: float = option(1e-5, "epsilon of the layer or RMS norms (a folder's layer_norm_epsilon or rms_norm_eps)")
    n_positions: int | None = option(None, "rows of the position embedding, the longest sequence the model "
                                           "reads (default: --seq-len; a folder's max_position_embeddings)")
    n_vocab: int | None = option(None, "the model's vocabulary before --vocab-multiple padding (default: the "
                                       "tokenizer's; a Hugging Face folder's vocab_size)")


@dataclass
class DataConfig:
    data: str | list[str] | None = option(None, "text file or folder; .jsonl/.json/.parquet records; a datasets "
                                          "save_to_disk folder; a scaletrain prepare folder; repeat it to mix "
                                          "sources, each PATH:WEIGHT (docs/data.md; default: the Python standard "
                                          "library's own source, present on every machine)")
    text_field: str = option("text", "the records' field that holds the text")
    sft: bool = option(False, "instruction fine-tuning: records are chats (messages) or Alpaca instructions, "
                              "rendered with the tokenizer's chat template; the loss is on the answers only")
    pack: bool | None = option(None, "several documents per sequence, attention kept inside each (default: on "
                                     "with --sft)")
    chat_template: str | None = option(None, "with --sft: tokenizer (its own template, else builtin), builtin, "
                                             "chatml, alpaca, another by name (docs/data.md) or a Jinja file")
    train_on_inputs: bool = option(False, "with --sft: the loss on the prompts too, not only the answers")
    system_prompt: str | None = option(None, "with --sft: a system turn of this text for every record that has none")
    too_long: str = option("truncate", "an example longer than --seq-len: cut it to fit (and count it) or refuse "
                                       "the data", choices=("truncate", "refuse"))
    val_data: str | None = option(None, "a separate validation set, in any --data form (default: the last "
                                        "--val-fraction of the data)")
    workers: int = option(1, "processes that tokenize records into the cache (as scaletrain prepare --workers)")
    tokenizer: str = option("byte", "byte-level, or a BPE trained locally on the corpus",
                            choices=("byte", "bpe"))
    vocab_size: int = option(4096, "vocabulary size of the BPE tokenizer")
    val_fraction: float = option(0.02, "share of the corpus held out for validation")
    seq_len: int = option(128, "tokens per sequence")
    cache_dir: str | None = option(None, "folder for tokenizers and token files (default: .cache beside "
                                         "the run folder)")
    tokenizer_from: str | None = option(None, "tokenize with the tokenizer of this run folder or Hugging Face "
                                              "model folder instead of --tokenizer (a fine-tune sets its --from)")


@dataclass
class FinetuneConfig:
    base: str | None = option(None, "a checkpoint (run folder or step_NNNNNN) or a Hugging Face model folder "
                                    "to start from: its model, tokenizer and weights", flag="from")
    lora_rank: int = option(0, "rank r of the LoRA adapters on the --lora-targets layers, the base frozen "
                               "(0: no adapters, every weight trains)")
    lora_alpha: float = option(16.0, "LoRA scaling numerator: the update is alpha / r x B A")
    lora_dropout: float = option(0.0, "dropout on the adapters' input")
    lora_targets: str = option("qkv,proj,fc", "the linear layers that get adapters: qkv, proj (the attention's "
                                              "and the MLP's output), fc, a group's layers one by one (q,v), or "
                                              "the model's Hugging Face module names (q_proj,v_proj,o_proj)")
    lora_modules_to_save: str | None = option(None, "trained whole beside the adapters (PEFT's modules_to_save): "
                                                    "embed, head or both (or their HF names); a tied pair is one "
                                                    "tensor, trained in both roles")
    quantize: str = option("none", "store the frozen base weights as 4-bit NormalFloat with double "
                                   "quantization (QLoRA; needs --lora-rank)", choices=("none", "nf4"))
    adapter: str | None = option(None, "a PEFT LoRA adapter folder (adapter_config.json, "
                                       "adapter_model.safetensors) over the --from base to continue from: its rank, "
                                       "alpha, dropout, target layers and weights")
