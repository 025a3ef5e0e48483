"""The GPT family's model spec (models/spec.py): presets, plans, shapes and GPT-2's folders.

GPT-2's Hugging Face folders are our GPT with biases (``GPTConfig.bias``):
pre-norm blocks, learned positions, a head tied to the token embedding,
GELU's tanh approximation (``gelu_new``). The names map one to one::

    wte, wpe, ln_f                          tok_emb, pos_emb, ln_f
    h.{i}.ln_1, h.{i}.ln_2                  blocks.{i}.ln1, blocks.{i}.ln2
    h.{i}.attn.c_attn, h.{i}.attn.c_proj    blocks.{i}.attn.qkv, blocks.{i}.attn.proj
    h.{i}.mlp.c_fc, h.{i}.mlp.c_proj        blocks.{i}.mlp.fc, blocks.{i}.mlp.proj

GPT-2's linear layers are ``Conv1D`` modules, which compute ``x @ W + b`` and
so store ``W`` as [in, out]; ``nn.Linear`` stores [out, in], hence the
transposes. ``c_attn``'s output is q, k and v one after the other, each split
into heads of head_dim: the [3, heads, head_dim] layout our attention reads,
so the fused weight maps without reordering. ``h.{i}.attn.bias`` and
``masked_bias`` in older files are the causal mask and its fill value,
buffers rather than weights, and are skipped.
"""

from __future__ import annotations

import re
from pathlib import Path

from scaletrain.errors import UserError
from scaletrain.models.gpt import GPT, GPTConfig
from scaletrain.models.moe import MoEConfig
from scaletrain.models.spec import (
    Column,
    HFAdapter,
    ModelShape,
    ModelSpec,
    PositionEmbedding,
    Region,
    Row,
    StagePlan,
    VocabEmbedding,
    VocabHead,
)

# gpt-tiny takes a fraction of a second per step on a laptop CPU (tests);
# gpt-small trains a few hundred steps in minutes.
PRESETS = {
    "gpt-tiny": {"n_layers": 2, "n_heads": 4, "d_model": 64},
    "gpt-small": {"n_layers": 4, "n_heads": 8, "d_model": 256},
    "gpt2-124m": {"n_layers": 12, "n_heads": 12, "d_model": 768},
}


# What the GPT has no place for: flags of other families, refused rather than ignored.
OTHER_FAMILIES_FLAGS = {"n_kv_heads": "--n-kv-heads", "ffn_hidden": "--ffn-hidden", "rope_theta": "--rope-theta",
                        "rope_scaling": "--rope-scaling", "sliding_window": "--sliding-window"}


def configure(cfg, vocab_size: int, seq_len: int) -> GPTConfig:
    """The preset, with any size the user set overriding it; ``vocab_size`` is the tokenizer's,
    which ``--n-vocab`` (a GPT-2 folder's vocab_size) overrides."""
    for field, flag in OTHER_FAMILIES_FLAGS.items():
        if getattr(cfg, field) is not None:
            raise UserError(f"{flag} applies to models with rotary positions and grouped-query attention, not "
                            f"{cfg.name} (docs/models.md); drop it or choose such a --model.")
    if cfg.tie_embeddings is False:
        raise UserError(f"{cfg.name} always ties its head to the token embedding; drop --no-tie-embeddings "
                        f"or choose a --model that unties them.")
    preset = PRESETS[cfg.name]
    width = cfg.d_model or preset["d_model"]
    moe = None
    if cfg.moe_experts:
        moe = MoEConfig(experts=cfg.moe_experts, top_k=cfg.moe_top_k, hidden=4 * width // cfg.moe_top_k,
                        capacity=cfg.moe_capacity, every=cfg.moe_every, aux_coef=cfg.moe_aux_coef,
                        z_coef=cfg.moe_z_coef)
    return GPTConfig(vocab_size=cfg.n_vocab or vocab_size, seq_len=seq_len,
                     n_layers=cfg.n_layers or preset["n_layers"], n_heads=cfg.n_heads or preset["n_heads"],
                     d_model=width, dropout=cfg.dropout, vocab_multiple=cfg.vocab_multiple, moe=moe,
                     bias=cfg.bias, norm_eps=cfg.norm_eps, n_positions=cfg.n_positions)


