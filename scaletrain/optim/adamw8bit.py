"""8-bit AdamW: both moments kept in 8 bits, block by block (Dettmers et al. 2021, "8-bit
Optimizers via Block-wise Quantization"). The pure-PyTorch reference.

Each moment tensor is cut into blocks of B = 2048 elements. A block keeps its absolute
maximum N_b in fp32, and each element the 8-bit index of the nearest value of a fixed map Q
of values in [-1, 1]:

    code_i = argmin_j |Q_j - x_i / N_b|,        x_i ~ Q[code_i] * N_b

Q is dynamic tree quantization (Dettmers 2016): after the sign bit, a run of e zero bits
gives the decade 10^-e, a one bit ends the run, and the 6 - e bits left split (0.1, 1]
linearly, so a small value keeps its relative precision where a linear map would round it
to zero, and a block's largest element (1 after scaling) is exact. The second moment is
never negative and takes the unsigned map: no sign bit, one more bit of fraction. A block's
own N_b confines an outlier's damage to its 2048 neighbours (the paper's point against one
scale per tensor).

State: 2 bytes per parameter plus 2 x 4 bytes per block (0.004 per parameter), against
AdamW's 8. A step dequantizes a tensor's moments to fp32, takes AdamW's step on them
(bias-corrected, decoupled weight decay), and quantizes them back (``fused=True``: all three in
one Triton kernel per tensor, kernels/adamw8bit.py, which never holds the fp32 moments). As the paper advises, a
tensor of fewer than 4096 elements keeps fp32 moments (its bytes are negligible, and norms
and biases are where quantization error would cost most), and so do the embedding tables
(``fp32_state``): the paper's stable embedding keeps their state in 32 bits, because the
rows of rare tokens see gradients so seldom that their moments live near zero, where
quantization's error is largest relative to them.

A checkpoint holds the moments dequantized, as fp32 ``exp_avg`` and ``exp_avg_sq`` shaped like
their weights (``unpacked``): AdamW's own format, so it reads back under any layout (another
ZeRO sharding cuts other blocks) and into ``--optimizer adamw`` and back, and a resume under the
same layout is exact (a block's maximum dequantizes to itself, each code to its own value).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterator
from contextlib import contextmanager

import torch

from scaletrain.errors import UserError
from scaletrain.kernels import unavailable

BLOCK = 2048
MIN_8BIT = 4096  # a tensor smaller than this keeps fp32 moments


def dynamic_map(signed: bool) -> torch.Tensor:
    """The sorted values of dynamic tree quantization (module docstring): 255 of them signed
    (0, and 127 of each sign), 256 unsigned."""
    bits = 7 if signed else 8  # after the sign bit
    magnitudes = [0.0]
    for zeros in range(bits):  # the run of zero bits, then the indicator bit
        fraction_bits = bits - 1 - zeros
        levels = 2 ** fraction_bits
        magnitudes += [10.0 ** -zeros * (0.1 + 0.9 * k / levels) for k in range(1, levels + 1)]
    values = torch.tensor(magnitudes, dtype=torch.float32)
    if signed:
        values = torch.cat([-values[1:], values])
    return values.sort().values


def quantize(x: torch.Tensor, qmap: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` -> (uint8 codes, one per element, flat; fp32 absmax per block of ``BLOCK``)."""
    flat = x.reshape(-1).float()
    blocks = torch.nn.functional.pad(flat, (0, -flat.numel() % BLOCK)).view(-1, BLOCK)
    absmax = blocks.abs().amax(dim=1)
    normed = blocks / absmax.clamp(min=torch.finfo(torch.float32).tiny)[:, None]
    bounds = (qmap[1:] + qmap[:-1]) / 2  # nearest value: between which midpoints it falls
    codes = torch.searchsorted(bounds, normed.contiguous()).to(torch.uint8)
    return codes.reshape(-1)[:flat.numel()], absmax


