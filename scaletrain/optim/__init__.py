"""Optimizers, fp32 master weights (and their offload to host memory), and the learning-rate schedule."""

from __future__ import annotations

from collections.abc import Collection

import torch

from scaletrain.optim.adafactor import Adafactor, build_adafactor
from scaletrain.optim.adamw import build_adamw, decay_groups
from scaletrain.optim.adamw8bit import AdamW8bit
from scaletrain.optim.masters import MasterWeights
from scaletrain.optim.schedule import lr_at, run_lr


def build_optimizer(param_groups: list[dict], cfg, embeddings: Collection[torch.Tensor] = ()) -> torch.optim.Optimizer:
    """``--optimizer`` over ``param_groups`` (the model's decay groups, or their masters), as the
    training settings ``cfg`` say (config.py's TrainConfig: optimizer, lr, betas, momentum, fused);
    ``embeddings``: the stepped tensors of embedding tables, whose 8-bit AdamW state stays fp32."""
    if cfg.optimizer == "adafactor":
        return Adafactor(param_groups, lr=cfg.lr)
    if cfg.optimizer == "sgd":
        # Weight decay as SGD takes it, added to the gradient (for SGD without momentum the same
        # as AdamW's decoupled decay at this learning rate).
        return torch.optim.SGD(param_groups, lr=cfg.lr, momentum=cfg.momentum, foreach=True)
    if cfg.optimizer == "adamw8bit":
        return AdamW8bit(param_groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=1e-8, fp32_state=embeddings,
                         fused=cfg.fused == "triton")
    if cfg.fused == "triton":
        # Imported here: importing Triton decorates the kernel, which must come after
        # TRITON_INTERPRET is set (kernels/__init__.py).
        from scaletrain.optim.fused_adamw import TritonAdamW
        return TritonAdamW(param_groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=1e-8)
    # torch's fused kernel on CUDA and on the CPU (offloaded state included): one pass over each
    # weight, its gradient and moments (the foreach loop makes a dozen), no host sync, and the
    # clipping's scale folded in (optim/clip.py); the foreach loop where it has none (meta).
    fused = all(p.device.type in ("cuda", "cpu") for group in param_groups for p in group["params"])
    return torch.optim.AdamW(param_groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=1e-8,
                             **({"fused": True} if fused else {"foreach": True}))


__all__ = ["Adafactor", "AdamW8bit", "MasterWeights", "build_adafactor", "build_adamw", "build_optimizer",
           "decay_groups", "lr_at", "run_lr"]
