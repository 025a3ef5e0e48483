"""The training step, the same for every layout (train/loop.py runs the steps).

One optimizer step over a global batch of ``G = micro_batch * grad_accum * dp * ep``
sequences (with ``--pp``, ``grad_accum`` rounds of the pipeline schedule over
``--microbatches`` micro-batches each take the place of the loop below:
parallel/pipeline/parallel.py; then the tied embedding's gradient is summed
over the stages that hold it, whole or shard by shard under ZeRO). The
strategies compose in this order, each on its own group of the mesh
(docs/nd-parallel.md): tp splits the weights, cp sends attention round a
ring (parallel/context.py), ep divides the experts (parallel/experts.py), pp
cuts the split model into stages, dp (or ZeRO) replicates (or shards) each
stage's slices. The ranks of dp and ep read different samples; cp's read
different positions of the same ones; the gradients of a replicated weight
are averaged over all three, an expert's over dp and cp (the ep ranks hold
different experts):

    for each of the grad_accum micro-batches:
        loss = mean cross-entropy of this rank's micro-batch / grad_accum
                                           (with --tp: from vocabulary-split logits, the
                                            tp ranks of a replica sharing one micro-batch;
                                            with --cp: over this rank's positions;
                                            with experts: plus their auxiliary loss)
        loss.backward()                    (gradients add up across micro-batches; on the last
                                            one, gradient buckets start their all-reduce as
                                            they fill, overlapping the rest of backward)
    wait for the data-parallel average (parallel/data.py), or with --zero for this rank's
    shard of it (parallel/zero.py); with --sync-every N > 1 keep the local gradient (local SGD
    averages the parameters after every N-th optimizer step instead: parallel/local_sgd.py)
    with fp32 master weights (--param-dtype bf16, --offload optimizer): gradients to the masters
    average the loss; unscale (fp16); a loss or gradient that is inf or NaN on any rank (one
    flag over the world, train/nonfinite.py) makes every rank skip the step, or stop (--on-nan)
    clip the global gradient norm (each element counted once over the mesh: tp slices and ZeRO
    shards summed, replicated norms and the tied embedding's copies not; optim/clip.py), set the
    learning rate, take the optimizer step (unless skipped; fp16 then halves its loss scale)
    with master weights: round the masters back into the model's weights (ZeRO-1/2: and
    all-gather the updated shards)

Dividing by ``grad_accum`` once per micro-batch and averaging over ranks once
per step makes the update equal to one step on the whole global batch: the
equivalence every parallel layout is tested against.
PipeDream-2BW is the exception by design: each step applies the previous
step's gradient (parallel/pipeline/two_bw.py), as one device then does too.

Everything random is a pure function of the step: micro-batch ``m`` of step
``t`` on rank ``r`` of the dp x ep group holds global samples
``((t*A + m)*dp*ep + r)*B ... +B`` of a seeded stream (see data/batches.py), the
learning rate is ``lr_at(t)``, and the RNG behind dropout is reseeded from
``(seed, t, rank)`` at every step. A resumed run therefore needs only the
step number to continue exactly as if it had never stopped.
"""

from __future__ import annotations

import math
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch

from scaletrain.compress_activations import ActivationCompression
from scaletrain.config import Config
from scaletrain.data.batches import IGNORE_INDEX
from scaletrain.dist.comm import Comm
from scaletrain.dist.launch import DistRuntime
from scaletrain.dist.mesh import Mesh
from scaletrain.faults import Faults, poison
from scaletrain.models.moe import auxiliary_loss
from scaletrain.optim import lr_at
from scaletrain.optim.clip import clip_grad_norm_
from scaletrain.parallel.pipeline.runtime import timer
from scaletrain.parallel.pipeline.schedules import Span
from scaletrain.precision import DynamicLossScaler, autocast
from scaletrain.train import checkpoint as ckpt
from scaletrain.train.data_setup import DataSpec, open_data
from scaletrain.train.layout import Layout
from scaletrain.train.memory import ActivationMeter, memory_ledger
from scaletrain.train.metrics import peak_tflops
from scaletrain.train.nonfinite import agreed_flag, first_nonfinite, late_stop_report, local_flag, stop_report
from scaletrain.train.routing import RoutingStats
from scaletrain.train.sampling import generate, line_prompt
from scaletrain.train.step_window import PendingStep, StepWindow


