"""Linear warm-up, then a decay to a floor: cosine (Loshchilov & Hutter 2017), linear, or none.

    lr(t) = peak * (t + 1) / warmup                                  t < warmup
    cosine:   lr(t) = floor + (peak - floor) * (1 + cos(pi * p)) / 2
    linear:   lr(t) = floor + (peak - floor) * (1 - p)
    constant: lr(t) = peak                                           otherwise,
            p = (t - warmup) / max(1, total - warmup), floor = peak * min_ratio

``t`` is the 0-based index of the optimizer step about to be taken. The
schedule is a pure function of the step, so resuming needs only the step.
"""

from __future__ import annotations

import math

SCHEDULES = ("cosine", "linear", "constant")


def lr_at(step: int, *, peak: float, warmup: int, total: int, min_ratio: float, schedule: str = "cosine") -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    if schedule == "constant":
        return peak
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    floor = peak * min_ratio
    if schedule == "linear":
        return floor + (peak - floor) * (1.0 - progress)
    return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def run_lr(step: int, train) -> float:
    """The learning rate of ``step`` under a run's train settings (config.py's TrainConfig: lr,
    warmup_steps, steps, min_lr_ratio, lr_schedule)."""
    return lr_at(step, peak=train.lr, warmup=train.warmup_steps, total=train.steps, min_ratio=train.min_lr_ratio,
                 schedule=train.lr_schedule)
