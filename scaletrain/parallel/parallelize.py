"""``parallelize``: a plain model spread over the mesh, one call per transform, in the order they compose.

    tp   Megatron tensor (and sequence) parallelism: each tp rank keeps its slices of the
         weights, built alike on every rank (parallel/tensor.py; Shoeybi et al. 2019)
    cp   context parallelism: each cp rank keeps two chunks of every sequence, attention
         by ring (parallel/context.py; Liu et al. 2023)
    ep   expert parallelism: each ep rank keeps its share of every MoE layer's experts
         (parallel/experts.py; Lepikhin et al. 2020)
    pp   pipeline parallelism: each pp rank keeps its stages of what is left
         (parallel/pipeline/; Huang et al. 2019, Narayanan et al. 2021)

The order is the one every name survives: tp and cp rewrite modules in place
keeping their parameters' names, ep empties the experts a rank does not
hold, and pp prunes whole layers last, so each transform finds the modules
its plan names (docs/nd-parallel.md). What replicates or shards the rest
(dp, ZeRO) and what holds the optimizer's tensors come after, in the layout
(train/layout.py), as do the per-block techniques (recompute, compile).

A model on the meta device (a fine-tune read from a Hugging Face folder,
finetune/sliced.py) is read by ``read_weights`` once its splits are known:
before the cut where the cut needs the values (timing the blocks for
``--pp-balance time``, PipeDream-2BW's weight versions), after it otherwise,
so each rank reads only the slices of the stages it keeps.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from scaletrain.models.spec import ModelPlan
from scaletrain.parallel.context import ContextParallel, parallelize_context
from scaletrain.parallel.experts import ExpertParallel, parallelize_experts
from scaletrain.parallel.pipeline.parallel import PipelineParallel
from scaletrain.parallel.pipeline.schedules import PIPEDREAM_2BW
from scaletrain.parallel.tensor import TensorParallel, parallelize_tensor
from scaletrain.runtime.comm import Comm
from scaletrain.runtime.mesh import Mesh


@dataclass
class Parallelized:
    """The transforms ``parallelize`` applied, each None where its axis has one rank."""
    tensor: TensorParallel | None = None
    context: ContextParallel | None = None
    experts: ExpertParallel | None = None
    pipeline: PipelineParallel | None = None


# Where an attention keeps the dropout probability it passes to its kernel: scaletrain's
# CausalAttention (``dropout``), transformers' attentions (``attention_dropout``).
_ATTENTION_RATES = ("dropout", "attention_dropout")


def _dropout_sites(model: nn.Module) -> Iterator[tuple[nn.Module, str]]:
    """Each (module, attribute) holding a dropout probability: dropout layers' ``p``, attentions' rates."""
    for module in model.modules():
        if isinstance(module, nn.modules.dropout._DropoutNd):
            yield module, "p"
            continue
        for name in _ATTENTION_RATES:
            rate = getattr(module, name, None)
            if isinstance(rate, (int, float)) and not isinstance(rate, bool):
                yield module, name


def model_dropout(model: nn.Module) -> float:
    """The largest dropout probability of the model's dropout layers and attentions."""
    return max((float(getattr(module, name)) for module, name in _dropout_sites(model)), default=0.0)


def switch_off_dropout(model: nn.Module) -> None:
    """Every dropout of ``model`` at probability 0, in place (``check_parity``'s default: a layout
    draws other masks than one device, so only a model without dropout can match it exactly)."""
    for module, name in list(_dropout_sites(model)):
        setattr(module, name, 0.0)


def parallelize(model: nn.Module, plan: ModelPlan, mesh: Mesh, comm: Comm, device: torch.device, *,
                sequence_parallel: bool = False, seq_len: int | None = None, schedule: str = "1f1b",
                micro_batches: int = 1, virtual_stages: int = 1, balance_by: str = "params",
                sample: torch.Tensor | None = None,
                read_weights: Callable[[TensorParallel | None], None] | None = None) -> Parallelized:
    """This rank's part of ``model`` (module docstring), in place. ``seq_len``: every sequence's
    length (cp); the pipeline's ``schedule``, its ``micro_batches`` per round, ``virtual_stages``
    per rank and what its cuts balance (``balance_by``: "time" times the blocks on ``sample``, one
    micro-batch of inputs, all positions); ``read_weights``: reads a meta-device model's weights
    for the splits."""
    tp, cp, ep, pp = (mesh.group(axis) for axis in ("tp", "cp", "ep", "pp"))
    parts = Parallelized()
    if tp.size > 1:
        parts.tensor = parallelize_tensor(model, plan.tensor, comm, tp, sequence_parallel=sequence_parallel,
                                          dropout=model_dropout(model), hook_gradients=read_weights is None)
    if cp.size > 1:
        parts.context = parallelize_context(model, comm, cp, seq_len=seq_len, position_modules=plan.position_modules,
                                            device=device)
    if ep.size > 1:
        parts.experts = parallelize_experts(model, comm, ep)
    if read_weights and (balance_by == "time" or schedule == PIPEDREAM_2BW):
        read_weights(parts.tensor)  # timing the blocks, or 2BW's weight versions, need the values
    if pp.size > 1:
        if sample is not None:  # timed as this rank runs it: on its device, its cp positions
            sample = sample.to(device)
            sample = parts.context.local(sample) if parts.context else sample
        parts.pipeline = PipelineParallel(
            model, plan.stages, comm, pp, schedule=schedule, micro_batches=micro_batches,
            virtual_stages=virtual_stages, balance_by=balance_by, sample=sample, world=mesh.group("world"),
            boundary=_residual_stream(plan.width, parts.tensor, device))
        if parts.experts:
            parts.experts.keep_held(model)
    if read_weights:
        read_weights(parts.tensor)
    return parts


def _residual_stream(width: int, tensor: TensorParallel | None, device: torch.device):
    """What crosses a pipeline cut for a micro-batch of [batch, seq] positions: the decoder's
    residual stream, in fp32 whatever the precision; with sequence parallelism each tp rank
    holds its chunk of the (cp rank's) positions."""
    def boundary(batch: int, seq: int) -> tuple[tuple[int, ...], torch.dtype, torch.device]:
        if tensor and tensor.sequence_parallel:
            seq //= tensor.group.size
        return (batch, seq, width), torch.float32, device
    return boundary
