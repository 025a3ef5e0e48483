"""Linear warm-up, then cosine decay to a floor (Loshchilov & Hutter 2017).

    lr(t) = peak * (t + 1) / warmup                                  t < warmup
    lr(t) = floor + (peak - floor) * (1 + cos(pi * p)) / 2           otherwise,
            p = (t - warmup) / max(1, total - warmup), floor = peak * min_ratio

``t`` is the 0-based index of the optimizer step about to be taken. The
schedule is a pure function of the step, so resuming needs only the step.
"""

from __future__ import annotations

import math


def lr_at(step: int, *, peak: float, warmup: int, total: int, min_ratio: float) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    floor = peak * min_ratio
    return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
