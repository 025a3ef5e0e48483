"""Pure bf16 training's update with stochastic rounding (Gupta et al. 2015, "Deep Learning with
Limited Numerical Precision"; Zamirai et al. 2020, "Revisiting BFloat16 Training").

Pure bf16 (``--masters none``) keeps no fp32 master: the optimizer steps the bf16 weights
themselves. Rounded to nearest, an update smaller than half the spacing of bf16 values around
w (2^-9 |w| or less: optim/masters.py) is lost every time, and late in training most are. A
stochastic rounding of x, whose neighbours in bf16 are lo <= x < hi, takes

    hi with probability (x - lo) / (hi - lo),  lo otherwise,      so that E[round(x)] = x:

a small update moves the weight by a whole spacing now and then, as often as its size asks,
and over many steps the weight follows the fp32 trajectory in expectation. In bits: bf16 is
the upper 16 bits of fp32, so adding a uniform random integer in [0, 2^16) to the fp32 bit
pattern and dropping the lower 16 bits carries into the kept bits with exactly that
probability.

How it steps. The optimizer (any of them) runs one tensor at a time on fp32 copies of the
weight, its gradient and its bf16 state (AdamW's moments, SGD's momentum: the state shaped
like the weight, which these optimizers create in the weight's dtype); the new weight is
rounded stochastically into the weight's own storage and the state to nearest. One tensor at a time keeps the fp32
copies to the largest tensor's, transient. The noise of tensor i at step t comes from a
generator seeded with (seed, t, i), so every replica of a weight (dp ranks, tp ranks holding
a norm) draws the same noise and the replicas stay equal.
"""

from __future__ import annotations

import torch

_LOW_BITS = 1 << 16  # the fp32 bits below bf16's


def round_stochastically(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """fp32 ``x`` rounded to bf16, up or down with the probabilities of the module docstring."""
    noise = torch.randint(0, _LOW_BITS, x.shape, dtype=torch.int32, generator=generator, device=x.device)
    bits = x.contiguous().view(torch.int32) + noise
    return (bits & -_LOW_BITS).view(torch.float32).to(torch.bfloat16)  # exact: the low bits are zero


class StochasticRounding:
    """Steps ``optimizer``, whose weights are bf16, with stochastically rounded updates
    (module docstring); ``seed``: the run's."""

    def __init__(self, optimizer: torch.optim.Optimizer, seed: int):
        self.optimizer, self.seed = optimizer, seed
        self.generators: dict[torch.device, torch.Generator] = {}  # one per device: the noise is drawn there
        self.step_number = 0  # the noise's seed: a resumed run draws what the straight run drew

    def at(self, step_number: int) -> StochasticRounding:
        """Itself, set to take step ``step_number`` (an optimizer's ``step()`` to the loss scaler)."""
        self.step_number = step_number
        return self

    @torch.no_grad()
    def step(self) -> None:
        step = self.step_number
        groups = self.optimizer.param_groups
        all_params = [group["params"] for group in groups]
        try:
            for group in groups:
                group["params"] = []
            index = 0
            for group, params in zip(groups, all_params):
                for p in params:
                    index += 1
                    if p.grad is not None:
                        if p.device not in self.generators:
                            self.generators[p.device] = torch.Generator(device=p.device)
                        generator = self.generators[p.device]
                        generator.manual_seed(((self.seed * 1_000_003 + step) * 10_007 + index) % 2**63)
                        group["params"] = [p]
                        self._step_one(p, generator)
                group["params"] = []
        finally:
            for group, params in zip(groups, all_params):
                group["params"] = params

    def _step_one(self, p: torch.Tensor, generator: torch.Generator) -> None:
        weight, grad = p.data, p.grad
        state = self.optimizer.state.get(p, {})
        p.data, p.grad = weight.float(), grad.float()
        for key, value in state.items():
            if _follows_weight(value, p):
                state[key] = value.float()
        self.optimizer.step()
        weight.copy_(round_stochastically(p.data, generator))  # into the weight's storage: views stay
        p.data, p.grad = weight, grad
        state = self.optimizer.state[p]  # the first step creates it, from the fp32 copy
        for key, value in state.items():
            if _follows_weight(value, p):
                state[key] = value.to(torch.bfloat16)


def _follows_weight(value: object, p: torch.Tensor) -> bool:
    """A state tensor kept in the weight's dtype (AdamW's moments, SGD's momentum; the
    optimizers --stochastic-rounding takes create their state like the weight)."""
    return torch.is_tensor(value) and value.is_floating_point() and value.shape == p.shape
