"""Plain models, their presets and their specs. Nothing here knows about parallelism.

Each family is a module and a spec (models/spec.py); ``FAMILIES`` lists them,
and the rest of scaletrain finds a model's spec by its preset name.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from scaletrain.models.gpt import GPT, GPTConfig
from scaletrain.models.gpt_spec import GPT_SPEC
from scaletrain.models.llama_spec import LLAMA_SPEC
from scaletrain.models.mlp import MLPClassifier
from scaletrain.models.spec import ModelSpec

FAMILIES: tuple[ModelSpec, ...] = (GPT_SPEC, LLAMA_SPEC)
CLASSIFIER = "mlp"  # the digits classifier of the data-parallel exercise: no spec, no text
PRESETS: dict[str, ModelSpec] = {name: spec for spec in FAMILIES for name in spec.presets}
PRESET_NAMES: tuple[str, ...] = (*PRESETS, CLASSIFIER)
DEFAULT_PRESET = "gpt-small"  # what `scaletrain train` trains with no --model
TINY_PRESET = "gpt-tiny"  # seconds per step on a CPU: `scaletrain parity`'s default
LADDER_PRESET = "llama-small"  # `bench finetune`'s default: a CPU-sized model of the family the lab fine-tunes
PLANNED_PRESET = "gpt2-124m"  # what `scaletrain plan` weighs with no --model


def spec_for(name: str) -> ModelSpec:
    """The spec of the family that preset ``name`` belongs to."""
    return PRESETS[name]


def preset_experts(name: str) -> int:
    """The experts of each mixture-of-experts block of preset ``name`` (0: dense), which a run
    takes unless ``--moe-experts`` says otherwise (config.py `resolve`)."""
    return PRESETS[name].presets[name].get("moe_experts", 0) if name in PRESETS else 0


def spec_of_hf(model_type: str | None) -> ModelSpec | None:
    """The family that reads a Hugging Face folder of ``model_type`` (None: a config.json that
    names none), if any."""
    return next((spec for spec in FAMILIES if spec.hf and (model_type in spec.hf.model_types if model_type
                                                           else spec.hf.reads_untyped)), None)


def family_config(cfg, vocab_size: int, seq_len: int) -> Any:
    """The family's own config for the user's model settings (config.py's ModelConfig: the preset,
    flags over it); models/ reads them and never imports the command line's settings."""
    return spec_for(cfg.name).configure(cfg, vocab_size, seq_len)


def build_model(cfg, *, vocab_size: int, seq_len: int, n_features: int = 0,
                n_classes: int = 0) -> nn.Module:
    """A freshly initialized model of the user's model settings ``cfg`` (config.py's ModelConfig),
    to call after seeding the RNG."""
    if cfg.name == CLASSIFIER:
        return MLPClassifier(n_features, n_classes, cfg.mlp_hidden)
    spec = spec_for(cfg.name)
    return spec.build(spec.configure(cfg, vocab_size, seq_len))


__all__ = ["GPT", "GPTConfig", "MLPClassifier", "FAMILIES", "PRESETS", "PRESET_NAMES", "DEFAULT_PRESET", "TINY_PRESET",
           "LADDER_PRESET", "PLANNED_PRESET", "spec_for", "spec_of_hf", "family_config", "build_model"]
