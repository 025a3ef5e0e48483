"""The engine: one optimizer step of any model under any layout, for the command and the library.

``scaletrain train`` (job/trainer.py: its models, its data, its loss) and a
user's own script (library.py: their model, their loop) run the same
`Stepper`: `Stepper.step` is the whole step in reading order, given the
micro-batches and a loss function (the library's own loop, ``backward()``
then ``step()``, calls its parts one by one); `Stepper.update` is the update,
from the gradients' average to the cleared gradients, calling the hooks of
whatever holds the optimizer's tensors (train/step_weights.py).

One step covers a global batch of ``G = micro_batch * grad_accum * dp * ep``
samples. The strategies compose in this order, each on its own group of the
mesh (docs/nd-parallel.md, train/layout.py): tp splits the weights, cp sends
attention round a ring, ep divides the experts, pp cuts the split model into
stages (its schedule's rounds take the place of the micro-batch loop), dp
(or ZeRO) replicates (or shards) each stage's slices. The ranks of dp and ep
read different samples, cp's different positions of the same ones; the
gradient of a replicated weight is averaged over all three, an expert's over
dp and cp.

Each micro-batch's loss is divided by D before its backward (D =
``grad_accum`` for a mean loss; job/trainer.py's count for masked tokens),
so the gradients summed over micro-batches and averaged over ranks are the
gradient of one step on the whole global batch: the equivalence every layout
is tested against. A mixture of experts' auxiliary loss joins each
micro-batch's backward divided by the step's micro-batches (``grad_accum``,
times a pipeline's M per round); with pp, each stage's part joins that
stage's backward of the micro-batch (parallel/pipeline/runtime.py).
PipeDream-2BW is the exception by design: each step applies the previous
step's gradient (parallel/pipeline/two_bw.py), as one device then does too.

Everything random is a pure function of the step: the learning rate is
``run_lr(t)``, and the RNG behind dropout is reseeded from ``(seed, t, rank)``
at every step, so a resumed run needs only the step number to continue
exactly as if it had never stopped.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
from torch import nn

from scaletrain.config import ParallelConfig, TrainConfig
from scaletrain.finetune.sliced import FolderSource
from scaletrain.models.moe import auxiliary_loss, moe_layers
from scaletrain.models.spec import ModelPlan
from scaletrain.optim import run_lr
from scaletrain.optim.clip import global_grad_norm, scale_to_norm
from scaletrain.parallel.pipeline.partition import Stage
from scaletrain.parallel.pipeline.runtime import timer
from scaletrain.parallel.pipeline.schedules import Span
from scaletrain.runtime.comm import Comm
from scaletrain.runtime.faults import Faults, poison
from scaletrain.runtime.mesh import Mesh
from scaletrain.runtime.rng import reseed
from scaletrain.techniques.compile import mark_step
from scaletrain.techniques.compress_activations import ActivationCompression
from scaletrain.techniques.precision import DynamicLossScaler, autocast
from scaletrain.train import checkpoint as ckpt
from scaletrain.train.layout import Layout
from scaletrain.train.memory import ActivationMeter, memory_ledger
from scaletrain.train.nonfinite import (
    agreed_flag,
    first_nonfinite,
    late_stop_report,
    local_flag,
    stop_report,
)
from scaletrain.train.routing import RouterRows, RoutingStats
from scaletrain.train.step_memory import StepMemory
from scaletrain.train.step_window import PendingStep

Batch = tuple[torch.Tensor, ...]
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (outputs, targets) -> one micro-batch's loss


def step_seed(seed: int, step: int, rank: int) -> int:
    """The dropout RNG's seed for ``step`` on ``rank``."""
    return (seed * 1_000_003 + step * 10_007 + rank) % (2**63)


