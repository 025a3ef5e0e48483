"""Adafactor (Shazeer & Stern 2018, "Adafactor: Adaptive Learning Rates with
Sublinear Memory Cost"): Adam's per-coordinate scaling from O(n + m) state for
an n x m matrix instead of O(nm).

For a gradient G of shape [..., n, m] (every trailing matrix on its own), with
t the 1-based step and beta2_t = 1 - t^(-0.8):

    R_t = beta2_t R_{t-1} + (1 - beta2_t) (G^2 + eps1) 1_m         row sums, [..., n]
    C_t = beta2_t C_{t-1} + (1 - beta2_t) 1_n^T (G^2 + eps1)       column sums, [..., m]
    V_t = R_t C_t^T / (1_n^T R_t)                                  rank-1 estimate of E[G^2]
    U_t = G / sqrt(V_t)
    U^_t = U_t / max(1, RMS(U_t) / d),  d = 1                       update clipping
    X_t = X_{t-1} - a_t U^_t

Vectors (biases, norm gains) keep a full V_t = beta2_t V_{t-1} + (1 - beta2_t)(G^2 + eps1).
beta2_t = 0 at t = 1 and rises toward 1, so the statistics need no bias
correction: early on they are a short average, later a long one.

Step size a_t. With ``relative_step=False`` (the default) a_t is the group's
``lr``, so the trainer's warm-up/cosine schedule drives Adafactor exactly as it
drives AdamW. With ``relative_step=True`` a_t = lr * max(eps2, RMS(X_{t-1})),
the paper's relative step: each tensor moves by a fraction of its own scale.
The paper pairs it with its own schedule rho_t = min(1e-2, 1/sqrt(t)); here
rho_t is whatever the caller puts in ``lr``.

Options beyond the paper's Algorithm 4, both off by default:
``beta1`` keeps a first moment of the clipped update, M_t = beta1 M_{t-1} +
(1 - beta1) U^_t, and steps along M_t (no bias correction, as beta2_t has
none); it costs a full nm tensor again. ``weight_decay`` is decoupled as in
AdamW, X <- X (1 - lr * weight_decay) before the step, using the group's lr
(not a_t), so a weight-decay setting means the same for both optimizers.

Against torch.optim.Adafactor (torch 2.5+): torch always takes the relative
step, with a_t = max(eps2, RMS(X_{t-1})) * min(lr, 1/sqrt(t)); it keeps row and
column *means* of G^2 rather than sums (the ratio R C^T / sum(R) is the same);
and it uses eps1 as a floor (V >= eps1^2, mean(R) >= eps1) instead of adding it
to G^2. So with ``relative_step=True``, eps1 far below G^2 (the paper's 1e-30),
lr <= 1/sqrt(t) and no beta1 the two are the same algorithm, which the tests
check to float64 precision; torch has no absolute-step mode and no momentum.

Trade-off: second-moment memory drops from nm to n + m per matrix (no first
moment by default either, so ~0 optimizer bytes next to AdamW's 8 per
parameter), at the cost of a rank-1 approximation of E[G^2] and, without
momentum, noisier steps; update clipping guards against the too-large updates
that a slowly decaying stale V would otherwise allow.
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch
from torch import nn

from scaletrain.optim.adamw import decay_groups


def _rms(x: torch.Tensor) -> torch.Tensor:
    return x.norm() / x.numel() ** 0.5


class Adafactor(torch.optim.Optimizer):
    def __init__(self, params: Iterable, lr: float, *, beta1: float | None = None,
                 decay_rate: float = 0.8, eps1: float = 1e-30, eps2: float = 1e-3,
                 clip_threshold: float = 1.0, relative_step: bool = False,
                 weight_decay: float = 0.0):
        if lr < 0:
            raise ValueError(f"lr must be >= 0, got {lr}")
        if beta1 is not None and not 0.0 <= beta1 < 1.0:
            raise ValueError(f"beta1 must be in [0, 1) or None, got {beta1}")
        if clip_threshold < 1.0:
            raise ValueError(f"clip_threshold d must be >= 1, got {clip_threshold}")
        defaults = dict(lr=lr, beta1=beta1, decay_rate=decay_rate, eps1=eps1, eps2=eps2,
                        clip_threshold=clip_threshold, relative_step=relative_step,
                        weight_decay=weight_decay)
        super().__init__(params, defaults)

    def _init_state(self, p: torch.Tensor, beta1: float | None) -> dict:
        # Statistics are kept in at least fp32: squared bf16 gradients averaged
        # in bf16 would lose most of their bits.
        dtype = torch.promote_types(p.dtype, torch.float32)
        # The counter stays on the host (as in torch's optimizers): reading it
        # as a Python number then costs no device synchronization.
        state = {"step": torch.zeros((), dtype=torch.float32)}
        if p.dim() >= 2:
            state["row"] = torch.zeros(p.shape[:-1], dtype=dtype, device=p.device)
            state["col"] = torch.zeros(p.shape[:-2] + p.shape[-1:], dtype=dtype, device=p.device)
        else:
            state["sq"] = torch.zeros(p.shape, dtype=dtype, device=p.device)
        if beta1 is not None:
            state["exp_avg"] = torch.zeros(p.shape, dtype=dtype, device=p.device)
        return state

    @torch.no_grad()
    def step(self, closure: Callable[[], torch.Tensor] | None = None) -> torch.Tensor | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, beta1, wd = group["lr"], group["beta1"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("Adafactor does not support sparse gradients")
                state = self.state[p]
                if not state:
                    state.update(self._init_state(p, beta1))
                state["step"] += 1
                weight = state["step"].item() ** -group["decay_rate"]  # 1 - beta2_t

                dtype = state["row" if "row" in state else "sq"].dtype
                g = p.grad.to(dtype)  # may be p.grad itself: read, never written
                g2 = g.square().add_(group["eps1"])
                if p.dim() >= 2:
                    row, col = state["row"], state["col"]
                    row.lerp_(g2.sum(dim=-1), weight)
                    col.lerp_(g2.sum(dim=-2), weight)
                    v = (row.unsqueeze(-1) * col.unsqueeze(-2)).div_(
                        row.sum(dim=-1)[..., None, None])
                else:
                    v = state["sq"].lerp_(g2, weight)
                update = g / v.sqrt()
                # Tensor-valued clip (no .item()): no device sync per parameter.
                update.div_((_rms(update) / group["clip_threshold"]).clamp_(min=1.0))
                if beta1 is not None:
                    update = state["exp_avg"].lerp_(update, 1.0 - beta1)

                # a_t reads X_{t-1}, so it is taken before weight decay moves X.
                scale = (_rms(p.to(dtype)).clamp_(min=group["eps2"]) * lr
                         if group["relative_step"] else lr)
                if wd != 0.0:
                    p.mul_(1.0 - lr * wd)
                p.sub_((update * scale).to(p.dtype))
        return loss


def build_adafactor(model: nn.Module, *, lr: float, weight_decay: float,
                    beta1: float | None = None, relative_step: bool = False) -> Adafactor:
    """Adafactor over the same decay/no-decay groups as ``build_adamw``."""
    return Adafactor(decay_groups(model, weight_decay), lr=lr, beta1=beta1,
                     relative_step=relative_step)
