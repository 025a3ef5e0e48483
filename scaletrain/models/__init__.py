"""Plain models and their presets. Nothing here knows about parallelism."""

from __future__ import annotations

from torch import nn

from scaletrain.config import ModelConfig
from scaletrain.models.gpt import GPT, GPTConfig
from scaletrain.models.mlp import MLPClassifier
from scaletrain.models.moe import MoEConfig

# (n_layers, n_heads, d_model). gpt-tiny takes a fraction of a second per step
# on a laptop CPU (tests); gpt-small trains a few hundred steps in minutes.
GPT_PRESETS = {
    "gpt-tiny": (2, 4, 64),
    "gpt-small": (4, 8, 256),
    "gpt2-124m": (12, 12, 768),
}


def gpt_config(cfg: ModelConfig, vocab_size: int, seq_len: int) -> GPTConfig:
    """The preset, with any size the user set overriding it; ``vocab_size`` is the tokenizer's,
    which ``--n-vocab`` (a GPT-2 folder's vocab_size) overrides."""
    layers, heads, width = GPT_PRESETS[cfg.name]
    width = cfg.d_model or width
    moe = None
    if cfg.moe_experts:
        moe = MoEConfig(experts=cfg.moe_experts, top_k=cfg.moe_top_k, hidden=4 * width // cfg.moe_top_k,
                        capacity=cfg.moe_capacity, every=cfg.moe_every, aux_coef=cfg.moe_aux_coef,
                        z_coef=cfg.moe_z_coef)
    return GPTConfig(vocab_size=cfg.n_vocab or vocab_size, seq_len=seq_len,
                     n_layers=cfg.n_layers or layers, n_heads=cfg.n_heads or heads,
                     d_model=width, dropout=cfg.dropout, vocab_multiple=cfg.vocab_multiple, moe=moe,
                     bias=cfg.bias, norm_eps=cfg.norm_eps, n_positions=cfg.n_positions)


def build_model(cfg: ModelConfig, *, vocab_size: int, seq_len: int, n_features: int = 0,
                n_classes: int = 0) -> nn.Module:
    """A freshly initialized model (call after seeding the RNG)."""
    if cfg.name == "mlp":
        return MLPClassifier(n_features, n_classes, cfg.mlp_hidden)
    return GPT(gpt_config(cfg, vocab_size, seq_len))


__all__ = ["GPT", "GPTConfig", "MLPClassifier", "GPT_PRESETS", "gpt_config", "build_model"]