class Stepper:
    """The steps of one model under one layout (module docstring); the layout is built here
    from the model and its plan (train/layout.py). ``run_dir`` holds the checkpoints;
    ``log_every`` > 1 lets ``--on-nan stop`` read its flag with the window
    (train/step_window.py); ``report_memory`` measures the second step's memory (the first's in a
    one-step run; train/step_memory.py); ``sync_batchnorm``: BatchNorm over the whole
    data-parallel batch (parallel/batchnorm.py)."""

    def __init__(self, model: nn.Module, train: TrainConfig, parallel: ParallelConfig, mesh: Mesh, comm: Comm,
                 device: torch.device, *, plan: ModelPlan | None = None, seq_len: int | None = None,
                 sample: torch.Tensor | None = None, source: FolderSource | None = None, fused_head: bool = False,
                 run_dir: Path | None = None, log_every: int = 1, report_memory: bool = False,
                 sync_batchnorm: bool = False):
        self.train, self.parallel, self.mesh, self.comm, self.device = train, parallel, mesh, comm, device
        self.seq_len = seq_len  # every sequence's length, where given (cp, the library's generate)
        self.run_dir, self.log_every, self.report_memory = run_dir, log_every, report_memory
        self.faults = Faults.from_env(mesh.rank)  # none unless SCALETRAIN_FAULT asks (runtime/faults.py)
        # every MoE layer of the whole model, read before a pipeline keeps only this rank's stages
        self.router_rows = RouterRows.of(model)
        self.layout = Layout(model, plan, train, parallel, mesh, comm, device, seq_len=seq_len, sample=sample,
                             source=source, fused_head=fused_head, sync_batchnorm=sync_batchnorm)
        self.compression = ActivationCompression(train.compress_activations)  # entered around each forward
        self.scaler = DynamicLossScaler(enabled=train.precision == "fp16")
        self.on_nan = train.on_nan or ("skip" if train.precision == "fp16" else "stop")
        self.timeline: list[Span] | None = None  # the recorded pipeline round, on the run's last step
        self.activation_meter: ActivationMeter | None = None  # set by the measured step with report_memory
        self.step_memory: StepMemory | None = None  # its four points
        self.memory: dict | None = None  # the ledger taken on that step
        self._measured_step: int | None = None  # with report_memory: the step measured
        self._step_under_way: int | None = None

    @property
    def model(self) -> nn.Module:
        """This rank's part of the model (split, cut, wrapped as the layout says)."""
        return self.layout.model

    # -- one whole step -----------------------------------------------------------
    def step(self, step: int, batches: Sequence[Batch], loss_fn: LossFn, divisor: float | torch.Tensor,
                 record: bool = False) -> PendingStep:
        """One optimizer step over the step's micro-batches (inputs, targets[, documents]), in
        reading order: the step begins (dropout reseeded), every micro-batch's forward and
        backward, or with pp the pipeline schedule's rounds, then the update; its numbers left on
        the device (train/step_window.py). ``loss_fn(outputs, targets)`` is one micro-batch's
        loss, divided by ``divisor`` (module docstring); ``record`` keeps a pipeline's timeline."""
        self.start_step(step)
        pipeline = self.layout.pipeline
        if pipeline:
            loss_sum, routing = self.pipeline_accumulate(batches, loss_fn, divisor, record)
        else:
            loss_sum, routing = self.accumulate(batches, self.forward_loss(loss_fn), divisor)
        pending = self.update(step, loss_sum)
        if routing and pending.host["lr"] is not None:  # what the routers did, where the step updated
            pending.host.update(routing.summed(self.comm, self.layout.replicas.batch,
                                               self.layout.pp_group if pipeline else None))
        return pending

    def forward_loss(self, loss_fn: LossFn) -> Callable[..., torch.Tensor]:
        """One micro-batch's forward and ``loss_fn``: the model under autocast and compression,
        or where the layout chunks the head and loss (kernels/head_loss.py) the final norm's
        output into the chunked kernel, which never holds the logits whole."""
        layout = self.layout

        def forward_loss(x: torch.Tensor, y: torch.Tensor, documents: torch.Tensor | None = None) -> torch.Tensor:
            packed = {} if documents is None else {"documents": documents}
            with self.forward_context():
                if layout.fused_head_loss:
                    # imported here: it imports Triton, which only a layout with the kernel needs
                    from scaletrain.kernels.cross_entropy import (
                        fused_linear_cross_entropy,
                    )
                    return fused_linear_cross_entropy(layout.model(x, logits=False, **packed),
                                                      layout.model.head.weight, y)
                outputs = layout.model(x, **packed)
            with self.compression:  # the tensors the loss saves (the log-probabilities: b x s x V)
                return loss_fn(outputs, y)
        return forward_loss

    # -- a step's forward and backward -------------------------------------------
    @contextmanager
    def forward_context(self):
        """What a forward runs under: autocast, and the compression of the tensors it saves."""
        with autocast(self.train.precision, self.device), self.compression:
            yield

    def start_step(self, step: int) -> None:
        """Before the step's first forward: the dropout RNG reseeded from the step, training mode."""
        self.faults.strike("step", step + 1)
        if self.report_memory and self._measured_step is None:  # this process's first step
            self._measured_step = step + 1 if step + 1 < self.train.steps else step
        self._step_under_way = step
        reseed(step_seed(self.train.seed, step, self.layout.dropout_rank(self.mesh.rank)), self.device)
        if self.train.compile and self.train.compile_mode == "reduce-overhead":
            mark_step()  # the last step's graph outputs may be overwritten (techniques/compile.py)
        if not self.layout.model.training:  # set back after an evaluation: a walk over every module
            self.layout.model.train()

    def backward_micro_batch(self, loss: torch.Tensor, final: bool) -> torch.Tensor | float:
        """Backward of one micro-batch's (divided) loss, with a mixture of experts' auxiliary
        loss, which it returns; ``final``: the step's last, whose gradients the data-parallel
        average takes."""
        layout = self.layout
        aux = auxiliary_loss(layout.model) / self.train.grad_accum if layout.moe_layers else 0.0
        with nullcontext() if final else layout.data_parallel.no_sync():
            self.scaler.scale(loss + aux).backward()
        return aux

    def accumulate(self, batches: Sequence[Batch], loss_of: Callable[..., torch.Tensor],
                   divisor: float | torch.Tensor) -> tuple[torch.Tensor, RoutingStats | None]:
        """Forward and backward of the step's micro-batches, ``loss_of(*batch)`` running each
        forward; the sum of their losses / divisor, and with experts what the routers did."""
        layout = self.layout
        loss_sum = torch.zeros((), device=self.device)
        routing = RoutingStats.empty(self.router_rows, layout.model, self.device) if self.router_rows else None
        for micro, batch in enumerate(batches):
            with self._meter_first_micro_batch(micro):
                loss = loss_of(*batch) / divisor
                if micro == 0:
                    self._take_memory("after_forward")
                aux = self.backward_micro_batch(loss, final=micro == len(batches) - 1)
            loss_sum += loss.detach()
            if routing:
                routing.add(layout.moe_layers, aux)
        return loss_sum, routing

    def pipeline_accumulate(self, batches: Sequence[Batch], loss_fn: Callable[[torch.Tensor, torch.Tensor],
                                                                                torch.Tensor],
                            divisor: float | torch.Tensor, record: bool = False
                            ) -> tuple[torch.Tensor, RoutingStats | None]:
        """``grad_accum`` rounds of the pipeline schedule over the step's micro-batches
        (inputs, targets[, documents]), ``loss_fn(outputs, targets)`` on the last stage,
        gradients synchronised after the last; the loss, as the last stage has it, on every pp
        rank, and with experts what this rank's routers did. ``record``: keep the first round's
        timeline, its clock started together on every pp rank."""
        layout = self.layout
        loss_sum = torch.zeros((), device=self.device)
        per_round = layout.micro_batches
        per_step = self.train.grad_accum * per_round
        routing = RoutingStats.empty(self.router_rows, layout.model, self.device) if self.router_rows else None
        # each stage's MoE layers, found once for the step's every forward
        stage_layers = {stage.index: [layer for module in stage.modules() for layer in moe_layers(module)]
                        for stage in layout.pipeline.stages} if routing else {}

        def auxiliary(stage: Stage) -> torch.Tensor | None:
            """The auxiliary loss the stage's MoE layers left in the forward just run, divided by the
            step's micro-batches as one device divides it (`backward_micro_batch`), and counted."""
            layers = stage_layers[stage.index]
            if not layers:
                return None
            aux = torch.stack([layer.aux_loss for layer in layers]).sum() / per_step
            routing.add(layers, aux)
            return aux

        with layout.data_parallel.no_sync():
            for round_ in range(len(batches) // per_round):
                clock = None
                if record and round_ == 0:
                    self.comm.barrier(layout.pp_group)
                    clock = timer()
                with self._meter_first_micro_batch(round_):
                    loss, spans = layout.pipeline.train_round(
                        lambda m, r=round_: batches[r * per_round + m], loss_fn=self._compressed(loss_fn),
                        divisor=divisor, backward_scale=self.scaler.scale, forward_context=self.forward_context,
                        clock=clock, stage_loss=auxiliary if routing else None)
                loss_sum += loss
                if clock:
                    self.timeline = spans
        return layout.pipeline.from_last_stage(loss_sum), routing

    def _compressed(self, loss_fn: Callable) -> Callable:
        """``loss_fn``, the tensors it saves compressed too (the log-probabilities: b x s x V)."""
        def compressed(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            with self.compression:
                return loss_fn(outputs, targets)
        return compressed

    def _meter_first_micro_batch(self, micro: int):
        """With report_memory, measure saved activations of the measured step's first
        micro-batch (the meter slows the step, so once is enough), and take the step's first
        point; with a pipeline, of its first round, whose schedule decides how many
        micro-batches are alive at once."""
        if (not self.report_memory or self.activation_meter is not None or micro != 0
                or self._measured_step != self._step_under_way):
            return nullcontext()
        self.activation_meter = ActivationMeter(self.layout.model)
        self.step_memory = StepMemory(self.layout.bytes_ledger, self.activation_meter, self.device)
        self._take_memory("before_forward")
        return self.activation_meter

    def _take_memory(self, point: str) -> None:
        """One of the measured step's four points (train/step_memory.py), on that step only."""
        if self.step_memory is not None and self.memory is None:
            self.step_memory.take(point)

    # -- the update --------------------------------------------------------------
    def update(self, step: int, loss_sum: torch.Tensor, lr: float | None = None) -> PendingStep:
        """The step after its backward passes (module docstring); its loss, gradient norm and
        (with ``log_every`` > 1) its non-finite flag left on the device (train/step_window.py).
        ``lr``: the step's learning rate (default ``run_lr(step)`` of the train settings)."""
        layout = self.layout
        t = self.train
        self._take_memory("after_backward")
        # wait for the buckets' all-reduce (ZeRO: the reduce-scatter of this rank's shard), launched in backward
        layout.data_parallel.finish_gradient_sync()
        # The step's forwards are done: rank 0's running statistics to every copy, so the ranks
        # evaluate, save and begin the next step alike (parallel/batchnorm.py; none: nothing sent)
        layout.running_statistics.broadcast()
        if not layout.exchange_delayed_gradients():  # PipeDream-2BW's first step: nothing to apply yet
            return self._before_first_update(step, loss_sum)
        layout.sum_shared_gradients()  # a weight two pipeline stages hold: its two gradients summed
        layout.step_weights.take_gradients()  # onto what the optimizer steps: the weights, fp32 masters or shards
        for name in self.faults.poisoned(step + 1):
            poison(layout.named_step_tensors(), name)
        if not self.faults.skips(step + 1):  # a desync on purpose (runtime/faults.py)
            self.comm.all_reduce(loss_sum, layout.replicas.dense, op="avg")  # one float: the global batch's loss
        overflow = self.scaler.unscale_(layout.step_params).to(self.device)
        grad_norm = global_grad_norm([p.grad for p in layout.norm_counted if p.grad is not None], comm=self.comm,
                                     groups=layout.norm_groups, device=self.device)
        # Every rank skips (or stops) together (train/nonfinite.py): the norm checks every gradient it
        # counts, the copies it does not are checked apart; fp16's unscaling pass checks them all.
        apart = [p.grad for p in layout.norm_uncounted if p.grad is not None]
        flag = local_flag(loss_sum, [] if self.scaler.enabled else apart,
                          None if self.scaler.enabled else grad_norm).maximum(overflow)
        late = self._reads_flag_late
        flag = agreed_flag(flag, self.comm, self.mesh.group("world"))  # one number over the world: the max
        skip = False if late else bool(flag.item())
        if skip and self.on_nan == "stop":
            raise self._nonfinite_stop(step + 1, loss_sum.item())
        scale_to_norm([p.grad for p in layout.step_params if p.grad is not None],
                      t.grad_clip if t.grad_clip > 0 else math.inf, grad_norm, layout.clip_into)
        if lr is None:
            lr = run_lr(step, t)
        for group in layout.optimizer.param_groups:
            group["lr"] = lr
        self.faults.strike("optimizer", step + 1)
        self.scaler.step(layout.stepping_optimizer(step + 1), skip)
        self.scaler.update(skip)
        layout.step_weights.give_weights(step + 1)  # masters rounded down; ZeRO-1/2 gathers the updated shards
        if self.step_memory is not None and self.memory is None:
            # after the step (optimizer state exists), before the gradients are freed
            self._take_memory("after_step")
            self.memory = memory_ledger(layout.bytes_ledger(), self.activation_meter, layout.host_peak)
            self.memory.update(step=step + 1, points=self.step_memory.points)
        layout.step_weights.zero_grad()
        host = {"lr": lr, "skipped_steps": self.scaler.skipped_steps}
        if t.precision == "fp16":
            host.update(loss_scale=self.scaler.scale_value)
        return PendingStep(step + 1, host, {"loss": loss_sum, "grad_norm": grad_norm},
                           nonfinite=flag if late else None)

    @property
    def _reads_flag_late(self) -> bool:
        """Whether the non-finite flag is read with the window rather than at once: only
        where nothing this step does depends on it (train/step_window.py)."""
        return self.log_every > 1 and self.on_nan == "stop" and not self.scaler.enabled

    def _before_first_update(self, step: int, loss_sum: torch.Tensor) -> PendingStep:
        """PipeDream-2BW's first step: no gradient is complete yet, so no update (W(1) = W(0))."""
        self.comm.all_reduce(loss_sum, self.layout.replicas.dense, op="avg")
        self.layout.data_parallel.zero_grad()
        return PendingStep(step + 1, {"grad_norm": None, "lr": None, "skipped_steps": self.scaler.skipped_steps},
                           {"loss": loss_sum})

    def _latest_name(self) -> str | None:
        latest = ckpt.latest_checkpoint(self.run_dir) if self.run_dir else None
        return latest.name if latest else None

    def _nonfinite_stop(self, step: int, loss: float) -> Exception:
        culprit = first_nonfinite((name, t.grad) for name, t in self.layout.named_step_tensors())
        culprits = self.comm.all_gather_object(culprit, self.mesh.group("world"))
        return stop_report(step, loss, culprits, self._latest_name())

    def late_stop(self, record: dict, step_under_way: int | None) -> Exception:
        """The stop of a step whose non-finite flag was read with its window."""
        return late_stop_report(record["step"], record["loss"], step_under_way, self.log_every, self._latest_name())

    # -- checkpoints -----------------------------------------------------------
    def save_checkpoint(self, step: int, state: dict | None = None, keep_last: int = 0) -> Path:
        """A checkpoint of the step's model and optimizer (every rank its part, train/checkpoint.py)
        in ``run_dir``, with ``state`` (JSON values) beside the engine's own."""
        layout = self.layout
        world = self.mesh.group("world")
        team = ckpt.Team(world.rank, world.size, barrier=lambda: self.comm.barrier(world),
                         gather=lambda value: self.comm.all_gather_object(value, world))
        saved = {**(state or {}), "step": step, "world_size": self.mesh.dims.world_size,
                 "layout": self.mesh.dims.describe(),
                 "scaler": {k: float(v) if torch.is_tensor(v) else v for k, v in self.scaler.state_dict().items()}}
        # how many ranks' own optimizer states the checkpoint holds (commands/train.py checks a resume)
        if layout.local_sgd:
            saved["optimizer_per_rank"] = layout.replicas.dense.size
        layout.running_statistics.broadcast()  # one set of running statistics, whenever the save comes
        return ckpt.save_checkpoint(self.run_dir, step, layout.model, layout.optimizer, layout.masters, saved, team,
                                    zero=layout.zero, tensor_parallel=layout.tensor_parallel,
                                    own_optimizer=layout.own_optimizer(), keep_last=keep_last,
                                    strike=lambda point: self.faults.strike(point, step))

    def load_checkpoint(self, path: Path) -> dict:
        """The model and optimizer of checkpoint ``path`` (any layout's), in place; its state."""
        layout = self.layout
        state = ckpt.load_checkpoint(path, layout.model, layout.optimizer, layout.masters, layout.zero,
                                     layout.tensor_parallel, layout.own_optimizer())
        self.scaler.load_state_dict(state["scaler"])
        return state
