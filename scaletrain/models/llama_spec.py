"""The Llama family's model spec (models/spec.py): presets, plans, shapes, and Llama, Qwen2 and Mistral folders.

The presets' sizes are those of the released models' config.json files
(SmolLM-135M, TinyLlama-1.1B, Llama 3.2 1B and 3B, Llama 2 7B and 13B, Llama 3.1 8B and 70B); llama-tiny and
llama-small are for tests and laptops. Their SwiGLU widths are 8/3 d_model
rounded up to a multiple of 16, as a resized preset's are.

Hugging Face's ``LlamaForCausalLM``, ``Qwen2ForCausalLM`` and
``MistralForCausalLM`` are this model (models/llama.py): Qwen2 adds biases to
q, k and v, Mistral a sliding attention window, which equals causal
attention for sequences no longer than it, so longer ones are refused
(`check`). Their linear layers are ``nn.Linear``, so no weight is transposed::

    model.embed_tokens, model.norm, lm_head             tok_emb, ln_f, head
    model.layers.{i}.input_layernorm                    blocks.{i}.ln1
    model.layers.{i}.post_attention_layernorm           blocks.{i}.ln2
    model.layers.{i}.self_attn.{q,k,v}_proj, o_proj     blocks.{i}.attn.{q,k,v}, attn.proj
    model.layers.{i}.mlp.{gate,up,down}_proj            blocks.{i}.mlp.{gate,up,proj}

Both sides order q's and k's features as two halves per head (the rotation
pairs feature i with i + head_dim/2), so nothing is permuted.
"""

from __future__ import annotations

import math
from pathlib import Path

from scaletrain.errors import UserError
from scaletrain.models.llama import Llama, LlamaConfig
from scaletrain.models.moe import MoEConfig
from scaletrain.models.spec import (
    Column,
    HFAdapter,
    ModelShape,
    ModelSpec,
    Region,
    Row,
    StagePlan,
    VocabEmbedding,
    VocabHead,
)

_SMALL = {"rope_theta": 10000.0, "rope_scaling": None, "tie_embeddings": False, "norm_eps": 1e-5,
          "n_positions": None, "n_vocab": None}
_LLAMA3 = {"rope_theta": 500000.0, "rope_scaling": "8,1,4,8192", "tie_embeddings": False, "norm_eps": 1e-5,
           "n_positions": 131072, "n_vocab": 128256}
_LLAMA2 = {"rope_theta": 10000.0, "rope_scaling": None, "tie_embeddings": False, "norm_eps": 1e-5,
           "n_positions": 4096, "n_vocab": 32000}
