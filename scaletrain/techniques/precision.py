"""Mixed precision: autocast policy and dynamic loss scaling.

Follows Micikevicius et al. 2018, "Mixed Precision Training": run the
arithmetic-heavy operations in a 16-bit format, keep everything that
accumulates error in fp32, and scale the loss so fp16 gradients do not
underflow.

Formats (sign / exponent / stored mantissa bits)::

    fp32  1 / 8 / 23   range ~1e-38 .. 3e38, spacing at 1.0 = 2^-23
    bf16  1 / 8 / 7    the same range as fp32, spacing at 1.0 = 2^-7
    fp16  1 / 5 / 10   range ~6e-8 (subnormal) .. 65504, spacing at 1.0 = 2^-10

bf16 keeps fp32's exponent, so gradients neither underflow nor overflow and
no loss scaling is needed; the price is precision. fp16 keeps three more
mantissa bits but its narrow range flushes small gradients to zero, which is
what the loss scaler exists for.

Autocast policy (`autocast`). Matrix products (linear, matmul, bmm, addmm,
conv) run in the low precision: they hold nearly all the FLOPs and tensor
cores accumulate them in fp32 internally. Softmax, normalization and the loss
should see fp32, because they reduce over many elements (a sum of exp, a
variance) where 16-bit rounding accumulates. On CUDA, autocast's own fp32
list covers softmax, log_softmax, layer_norm and the losses. CPU autocast is
narrower, checked in torch 2.13: linear and matmul produce bf16 (or fp16,
which CPU autocast supports too); cross_entropy returns fp32 even from bf16
logits; but layer_norm and softmax are not on its fp32 list, so they run in
whatever dtype they are handed: fp32 input stays fp32, a bf16 activation
gives a bf16 result. The trainer therefore casts logits to fp32 itself
before cross-entropy on every device, rather than relying on the list.

Dynamic loss scaling (`DynamicLossScaler`). With loss L and scale S, the
backward pass computes grad(S*L) = S*grad(L), lifting small gradients out of
fp16's underflow region; before the optimizer step the gradients are
multiplied by 1/S. S is chosen dynamically, as large as possible without
overflow:

    non-finite gradient:  S <- S * backoff_factor, skip the step, counter <- 0
    finite gradient:      counter += 1; when counter == growth_interval:
                          S <- S * growth_factor, counter <- 0

This is torch.amp.GradScaler's rule, reproduced step for step, including
that S is held in fp32 and that a growth which would overflow fp32 is
dropped. Detection and decision are separate calls: `unscale_` returns a
float flag per rank, the trainer all-reduces it with MAX so every rank skips
together, then calls `step` and `update` with the agreed flag. A skipped step
costs one wasted batch; with the default growth_interval of 2000 the scaler
tries a larger scale about once per 2000 steps, so overflow skips stay rare.
For fp32 and bf16 the scaler is disabled and is a pass-through.

Master weights for ``--param-dtype bf16`` (bf16 working weights, fp32 copies
that the optimizer updates) live in optim/masters.py, beside optimizer
offload, which is the same mechanism with the copies in host memory.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable

import torch

from scaletrain.errors import UserError

PRECISIONS = ("fp32", "bf16", "fp16", "fp8")

# fp8: the blocks' linear products in float8 (techniques/fp8.py), everything else as bf16
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16}


def compute_dtype(precision: str) -> torch.dtype:
    if precision not in _DTYPES:
        raise UserError(f"Unknown precision {precision!r}; choose one of {', '.join(PRECISIONS)}.")
    return _DTYPES[precision]


def autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    """The forward-pass context for ``precision``: matmuls low, reductions as the module docstring says."""
    dtype = compute_dtype(precision)
    if dtype == torch.float32:
        return contextlib.nullcontext()
    if not torch.amp.is_autocast_available(device.type):
        raise UserError(f"Precision {precision} needs autocast, which torch does not offer on "
                        f"{device.type}; use fp32 there.")
    return torch.autocast(device.type, dtype=dtype)


def _round_fp32(value: float) -> float:
    # GradScaler keeps the scale in an fp32 tensor; rounding every new value
    # to fp32 keeps this scaler on the same trajectory for any factors, not
    # only powers of two.
    return torch.tensor(value, dtype=torch.float32).item()


class DynamicLossScaler:
    """Loss scaling with GradScaler's growth/backoff rule; see the module docstring."""

    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000, enabled: bool = True):
        if not init_scale > 0:
            raise UserError(f"The initial loss scale must be positive, got {init_scale}.")
        if not growth_factor > 1:
            raise UserError(f"The loss-scale growth factor must exceed 1, got {growth_factor}.")
        if not 0 < backoff_factor < 1:
            raise UserError(f"The loss-scale backoff factor must lie in (0, 1), got {backoff_factor}.")
        if growth_interval < 1:
            raise UserError(f"The loss-scale growth interval must be at least 1, got {growth_interval}.")
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.enabled = enabled
        self._scale = _round_fp32(init_scale)
        self._clean_steps = 0
        self._skipped = 0

    @property
    def scale_value(self) -> float:
        return self._scale if self.enabled else 1.0

    @property
    def skipped_steps(self) -> int:
        return self._skipped

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        # A Python float keeps the loss's dtype and needs no host-device copy.
        return loss * self._scale if self.enabled else loss

    def unscale_(self, params: Iterable[torch.Tensor]) -> torch.Tensor:
        """Divide every existing gradient by the scale in place; 1.0 if any is inf/nan, else 0.0.

        The flag is a tensor on the gradients' device so the trainer can
        all-reduce it with MAX before anyone decides to skip.
        """
        grads = [p.grad for p in params if p.grad is not None]
        device = grads[0].device if grads else torch.device("cpu")
        if not self.enabled or not grads:
            return torch.zeros((), device=device)
        # The reciprocal is formed in double and rounded to fp32 once, then
        # multiplied in (fp32 opmath even for 16-bit gradients): bit-identical
        # to GradScaler, and exact division whenever the scale is a power of two.
        torch._foreach_mul_(grads, _round_fp32(1.0 / self._scale))
        # Max-abs per tensor: cannot overflow the way a 2-norm of large
        # finite values can, and propagates both inf and nan.
        peaks = torch.stack(torch._foreach_norm(grads, float("inf")))
        return (~torch.isfinite(peaks)).any().float()

    def update(self, found_inf: bool) -> None:
        if not self.enabled:
            return
        if found_inf:
            self._scale = _round_fp32(self._scale * self.backoff_factor)
            self._clean_steps = 0
            return
        self._clean_steps += 1
        if self._clean_steps == self.growth_interval:
            grown = _round_fp32(self._scale * self.growth_factor)
            # An infinite scale would turn every gradient into inf/nan.
            if grown != float("inf"):
                self._scale = grown
            self._clean_steps = 0

    def step(self, optimizer: torch.optim.Optimizer, found_inf: bool) -> bool:
        """Run ``optimizer.step()`` unless the (all-reduced) flag says a gradient overflowed; a
        skipped step is counted whatever the precision (``--on-nan skip``, train/nonfinite.py)."""
        if found_inf:
            self._skipped += 1
            return False
        optimizer.step()
        return True

    def state_dict(self) -> dict:
        return {"scale": torch.tensor(self._scale, dtype=torch.float32),
                "clean_steps": self._clean_steps, "skipped_steps": self._skipped}

    def load_state_dict(self, state: dict) -> None:
        missing = {"scale", "clean_steps", "skipped_steps"} - state.keys()
        if missing:
            raise UserError(f"The checkpoint's loss-scaler state lacks {', '.join(sorted(missing))}.")
        self._scale = float(state["scale"])
        self._clean_steps = int(state["clean_steps"])
        self._skipped = int(state["skipped_steps"])
