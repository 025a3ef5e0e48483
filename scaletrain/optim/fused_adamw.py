"""``--optimizer adamw --fused triton``: torch's AdamW, stepped by the fused
multi-tensor Triton kernel of kernels/adamw.py.

`TritonAdamW` takes torch.optim.AdamW's arguments (lr, betas, eps,
weight_decay, per group) and keeps torch's per-parameter state (``step``, a
CPU scalar tensor, ``exp_avg``, ``exp_avg_sq``), so checkpoints, state dicts
and the memory ledger treat it as they treat torch's. A step makes one launch
per set of parameters that share a group, the dtypes and the step count:
one per group in a normal run, where every parameter has been stepped
equally often (a parameter left without a gradient keeps its count, and
its later steps form a set of their own, as its bias correction differs).

With fp32 master weights (optim/masters.py) the kernel can also write each
master's bf16 working copy as it writes the master, in the same pass:
`attach_working_copies` takes (master, working weight) pairs, and the
separate rounding pass (`MasterWeights.copy_master_to_model`) is then
unnecessary. Only where both live on one device: with ``--offload
optimizer`` the masters are on the host and the copy is a transfer.

``reference=True`` runs the same update in plain PyTorch
(`adamw_reference`), for machines without Triton and for tests.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable

import torch

from scaletrain.errors import UserError
from scaletrain.kernels import unavailable
from scaletrain.kernels.adamw import AdamWLaunch, adamw_reference


class TritonAdamW(torch.optim.Optimizer):
    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, *, reference: bool = False):
        if not 0.0 <= lr:
            raise ValueError(f"Invalid learning rate: {lr}")
        if not 0.0 <= eps:
            raise ValueError(f"Invalid epsilon value: {eps}")
        if not all(0.0 <= beta < 1.0 for beta in betas):
            raise ValueError(f"Invalid beta parameters: {betas}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        self.reference = reference
        if not reference:
            for device in {p.device for group in self.param_groups for p in group["params"]}:
                if (why := unavailable(device)) is not None:
                    raise UserError(why)
        self._working: dict[torch.Tensor, torch.Tensor] = {}
        # One launch (and its cached tables) per (group, device, dtypes); see `_sets`.
        self._launches: dict[tuple, AdamWLaunch] = {}

    def attach_working_copies(self, pairs: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """After each step, write every ``param`` of the (param, working) pairs, rounded
        to the working tensor's dtype, into ``working`` (in the kernel's pass)."""
        stepped = {p for group in self.param_groups for p in group["params"]}
        for param, working in pairs:
            if param not in stepped:
                raise ValueError("attach_working_copies: a tensor that this optimizer does not step")
            if working.shape != param.shape or working.device != param.device:
                raise ValueError(f"attach_working_copies: a working copy must match its parameter's shape "
                                 f"and device, got {tuple(working.shape)} on {working.device} for "
                                 f"{tuple(param.shape)} on {param.device}")
            self._working[param] = working

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for index, group in enumerate(self.param_groups):
            self._step_group(index, group)
        return loss

    def _step_group(self, index: int, group: dict) -> None:
        params = [p for p in group["params"] if p.grad is not None]
        if not params:
            return
        if any(p.grad.is_sparse for p in params):
            raise RuntimeError("TritonAdamW does not support sparse gradients")
        states = [self._state(p) for p in params]
        torch._foreach_add_([s["step"] for s in states], 1.0)
        beta1, beta2 = group["betas"]
        hyper = {"lr": float(group["lr"]), "beta1": beta1, "beta2": beta2, "eps": group["eps"],
                 "weight_decay": group["weight_decay"]}
        for (slot, step), members in self._sets(index, params, states).items():
            workings = [self._working[p] for p in members] if slot[-1] is not None else None
            update = adamw_reference if self.reference else self._launches.setdefault(slot, AdamWLaunch())
            update(members, [p.grad for p in members], [self.state[p]["exp_avg"] for p in members],
                   [self.state[p]["exp_avg_sq"] for p in members], workings, step=step, **hyper)

    def _sets(self, index: int, params: list[torch.Tensor], states: list[dict]) -> dict[tuple, list]:
        """The parameters one launch updates together, keyed by (slot, step). The slot
        (group, device, dtypes) names the cached launch; the step is left out of it so
        the launch survives from step to step."""
        sets: dict[tuple, list] = defaultdict(list)
        for p, state in zip(params, states):
            working = self._working.get(p)
            slot = (index, p.device, p.dtype, p.grad.dtype, None if working is None else working.dtype)
            sets[slot, int(state["step"].item())].append(p)
        return sets

    def _state(self, param: torch.Tensor) -> dict:
        """torch.optim.AdamW's state for ``param``, created on its first step."""
        state = self.state[param]
        if not state:
            # A CPU scalar of the default dtype, as torch's non-fused AdamW keeps it.
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        return state
