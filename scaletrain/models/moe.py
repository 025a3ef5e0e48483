"""Mixture of experts: a learned router sends each token to top_k of E expert MLPs.

Shazeer et al. 2017, "Outrageously Large Neural Networks: The Sparsely-Gated
Mixture-of-Experts Layer"; Lepikhin et al. 2020, "GShard"; Fedus et al. 2021,
"Switch Transformers"; Zoph et al. 2022, "ST-MoE"; DeepSeek-AI 2024,
"DeepSeek-V3 Technical Report".

Routing. For a token x (after the block's layer norm) and router weight W_r
[E, d_model]:

    logits = W_r x            computed in fp32, even under autocast: the
                              choice of experts must not flip with rounding
    p      = softmax(logits)
    top-k  experts e_1..e_k with the largest p, best first
    gates  g_i = p_{e_i} / sum_j p_{e_j}   (k > 1, GShard)
           g_1 = p_{e_1}                   (k = 1, Switch: the raw probability,
                                            so the router still gets a gradient)
    y      = sum_i g_i * expert_{e_i}(x)

Each expert is the dense MLP's shape at its own width: ``proj(gelu(fc(x)))``
(GPT), or with ``activation="swiglu"`` ``proj(silu(gate(x)) * up(x))``, the
experts of Mixtral (Jiang et al. 2024, "Mixtral of Experts") and of the
Llama family's MLP (models/llama.py).

Capacity (GShard section 2.2, Switch section 2.2). The routing group is one
sequence of s tokens: with a capacity factor c, each expert takes at most

    C = ceil(c * s * k / E)

of the sequence's s*k assignments, every first choice before any second
choice, earlier positions first. An assignment past its expert's C is
dropped: it contributes nothing, so a token whose choices are all dropped
leaves the block through the residual connection unchanged. ``capacity=None``
drops nothing (dropless).

Auxiliary losses, per sequence then averaged over the batch's sequences:

    balance = E * sum_e f_e * P_e       Switch eq. 4-6, per sequence as
                                        DeepSeek-V3's sequence-wise balance loss
        f_e = the fraction of the sequence's s*k assignments choosing e,
              counted before dropping (a count: no gradient)
        P_e = the mean over the sequence's tokens of p_e (differentiable)
    z       = mean over tokens of logsumexp(logits)^2        ST-MoE eq. 5

``balance`` is 1 when routing is uniform and grows as it concentrates; z
keeps the logits small, where fp32 softmax stays accurate. The layer leaves
``aux_coef * balance + z_coef * z`` in ``aux_loss`` for the trainer to add.

Why per sequence. A layer whose routing, capacity and balance statistics all
live within one sequence computes the same output and the same loss for a
sequence whatever else is in its batch. Data and expert parallelism split a
batch across ranks by whole sequences, so a parallel run computes exactly
what one device computes on the whole batch: the mean of per-sequence losses
splits into per-rank sums, with no statistics to exchange.

Expert parallelism (parallel/experts.py) puts a dispatch in place of
``Experts``; this layer knows nothing of it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class MoEConfig:
    experts: int  # E
    top_k: int  # k: experts per token
    hidden: int  # each expert's hidden width (4 * d_model / k keeps the dense MLP's active parameters)
    capacity: float | None = None  # capacity factor; None: dropless
    every: int = 1  # every this-many-th block is a mixture of experts
    aux_coef: float = 0.01  # load-balancing loss weight (Switch: 0.01)
    z_coef: float = 0.0  # router z-loss weight (ST-MoE: 0.001)
    activation: str = "gelu"  # each expert's MLP: "gelu" (fc, proj) or "swiglu" (gate, up, proj)

    def in_block(self, index: int) -> bool:
        return index % self.every == self.every - 1


ACTIVATIONS = ("gelu", "swiglu")


class Expert(nn.Module):
    """One expert: the dense MLP's shape at width ``hidden``, ``proj(gelu(fc(x)))`` or, with
    ``activation="swiglu"``, ``proj(silu(gate(x)) * up(x))``."""

    def __init__(self, d_model: int, hidden: int, activation: str = "gelu"):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"an expert's activation is one of {', '.join(ACTIVATIONS)}, got {activation!r}")
        self.swiglu = activation == "swiglu"
        if self.swiglu:
            self.gate = nn.Linear(d_model, hidden, bias=False)
            self.up = nn.Linear(d_model, hidden, bias=False)
        else:
            self.fc = nn.Linear(d_model, hidden, bias=False)
        self.proj = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.swiglu:
            return self.proj(F.silu(self.gate(x)) * self.up(x))
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


def run_experts(experts: Sequence[nn.Module], rows: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
    """``rows`` grouped by expert, ``counts[i]`` rows for ``experts[i]`` -> their outputs in the
    same order; one call per expert that has rows. An expert without rows still joins the graph
    (`_idle`), so that every backward gives every expert a gradient, in the same place, whatever
    the routing: replicas that reduce gradients as they arrive (ZeRO, parallel/zero.py) must all
    see the same ones in the same order. The gradient is zeros, which is what data parallelism
    and ZeRO took a missing one for."""
    outputs = [expert(part) if len(part) else _idle(expert, part)
               for expert, part in zip(experts, rows.split(list(counts)), strict=True)]
    dtype = next((out.dtype for out, n in zip(outputs, counts) if n), rows.dtype)  # autocast's, where one ran
    return torch.cat([out.to(dtype) for out in outputs])


def _idle(expert: nn.Module, part: torch.Tensor) -> torch.Tensor:
    """The output of an expert given no rows (no rows), tied to its weights by empty slices: the
    forward computes nothing, and backward gives each weight a gradient of zeros."""
    nothing = sum(weight.flatten()[:0].sum() for weight in expert.parameters() if weight.requires_grad)
    return part + nothing


class Experts(nn.ModuleList):
    """The E experts; ``forward(rows, counts)`` runs each on its group of rows."""

    def __init__(self, d_model: int, hidden: int, n: int, activation: str = "gelu"):
        super().__init__(Expert(d_model, hidden, activation) for _ in range(n))

    def forward(self, rows: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
        return run_experts(self, rows, counts)


@dataclass(frozen=True)
class Routing:
    """A batch's routing decisions, for [b, s] tokens."""

    logits: torch.Tensor  # [b, s, E] fp32
    probs: torch.Tensor  # [b, s, E] softmax of the logits
    experts: torch.Tensor  # [b, s, k] chosen expert ids, best first
    gates: torch.Tensor  # [b, s, k] their weights in the output
    kept: torch.Tensor  # [b, s, k] bool: within the expert's capacity


