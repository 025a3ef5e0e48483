"""The weights one rank holds, found by building the model without storage.

A layout's parameter, gradient and optimizer bytes follow from which weights
each rank keeps, and that is decided by code the trainer already has: the
tensor-parallel plan (parallel/tensor.py) cuts matrices into slices, expert
parallelism (parallel/experts.py) keeps a share of the experts, and the
pipeline (parallel/pipeline/partition.py) balances the blocks over stages and
prunes the rest. The planner runs those same transforms, as the family's
spec declares them (its tensor plan and its stage plan: models/spec.py), on
the model built on PyTorch's ``meta`` device, where a tensor has a shape and a dtype but no
storage: building even a 70B-parameter model takes milliseconds and no
memory, and the counts are the trainer's by construction rather than a
formula that could drift from it (a vocabulary split unevenly over tp ranks,
the tied embedding copied onto the last stage, placeholders left by the
pruning: all come out as the trainer makes them).

The planner reports the most loaded rank: the first of a tp group (an
uneven vocabulary split gives the first ranks one row more) and of an ep
group, and every rank of the pipeline, whose stages differ.
"""

from __future__ import annotations

import copy
import fnmatch
import functools
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from scaletrain.config import FinetuneConfig, ModelConfig
from scaletrain.finetune.adapters import add_adapters, whole_parameters
from scaletrain.finetune.lora import ADAPTER_PARAMS, LoRALinear
from scaletrain.models import spec_for
from scaletrain.models.spec import Column, ModelShape, ModelSpec, Region, Row, TensorPlan
from scaletrain.parallel.experts import parallelize_experts
from scaletrain.parallel.pipeline.partition import (
    balance,
    keep_stages,
    parameter_costs,
    shared_parameters,
)
from scaletrain.parallel.tensor import parallelize_tensor
from scaletrain.parallel.zero import layer_modules
from scaletrain.planner.activations import Adapters
from scaletrain.runtime.mesh import Group


@dataclass(frozen=True)
class Planned:
    """A model as the planner weighs it: its family's spec (how to build, split and cut it)
    and the family's own config (and a fine-tune's adapters). Equal and hashed by the config
    and the adapters alone, the config's class the family's, so that the caches below key on them."""

    spec: ModelSpec = field(compare=False)
    cfg: Any
    adapters: tuple = ()  # a LoRA fine-tune's (rank, targets, quantize, modules to save): the base frozen

    @classmethod
    def of(cls, model: ModelConfig, vocab_size: int, seq_len: int, finetune: FinetuneConfig | None = None) -> Planned:
        spec = spec_for(model.name)
        adapters = (finetune.lora_rank, finetune.lora_targets, finetune.quantize, finetune.lora_modules_to_save) \
            if finetune and finetune.lora_rank else ()
        return cls(spec, spec.configure(model, vocab_size, seq_len), adapters)

    @functools.cached_property
    def shape(self) -> ModelShape:
        return self.spec.shape(self.cfg)

    @property
    def tensor_plan(self) -> TensorPlan | None:
        return self.spec.tensor_plan(self.cfg) if self.spec.tensor_plan else None

    @functools.cached_property
    def lora(self) -> Adapters:
        """A LoRA fine-tune's adapters in each block, found in the first block and sorted by the part of
        the tensor plan each sits in (the attention's region is the plan's first, as a decoder's is);
        none without adapters."""
        if not self.adapters:
            return Adapters()
        stack = self.spec.stages.stack
        plan = self.tensor_plan or ()
        region = next((pattern for pattern, style in plan if isinstance(style, Region)), None)
        found = {"attention": 0, "mlp": 0, "mlp_row": False, "layers": 0}
        model = whole_model(self)
        for name, module in getattr(model, stack)[0].named_modules(prefix=f"{stack}.0"):
            if not isinstance(module, LoRALinear):
                continue
            style = next((style for pattern, style in plan if fnmatch.fnmatchcase(name, pattern)), None)
            attention = region is not None and fnmatch.fnmatchcase(name, f"{region}.*")
            found["layers"] += 1
            if isinstance(style, Column):
                found["attention" if attention else "mlp"] += 1
            elif isinstance(style, Row) and not attention:
                found["mlp_row"] = True
        trained = {id(p) for p in whole_parameters(model, self.spec, self.adapters[3]).values()}

        def trains(word: str) -> bool:
            module = self.spec.whole_modules.get(word)
            return module is not None and any(id(p) in trained for p in model.get_submodule(module).parameters())

        return Adapters(self.adapters[0], found["layers"], found["attention"], found["mlp"], found["mlp_row"],
                        trains("embed"), trains("head"))

    @property
    def adapted_head(self) -> bool:
        """Whether a fine-tune's adapters or 4-bit weights sit on the head, which then keeps its own
        forward rather than the chunked head and loss (train/layout.py)."""
        return not isinstance(getattr(whole_model(self), "head", None), nn.Linear)


