"""Optimizers, CPU offload of their state, and the learning-rate schedule."""

from __future__ import annotations

import torch
from torch import nn

from scaletrain.config import TrainConfig
from scaletrain.optim.adafactor import Adafactor, build_adafactor
from scaletrain.optim.adamw import build_adamw, decay_groups
from scaletrain.optim.offload import OffloadedOptimizer
from scaletrain.optim.schedule import lr_at


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer | OffloadedOptimizer:
    """``--optimizer`` over the decay groups, its state on the host with ``--offload optimizer``."""

    def make(groups: list[dict]) -> torch.optim.Optimizer:
        if cfg.optimizer == "adafactor":
            return Adafactor(groups, lr=cfg.lr)
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=1e-8, foreach=True)

    groups = decay_groups(model, cfg.weight_decay)
    return OffloadedOptimizer(groups, make) if cfg.offload == "optimizer" else make(groups)


__all__ = ["Adafactor", "OffloadedOptimizer", "build_adafactor", "build_adamw", "build_optimizer",
           "decay_groups", "lr_at"]
