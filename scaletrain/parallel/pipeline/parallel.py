"""Pipeline parallelism as the trainer sees it: cut the model, run rounds of
micro-batches through a schedule, and keep the cut model equal to the whole.

    pipeline = PipelineParallel(model, spec.stages, comm, pp_group, schedule="1f1b", ...)
    losses = pipeline.train_round(batch, divisor=M)      forward and backward of M micro-batches
    pipeline.sum_shared_gradients(grad_of)               tied weights: the holders add their parts
    pipeline.clip_grad_norm_(params, max_norm)           each weight counted once over the stages
    ... optimizer step on this rank's stages ...

The pieces: partition.py (where the cuts go, what each rank keeps),
schedules.py (the order of the work, as data), runtime.py (executing it),
weight_grad.py (B and W apart, for ZB-H1), two_bw.py (PipeDream-2BW's weight
versions: there a round is one step of a pipeline that never drains, and
the gradient it hands the optimizer is the previous version's).

Evaluation and generation run the same stages forward only. Generation
passes one growing sequence through the stages per new token; the last stage
samples the token and broadcasts it to the other stages, which feed it in.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import torch
from torch import nn

from scaletrain.optim.clip import clip_grad_norm_
from scaletrain.parallel.pipeline.partition import (
    Costs,
    Stage,
    StagePlan,
    balance,
    describe,
    keep_stages,
    parameter_costs,
    shared_parameters,
    time_costs,
)
from scaletrain.parallel.pipeline.runtime import PipelineRuntime
from scaletrain.parallel.pipeline.schedules import (
    PIPEDREAM_2BW,
    Schedule,
    Span,
    build,
    forward_only,
    two_bw_step,
)
from scaletrain.parallel.pipeline.two_bw import WeightVersions
from scaletrain.parallel.pipeline.weight_grad import WeightGradStore, make_deferrable
from scaletrain.runtime.comm import Comm
from scaletrain.runtime.mesh import Group

Batch = tuple[torch.Tensor, ...]  # (inputs, targets), or (inputs, targets, documents) for packed rows
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class PipelineParallel:
    """This rank's stages of ``model`` (pruned in place) and the schedule that runs them.

    ``boundary(batch, seq)`` gives the (shape, dtype, device) of what crosses
    a stage boundary for a micro-batch of that size; ``sample`` is one
    micro-batch of input, timed when ``balance_by`` is "time", the timings
    averaged over ``world`` (every replica must cut alike).
    """

    def __init__(self, model: nn.Module, plan: StagePlan, comm: Comm, group: Group, *, schedule: str,
                 micro_batches: int, virtual_stages: int, balance_by: str,
                 boundary: Callable[[int, int], tuple[tuple[int, ...], torch.dtype, torch.device]],
                 sample: torch.Tensor, world: Group):
        self.comm, self.group, self.boundary = comm, group, boundary
        n, v = group.size, virtual_stages
        self.schedule: Schedule = build(schedule, n, micro_batches, v)
        self.ranges = balance(self._costs(model, plan, balance_by, sample, world), n * v)
        self.layout = describe(self.ranges, plan)
        shared = shared_parameters(model, plan, self.ranges)
        self.stages = keep_stages(model, plan, self.ranges, self.schedule.stages_of(group.rank))
        self.store = WeightGradStore() if self.schedule.split_backward else None
        if self.store:
            make_deferrable(model, self.store)
        self.runtime = PipelineRuntime(self.stages, comm, group, self.store)
        self.versions = WeightVersions(model, micro_batches) if schedule == PIPEDREAM_2BW else None
        self.rounds = 0  # rounds run so far: PipeDream-2BW's step, which numbers its micro-batches
        # PipeDream-2BW's rounds leave micro-batches in flight, kept apart from evaluation's.
        self.training_runtime = PipelineRuntime(self.stages, comm, group) if self.versions else self.runtime
        params = dict(model.named_parameters())
        # Tied weights on this rank, with every pp rank holding a copy (ascending).
        self.shared = [(params[name], sorted({self.schedule.rank_of(s) for s in stages}))
                       for name, stages in shared.items() if name in params]
        # Each tied weight counts towards the norm on its first holder only; the others hold copies.
        self.copies = [p for p, holders in self.shared if holders[0] != group.rank]
        self.last_rank = self.schedule.rank_of(self.schedule.stages - 1)
        # What every run of the schedule happens inside: ZeRO-3's gathers of the weights a round
        # holds (parallel/zero3.py), set by the layout that shards them.
        self.round_context: Callable[[], AbstractContextManager] = nullcontext

    def _costs(self, model: nn.Module, plan: StagePlan, balance_by: str, sample: torch.Tensor,
               world: Group) -> Costs:
        if balance_by == "params":
            return parameter_costs(model, plan)
        measured = time_costs(model, plan, sample)
        # Ranks time alike but not equally: the average makes them all cut alike.
        flat = torch.tensor([*measured.layers, measured.first, measured.last], dtype=torch.float64,
                            device=sample.device)
        # each rank's L + 2 measured seconds (per layer, then the first and last stages' extras), averaged
        self.comm.all_reduce(flat, world, op="avg")
        values = flat.tolist()
        return Costs(tuple(values[:-2]), values[-2], values[-1])

    @property
    def holds_loss(self) -> bool:
        return self.group.rank == self.last_rank

    def blocks(self) -> list[nn.Module]:
        """This rank's layers, for per-block transforms (recompute, compile)."""
        return [block for stage in self.stages for block in stage.blocks()]

    # -- training ------------------------------------------------------------------
    def train_round(self, batch: Callable[[int], Batch], *, loss_fn: LossFn,
                    divisor: float | torch.Tensor, backward_scale: Callable[[torch.Tensor], torch.Tensor] = lambda t: t,
                    forward_context: Callable[[], AbstractContextManager] = nullcontext,
                    clock: Callable[[], float] | None = None,
                    stage_loss: Callable[[Stage], torch.Tensor | None] | None = None
                    ) -> tuple[torch.Tensor, list[Span]]:
        """Forward and backward of the schedule's micro-batches; ``batch(m)`` is
        micro-batch m's (input, target), read once; ``stage_loss(stage)``: what a stage's
        forward adds to the loss (runtime.py), already divided as the loss is. Returns the
        sum of the micro-batches' ``loss / divisor`` on the last stage (zero elsewhere) and, with
        ``clock``, the spans of this rank's computations. PipeDream-2BW: one step
        of the never-drained pipeline, whose backwards trail its forwards
        (schedules.two_bw_step), the previous version's gradient handed over."""
        read: dict[int, Batch] = {}

        def micro(m: int) -> Batch:  # the first stage wants the input, the last the target
            if m not in read:
                read[m] = batch(m)
            return read[m]

        x0 = micro(0)[0]
        schedule, first = self.schedule, 0
        if self.versions:  # this step's micro-batches are numbered from rounds x M on
            schedule, first = two_bw_step(self.group.size, self.schedule.micro_batches, self.rounds), \
                self.rounds * self.schedule.micro_batches
            self.versions.begin(self.rounds)
        with self.round_context():
            losses, spans = self.training_runtime.run(
                schedule, boundary=lambda m: self.boundary(*x0.shape[:2]), inputs=lambda m: micro(m - first)[0],
                documents=lambda m: _documents(micro(m - first)),
                loss=lambda m, logits: loss_fn(logits, micro(m - first)[1]) / divisor, backward_scale=backward_scale,
                forward_context=forward_context, clock=clock, versions=self.versions, stage_loss=stage_loss)
        if self.versions:
            self.versions.advance()
        self.rounds += 1
        total = torch.zeros((), device=x0.device)
        for m in sorted(losses):
            total += losses[m]
        return total, spans

    def from_last_stage(self, value: torch.Tensor) -> torch.Tensor:
        """``value`` as the last stage has it, on every rank of the group."""
        # only the last stage has it (a scalar loss, or the sampled ids [b, 1]): the other stages get a copy
        self.comm.broadcast(value, self.group, src=self.last_rank)
        return value

    @torch.no_grad()
    def sum_shared_gradients(self, grad_of: Callable[[nn.Parameter], torch.Tensor | None]) -> None:
        """Every holder of a tied weight gets the sum of all holders' gradients,
        added in rank order so that every copy is bitwise the same."""
        for param, holders in self.shared:
            if not param.requires_grad:  # a fine-tune's frozen base (finetune/adapters.py): nothing to sum
                continue
            mine = grad_of(param)
            others = {r: torch.empty_like(mine) for r in holders if r != self.group.rank}
            ops = [("send", mine, r) for r in others] + [("recv", t, r) for r, t in others.items()]
            self.comm.batch_isend_irecv(ops, self.group).wait()
            parts = {**others, self.group.rank: mine}
            mine.copy_(sum(parts[r] for r in holders))  # the sum is complete before the copy

    def counts(self, param: nn.Parameter) -> bool:
        """Whether this rank counts ``param``'s gradient towards the model's norm
        (optim/clip.py): a tied weight on its first holder only."""
        return not any(param is copy for copy in self.copies)

    def clip_grad_norm_(self, params: list[nn.Parameter], max_norm: float) -> torch.Tensor:
        """torch's rule over the whole model: each stage's squares summed over
        the group, a tied weight counted once."""
        params = [p for p in params if p.grad is not None]
        return clip_grad_norm_([p.grad for p in params], max_norm,
                               counted=[p.grad for p in params if self.counts(p)],
                               comm=self.comm, groups=[self.group])

    # -- forward only --------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, batches: list[Batch], loss_fn: LossFn,
                 forward_context: Callable[[], AbstractContextManager] = nullcontext) -> float:
        """The mean loss over ``batches``, on every rank."""
        x0 = batches[0][0]
        with self.round_context():
            losses, _ = self.runtime.run(
                forward_only(self.group.size, len(batches), self.schedule.virtual_stages),
                boundary=lambda m: self.boundary(*batches[m][0].shape[:2]), inputs=lambda m: batches[m][0],
                documents=lambda m: _documents(batches[m]),
                loss=lambda m, logits: loss_fn(logits, batches[m][1]), forward_context=forward_context)
        mean = torch.stack([losses[m] for m in sorted(losses)]).mean() if losses \
            else torch.zeros((), device=x0.device)
        return self.from_last_stage(mean.float()).item()

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, new_tokens: int, context: int,
                 sample_next: Callable[[torch.Tensor], torch.Tensor],
                 forward_context: Callable[[], AbstractContextManager] = nullcontext) -> torch.Tensor:
        """Sample ``new_tokens`` continuations of ``idx`` [batch, seq], the last
        ``context`` tokens as input; every rank returns the same ids."""
        for _ in range(new_tokens):
            logits = self._forward_round(idx[:, -context:], forward_context)
            next_id = sample_next(logits[:, -1, :]) if self.holds_loss \
                else torch.empty((idx.shape[0], 1), dtype=idx.dtype, device=idx.device)
            idx = torch.cat([idx, self.from_last_stage(next_id)], dim=1)
        return idx

    @torch.no_grad()
    def logits(self, window: torch.Tensor, rows: int,
               forward_context: Callable[[], AbstractContextManager] = nullcontext) -> torch.Tensor:
        """The model's fp32 logits [batch, seq, rows] of ``window`` [batch, seq], on every rank of
        the group (scaletrain eval scores them on each); ``rows``: the head's, which the stages
        without it need to receive the last stage's."""
        logits = self._forward_round(window, forward_context)
        if logits is None:
            logits = torch.empty((*window.shape[:2], rows), dtype=torch.float32, device=window.device)
        return self.from_last_stage(logits.float().contiguous())

    def _forward_round(self, window: torch.Tensor, forward_context: Callable[[], AbstractContextManager]
                       ) -> torch.Tensor | None:
        """One forward-only round of ``window`` through the stages: the last stage's output there,
        None on the other ranks."""
        shape = self.boundary(*window.shape[:2])
        with self.round_context():
            outputs, _ = self.runtime.run(forward_only(self.group.size, 1, self.schedule.virtual_stages),
                                          boundary=lambda m: shape, inputs=lambda m: window, loss=None,
                                          forward_context=forward_context)
        return outputs[0] if self.holds_loss else None


def _documents(batch: Batch) -> torch.Tensor | None:
    """A micro-batch's documents, where its rows are packed."""
    return batch[2] if len(batch) > 2 else None
