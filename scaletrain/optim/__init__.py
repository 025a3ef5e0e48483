"""Optimizers and the learning-rate schedule."""

from scaletrain.optim.adamw import build_adamw, decay_groups
from scaletrain.optim.schedule import lr_at

__all__ = ["build_adamw", "decay_groups", "lr_at"]