# The same for every size: the fused qkv splits each of q, k and v by heads.
TENSOR_PLAN = (
    ("tok_emb", VocabEmbedding()),
    ("pos_emb", PositionEmbedding()),
    ("blocks.*.attn", Region()),
    ("blocks.*.attn.qkv", Column(parts=3)),
    ("blocks.*.attn.proj", Row()),
    ("blocks.*.mlp", Region()),
    ("blocks.*.mlp.fc", Column()),
    ("blocks.*.mlp.proj", Row()),
    ("head", VocabHead()),
)


STAGES = StagePlan(stack="blocks", first=("tok_emb", "pos_emb", "drop"), last=("ln_f", "head"),
                   enter="embed", leave="unembed")


def shape(cfg: GPTConfig) -> ModelShape:
    moe = cfg.moe
    return ModelShape(n_layers=cfg.n_layers, d_model=cfg.d_model, n_heads=cfg.n_heads, n_kv_heads=cfg.n_heads,
                      head_dim=cfg.head_dim, ffn_hidden=4 * cfg.d_model, ffn_inputs=1, vocab=cfg.padded_vocab,
                      seq_len=cfg.seq_len, norm_with_mean=True, learned_positions=True,
                      moe_experts=moe.experts if moe else 0, moe_top_k=moe.top_k if moe else 0,
                      moe_hidden=moe.hidden if moe else 0, moe_every=moe.every if moe else 1)


def check(cfg: GPTConfig, tp: int) -> None:
    if cfg.d_model % cfg.n_heads:
        raise UserError(f"--d-model {cfg.d_model} is not divisible by --n-heads {cfg.n_heads}; "
                        f"choose sizes where it is.")


# -- GPT-2 folders ---------------------------------------------------------------------

# transformers' GPT2Config defaults: what transformers builds when config.json leaves a field out.
GPT2_DEFAULTS = {"n_layer": 12, "n_head": 12, "n_embd": 768, "n_positions": 1024, "vocab_size": 50257,
                 "n_inner": None, "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5,
                 "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
                 "tie_word_embeddings": True}
# Names transformers gives GELU's tanh approximation, each the function our MLP computes.
TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")
BLOCK_PARTS = {"ln_1": "ln1", "ln_2": "ln2", "attn.c_attn": "attn.qkv", "attn.c_proj": "attn.proj",
               "mlp.c_fc": "mlp.fc", "mlp.c_proj": "mlp.proj"}
CONV1D = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
BUFFERS = re.compile(r"(transformer\.)?h\.\d+\.attn\.(bias|masked_bias)")


def _positive(hf: dict, key: str, where: Path) -> int:
    value = hf[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UserError(f"{where} gives {key} = {value!r}; it must be a positive whole number.")
    return value


def config_from_hf(given: dict, where: Path) -> dict:
    """ModelConfig values for a GPT-2 config.json, or one sentence on what differs from GPT-2's
    architecture. Dropout stays the run's: the released model is used as it is."""
    hf = {**GPT2_DEFAULTS, "n_positions": given.get("n_ctx", GPT2_DEFAULTS["n_positions"]), **given}
    sizes = {key: _positive(hf, key, where) for key in ("n_layer", "n_head", "n_embd", "n_positions",
                                                         "vocab_size")}
    if sizes["n_embd"] % sizes["n_head"]:
        raise UserError(f"{where} gives n_embd {sizes['n_embd']}, which n_head {sizes['n_head']} does not "
                        f"divide; attention heads must split the width evenly.")
    if hf["activation_function"] not in TANH_GELUS:
        raise UserError(f"{where} names activation_function {hf['activation_function']!r}; this GPT computes "
                        f"GELU's tanh approximation ({', '.join(TANH_GELUS)}) only.")
    if hf["n_inner"] not in (None, 4 * sizes["n_embd"]):
        raise UserError(f"{where} gives n_inner {hf['n_inner']}; this GPT's MLP is 4 x n_embd = "
                        f"{4 * sizes['n_embd']} wide.")
    for key, gpt2 in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                      ("tie_word_embeddings", True)):
        if hf[key] != gpt2:
            raise UserError(f"{where} sets {key} to {hf[key]}; this GPT computes GPT-2's {key} = {gpt2} only.")
    eps = hf["layer_norm_epsilon"]
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or eps <= 0:
        raise UserError(f"{where} gives layer_norm_epsilon = {eps!r}; it must be a positive number.")
    # The preset's name only labels the run: every size is given. The vocabulary keeps its exact rows,
    # so that the logits are GPT-2's (--vocab-multiple would add rows that GPT-2's softmax lacks).
    return {"name": "gpt2-124m", "n_layers": sizes["n_layer"], "n_heads": sizes["n_head"],
            "d_model": sizes["n_embd"], "vocab_multiple": 1, "moe_experts": 0, "bias": True,
            "norm_eps": float(eps), "n_positions": sizes["n_positions"], "n_vocab": sizes["vocab_size"]}


