"""The 8x8 handwritten digits data set for the MLP classifier.

It ships inside scikit-learn (1797 images, no download), is small enough to
train on in seconds on a CPU, and is still a real task: a working MLP reaches
well above 90% validation accuracy while chance is 10%.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from scaletrain.errors import UserError

NUM_FEATURES = 64
NUM_CLASSES = 10
# Pixel intensities in the data set run from 0 to 16.
_MAX_PIXEL = 16.0


@dataclass(frozen=True)
class Digits:
    """Inputs are float32 [N, 64] in [0, 1]; targets are int64 class ids."""

    NUM_FEATURES: ClassVar[int] = NUM_FEATURES
    NUM_CLASSES: ClassVar[int] = NUM_CLASSES

    train_x: torch.Tensor
    train_y: torch.Tensor
    val_x: torch.Tensor
    val_y: torch.Tensor


def load_digits(val_fraction: float = 0.2, seed: int = 0) -> Digits:
    """The digits, split into train and validation by a permutation drawn from `seed`."""
    # Imported here: scikit-learn takes about a second to import and only the classifier needs it.
    from sklearn import datasets

    bunch = datasets.load_digits()
    x = torch.tensor(bunch.data / _MAX_PIXEL, dtype=torch.float32)
    y = torch.tensor(bunch.target, dtype=torch.int64)
    n_val = round(len(x) * val_fraction)
    if not 0 < n_val < len(x):
        raise UserError(
            f"--val-fraction {val_fraction} leaves no training or no validation digits; "
            f"use a value between 0 and 1 such as 0.2."
        )
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    val, train = order[:n_val], order[n_val:]
    return Digits(train_x=x[train], train_y=y[train], val_x=x[val], val_y=y[val])