@dataclass(frozen=True)
class Split:
    """How a layout divides the model: the sizes that change what a rank holds."""

    tp: int = 1
    ep: int = 1
    pp: int = 1
    virtual: int = 1

    def stages_of(self, pp_rank: int) -> list[int]:
        """The stages a pipeline rank runs (Megatron's interleaved placement: schedules.py)."""
        return [chunk * self.pp + pp_rank for chunk in range(self.virtual)]


@dataclass(eq=False)  # one object per rank and split (`rank_weights` caches it): hashed by identity
class RankWeights:
    """One pipeline rank's part of the model (first tp and ep rank), weightless.

    ``params`` are its trainable parameters in ``model.parameters()`` order (the
    order gradient buckets and ZeRO units are cut in), ``experts`` those of
    them that expert parallelism spreads over the ep ranks (averaged and
    sharded over a group of their own; without ep none, every weight in one
    group), ``tied`` those a pipeline copies onto another rank (the token
    embedding the head reuses), ``layers`` the repeated layers ZeRO-3 makes
    units of, ``stages`` the indices of the transformer blocks of each stage
    this rank runs, and ``n_stages`` how many stages there are (stage 0
    embeds, the last one computes the loss).
    """

    model: nn.Module
    params: list[nn.Parameter]
    experts: set[int]
    tied: list[nn.Parameter]
    replicated: list[nn.Parameter]
    layers: list[nn.Module]
    stages: dict[int, list[int]]
    n_stages: int
    zero_cuts: dict = field(default_factory=dict)  # ZeRO's units by stage and bucket size (planner/memory.py)
    # the adapters' factors tp leaves whole, whose gradients it sums over its group (finetune/lora.py)
    adapter_factors: list[nn.Parameter] = field(default_factory=list)

    @property
    def blocks(self) -> list[int]:
        return [i for blocks in self.stages.values() for i in blocks]

    @property
    def first(self) -> bool:
        return 0 in self.stages

    @property
    def last(self) -> bool:
        return self.n_stages - 1 in self.stages

    @property
    def numel(self) -> int:
        return sum(p.numel() for p in self.params)

    @functools.cached_property
    def _untrained(self) -> tuple[int, int]:
        """Elements of frozen weights and bytes of buffers: counted once (the search asks often)."""
        frozen = sum(p.numel() for p in self.model.parameters() if not p.requires_grad)
        return frozen, sum(b.numel() * b.element_size() for b in self.model.buffers())

    def untrained_bytes(self, w: int) -> int:
        """What the rank holds and does not train: frozen weights (a fine-tune's base) at ``w``
        bytes each, and buffers (a 4-bit base's codes and scales) at their own."""
        frozen, buffers = self._untrained
        return w * frozen + buffers

    @functools.cached_property
    def tables(self) -> frozenset[int]:
        """The ids of the embedding tables' weights."""
        return frozenset(id(q) for m in self.model.modules() if isinstance(m, nn.Embedding) for q in m.parameters())


class _NoInitOnMeta(TorchFunctionMode):
    """torch.nn.init's functions skipped for meta tensors, which have nothing to write: their Python
    decompositions import torch's compiler on first use, a second of startup for a process (one
    that only checks a run before launching its workers, say) that never compiles."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__module__", None) == "torch.nn.init":
            target = args[0] if args else kwargs.get("tensor")
            if isinstance(target, torch.Tensor) and target.is_meta:
                return target
        return func(*args, **kwargs)


def _first_rank(name: str, size: int) -> Group:
    """Rank 0's view of a group of ``size``: enough for the transforms, which talk only later."""
    return Group(name, tuple(range(size)), 0)