class MoE(nn.Module):
    """A mixture-of-experts feed-forward layer (module docstring): [b, s, d_model] -> [b, s, d_model].

    After each forward: ``aux_loss`` (scalar, in the graph), ``tokens_per_expert``
    (int64 [E], kept assignments) and ``dropped`` (int64 scalar, dropped assignments).
    """

    def __init__(self, d_model: int, cfg: MoEConfig):
        super().__init__()
        if not 1 <= cfg.top_k <= cfg.experts:
            raise ValueError(f"top_k must be between 1 and the {cfg.experts} experts, got {cfg.top_k}")
        self.cfg = cfg
        self.router = nn.Linear(d_model, cfg.experts, bias=False)
        self.experts = Experts(d_model, cfg.hidden, cfg.experts, cfg.activation)
        self.aux_loss: torch.Tensor | None = None  # None until the layer first runs
        self.tokens_per_expert = torch.zeros(cfg.experts, dtype=torch.int64)
        self.dropped = torch.zeros((), dtype=torch.int64)

    def route(self, x: torch.Tensor) -> Routing:
        """Top-k experts, gates and capacity for every token of ``x`` [b, s, d_model]."""
        with torch.autocast(x.device.type, enabled=False):
            logits = x.float() @ self.router.weight.float().t()
        probs = logits.softmax(-1)
        top, experts = probs.topk(self.cfg.top_k, dim=-1)
        gates = top / top.sum(-1, keepdim=True) if self.cfg.top_k > 1 else top
        return Routing(logits, probs, experts, gates, self._within_capacity(experts))

    def _within_capacity(self, experts: torch.Tensor) -> torch.Tensor:
        """[b, s, k] expert ids -> [b, s, k] bool: the assignment's place in its expert's
        queue, first choices before second ones and by position within a choice, is at
        most the capacity (GShard's cumulative sum over one-hot masks)."""
        if self.cfg.capacity is None:
            return torch.ones_like(experts, dtype=torch.bool)
        b, s, k = experts.shape
        limit = math.ceil(self.cfg.capacity * s * k / self.cfg.experts)
        choice_major = experts.transpose(1, 2).reshape(b, k * s)
        place = F.one_hot(choice_major, self.cfg.experts).cumsum(1).gather(2, choice_major[..., None])
        return (place <= limit).view(b, k, s).transpose(1, 2)

    def _aux_loss(self, routing: Routing) -> torch.Tensor:
        b, s, k = routing.experts.shape
        choices = routing.experts.flatten(1)  # [b, s*k]
        fraction = routing.probs.new_zeros(b, self.cfg.experts).scatter_add_(
            1, choices, routing.probs.new_ones(choices.shape)) / (s * k)  # f, per sequence
        mean_prob = routing.probs.mean(1)  # P, per sequence
        balance = self.cfg.experts * (fraction * mean_prob).sum(-1).mean()
        z = torch.logsumexp(routing.logits, -1).square().mean()
        return self.cfg.aux_coef * balance + self.cfg.z_coef * z

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        routing = self.route(x)
        # A forward recomputed inside backward (activation recompute) routes the same rows again:
        # the first forward's loss and counts stand, and a second graph kept here would hold the
        # recomputed block's tensors alive until the step ends. The loss is still computed, so the
        # recomputation saves the tensors the first forward saved (torch.utils.checkpoint checks).
        recomputed = torch._C._current_graph_task_id() != -1
        aux_loss = self._aux_loss(routing)
        if not recomputed:
            self.aux_loss = aux_loss
        # The kept assignments, grouped by expert (a stable sort keeps token order within an expert).
        token = torch.arange(b * s, device=x.device).view(b, s, 1).expand_as(routing.experts)[routing.kept]
        expert = routing.experts[routing.kept]
        by_expert = torch.argsort(expert, stable=True)
        token, gate = token[by_expert], routing.gates[routing.kept][by_expert]
        counts = torch.bincount(expert, minlength=self.cfg.experts)
        if not recomputed:
            self.tokens_per_expert = counts  # indices and counts: outside the graph already
            self.dropped = routing.kept.numel() - counts.sum()
        # the kept rows [n_kept, d_model] in expert order: each expert runs once, on all its rows
        out = self.experts(x.reshape(b * s, d)[token], counts.tolist())
        weighted = out * gate[:, None]
        # scattered back: y[token] += gate * output; dropped assignments add nothing
        return weighted.new_zeros(b * s, d).index_add(0, token, weighted).view(b, s, d)


