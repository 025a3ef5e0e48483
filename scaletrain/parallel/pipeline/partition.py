"""Cutting a plain model into pipeline stages.

A model is a stack of similar layers (a decoder's ``blocks``) with something
before it (embeddings) and after it (final norm, head). A `StagePlan` (the
family's spec, models/spec.py) names these parts, so the model itself knows nothing of stages: the first stage
runs the part before the stack, the last the part after, every stage a
contiguous, non-empty range of the stack.

Balance. The ranges minimise the cost of the most loaded stage (the
pipeline runs at the pace of its slowest stage), by dynamic programming over
the cut points: ``best[k][i]`` is the least possible maximum for the first
``i`` layers in ``k`` stages. The cost of a layer is its parameter count (the
default: memory in balance), or its measured forward and backward time (the
embedding lookup is nearly free while the vocabulary projection is not, so
the two orders can differ).

Pruning. Each rank keeps only the layers of its own stages: the others are
replaced by empty modules in the stack, which keeps every remaining
parameter's name (``blocks.5.mlp.fc.weight`` on whichever rank holds it), so
checkpoints, the optimizer and parity read the same names as one device.

Tied weights (Press & Wolf 2017). A head that uses the token embedding's
weight (tied embeddings), so the first and the last stage each hold a copy. Both copies must
stay equal: each stage's gradient is only part of the true one (the sum of
the embedding's and the head's), so the holders add up their gradients
before the optimizer step (Megatron's "embedding group"), then take the same
step. A module that only holds such a shared weight stays on every stage
that uses it (the last stage keeps ``tok_emb`` next to ``head``), so the
shared weight keeps the canonical name one device gives it.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from scaletrain.models.spec import StagePlan


@dataclass(frozen=True)
class Costs:
    """A cost per layer of the stack, plus what the first and last stages add."""

    layers: tuple[float, ...]
    first: float = 0.0
    last: float = 0.0


def balance(costs: Costs, stages: int) -> list[range]:
    """Contiguous, non-empty ranges of layers, one per stage, minimising the
    largest stage cost (see the module docstring)."""
    n = len(costs.layers)
    if not 1 <= stages <= n:
        raise ValueError(f"cannot cut {n} layers into {stages} non-empty stages")
    prefix = [0.0]
    for c in costs.layers:
        prefix.append(prefix[-1] + c)

    def cost(k: int, start: int, stop: int) -> float:
        return (prefix[stop] - prefix[start] + (costs.first if k == 0 else 0.0)
                + (costs.last if k == stages - 1 else 0.0))

    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for k in range(1, stages + 1):
        for stop in range(k, n - (stages - k) + 1):
            for start in range(k - 1, stop):  # the earliest cut wins ties: a deterministic plan
                value = max(best[k - 1][start], cost(k - 1, start, stop))
                if value < best[k][stop]:
                    best[k][stop], cut[k][stop] = value, start
    ranges, stop = [], n
    for k in range(stages, 0, -1):
        ranges.append(range(cut[k][stop], stop))
        stop = cut[k][stop]
    return ranges[::-1]


def _unique_numel(modules: Sequence[nn.Module]) -> int:
    return sum(p.numel() for p in {id(p): p for m in modules for p in m.parameters()}.values())


def parameter_costs(model: nn.Module, plan: StagePlan) -> Costs:
    """Parameters per layer; the first and last stages' extra modules count
    whole, the shared head weight on both (each holds a copy)."""
    stack = getattr(model, plan.stack)
    return Costs(tuple(float(_unique_numel([layer])) for layer in stack),
                 float(_unique_numel([model.get_submodule(name) for name in plan.first])),
                 float(_unique_numel([model.get_submodule(name) for name in plan.last])))


def _timed(run, repeats: int) -> float:
    """Median seconds of ``run()`` (forward and backward) after one untimed call."""
    run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def time_costs(model: nn.Module, plan: StagePlan, sample: torch.Tensor, repeats: int = 3) -> Costs:
    """Measured forward plus backward seconds of each part on ``sample`` (a
    micro-batch of the model's input). Every rank measures; the caller
    averages over the pipeline group so that all ranks cut alike."""
    stack = getattr(model, plan.stack)
    with torch.no_grad():
        hidden = getattr(model, plan.enter)(sample)
    hidden.requires_grad_(True)

    def through(fn) -> float:
        return _timed(lambda: fn().float().sum().backward(), repeats)

    costs = Costs(tuple(through(lambda layer=layer: layer(hidden)) for layer in stack),
                  through(lambda: getattr(model, plan.enter)(sample)),
                  through(lambda: getattr(model, plan.leave)(hidden)))
    model.zero_grad(set_to_none=True)
    return costs


@dataclass
class Stage:
    """One stage of the cut model, run on the rank that holds it."""

    index: int
    layers: range
    is_first: bool
    is_last: bool
    model: nn.Module
    plan: StagePlan

    def blocks(self) -> list[nn.Module]:
        stack = getattr(self.model, self.plan.stack)
        return [stack[i] for i in self.layers]

    def modules(self) -> list[nn.Module]:
        """Every module the stage runs: its blocks, and the first or the last stage's parts around them."""
        around = (*(self.plan.first if self.is_first else ()), *(self.plan.last if self.is_last else ()))
        return self.blocks() + [self.model.get_submodule(name) for name in around]

    def __call__(self, x: torch.Tensor, documents: torch.Tensor | None = None) -> torch.Tensor:
        """The stage's layers on ``x``; ``documents``: the micro-batch's packed rows
        (models/decoder.py), which every stage's attention needs."""
        packed = () if documents is None else (documents,)
        # what every block reads besides x: the documents, and what the model computes once for them all
        # (models/decoder.py's block_extras; a model without it: the documents alone)
        extras = self.model.block_extras(x.shape[1], x.device, documents) \
            if hasattr(self.model, "block_extras") else packed
        if self.is_first:
            x = getattr(self.model, self.plan.enter)(x, *packed)
        for block in self.blocks():
            x = block(x, *extras)
        if self.is_last:
            x = getattr(self.model, self.plan.leave)(x)
        return x


def _used(model: nn.Module, plan: StagePlan, ranges: list[range], stage: int) -> list[nn.Module]:
    stack = getattr(model, plan.stack)
    modules = [stack[i] for i in ranges[stage]]
    if stage == 0:
        modules += [model.get_submodule(name) for name in plan.first]
    if stage == len(ranges) - 1:
        modules += [model.get_submodule(name) for name in plan.last]
    return modules


def shared_parameters(model: nn.Module, plan: StagePlan, ranges: list[range]) -> dict[str, list[int]]:
    """Parameters used by more than one stage (tied weights): canonical name -> the stages using them."""
    users: dict[int, list[int]] = {}
    for stage in range(len(ranges)):
        for p in {id(p) for m in _used(model, plan, ranges, stage) for p in m.parameters()}:
            users.setdefault(p, []).append(stage)
    return {name: users[id(p)] for name, p in model.named_parameters() if len(users.get(id(p), ())) > 1}


def keep_stages(model: nn.Module, plan: StagePlan, ranges: list[range], stages: Sequence[int]) -> list[Stage]:
    """Prune ``model`` in place to what ``stages`` need; return those stages."""
    stack = getattr(model, plan.stack)
    kept = {i for s in stages for i in ranges[s]}
    for i in range(len(stack)):
        if i not in kept:
            stack[i] = nn.Module()  # a placeholder keeps the other layers' indices, hence names
    needed = {m for s in stages for m in _used(model, plan, ranges, s)}
    kept_params = {id(p) for m in needed for p in m.parameters()}
    for name in (*plan.first, *plan.last):
        module = model.get_submodule(name)
        params = list(module.parameters())
        tied_alias = params and all(id(p) in kept_params for p in params)
        if module not in needed and not tied_alias:
            setattr(model, name, None)
    last = len(ranges) - 1
    return [Stage(s, ranges[s], s == 0, s == last, model, plan) for s in stages]


def describe(ranges: list[range], plan: StagePlan) -> str:
    """One line per stage: which layers it runs."""
    lines = []
    for s, r in enumerate(ranges):
        parts = [f"{plan.stack} {r.start}-{r.stop - 1}" if len(r) > 1 else f"{plan.stack} {r.start}"]
        if s == 0:
            parts.insert(0, "+".join(plan.first))
        if s == len(ranges) - 1:
            parts.append("+".join(plan.last))
        lines.append(f"stage {s}: {', '.join(parts)}")
    return "\n".join(lines)
