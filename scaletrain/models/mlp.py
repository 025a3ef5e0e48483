"""A small MLP classifier: the model of the classic data-parallel exercise.

Three linear layers with ReLU, trained with cross-entropy on scikit-learn's
bundled 8x8 handwritten digits (64 inputs, 10 classes).
"""

from __future__ import annotations

import torch
from torch import nn


class MLPClassifier(nn.Module):
    def __init__(self, n_features: int, n_classes: int, hidden: int):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(n_features, hidden), nn.ReLU(),
            nn.Linear(hidden, hidden), nn.ReLU(),
            nn.Linear(hidden, n_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Features [batch, n_features] -> logits [batch, n_classes]."""
        return self.net(x)

    def flops_per_token(self) -> float:
        """Training FLOPs per sample: 6 x weights (2 forward, 4 backward)."""
        return 6 * sum(p.numel() for p in self.parameters() if p.dim() == 2)