# llama-tiny takes a fraction of a second per step on a laptop CPU (tests); llama-small trains
# a few hundred steps in minutes. n_vocab None: the tokenizer's.
PRESETS = {
    "llama-tiny": {"n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "d_model": 64, "ffn_hidden": 176, **_SMALL},
    "llama-small": {"n_layers": 4, "n_heads": 8, "n_kv_heads": 4, "d_model": 256, "ffn_hidden": 688, **_SMALL},
    "smollm-135m": {"n_layers": 30, "n_heads": 9, "n_kv_heads": 3, "d_model": 576, "ffn_hidden": 1536,
                    "rope_theta": 10000.0, "rope_scaling": None, "tie_embeddings": True, "norm_eps": 1e-5,
                    "n_positions": 2048, "n_vocab": 49152},
    "tinyllama-1.1b": {"n_layers": 22, "n_heads": 32, "n_kv_heads": 4, "d_model": 2048, "ffn_hidden": 5632,
                       "rope_theta": 10000.0, "rope_scaling": None, "tie_embeddings": False, "norm_eps": 1e-5,
                       "n_positions": 2048, "n_vocab": 32000},
    "llama3.2-1b": {"n_layers": 16, "n_heads": 32, "n_kv_heads": 8, "d_model": 2048, "ffn_hidden": 8192,
                    **_LLAMA3, "rope_scaling": "32,1,4,8192", "tie_embeddings": True},
    "llama3.2-3b": {"n_layers": 28, "n_heads": 24, "n_kv_heads": 8, "d_model": 3072, "ffn_hidden": 8192,
                    **_LLAMA3, "rope_scaling": "32,1,4,8192", "tie_embeddings": True},
    "llama2-7b": {"n_layers": 32, "n_heads": 32, "n_kv_heads": 32, "d_model": 4096, "ffn_hidden": 11008, **_LLAMA2},
    "llama2-13b": {"n_layers": 40, "n_heads": 40, "n_kv_heads": 40, "d_model": 5120, "ffn_hidden": 13824, **_LLAMA2},
    "llama3-8b": {"n_layers": 32, "n_heads": 32, "n_kv_heads": 8, "d_model": 4096, "ffn_hidden": 14336, **_LLAMA3},
    "llama3-70b": {"n_layers": 80, "n_heads": 64, "n_kv_heads": 8, "d_model": 8192, "ffn_hidden": 28672, **_LLAMA3},
    # Mixtral 8x7B's shape: every block's MLP 8 SwiGLU experts of 14,336, each token routed to 2
    # (ffn_hidden is the dense MLP's width the experts share: ffn / top_k each)
    "mixtral-8x7b": {"n_layers": 32, "n_heads": 32, "n_kv_heads": 8, "d_model": 4096, "ffn_hidden": 2 * 14336,
                     "moe_experts": 8, "rope_theta": 1e6, "rope_scaling": None, "tie_embeddings": False,
                     "norm_eps": 1e-5, "n_positions": 32768, "n_vocab": 32000},
}
FAMILY_LABEL = "llama-small"  # the preset a folder's run is labelled with: every size is given


def swiglu_width(d_model: int) -> int:
    """8/3 d_model (the parameters of a 4 d_model GELU MLP), rounded up to a multiple of 16."""
    return -(-8 * d_model // 48) * 16


def parse_rope_scaling(text: str) -> tuple[float, float, float, int]:
    """``FACTOR,LOW,HIGH,ORIGINAL`` (8,1,4,8192) -> Llama 3.1's scaling parameters."""
    parts = text.split(",")
    try:
        factor, low, high = (float(part) for part in parts[:3])
        original = int(parts[3]) if len(parts) == 4 else 0
    except ValueError:  # too few parts, or one that is no number
        factor = low = high = original = 0
    if len(parts) != 4 or original < 1 or not math.isfinite(factor * high) or factor <= 0 or not 0 < low < high:
        raise UserError(f"--rope-scaling {text} is not FACTOR,LOW,HIGH,ORIGINAL (positive numbers with LOW below "
                        f"HIGH and a whole ORIGINAL context, as 8,1,4,8192); write it in that form.")
    return factor, low, high, original


def _number(x: float) -> str:
    return repr(float(x)).removesuffix(".0")


def configure(cfg, vocab_size: int, seq_len: int) -> LlamaConfig:
    """The preset, with any size the user set overriding it; ``vocab_size`` is the tokenizer's,
    which the preset's or ``--n-vocab`` overrides."""
    preset = PRESETS[cfg.name]

    def chosen(key: str):
        value = getattr(cfg, key)
        return preset[key] if value is None else value

    d_model = chosen("d_model")
    ffn = cfg.ffn_hidden or (preset["ffn_hidden"] if d_model == preset["d_model"] else swiglu_width(d_model))
    scaling = chosen("rope_scaling")
    moe = None
    experts = cfg.moe_experts or preset.get("moe_experts", 0)
    if experts:  # Mixtral's experts: SwiGLU, each ffn / top_k wide, as many active weights as the MLP
        moe = MoEConfig(experts=experts, top_k=cfg.moe_top_k, hidden=ffn // cfg.moe_top_k,
                        capacity=cfg.moe_capacity, every=cfg.moe_every, aux_coef=cfg.moe_aux_coef,
                        z_coef=cfg.moe_z_coef, activation="swiglu")
    return LlamaConfig(vocab_size=cfg.n_vocab or preset["n_vocab"] or vocab_size, seq_len=seq_len,
                       n_layers=chosen("n_layers"), n_heads=chosen("n_heads"), n_kv_heads=chosen("n_kv_heads"),
                       d_model=d_model, ffn_hidden=ffn, norm_eps=cfg.norm_eps, rope_theta=float(chosen("rope_theta")),
                       rope_scaling=parse_rope_scaling(scaling) if scaling else None,
                       tie_embeddings=chosen("tie_embeddings"), bias=cfg.bias, dropout=cfg.dropout,
                       vocab_multiple=cfg.vocab_multiple, moe=moe, n_positions=chosen("n_positions"),
                       sliding_window=cfg.sliding_window)


# Column-parallel q, k, v and gate, up; row-parallel projections. MoE blocks stay replicated.
TENSOR_PLAN = (
    ("tok_emb", VocabEmbedding()),
    ("blocks.*.attn", Region()),
    ("blocks.*.attn.q", Column()),
    ("blocks.*.attn.k", Column()),
    ("blocks.*.attn.v", Column()),
    ("blocks.*.attn.proj", Row()),
    ("blocks.*.mlp", Region()),
    ("blocks.*.mlp.gate", Column()),
    ("blocks.*.mlp.up", Column()),
    ("blocks.*.mlp.proj", Row()),
    ("head", VocabHead()),
)


def tensor_plan(cfg: LlamaConfig) -> tuple:
    """The plan of a model whose every block is a mixture of experts has no dense MLP to split."""
    every_block_experts = cfg.moe is not None and all(cfg.moe.in_block(i) for i in range(cfg.n_layers))
    return tuple(entry for entry in TENSOR_PLAN if not (every_block_experts and ".mlp" in entry[0]))

STAGES = StagePlan(stack="blocks", first=("tok_emb", "drop"), last=("ln_f", "head"), enter="embed",
                   leave="unembed")


def shape(cfg: LlamaConfig) -> ModelShape:
    moe = cfg.moe
    return ModelShape(n_layers=cfg.n_layers, d_model=cfg.d_model, n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads,
                      head_dim=cfg.head_dim, ffn_hidden=cfg.ffn_hidden, ffn_inputs=2, vocab=cfg.padded_vocab,
                      seq_len=cfg.seq_len, norm_with_mean=False, learned_positions=False,
                      moe_experts=moe.experts if moe else 0, moe_top_k=moe.top_k if moe else 0,
                      moe_hidden=moe.hidden if moe else 0, moe_every=moe.every if moe else 1)


def check(cfg: LlamaConfig, tp: int) -> None:
    """Sizes attention can be built from, a --tp that splits both kinds of heads, and sequences
    within a sliding window."""
    if cfg.d_model % cfg.n_heads:
        raise UserError(f"--d-model {cfg.d_model} is not divisible by --n-heads {cfg.n_heads}; "
                        f"choose sizes where it is.")
    if cfg.head_dim % 2:
        raise UserError(f"--d-model {cfg.d_model} / --n-heads {cfg.n_heads} gives heads {cfg.head_dim} wide, but "
                        f"rotary positions turn pairs of features; choose sizes giving an even head width.")
    if cfg.n_heads % cfg.n_kv_heads:
        raise UserError(f"--n-heads {cfg.n_heads} is not a multiple of --n-kv-heads {cfg.n_kv_heads}, but each "
                        f"key/value head serves an equal group of query heads; choose a --n-kv-heads that "
                        f"divides {cfg.n_heads}.")
    for count, kind in ((cfg.n_heads, "query"), (cfg.n_kv_heads, "key/value")):
        if count % tp:
            raise UserError(f"--tp {tp} splits attention into {tp} groups of heads, but the model has {count} "
                            f"{kind} heads; choose a --tp that divides {count}.")
    if cfg.sliding_window is not None and cfg.seq_len > cfg.sliding_window:
        raise UserError(f"--seq-len {cfg.seq_len} is longer than the model's sliding attention window of "
                        f"{cfg.sliding_window} tokens, which is computed as causal attention over the whole "
                        f"sequence; choose a --seq-len of at most {cfg.sliding_window}.")


# -- Llama, Qwen2 and Mistral folders ---------------------------------------------------------

# transformers' defaults for the fields a config.json may leave out, per model_type
# (LlamaConfig, Qwen2Config, MistralConfig); None: derived from other fields.
_COMMON = {"num_hidden_layers": 32, "num_attention_heads": 32, "hidden_size": 4096, "hidden_act": "silu",
           "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "head_dim": None, "rope_theta": 10000.0}
HF_DEFAULTS = {
    "llama": {**_COMMON, "vocab_size": 32000, "intermediate_size": 11008, "num_key_value_heads": None,
              "max_position_embeddings": 2048, "attention_bias": False, "mlp_bias": False},
    "qwen2": {**_COMMON, "vocab_size": 151936, "intermediate_size": 22016, "num_key_value_heads": 32,
              "max_position_embeddings": 32768, "use_sliding_window": False, "sliding_window": 4096},
    "mistral": {**_COMMON, "vocab_size": 32000, "intermediate_size": 14336, "num_key_value_heads": 8,
                "max_position_embeddings": 131072, "sliding_window": 4096},
}
SIZES = ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "hidden_size", "intermediate_size",
         "max_position_embeddings", "vocab_size")
SILU = ("silu", "swish")  # transformers' two names of x * sigmoid(x)
LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor")
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}


def _whole(value, where: Path, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UserError(f"{where} gives {key} = {value!r}; it must be a positive whole number.")
    return value


def _positive(value, where: Path, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise UserError(f"{where} gives {key} = {value!r}; it must be a positive number.")
    return float(value)


def _rope(hf: dict, where: Path, positions: int) -> tuple[float, str | None]:
    """rope_theta and the --rope-scaling string: from the rope_parameters of transformers 5, or
    the rope_theta and rope_scaling of older files."""
    key = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    params = hf.get(key) or {}
    if not isinstance(params, dict) or any(isinstance(v, dict) for v in params.values()):
        raise UserError(f"{where} gives {key} = {params!r}; this Llama takes one set of rotary parameters for "
                        f"every layer.")
    theta = _positive(params.get("rope_theta", hf["rope_theta"]), where, "rope_theta")
    rotary_share = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if rotary_share != 1.0:
        raise UserError(f"{where} gives partial_rotary_factor {rotary_share}; this Llama turns every feature "
                        f"of a head.")
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind != "llama3":
        raise UserError(f"{where} gives {key} with rope_type {kind!r}; this Llama computes plain rotary positions "
                        f"and Llama 3's 'llama3' scaling only.")
    factor, low, high = (_positive(params.get(k), where, f"{key}.{k}") for k in LLAMA3_KEYS)
    original = _whole(params.get("original_max_position_embeddings", positions), where,
                      f"{key}.original_max_position_embeddings")
    if low >= high:
        raise UserError(f"{where} gives {key}.low_freq_factor {low}, not below high_freq_factor {high}; "
                        f"Llama 3's scaling blends between the two.")
    return theta, ",".join([*map(_number, (factor, low, high)), str(original)])


def config_from_hf(given: dict, where: Path) -> dict:
    """ModelConfig values for a Llama, Qwen2 or Mistral config.json, or one sentence naming the
    field that this Llama cannot compute."""
    model_type = given.get("model_type", "llama")
    hf = {**HF_DEFAULTS[model_type], **given}
    if hf["num_key_value_heads"] is None:  # transformers' reading of a null: one key/value head per query head
        hf["num_key_value_heads"] = hf["num_attention_heads"]
    sizes = {key: _whole(hf[key], where, key) for key in SIZES}
    heads, kv_heads, width = sizes["num_attention_heads"], sizes["num_key_value_heads"], sizes["hidden_size"]
    if hf["hidden_act"] not in SILU:
        raise UserError(f"{where} names hidden_act {hf['hidden_act']!r}; this Llama's MLP is SwiGLU, gated by "
                        f"silu only.")
    if width % heads:
        raise UserError(f"{where} gives hidden_size {width}, which num_attention_heads {heads} does not divide; "
                        f"attention heads must split the width evenly.")
    if width // heads % 2:
        raise UserError(f"{where} gives hidden_size {width} and num_attention_heads {heads}, heads "
                        f"{width // heads} wide; rotary positions turn pairs of features, so heads must be even.")
    if hf["head_dim"] not in (None, width // heads):
        raise UserError(f"{where} gives head_dim {hf['head_dim']}; this Llama's heads are hidden_size / "
                        f"num_attention_heads = {width // heads} wide.")
    if heads % kv_heads:
        raise UserError(f"{where} gives num_attention_heads {heads}, which num_key_value_heads {kv_heads} does "
                        f"not divide; each key/value head must serve an equal group of query heads.")
    for key in ("attention_bias", "mlp_bias"):  # Llama's own switches; Qwen2's biases are fixed by its type
        if hf.get(key, False):
            raise UserError(f"{where} sets {key}; this Llama has biases only on q, k and v, as Qwen2 has.")
    theta, scaling = _rope(hf, where, sizes["max_position_embeddings"])
    window = None
    if model_type == "mistral" or (model_type == "qwen2" and hf["use_sliding_window"]):
        window = None if hf["sliding_window"] is None else _whole(hf["sliding_window"], where, "sliding_window")
    return {"name": FAMILY_LABEL, "n_layers": sizes["num_hidden_layers"], "n_heads": heads, "n_kv_heads": kv_heads,
            "d_model": width, "ffn_hidden": sizes["intermediate_size"],
            "norm_eps": _positive(hf["rms_norm_eps"], where, "rms_norm_eps"), "rope_theta": theta,
            "rope_scaling": scaling, "tie_embeddings": bool(hf["tie_word_embeddings"]),
            "n_positions": sizes["max_position_embeddings"], "n_vocab": sizes["vocab_size"], "vocab_multiple": 1,
            "moe_experts": 0, "bias": model_type == "qwen2", "sliding_window": window}


def config_to_hf(cfg: LlamaConfig) -> dict:
    """The config.json of the same model: Qwen2's with q, k, v biases, Mistral's with a sliding
    window, else Llama's. vocab_size counts the rows --vocab-multiple padded, which the exported
    tensors hold: the logits stay ours, column for column."""
    model_type = "qwen2" if cfg.bias else "mistral" if cfg.sliding_window else "llama"
    config = {"model_type": model_type, "architectures": [ARCHITECTURES[model_type]],
              "vocab_size": cfg.padded_vocab, "hidden_size": cfg.d_model, "intermediate_size": cfg.ffn_hidden,
              "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
              "num_key_value_heads": cfg.n_kv_heads, "hidden_act": "silu", "max_position_embeddings": cfg.positions,
              "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta, "rope_scaling": None,
              "tie_word_embeddings": cfg.tie_embeddings, "attention_dropout": 0.0, "torch_dtype": "float32"}
    if cfg.rope_scaling:
        factor, low, high, original = cfg.rope_scaling
        config["rope_scaling"] = {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
                                  "high_freq_factor": high, "original_max_position_embeddings": original}
    if model_type == "llama":
        config.update(attention_bias=False, mlp_bias=False, head_dim=cfg.head_dim)
    elif model_type == "mistral":
        config.update(sliding_window=cfg.sliding_window, head_dim=cfg.head_dim)
    else:  # Qwen2 slides in the layers from max_window_layers on: every one, as ours would
        config.update(use_sliding_window=cfg.sliding_window is not None, sliding_window=cfg.sliding_window,
                      max_window_layers=0)
    return config


BLOCK_PARTS = {"input_layernorm": "ln1", "post_attention_layernorm": "ln2", "self_attn.q_proj": "attn.q",
               "self_attn.k_proj": "attn.k", "self_attn.v_proj": "attn.v", "self_attn.o_proj": "attn.proj",
               "mlp.gate_proj": "mlp.gate", "mlp.up_proj": "mlp.up", "mlp.down_proj": "mlp.proj"}
BIASED = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")


def hf_names(cfg: LlamaConfig) -> dict[str, tuple[str, bool]]:
    """Every weight of a ``*ForCausalLM`` file: its name -> (our name, False: nothing is transposed)."""
    names = {"model.embed_tokens.weight": ("tok_emb.weight", False), "model.norm.weight": ("ln_f.weight", False)}
    for i in range(cfg.n_layers):
        for hf, ours in BLOCK_PARTS.items():
            names[f"model.layers.{i}.{hf}.weight"] = (f"blocks.{i}.{ours}.weight", False)
            if cfg.bias and hf in BIASED:
                names[f"model.layers.{i}.{hf}.bias"] = (f"blocks.{i}.{ours}.bias", False)
    if not cfg.tie_embeddings:
        names["lm_head.weight"] = ("head.weight", False)
    return names


def hf_tied(cfg: LlamaConfig) -> tuple[tuple[str, str], ...]:
    return (("lm_head.weight", "model.embed_tokens.weight"),) if cfg.tie_embeddings else ()


# --lora-targets: a group of layers or one of its layers (q, v: PEFT's common pair); ``proj`` is both output
# projections of a block (the attention's and the MLP's, an expert's too), which the folders' names tell apart.
LORA_ALIASES = {"qkv": ("attn.q", "attn.k", "attn.v"), "q": ("attn.q",), "k": ("attn.k",), "v": ("attn.v",),
                "proj": ("proj",), "fc": ("gate", "up"), "gate": ("gate",), "up": ("up",)}
LORA_HF_ALIASES = {"q_proj": ("attn.q",), "k_proj": ("attn.k",), "v_proj": ("attn.v",), "o_proj": ("attn.proj",),
                   "gate_proj": ("gate",), "up_proj": ("up",), "down_proj": ("mlp.proj", "experts.*.proj")}
# --lora-modules-to-save: our words, then the folders' module names
WHOLE_MODULES = {"embed": "tok_emb", "head": "head", "embed_tokens": "tok_emb", "lm_head": "head"}

HF = HFAdapter(model_types=tuple(HF_DEFAULTS), prefix="model.", config_from_hf=config_from_hf,
               config_to_hf=config_to_hf, names=hf_names, tied=hf_tied)

LLAMA_SPEC = ModelSpec(family="llama", presets=PRESETS, configure=configure, build=Llama,
                       tensor_plan=tensor_plan, stages=STAGES, shape=shape,
                       position_modules=("blocks.*.attn.rope",), hf=HF,
                       lora_aliases=LORA_ALIASES, lora_hf_aliases=LORA_HF_ALIASES, whole_modules=WHOLE_MODULES,
                       check=check)