def dequantize(codes: torch.Tensor, absmax: torch.Tensor, qmap: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """Codes and block maxima back to an fp32 tensor of ``shape``."""
    values = qmap[codes.long()]
    blocks = torch.nn.functional.pad(values, (0, -values.numel() % BLOCK)).view(-1, BLOCK) * absmax[:, None]
    return blocks.reshape(-1)[:codes.numel()].reshape(shape)


class AdamW8bit(torch.optim.Optimizer):
    """AdamW with block-wise 8-bit moments (module docstring); the arguments are AdamW's."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, fp32_state: Collection[torch.Tensor] = (), fused: bool = False):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.signed_map, self.unsigned_map = dynamic_map(signed=True), dynamic_map(signed=False)
        self.fp32_state = {id(t) for t in fp32_state}
        # fused: each 8-bit tensor's step is one Triton kernel (kernels/adamw8bit.py), its lookup
        # tables built once per device; fp32-state tensors keep the step below.
        self.fused = fused
        self._tables: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        if fused:
            for device in {p.device for group in self.param_groups for p in group["params"]}:
                if (why := unavailable(device)) is not None:
                    raise UserError(why)

    def _moments(self, p: torch.Tensor, state: dict) -> tuple[torch.Tensor, torch.Tensor]:
        if "exp_avg" in state:
            return state["exp_avg"], state["exp_avg_sq"]
        signed, unsigned = self.signed_map.to(p.device), self.unsigned_map.to(p.device)
        return (dequantize(state["exp_avg_codes"], state["exp_avg_absmax"], signed, p.shape),
                dequantize(state["exp_avg_sq_codes"], state["exp_avg_sq_absmax"], unsigned, p.shape))

    def _store(self, p: torch.Tensor, state: dict, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor) -> None:
        if p.numel() < MIN_8BIT or id(p) in self.fp32_state:
            state["exp_avg"], state["exp_avg_sq"] = exp_avg, exp_avg_sq
            return
        for key in ("exp_avg", "exp_avg_sq"):  # fp32 while unpacked
            state.pop(key, None)
        state["exp_avg_codes"], state["exp_avg_absmax"] = quantize(exp_avg, self.signed_map.to(p.device))
        state["exp_avg_sq_codes"], state["exp_avg_sq_absmax"] = quantize(exp_avg_sq, self.unsigned_map.to(p.device))

    @contextmanager
    def unpacked(self) -> Iterator[None]:
        """Every moment as an fp32 tensor shaped like its weight for the time of the block (a
        checkpoint's save, or its load, which writes into them), quantized again after."""
        packed = [p for p, state in self.state.items() if "exp_avg_codes" in state]
        for p in packed:
            state = self.state[p]
            moments = self._moments(p, state)
            for key in ("exp_avg_codes", "exp_avg_absmax", "exp_avg_sq_codes", "exp_avg_sq_absmax"):
                del state[key]
            state["exp_avg"], state["exp_avg_sq"] = moments
        try:
            yield
        finally:
            for p in packed:
                self._store(p, self.state[p], self.state[p]["exp_avg"], self.state[p]["exp_avg_sq"])

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    zeros = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
                    self._store(p, state, zeros, zeros.clone())
                state["step"] += 1
                t = state["step"].item()
                if self.fused and "exp_avg_codes" in state:
                    self._fused_step(p, state, group, t)
                    continue
                exp_avg, exp_avg_sq = self._moments(p, state)
                grad = p.grad.float()
                exp_avg.lerp_(grad, 1 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                denom = (exp_avg_sq.sqrt() / math.sqrt(1 - beta2 ** t)).add_(group["eps"])
                update = p.float().mul_(1 - group["lr"] * group["weight_decay"])
                update.addcdiv_(exp_avg, denom, value=-group["lr"] / (1 - beta1 ** t))
                p.copy_(update)
                self._store(p, state, exp_avg, exp_avg_sq)
        return loss

    def _fused_step(self, p: torch.Tensor, state: dict, group: dict, t: float) -> None:
        # Imported here: importing Triton decorates the kernel, which must come after
        # TRITON_INTERPRET is set (kernels/__init__.py).
        from scaletrain.kernels.adamw8bit import adamw8bit_step, lookup_table

        if p.device not in self._tables:
            self._tables[p.device] = (lookup_table(self.signed_map).to(p.device),
                                      lookup_table(self.unsigned_map).to(p.device))
        beta1, beta2 = group["betas"]
        adamw8bit_step(p, p.grad, state, *self._tables[p.device], block=BLOCK, step=t, lr=float(group["lr"]),
                       beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"])
