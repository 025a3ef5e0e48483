"""AdamW (Loshchilov & Hutter 2019) with weight-decay groups.

Decoupled weight decay applies to matrices (linear weights, embeddings) and
not to biases or normalization gains: decaying a gain toward zero fights the
normalization it scales, and biases are too few to overfit. This is the
convention of Radford et al. 2019's released code and its minimal
re-implementations: decay a parameter when it has two or more dimensions.
Parameters are taken once even when tied (a head that shares the token
embedding).
"""

from __future__ import annotations

import torch
from torch import nn


def decay_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    decay, no_decay = [], []
    for param in model.parameters():  # .parameters() yields a tied weight once
        if param.requires_grad:
            (decay if param.dim() >= 2 else no_decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def build_adamw(model: nn.Module, *, lr: float, betas: tuple[float, float],
                weight_decay: float) -> torch.optim.AdamW:
    # foreach: one kernel launch per group instead of one per tensor.
    return torch.optim.AdamW(decay_groups(model, weight_decay), lr=lr, betas=betas,
                             eps=1e-8, foreach=True)
