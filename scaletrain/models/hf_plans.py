"""Ready tensor plans for transformers' Llama-family causal language models.

    scaletrain.setup(LlamaForCausalLM(config), tp=2)      no plan to write

``LlamaForCausalLM``, ``Qwen2ForCausalLM`` and ``MistralForCausalLM`` are one
architecture under three names: embedding, decoder layers of RMSNorm,
attention (q, k, v, o projections, rotary positions, grouped-query heads) and
a SwiGLU MLP (gate, up, down), a final norm and a head (tied to the embedding
where ``tie_word_embeddings``). Megatron's split fits them as it fits
scaletrain's own Llama (models/llama_spec.py): q, k, v and gate, up
column-parallel, o and down row-parallel, the embedding and the head split by
vocabulary (a tied pair stays one weight: parallel/tensor.py shards it once).

Why a rank's slice runs transformers' own code unchanged (read in
transformers 5.24): the attention reshapes its projections with
``view(*input_shape, -1, self.head_dim)``, so it takes its head counts from
the weights' slices; ``num_key_value_groups`` (query heads per key-value head)
is a ratio, the same on a rank that keeps 1/t of each kind of head; the rotary
angles, the mask and sliding windows depend on positions, not heads; the
output projection's input width comes from ``reshape(*input_shape, -1)``.
What tp must do is split both kinds of heads whole: `ready_plan` refuses a tp
that does not divide them. The MLP's hidden features may split unevenly.

Sequence parallelism: the decoder derives its positions and its mask from
the length of its embedding's output (``arange(inputs_embeds.shape[1])``),
which under sp is the rank's 1/t of the sequence, while the attention sees it
whole. So under sp the decoder is handed its positions from the ids, as it
computes them itself without sp, and the attention must build no mask: sdpa
(transformers' default) and flash attention on a batch without padding rely
on causality alone; the eager and flex attentions, an ``attention_mask``, and
with sdpa a sequence as long as a sliding window (Mistral's) build one, and
are refused (sdpa would take a rank's share for shorter than the window and
silently skip it).

Pipeline parallelism takes no ready plan: a stage boundary carries one tensor
while transformers' layers also take the rotary angles and the mask from
their decoder, and the model has no methods that run the parts before and
after its layers (`StagePlan`); ``setup(model, pp=2)`` refuses it, naming the
plan it needs.

Recognized by class and ``config.model_type``, never by importing
transformers, an optional extra.
"""

from __future__ import annotations

import torch
from torch import nn

from scaletrain.errors import UserError
from scaletrain.models.spec import Column, ModelPlan, Region, Row, VocabEmbedding, VocabHead

# transformers' class -> its config's model_type
READY_CLASSES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "MistralForCausalLM": "mistral"}

TENSOR_PLAN = (
    ("model.embed_tokens", VocabEmbedding()),
    ("model.layers.*.self_attn", Region()),
    ("model.layers.*.self_attn.q_proj", Column()),
    ("model.layers.*.self_attn.k_proj", Column()),
    ("model.layers.*.self_attn.v_proj", Column()),
    ("model.layers.*.self_attn.o_proj", Row()),
    ("model.layers.*.mlp", Region()),
    ("model.layers.*.mlp.gate_proj", Column()),
    ("model.layers.*.mlp.up_proj", Column()),
    ("model.layers.*.mlp.down_proj", Row()),
    ("lm_head", VocabHead()),
)

# The decoder's first parameters, in order: how ``model.model(ids, mask)`` passes them by position.
DECODER_ARGUMENTS = ("input_ids", "attention_mask")


def _ready_class(model: nn.Module) -> str | None:
    """The ready class ``model`` is (or derives from), if its config says the same architecture."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    return next((cls.__name__ for cls in type(model).__mro__
                 if model_type is not None and READY_CLASSES.get(cls.__name__) == model_type), None)


def _attention(config) -> str:
    return getattr(config, "_attn_implementation", None) or "sdpa"


def _sequence_parallel_inputs(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """Under sp, the decoder's positions from its ids, where the caller gave neither positions nor a
    cache; what needs a mask of the sequence refused (module docstring)."""
    given = {**dict(zip(DECODER_ARGUMENTS, args)), **kwargs}
    if given.get("attention_mask") is not None:
        raise UserError("sp=True splits the sequence before the decoder builds its mask from attention_mask, which "
                        "it would build for a rank's share of the positions; train on batches without padding and "
                        "give no attention_mask, or set sp=False.")
    ids = given.get("input_ids")
    window = getattr(module.config, "sliding_window", None)
    # sdpa skips the sliding window's mask for a sequence it takes to be shorter than the window, as a
    # rank's share is: only flash attention applies the window without one
    masked_window = window is not None and not _attention(module.config).startswith("flash")
    if ids is not None and masked_window and ids.shape[1] >= window:
        raise UserError(f"sp=True meets sequences of {ids.shape[1]} positions, which the model's sliding window of "
                        f"{window} cuts with a mask the decoder would build for a rank's share of the positions; "
                        f"train on sequences shorter than the window, load the model with flash attention, or set "
                        f"sp=False.")
    if ids is None or len(args) > 2 or any(given.get(name) is not None for name in
                                           ("position_ids", "cache", "past_key_values", "inputs_embeds")):
        return None
    return args, {**kwargs, "position_ids": torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)}


def ready_plan(model: nn.Module, tp: int, sp: bool) -> ModelPlan | None:
    """The tensor plan of a transformers Llama, Qwen2 or Mistral causal LM (module docstring), under
    sp its decoder handed its positions; None for any other model. UserError where ``tp`` does not
    divide the attention's heads of both kinds, or sp meets an attention that builds a mask."""
    name = _ready_class(model)
    if name is None:
        return None
    config = model.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    if heads % tp or kv_heads % tp:
        raise UserError(f"tp={tp} must divide the {name}'s {heads} attention heads and {kv_heads} key-value heads, "
                        f"which its attention keeps whole on a rank; choose a tp that divides both.")
    if sp:
        attention = _attention(config)
        if attention != "sdpa" and not attention.startswith("flash"):
            raise UserError(f"sp=True needs an attention that builds no mask of the sequence (the decoder would "
                            f"build it for a rank's share of the positions), but the {name} uses {attention!r}; "
                            f"load it with attn_implementation='sdpa', or set sp=False.")
        model.model.register_forward_pre_hook(_sequence_parallel_inputs, with_kwargs=True)
    return ModelPlan(tensor=TENSOR_PLAN)
