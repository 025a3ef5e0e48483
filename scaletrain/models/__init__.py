"""Plain models and their presets. Nothing here knows about parallelism."""

from __future__ import annotations

from torch import nn

from scaletrain.config import ModelConfig
from scaletrain.models.gpt import GPT, GPTConfig
from scaletrain.models.mlp import MLPClassifier

# (n_layers, n_heads, d_model). gpt-tiny takes a fraction of a second per step
# on a laptop CPU (tests); gpt-small trains a few hundred steps in minutes.
GPT_PRESETS = {
    "gpt-tiny": (2, 4, 64),
    "gpt-small": (4, 8, 256),
    "gpt2-124m": (12, 12, 768),
}


def gpt_config(cfg: ModelConfig, vocab_size: int, seq_len: int) -> GPTConfig:
    """The preset, with any size the user set overriding it."""
    layers, heads, width = GPT_PRESETS[cfg.name]
    return GPTConfig(vocab_size=vocab_size, seq_len=seq_len,
                     n_layers=cfg.n_layers or layers, n_heads=cfg.n_heads or heads,
                     d_model=cfg.d_model or width, dropout=cfg.dropout, vocab_multiple=cfg.vocab_multiple)


def build_model(cfg: ModelConfig, *, vocab_size: int, seq_len: int, n_features: int = 0,
                n_classes: int = 0) -> nn.Module:
    """A freshly initialized model (call after seeding the RNG)."""
    if cfg.name == "mlp":
        return MLPClassifier(n_features, n_classes, cfg.mlp_hidden)
    return GPT(gpt_config(cfg, vocab_size, seq_len))


__all__ = ["GPT", "GPTConfig", "MLPClassifier", "GPT_PRESETS", "gpt_config", "build_model"]