@functools.lru_cache(maxsize=64)
def _split_model(model: Planned, tp: int, ep: int) -> tuple[nn.Module, frozenset[str]]:
    """The whole model as tp rank 0 and ep rank 0 hold it, on the meta device,
    and the names of the weights tp slices."""
    with torch.device("meta"), _NoInitOnMeta():
        whole = model.spec.build(model.cfg)
        if model.adapters:  # the trainer's own adapters, and its 4-bit base's buffers at their sizes
            rank, targets, quantize, modules_to_save = model.adapters
            add_adapters(whole, FinetuneConfig(lora_rank=rank, lora_targets=targets, quantize=quantize,
                                               lora_modules_to_save=modules_to_save), model.spec)
    sliced: frozenset[str] = frozenset()
    if tp > 1:
        plan = parallelize_tensor(whole, model.tensor_plan, None, _first_rank("tp", tp),
                                  sequence_parallel=False, dropout=0.0)
        sliced = frozenset(name for name, p in whole.named_parameters() if p in plan.splits)
    if ep > 1:
        parallelize_experts(whole, None, _first_rank("ep", ep))
    return whole, sliced


@functools.lru_cache(maxsize=512)
def _stage_ranges(model: Planned, tp: int, ep: int, stages: int) -> tuple[list[range], dict[str, list[int]]]:
    """The pipeline's cut into ``stages`` (the trainer's balance of parameters), and the
    parameters more than one stage uses: the same for every pipeline rank."""
    whole, _ = _split_model(model, tp, ep)
    ranges = balance(parameter_costs(whole, model.spec.stages), stages)
    return ranges, shared_parameters(whole, model.spec.stages, ranges)


def _prunable_copy(whole: nn.Module, stack: str) -> nn.Module:
    """``whole`` as `keep_stages` may prune it, ``whole`` left as it is: a module of its own
    with its own table of children and its own stack, holding the same layers (pruning
    replaces children and layers, never changes them). A deep copy of a 70B model's meta
    tensors would take a quarter second for every pipeline rank of every layout."""
    held = copy.copy(whole)
    held._modules = dict(whole._modules)
    setattr(held, stack, nn.ModuleList(getattr(whole, stack)))
    return held


@functools.lru_cache(maxsize=4096)
def rank_weights(model: Planned, split: Split, pp_rank: int) -> RankWeights:
    """What pipeline rank ``pp_rank`` holds under ``split`` (module docstring)."""
    whole, sliced = _split_model(model, split.tp, split.ep)
    stages = {0: list(range(model.shape.n_layers))}
    tied: list[nn.Parameter] = []
    held = whole
    if split.pp > 1:
        cut = model.spec.stages
        ranges, shared = _stage_ranges(model, split.tp, split.ep, split.pp * split.virtual)
        held = _prunable_copy(whole, cut.stack)
        tied_names = [name for name, holders in shared.items() if len({s % split.pp for s in holders}) > 1]
        keep_stages(held, cut, ranges, split.stages_of(pp_rank))
        own = dict(held.named_parameters())
        tied = [own[name] for name in tied_names if name in own]
        stages = {s: list(ranges[s]) for s in split.stages_of(pp_rank)}
    params = [p for p in held.parameters() if p.requires_grad]
    named = list(held.named_parameters())
    experts = {id(p) for name, p in named if ".experts." in name} if split.ep > 1 else set()
    replicated = [p for name, p in named if p.requires_grad and name not in sliced] if split.tp > 1 else []
    factors = [p for name, p in named if p.requires_grad and name.endswith(ADAPTER_PARAMS) and name not in sliced]
    return RankWeights(held, params, experts, tied, replicated, layer_modules(held), stages,
                       split.pp * split.virtual, adapter_factors=factors if split.tp > 1 else [])


def whole_model(model: Planned) -> nn.Module:
    """The unsplit model, weightless: for what is defined on the whole (its FLOPs per token)."""
    return _split_model(model, 1, 1)[0]