def config_to_hf(cfg: GPTConfig) -> dict:
    return {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_layer": cfg.n_layers,
            "n_head": cfg.n_heads, "n_embd": cfg.d_model, "n_positions": cfg.positions, "n_ctx": cfg.positions,
            "vocab_size": cfg.padded_vocab, "n_inner": None, "activation_function": "gelu_new",
            "layer_norm_epsilon": cfg.norm_eps, "tie_word_embeddings": True, "resid_pdrop": 0.0,
            "embd_pdrop": 0.0, "attn_pdrop": 0.0, "torch_dtype": "float32"}


def hf_names(cfg: GPTConfig) -> dict[str, tuple[str, bool]]:
    """Every weight a GPT-2 file holds: its name -> (our name, whether it is stored transposed)."""
    names = {"transformer.wte.weight": ("tok_emb.weight", False),
             "transformer.wpe.weight": ("pos_emb.weight", False),
             "transformer.ln_f.weight": ("ln_f.weight", False), "transformer.ln_f.bias": ("ln_f.bias", False)}
    for i in range(cfg.n_layers):
        for hf, ours in BLOCK_PARTS.items():
            for kind in ("weight", "bias"):
                names[f"transformer.h.{i}.{hf}.{kind}"] = (f"blocks.{i}.{ours}.{kind}",
                                                           kind == "weight" and hf in CONV1D)
    return names


# --lora-targets: ours, then GPT-2's module names. GPT-2 names both output projections c_proj, as PEFT
# adapts them; attn.c_proj and mlp.c_proj, PEFT's longer names, take one alone.
LORA_ALIASES = {"qkv": ("attn.qkv",), "proj": ("proj",), "fc": ("fc",)}
LORA_HF_ALIASES = {"c_attn": ("attn.qkv",), "c_proj": ("proj",), "c_fc": ("fc",), "attn.c_proj": ("attn.proj",),
                   "mlp.c_proj": ("mlp.proj", "experts.*.proj")}
# --lora-modules-to-save: our words, then GPT-2's module names (one tensor: the head is tied to wte)
WHOLE_MODULES = {"embed": "tok_emb", "head": "head", "wte": "tok_emb", "lm_head": "head"}

HF = HFAdapter(model_types=("gpt2",), prefix="transformer.", config_from_hf=config_from_hf,
               config_to_hf=config_to_hf, names=hf_names,
               tied=lambda cfg: (("lm_head.weight", "transformer.wte.weight"),),
               skipped=lambda name: BUFFERS.fullmatch(name) is not None, reads_untyped=True)

GPT_SPEC = ModelSpec(family="gpt", presets=PRESETS, configure=configure, build=GPT, tensor_plan=lambda cfg: TENSOR_PLAN,
                     stages=STAGES, shape=shape, position_modules=("pos_emb",), hf=HF,
                     lora_aliases=LORA_ALIASES, lora_hf_aliases=LORA_HF_ALIASES, whole_modules=WHOLE_MODULES,
                     check=check)
