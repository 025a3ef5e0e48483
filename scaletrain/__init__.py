"""scaletrain: training at scale, every technique written from scratch and checked
against single-device training.

The command is ``scaletrain`` (commands/cli.py); the library is these names (docs/library.md),
imported on first use so that the command starts without them:

    setup, Engine               a model on the engine, and its training loop (library.py)
    check_parity, format_parity a model under a layout against one process (library_parity.py)
    ModelPlan, StagePlan,       how tp, pp and cp may split a model, in the plan vocabulary
    Column, Row, Region,        the built-in families use (models/spec.py)
    VocabEmbedding, VocabHead,
    PositionEmbedding
    CausalAttention, MoE,       the attention cp swaps for ring attention; the layer ep divides
    MoEConfig
    ShardedSampler              any map-style dataset, sharded, deterministic, resumable
    UserError                   what every refusal raises: one sentence saying what to change
"""

from importlib import import_module

__version__ = "0.1.0"

_EXPORTS = {
    "setup": "scaletrain.library", "Engine": "scaletrain.library",
    "check_parity": "scaletrain.library_parity", "format_parity": ("scaletrain.commands.parity", "format_table"),
    "ModelPlan": "scaletrain.models.spec", "StagePlan": "scaletrain.models.spec", "Column": "scaletrain.models.spec",
    "Row": "scaletrain.models.spec", "Region": "scaletrain.models.spec", "VocabEmbedding": "scaletrain.models.spec",
    "VocabHead": "scaletrain.models.spec", "PositionEmbedding": "scaletrain.models.spec",
    "CausalAttention": "scaletrain.models.decoder", "MoE": "scaletrain.models.moe", "MoEConfig": "scaletrain.models.moe",
    "ShardedSampler": "scaletrain.data.sampler", "UserError": "scaletrain.errors",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'scaletrain' has no attribute {name!r}")
    where = _EXPORTS[name]
    module, attribute = where if isinstance(where, tuple) else (where, name)
    return getattr(import_module(module), attribute)