def moe_layers(model: nn.Module) -> list[MoE]:
    """The model's mixture-of-experts layers, in module order."""
    return [module for module in model.modules() if isinstance(module, MoE)]


def auxiliary_loss(model: nn.Module) -> torch.Tensor:
    """The sum of the aux losses its layers left in the last forward (zero when none ran),
    to add to the training loss."""
    losses = [layer.aux_loss for layer in moe_layers(model) if layer.aux_loss is not None]
    if losses:
        return torch.stack(losses).sum()
    parameter = next(model.parameters(), None)
    return torch.zeros((), device=parameter.device if parameter is not None else None)


def expert_token_counts(model: nn.Module) -> torch.Tensor:
    """int64 [n_moe_layers, E]: kept assignments per expert in each layer's last forward
    ([0, 0] for a model, or a pipeline stage, without such layers)."""
    layers = moe_layers(model)
    if not layers:
        return torch.zeros(0, 0, dtype=torch.int64)
    return torch.stack([layer.tokens_per_expert for layer in layers])


def dropped_counts(model: nn.Module) -> torch.Tensor:
    """int64 [n_moe_layers]: assignments past capacity in each layer's last forward."""
    layers = moe_layers(model)
    if not layers:
        return torch.zeros(0, dtype=torch.int64)
    return torch.stack([layer.dropped for layer in layers])