def first_sample(step: int, micro: int, grad_accum: int, dp_size: int, dp_rank: int, micro_batch: int) -> int:
    """Index in the data stream of the first sample of micro-batch ``micro`` of
    ``step`` on data-parallel rank ``dp_rank``: ranks read disjoint slices of
    the same global batch, and the index depends on nothing but the step."""
    return ((step * grad_accum + micro) * dp_size + dp_rank) * micro_batch


def _step_seed(seed: int, step: int, rank: int) -> int:
    return (seed * 1_000_003 + step * 10_007 + rank) % (2**63)


class Trainer:
    """The steps of a run over its `Layout` (train/layout.py, built here), with the run's
    data, loss scaler, checkpoints and the state a resume brings back."""

    def __init__(self, cfg: Config, spec: DataSpec, runtime: DistRuntime, mesh: Mesh, comm: Comm,
                 run_dir: Path):
        self.cfg, self.spec, self.runtime, self.mesh, self.comm = cfg, spec, runtime, mesh, comm
        self.run_dir = run_dir
        self.is_main = runtime.is_main
        self.device = runtime.device
        self.faults = Faults.from_env(runtime.env.rank)  # none unless SCALETRAIN_FAULT asks (faults.py)
        self.step: int | None = None  # the step under way, counted from 1, for failure reports
        self.data = open_data(spec, cfg)
        t = cfg.train
        self.layout = Layout(cfg, spec, mesh, comm, self.device, self.data.train.get(0, t.micro_batch),
                             n_features=self.data.n_features, n_classes=self.data.n_classes)
        self.compression = ActivationCompression(t.compress_activations)  # entered around each forward
        self.timeline: list[Span] | None = None  # the recorded pipeline round, on the run's last step
        self.scaler = DynamicLossScaler(enabled=t.precision == "fp16")
        self.on_nan = t.on_nan or ("skip" if t.precision == "fp16" else "stop")
        self.activation_meter: ActivationMeter | None = None  # set by the first step with --report-memory
        self.memory: dict | None = None  # the ledger taken on that step
        self.start_step = 0
        latest = ckpt.latest_checkpoint(run_dir) if cfg.run.resume else None
        if latest:  # (none: a job restarted before its first checkpoint, run.py)
            layout = self.layout
            state = ckpt.load_checkpoint(latest, layout.model, layout.optimizer, layout.masters, layout.zero,
                                         layout.tensor_parallel, layout.own_optimizer())
            self.start_step = state["step"]
            self.scaler.load_state_dict(state["scaler"])
        self.peak = peak_tflops(t.peak_tflops, self.device)

    # -- one optimizer step --------------------------------------------------
    def _micro_batch(self, step: int, micro: int) -> tuple[torch.Tensor, ...]:
        layout = self.layout
        t = self.cfg.train
        per_step = t.grad_accum * layout.micro_batches
        if micro == min(1, per_step - 1):
            self.faults.strike("micro-batch", step + 1)
        first = first_sample(step, micro, per_step, layout.replicas.batch.size,
                             layout.replicas.batch.rank, t.micro_batch)
        return layout.local(*self.data.train.get(first, t.micro_batch))

    def _step_batches(self, step: int) -> tuple[list[tuple[torch.Tensor, ...]], float | torch.Tensor,
                                                torch.Tensor | None]:
        """The step's micro-batches on this rank, read before any forward; the divisor of each
        micro-batch's loss and the global batch's count of trained tokens (None: all are).

        Each loss is the sum over its trained tokens / its positions P (train/layout.py). With
        T trained tokens in the whole global batch and R ranks averaging the gradients (dp x
        ep x cp: replicas.py), dividing by D = T / (P * R) makes the averaged gradient that of
        the sum over every trained token / T: the mean over the global batch's trained tokens,
        however masking and packing spread them over micro-batches and ranks (one all-reduce of
        a count). Where every target is trained, T = P * R * micro-batches, and D is their number."""
        layout = self.layout
        batches = [self._micro_batch(step, micro) for micro in range(self.cfg.train.grad_accum * layout.micro_batches)]
        if self.data.train.every_target_trained:  # known on the host: no count, no device work
            return batches, float(len(batches)), None
        trained = sum((batch[1] != IGNORE_INDEX).sum() for batch in batches)
        self.comm.all_reduce(trained, layout.replicas.dense)
        positions = batches[0][1].numel() * layout.replicas.dense.size
        # No trained token at all (every answer cut away): a zero loss, not 0 / 0.
        return batches, (trained.clamp(min=1).double() / positions).float(), trained

    def _forward_backward(self, step: int) -> tuple[torch.Tensor, RoutingStats | None, torch.Tensor | None]:
        """Forward and backward of the step's micro-batches; the sum of their losses / divisor
        (the cross-entropy alone: the mean over the trained tokens), with a mixture of experts what
        the routers did, and the count of trained tokens (`_step_batches`)."""
        layout = self.layout
        t = self.cfg.train
        loss_sum = torch.zeros((), device=self.device)
        routing = RoutingStats.empty(layout.moe_layers, self.device) if layout.moe_layers else None
        batches, divisor, trained = self._step_batches(step)
        for micro, (x, y, *packed) in enumerate(batches):
            final = micro == t.grad_accum - 1
            with self._meter_first_micro_batch(micro), \
                    (nullcontext() if final else layout.data_parallel.no_sync()):
                loss = self._loss(x, y, *packed) / divisor
                aux = auxiliary_loss(layout.model) / t.grad_accum if routing else 0.0
                self.scaler.scale(loss + aux).backward()
            loss_sum += loss.detach()
            if routing:
                routing.add(layout.moe_layers, aux)
        return loss_sum, routing, trained

    @contextmanager
    def _forward_context(self):
        """What a forward runs under: autocast, and the compression of the tensors it saves."""
        with autocast(self.cfg.train.precision, self.device), self.compression:
            yield

    def _loss(self, x: torch.Tensor, y: torch.Tensor, documents: torch.Tensor | None = None) -> torch.Tensor:
        """The cross-entropy of one micro-batch, summed over its trained tokens / its positions
        (forward included); ``documents``: its rows are packed (models/decoder.py)."""
        layout = self.layout
        packed = {} if documents is None else {"documents": documents}
        with self._forward_context():
            if layout.fused_head_loss:
                from scaletrain.kernels.cross_entropy import fused_linear_cross_entropy
                return fused_linear_cross_entropy(layout.model(x, logits=False, **packed), layout.model.head.weight, y)
            logits = layout.model(x, **packed)
        return self._loss_of(logits, y)

    def _loss_of(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The loss of given logits, the tensors it saves compressed too (the log-probabilities: b x s x V)."""
        with self.compression:
            return self.layout.loss_fn(logits, y)

    def _pipeline_forward_backward(self, step: int, record: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``--grad-accum`` rounds of the pipeline schedule over the step's
        micro-batches, gradients synchronised after the last; the loss, as the
        last stage has it, on every pp rank, and the count of trained tokens.
        ``record``: keep the first round's timeline, its clock started together
        on every pp rank."""
        layout = self.layout
        t = self.cfg.train
        loss_sum = torch.zeros((), device=self.device)
        batches, divisor, trained = self._step_batches(step)
        with layout.data_parallel.no_sync():
            for round_ in range(t.grad_accum):
                clock = None
                if record and round_ == 0:
                    self.comm.barrier(layout.pp_group)
                    clock = timer()
                with self._meter_first_micro_batch(round_):
                    loss, spans = layout.pipeline.train_round(
                        lambda m, r=round_: batches[r * layout.micro_batches + m],
                        loss_fn=self._loss_of, divisor=divisor,
                        backward_scale=self.scaler.scale,
                        forward_context=self._forward_context, clock=clock)
                loss_sum += loss
                if clock:
                    self.timeline = spans
        return layout.pipeline.from_last_stage(loss_sum), trained

    def train_step(self, step: int, record: bool = False) -> dict[str, float]:
        """One optimizer step, its numbers read at once (``fit`` reads them a window at a time)."""
        window = StepWindow(1, self.layout.tokens_per_step)
        window.add(self.queue_step(step, record))
        (read,) = window.read()
        if read.nonfinite:
            raise self.late_stop(read.record)
        return read.record

    def queue_step(self, step: int, record: bool) -> PendingStep:
        """One optimizer step; its loss, gradient norm and (with ``--log-every`` K > 1) its
        non-finite flag left on the device (train/step_window.py)."""
        layout = self.layout
        t = self.cfg.train
        self.faults.strike("step", step + 1)
        torch.manual_seed(_step_seed(t.seed, step, layout.dropout_rank(self.runtime.env.rank)))
        layout.model.train()
        routing = None
        if layout.pipeline:
            loss_sum, trained = self._pipeline_forward_backward(step, record)
        else:
            loss_sum, routing, trained = self._forward_backward(step)
        layout.data_parallel.finish_gradient_sync()
        if layout.delayed and not layout.delayed.exchange(layout.data_parallel.gradient):
            return self._before_first_update(step, loss_sum)
        if layout.pipeline:
            layout.pipeline.sum_shared_gradients(layout.data_parallel.gradient)
        if layout.masters:
            layout.masters.copy_grads_to_master(layout.data_parallel.gradient)
        if layout.zero:
            layout.zero.copy_grads_to_master()
        for name in self.faults.poisoned(step + 1):
            poison(layout.named_step_tensors(), name)
        if not self.faults.skips(step + 1):  # a desync on purpose (faults.py)
            self.comm.all_reduce(loss_sum, layout.replicas.dense, op="avg")
        # Every rank skips (or stops) together (train/nonfinite.py); fp16's unscaling pass checks the gradients.
        grads = [p.grad for p in layout.step_params if p.grad is not None]
        overflow = self.scaler.unscale_(layout.step_params).to(self.device)
        flag = local_flag(loss_sum, [] if self.scaler.enabled else grads).maximum(overflow)
        late = self._reads_flag_late
        flag = agreed_flag(flag, self.comm, self.mesh.group("world"))
        skip = False if late else bool(flag.item())
        if skip and self.on_nan == "stop":
            raise self._nonfinite_stop(step + 1, loss_sum.item())
        grad_norm = clip_grad_norm_([p.grad for p in layout.step_params if p.grad is not None],
                                    t.grad_clip if t.grad_clip > 0 else math.inf,
                                    counted=[p.grad for p in layout.norm_counted if p.grad is not None],
                                    comm=self.comm, groups=layout.norm_groups, device=self.device)
        lr = lr_at(step, peak=t.lr, warmup=t.warmup_steps, total=t.steps, min_ratio=t.min_lr_ratio)
        for group in layout.optimizer.param_groups:
            group["lr"] = lr
        self.faults.strike("optimizer", step + 1)
        self.scaler.step(layout.optimizer, skip)
        self.scaler.update(skip)
        averaged = layout.local_sgd is not None and layout.local_sgd.average_if_due(step + 1)
        if layout.masters and (averaged or not layout.fused_working_copy):
            layout.masters.copy_master_to_model()
        if layout.zero:
            layout.zero.publish()
        if self.activation_meter is not None and self.memory is None:
            # after the step (optimizer state exists), before the gradients are freed
            self.memory = memory_ledger(layout.bytes_ledger(), self.activation_meter, layout.host_peak)
        if layout.masters:
            layout.optimizer.zero_grad(set_to_none=True)  # the masters' gradients
        layout.data_parallel.zero_grad()  # the model's
        host = {"lr": lr, "skipped_steps": self.scaler.skipped_steps}
        if routing:
            host.update(routing.summed(self.comm, layout.replicas.batch))
        if t.precision == "fp16":
            host.update(loss_scale=self.scaler.scale_value)
        device = {"loss": loss_sum, "grad_norm": grad_norm}
        if trained is not None:  # masked or packed data: how many tokens the step trained on
            device["trained_tokens"] = trained
        return PendingStep(step + 1, host, device, nonfinite=flag if late else None)

    @property
    def _reads_flag_late(self) -> bool:
        """Whether the non-finite flag is read with the window rather than at once: only
        where nothing this step does depends on it (train/step_window.py)."""
        return self.cfg.run.log_every > 1 and self.on_nan == "stop" and not self.scaler.enabled

    def _before_first_update(self, step: int, loss_sum: torch.Tensor) -> PendingStep:
        """PipeDream-2BW's first step: no gradient is complete yet, so no update (W(1) = W(0))."""
        self.comm.all_reduce(loss_sum, self.layout.replicas.dense, op="avg")
        self.layout.data_parallel.zero_grad()
        return PendingStep(step + 1, {"grad_norm": None, "lr": None, "skipped_steps": self.scaler.skipped_steps},
                           {"loss": loss_sum})

    def _nonfinite_stop(self, step: int, loss: float) -> Exception:
        culprit = first_nonfinite((name, t.grad) for name, t in self.layout.named_step_tensors())
        culprits = self.comm.all_gather_object(culprit, self.mesh.group("world"))
        latest = ckpt.latest_checkpoint(self.run_dir)
        return stop_report(step, loss, culprits, latest.name if latest else None)

    def late_stop(self, record: dict) -> Exception:
        latest = ckpt.latest_checkpoint(self.run_dir)
        return late_stop_report(record["step"], record["loss"], self.step, self.cfg.run.log_every,
                                latest.name if latest else None)

    def _meter_first_micro_batch(self, micro: int):
        """With --report-memory, measure saved activations of the run's first
        micro-batch (the meter slows the step, so once is enough); with a
        pipeline, of its first round, whose schedule decides how many
        micro-batches are alive at once."""
        if not self.cfg.run.report_memory or self.activation_meter is not None or micro != 0:
            return nullcontext()
        self.activation_meter = ActivationMeter(self.layout.model)
        return self.activation_meter

    def memory_report(self) -> dict:
        """This rank's memory ledger (params, grads, optimizer, activations peak)
        as measured on the first step of this run."""
        return self.memory

    @torch.no_grad()
    def evaluate(self) -> float:
        """The mean loss over the validation batches' trained tokens."""
        layout = self.layout
        layout.model.eval()
        batches = [layout.local(*batch) for batch in
                   self.data.val.eval_batches(self.cfg.train.micro_batch, self.cfg.train.eval_batches)]
        if layout.pipeline:  # the mean over batches of each one's summed loss
            summed = layout.pipeline.evaluate(batches, lambda logits, y: layout.loss_fn(logits, y) * y.numel(),
                                              lambda: autocast(self.cfg.train.precision, self.device)) * len(batches)
        else:
            summed = sum(self._loss(*batch).item() * batch[1].numel() for batch in batches)
        totals = torch.tensor([summed, sum((batch[1] != IGNORE_INDEX).sum().item() for batch in batches)],
                              dtype=torch.float64, device=self.device)
        if layout.context_parallel:  # each cp rank has its positions' share
            self.comm.all_reduce(totals, layout.cp_group)
        return (totals[0] / totals[1].clamp(min=1)).item()

    def sample(self) -> str | None:
        """A continuation of a line from the validation text (language models only; train/sampling.py)."""
        tokenizer = self.data.tokenizer
        if tokenizer is None or self.cfg.run.sample_tokens == 0:
            return None
        window = self.data.val.get(0, 1)[0]
        continuation = generate(self.layout, line_prompt(tokenizer, window[0]), self.cfg.run.sample_tokens)
        return tokenizer.decode(continuation.tolist())

    # -- checkpoints -----------------------------------------------------------
    def save(self, step: int) -> Path:
        layout = self.layout
        world = self.mesh.group("world")
        team = ckpt.Team(world.rank, world.size, barrier=lambda: self.comm.barrier(world),
                         gather=lambda value: self.comm.all_gather_object(value, world))
        state = {"step": step, "world_size": self.runtime.env.world_size, "layout": self.mesh.dims.describe(),
                 "scaler": {k: float(v) if torch.is_tensor(v) else v for k, v in self.scaler.state_dict().items()}}
        if layout.local_sgd:  # how many ranks' own optimizer states the checkpoint holds (run.py checks a resume)
            state["optimizer_per_rank"] = layout.replicas.dense.size
        return ckpt.save_checkpoint(self.run_dir, step, layout.model, layout.optimizer, layout.masters, state, team,
                                    zero=layout.zero, tensor_parallel=layout.tensor_parallel,
                                    own_optimizer=layout.own_optimizer(),
                                    keep_last=self.cfg.run.keep_last,
                                    strike=lambda point: self.faults.strike(point, step))
