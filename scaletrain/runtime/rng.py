"""The random streams a rank draws from, reseeded: the host's and its own device's.

``torch.manual_seed`` seeds the host's generator and every accelerator backend torch knows
(CUDA, XPU, MTIA); each backend not yet initialized gets a lazy call that records the caller's
stack, so on a CPU every reseed formats three stack traces for streams the run never draws
from: host time a plain training loop, which seeds once, does not spend every step. A rank
draws only from the host's stream and its own device's, so those are the ones reseeded, to the
same values ``torch.manual_seed`` gives them.
"""

from __future__ import annotations

import torch


def reseed(seed: int, device: torch.device) -> None:
    """Seed the host's generator and ``device``'s (a GPU's) with ``seed``, as ``torch.manual_seed`` would."""
    torch.default_generator.manual_seed(seed)
    if device.type == "cuda":
        with torch.cuda.device(device):
            torch.cuda.manual_seed(seed)
