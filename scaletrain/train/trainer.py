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
import torch.nn.functional as F
from torch import nn

from scaletrain.compile import compile_blocks
from scaletrain.compress_activations import ActivationCompression
from scaletrain.config import Config
from scaletrain.dist.comm import Comm
from scaletrain.dist.launch import DistRuntime
from scaletrain.dist.mesh import Mesh
from scaletrain.faults import Faults, poison
from scaletrain.finetune.base import start_from_base
from scaletrain.models import build_model, gpt_config
from scaletrain.models.moe import auxiliary_loss, moe_layers
from scaletrain.optim import MasterWeights, build_optimizer, decay_groups, lr_at
from scaletrain.optim.clip import clip_grad_norm_
from scaletrain.parallel.context import ContextParallel, parallelize_context
from scaletrain.parallel.data import DataParallel, JointDataParallel
from scaletrain.parallel.experts import ExpertParallel, parallelize_experts
from scaletrain.parallel.hybrid import zero_groups
from scaletrain.parallel.local_sgd import LocalSGD
from scaletrain.parallel.pipeline.parallel import PipelineParallel
from scaletrain.parallel.pipeline.partition import GPT_STAGES
from scaletrain.parallel.pipeline.runtime import timer
from scaletrain.parallel.pipeline.schedules import Span
from scaletrain.parallel.pipeline.two_bw import delayed_update
from scaletrain.parallel.tensor import GPT_PLAN, TensorParallel, parallelize
from scaletrain.parallel.zero import ZeroDataParallel
from scaletrain.precision import DynamicLossScaler, autocast, compute_dtype
from scaletrain.recompute import apply_recompute
from scaletrain.train import checkpoint as ckpt
from scaletrain.train.data_setup import DataSpec, open_data
from scaletrain.train.memory import (
    ActivationMeter,
    bytes_by_entry,
    memory_ledger,
    model_bytes,
    optimizer_state,
)
from scaletrain.train.metrics import (
    peak_tflops,
)
from scaletrain.train.nonfinite import agreed_flag, first_nonfinite, late_stop_report, local_flag, stop_report
from scaletrain.train.replicas import Replicas
from scaletrain.train.routing import RoutingStats
from scaletrain.train.sampling import generate, line_prompt
from scaletrain.train.step_window import PendingStep, StepWindow


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over every position (token or sample)."""
    return F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten())


def fused_loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """`loss_fn` by the fused cross-entropy kernel (kernels/cross_entropy.py), on given logits."""
    # Imported when chosen: importing Triton decorates its kernels (kernels/__init__.py).
    from scaletrain.kernels.cross_entropy import cross_entropy

    return cross_entropy(logits.flatten(0, -2), targets.flatten())


def first_sample(step: int, micro: int, grad_accum: int, dp_size: int, dp_rank: int, micro_batch: int) -> int:
    """Index in the data stream of the first sample of micro-batch ``micro`` of
    ``step`` on data-parallel rank ``dp_rank``: ranks read disjoint slices of
    the same global batch, and the index depends on nothing but the step."""
    return ((step * grad_accum + micro) * dp_size + dp_rank) * micro_batch


def _step_seed(seed: int, step: int, rank: int) -> int:
    return (seed * 1_000_003 + step * 10_007 + rank) % (2**63)


class Trainer:
    def __init__(self, cfg: Config, spec: DataSpec, runtime: DistRuntime, mesh: Mesh, comm: Comm,
                 run_dir: Path):
        self.cfg, self.spec, self.runtime, self.mesh, self.comm = cfg, spec, runtime, mesh, comm
        self.run_dir = run_dir
        self.is_main = runtime.is_main
        self.device = runtime.device
        self.faults = Faults.from_env(runtime.env.rank)  # none unless SCALETRAIN_FAULT asks (faults.py)
        self.step: int | None = None  # the step under way, counted from 1, for failure reports
        self.data = open_data(spec, cfg)
        self.tp_group = mesh.group("tp")
        self.pp_group = mesh.group("pp")
        self.cp_group = mesh.group("cp")
        self.ep_group = mesh.group("ep")
        self.replicas = Replicas.of(mesh)  # who reads which samples, who holds which copies

        torch.manual_seed(cfg.train.seed)  # the same initial weights on every rank and layout
        t = cfg.train
        self.model: nn.Module = build_model(cfg.model, vocab_size=spec.vocab_size, seq_len=cfg.data.seq_len,
                                            n_features=self.data.n_features,
                                            n_classes=self.data.n_classes).to(self.device)
        if cfg.finetune.base:  # the base run's weights, frozen beside adapters with --lora-rank
            start_from_base(self.model, cfg.finetune)
        self.flops_per_token = self.model.flops_per_token()  # of the whole model, before any split
        p = cfg.parallel
        # Megatron tensor (and sequence) parallelism: the full weights were
        # just built from the seed, each tp rank keeps its slices of them.
        self.tensor_parallel: TensorParallel | None = None
        if self.tp_group.size > 1:
            self.tensor_parallel = parallelize(self.model, GPT_PLAN, comm, self.tp_group,
                                               sequence_parallel=p.sp, dropout=cfg.model.dropout)
        self.loss_fn = self.tensor_parallel.loss if self.tensor_parallel else loss_fn
        # Context parallelism: each cp rank keeps two chunks of every sequence, attention by ring.
        self.context_parallel: ContextParallel | None = None
        if self.cp_group.size > 1:
            self.context_parallel = parallelize_context(self.model, comm, self.cp_group)
        # Expert parallelism: each ep rank keeps its share of every mixture-of-experts block's experts.
        self.expert_parallel: ExpertParallel | None = None
        if self.ep_group.size > 1:
            self.expert_parallel = parallelize_experts(self.model, comm, self.ep_group)
        self.moe_layers = moe_layers(self.model)
        # --fused triton: the head and the loss as one chunked kernel, where the head's weight
        # is whole on this rank after the forward (not split by tp, not freed by ZeRO-3, not
        # behind a pipeline's last stage, which gets the kernel on its logits instead).
        fused_loss = t.fused == "triton" and spec.kind == "text" and self.tp_group.size == 1
        self.fused_head_loss = fused_loss and self.pp_group.size == 1 and p.zero < 3
        if fused_loss and not self.fused_head_loss:
            self.loss_fn = fused_loss_fn
        # Pipeline parallelism: each pp rank keeps its stages of the model.
        self.micro_batches, _ = p.pipeline_sizes()
        self.pipeline: PipelineParallel | None = None
        if self.pp_group.size > 1:
            self.pipeline = self._cut_into_stages()
        # Per-block transforms, per pipeline stage (a sqrt segment must not cross a cut).
        stage_blocks = [s.blocks() for s in self.pipeline.stages] if self.pipeline else [None]
        for blocks in stage_blocks:
            if t.recompute != "none":
                apply_recompute(self.model, t.recompute, blocks)
            if t.compile:
                compile_blocks(self.model, blocks)
        self.compression = ActivationCompression(t.compress_activations)  # entered around each forward
        self.replicas.start_equal(self.model, comm, self.expert_parallel)  # before the masters copy them
        master_device = "cpu" if t.offload == "optimizer" else None
        # fp32 masters for bf16 working weights, or in host memory with --offload
        # (optim/masters.py); the optimizer then steps on the masters. ZeRO
        # keeps its own, sharded (parallel/zero.py).
        self.masters: MasterWeights | None = None
        self.zero: ZeroDataParallel | None = None
        groups = decay_groups(self.model, t.weight_decay)
        if p.zero:
            # A weight tied across stages is sharded alone, so its holders' shards line up.
            tied = [param for param, _ in self.pipeline.shared] if self.pipeline else []
            shard, replica = zero_groups(mesh, self.replicas.dense)  # --shard-group: parallel/hybrid.py
            self.zero = ZeroDataParallel(self.model, comm, shard, stage=p.zero,
                                         param_dtype=compute_dtype(t.param_dtype),
                                         reduce_dtype=compute_dtype(p.reduce_dtype),
                                         master_device=master_device, bucket_mb=p.bucket_mb, own_units=tied,
                                         replica=replica, quantize_weights=p.quantize_weights)
            groups = self.zero.optimizer_groups(groups)
        self.data_parallel: DataParallel | JointDataParallel | ZeroDataParallel | None = self.zero
        if not self.zero:
            if t.param_dtype != "fp32" or master_device:
                self.masters = MasterWeights(self.model, compute_dtype(t.param_dtype), device=master_device)
                groups = self.masters.master_groups(groups)
            self.data_parallel = self.replicas.data_parallel(self.model, comm, p, t.seed, self.expert_parallel,
                                                             [q for group in groups for q in group["params"]], t.steps)
        # --sync-every N > 1: local SGD, the replicas averaged every N steps (parallel/local_sgd.py).
        self.local_sgd = self.data_parallel if isinstance(self.data_parallel, LocalSGD) else None
        self.optimizer = build_optimizer(groups, t)
        # The fused AdamW writes the bf16 working weights in the pass that steps the masters
        # (not from host masters: the kernel reads and writes one device).
        self.fused_working_copy = self.masters is not None and master_device is None and t.fused == "triton"
        if self.fused_working_copy:
            self.optimizer.attach_working_copies(self.masters.working_pairs())
        self.step_params = [p for group in groups for p in group["params"]]
        self.delayed = delayed_update(p.pp_schedule, self.model, self.pipeline)  # PipeDream-2BW's 1-stale update
        self.norm_counted = self._counted_for_norm()
        # Over these groups the counted gradients add up to the whole model's, each element once.
        self.norm_groups = [self.tp_group, self.pp_group, self.ep_group] + ([self.zero.group] if self.zero else [])
        self.timeline: list[Span] | None = None  # the recorded pipeline round, on the run's last step
        self.scaler = DynamicLossScaler(enabled=t.precision == "fp16")
        self.on_nan = t.on_nan or ("skip" if t.precision == "fp16" else "stop")
        self.activation_meter: ActivationMeter | None = None  # set by the first step with --report-memory
        self.memory: dict | None = None  # the ledger taken on that step
        self.start_step = 0
        latest = ckpt.latest_checkpoint(run_dir) if cfg.run.resume else None
        if latest:  # (none: a job restarted before its first checkpoint, run.py)
            state = ckpt.load_checkpoint(latest, self.model, self.optimizer, self.masters, self.zero,
                                         self.tensor_parallel, self._own_optimizer())
            self.start_step = state["step"]
            self.scaler.load_state_dict(state["scaler"])
        positions = cfg.data.seq_len if spec.kind == "text" else 1
        self.tokens_per_step = t.micro_batch * t.grad_accum * self.micro_batches * self.replicas.batch.size * positions
        self.peak = peak_tflops(t.peak_tflops, self.device)

    def _stepped(self, param: nn.Parameter) -> torch.Tensor:
        """The tensor the optimizer steps for ``param``: its fp32 master, where there is one."""
        return self.masters.master_of(param) if self.masters else param

    def _counted_for_norm(self) -> list[torch.Tensor]:
        """The step tensors whose gradients this rank counts towards the model's
        gradient norm (optim/clip.py): not a replicated weight's copy on a tp rank
        but the first, not the tied embedding's copy on a later pipeline stage;
        under ZeRO, this rank's shards, which the dp group's shards complete."""
        if self.zero:
            pairs = [(piece.tensor, piece.param) for unit in self.zero.units for piece in unit.pieces]
        else:
            pairs = [(self._stepped(p), p) for p in self.model.parameters() if p.requires_grad]
        parts = [part for part in (self.tensor_parallel, self.pipeline, self.expert_parallel) if part is not None]
        return [tensor for tensor, param in pairs if all(part.counts(param) for part in parts)]

    def _cut_into_stages(self) -> PipelineParallel:
        cfg, p = self.cfg, self.cfg.parallel
        width = gpt_config(cfg.model, vocab_size=self.spec.vocab_size, seq_len=cfg.data.seq_len).d_model
        _, virtual = p.pipeline_sizes()

        def boundary(batch: int, seq: int) -> tuple[tuple[int, ...], torch.dtype, torch.device]:
            # The GPT's residual stream crosses the cuts, in fp32 whatever the precision;
            # with sequence parallelism each tp rank holds its chunk of the (cp rank's) positions.
            if self.tensor_parallel and self.tensor_parallel.sequence_parallel:
                seq //= self.tp_group.size
            return (batch, seq, width), torch.float32, self.device

        return PipelineParallel(
            self.model, GPT_STAGES, self.comm, self.pp_group, schedule=p.pp_schedule,
            micro_batches=self.micro_batches, virtual_stages=virtual, balance_by=p.pp_balance,
            boundary=boundary, sample=self._micro_batch(0, 0)[0], world=self.mesh.group("world"))

    # -- one optimizer step --------------------------------------------------
    def _micro_batch(self, step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
        t = self.cfg.train
        per_step = t.grad_accum * self.micro_batches
        if micro == min(1, per_step - 1):
            self.faults.strike("micro-batch", step + 1)
        first = first_sample(step, micro, per_step, self.replicas.batch.size,
                             self.replicas.batch.rank, t.micro_batch)
        return self._local(*self.data.train.get(first, t.micro_batch))

    def _local(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A batch on this rank's device; with cp, only this rank's positions of it."""
        if self.device.type == "cuda":  # page-locked, so the copy is queued, not waited for
            x, y = x.pin_memory().to(self.device, non_blocking=True), y.pin_memory().to(self.device, non_blocking=True)
        else:
            x, y = x.to(self.device), y.to(self.device)
        if self.context_parallel:
            return self.context_parallel.local(x), self.context_parallel.local(y)
        return x, y

    def _dropout_rank(self) -> int:
        """Which stream this rank's dropout draws from: its own, except that the
        ranks of a tp group share one when they hold the same activations
        (tensor parallelism without sp; parallel/tensor.py)."""
        if self.tensor_parallel and not self.tensor_parallel.sequence_parallel:
            return self.mesh.dims.rank_of({**self.mesh.coords, "tp": 0})
        return self.runtime.env.rank

    def _forward_backward(self, step: int) -> tuple[torch.Tensor, RoutingStats | None]:
        """Forward and backward of the step's micro-batches; the sum of their losses / grad_accum
        (the cross-entropy alone), and with a mixture of experts what the routers did."""
        t = self.cfg.train
        loss_sum = torch.zeros((), device=self.device)
        routing = RoutingStats.empty(self.moe_layers, self.device) if self.moe_layers else None
        for micro in range(t.grad_accum):
            x, y = self._micro_batch(step, micro)
            final = micro == t.grad_accum - 1
            with self._meter_first_micro_batch(micro), \
                    (nullcontext() if final else self.data_parallel.no_sync()):
                loss = self._loss(x, y) / t.grad_accum
                aux = auxiliary_loss(self.model) / t.grad_accum if routing else 0.0
                self.scaler.scale(loss + aux).backward()
            loss_sum += loss.detach()
            if routing:
                routing.add(self.moe_layers, aux)
        return loss_sum, routing

    @contextmanager
    def _forward_context(self):
        """What a forward runs under: autocast, and the compression of the tensors it saves."""
        with autocast(self.cfg.train.precision, self.device), self.compression:
            yield

    def _loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The mean cross-entropy of one micro-batch (forward included)."""
        with self._forward_context():
            if self.fused_head_loss:
                from scaletrain.kernels.cross_entropy import fused_linear_cross_entropy
                return fused_linear_cross_entropy(self.model(x, logits=False), self.model.head.weight, y)
            logits = self.model(x)
        return self._loss_of(logits, y)

    def _loss_of(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The loss of given logits, the tensors it saves compressed too (the log-probabilities: b x s x V)."""
        with self.compression:
            return self.loss_fn(logits, y)

    def _pipeline_forward_backward(self, step: int, record: bool) -> torch.Tensor:
        """``--grad-accum`` rounds of the pipeline schedule over the step's
        micro-batches, gradients synchronised after the last; the loss, as the
        last stage has it, on every pp rank. ``record``: keep the first round's
        timeline, its clock started together on every pp rank."""
        t = self.cfg.train
        loss_sum = torch.zeros((), device=self.device)
        with self.data_parallel.no_sync():
            for round_ in range(t.grad_accum):
                clock = None
                if record and round_ == 0:
                    self.comm.barrier(self.pp_group)
                    clock = timer()
                with self._meter_first_micro_batch(round_):
                    loss, spans = self.pipeline.train_round(
                        lambda m, r=round_: self._micro_batch(step, r * self.micro_batches + m),
                        loss_fn=self._loss_of, divisor=t.grad_accum * self.micro_batches,
                        backward_scale=self.scaler.scale,
                        forward_context=self._forward_context, clock=clock)
                loss_sum += loss
                if clock:
                    self.timeline = spans
        return self.pipeline.from_last_stage(loss_sum)

    def train_step(self, step: int, record: bool = False) -> dict[str, float]:
        """One optimizer step, its numbers read at once (``fit`` reads them a window at a time)."""
        window = StepWindow(1, self.tokens_per_step)
        window.add(self.queue_step(step, record))
        (read,) = window.read()
        if read.nonfinite:
            raise self.late_stop(read.record)
        return read.record

    def queue_step(self, step: int, record: bool) -> PendingStep:
        """One optimizer step; its loss, gradient norm and (with ``--log-every`` K > 1) its
        non-finite flag left on the device (train/step_window.py)."""
        t = self.cfg.train
        self.faults.strike("step", step + 1)
        torch.manual_seed(_step_seed(t.seed, step, self._dropout_rank()))
        self.model.train()
        routing = None
        if self.pipeline:
            loss_sum = self._pipeline_forward_backward(step, record)
        else:
            loss_sum, routing = self._forward_backward(step)
        self.data_parallel.finish_gradient_sync()
        if self.delayed and not self.delayed.exchange(self.data_parallel.gradient):
            return self._before_first_update(step, loss_sum)
        if self.pipeline:
            self.pipeline.sum_shared_gradients(self.data_parallel.gradient)
        if self.masters:
            self.masters.copy_grads_to_master(self.data_parallel.gradient)
        if self.zero:
            self.zero.copy_grads_to_master()
        for name in self.faults.poisoned(step + 1):
            poison(self._named_step_tensors(), name)
        if not self.faults.skips(step + 1):  # a desync on purpose (faults.py)
            self.comm.all_reduce(loss_sum, self.replicas.dense, op="avg")
        # Every rank skips (or stops) together (train/nonfinite.py); fp16's unscaling pass checks the gradients.
        grads = [p.grad for p in self.step_params if p.grad is not None]
        overflow = self.scaler.unscale_(self.step_params).to(self.device)
        flag = local_flag(loss_sum, [] if self.scaler.enabled else grads).maximum(overflow)
        late = self._reads_flag_late
        flag = agreed_flag(flag, self.comm, self.mesh.group("world"))
        skip = False if late else bool(flag.item())
        if skip and self.on_nan == "stop":
            raise self._nonfinite_stop(step + 1, loss_sum.item())
        grad_norm = clip_grad_norm_([p.grad for p in self.step_params if p.grad is not None],
                                    t.grad_clip if t.grad_clip > 0 else math.inf,
                                    counted=[p.grad for p in self.norm_counted if p.grad is not None],
                                    comm=self.comm, groups=self.norm_groups, device=self.device)
        lr = lr_at(step, peak=t.lr, warmup=t.warmup_steps, total=t.steps, min_ratio=t.min_lr_ratio)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.faults.strike("optimizer", step + 1)
        self.scaler.step(self.optimizer, skip)
        self.scaler.update(skip)
        averaged = self.local_sgd is not None and self.local_sgd.average_if_due(step + 1)
        if self.masters and (averaged or not self.fused_working_copy):
            self.masters.copy_master_to_model()
        if self.zero:
            self.zero.publish()
        if self.activation_meter is not None and self.memory is None:
            # after the step (optimizer state exists), before the gradients are freed
            self.memory = memory_ledger(self._bytes_ledger(), self.activation_meter)
        if self.masters:
            self.optimizer.zero_grad(set_to_none=True)  # the masters' gradients
        self.data_parallel.zero_grad()  # the model's
        host = {"lr": lr, "skipped_steps": self.scaler.skipped_steps}
        if routing:
            host.update(routing.summed(self.comm, self.replicas.batch))
        if t.precision == "fp16":
            host.update(loss_scale=self.scaler.scale_value)
        return PendingStep(step + 1, host, {"loss": loss_sum, "grad_norm": grad_norm},
                           nonfinite=flag if late else None)

    @property
    def _reads_flag_late(self) -> bool:
        """Whether the non-finite flag is read with the window rather than at once: only
        where nothing this step does depends on it (train/step_window.py)."""
        return self.cfg.run.log_every > 1 and self.on_nan == "stop" and not self.scaler.enabled

    def _before_first_update(self, step: int, loss_sum: torch.Tensor) -> PendingStep:
        """PipeDream-2BW's first step: no gradient is complete yet, so no update (W(1) = W(0))."""
        self.comm.all_reduce(loss_sum, self.replicas.dense, op="avg")
        self.data_parallel.zero_grad()
        return PendingStep(step + 1, {"grad_norm": None, "lr": None, "skipped_steps": self.scaler.skipped_steps},
                           {"loss": loss_sum})

    def _named_step_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """What the optimizer steps, by parameter name: ZeRO's pieces, the masters, or the weights."""
        if self.zero:
            return [(piece.name, piece.tensor) for unit in self.zero.units for piece in unit.pieces]
        return [(name, self._stepped(p)) for name, p in self.model.named_parameters() if p.requires_grad]

    def _nonfinite_stop(self, step: int, loss: float) -> Exception:
        culprit = first_nonfinite((name, t.grad) for name, t in self._named_step_tensors())
        culprits = self.comm.all_gather_object(culprit, self.mesh.group("world"))
        latest = ckpt.latest_checkpoint(self.run_dir)
        return stop_report(step, loss, culprits, latest.name if latest else None)

    def late_stop(self, record: dict) -> Exception:
        latest = ckpt.latest_checkpoint(self.run_dir)
        return late_stop_report(record["step"], record["loss"], self.step, self.cfg.run.log_every,
                                latest.name if latest else None)

    def _bytes_ledger(self) -> dict:
        if self.zero:
            tensors = self.zero.memory_tensors()
            tensors["optimizer"] += optimizer_state(self.optimizer)
            return bytes_by_entry(tensors)
        return model_bytes(self.model, self.optimizer, self.masters, self.data_parallel.gradient_buffers(),
                           held=self.delayed.memory_tensors() if self.delayed else None)

    def _meter_first_micro_batch(self, micro: int):
        """With --report-memory, measure saved activations of the run's first
        micro-batch (the meter slows the step, so once is enough); with a
        pipeline, of its first round, whose schedule decides how many
        micro-batches are alive at once."""
        if not self.cfg.run.report_memory or self.activation_meter is not None or micro != 0:
            return nullcontext()
        self.activation_meter = ActivationMeter(self.model)
        return self.activation_meter

    def memory_report(self) -> dict:
        """This rank's memory ledger (params, grads, optimizer, activations peak)
        as measured on the first step of this run."""
        return self.memory

    @torch.no_grad()
    def evaluate(self) -> float:
        self.model.eval()
        batches = [self._local(x, y) for x, y in
                   self.data.val.eval_batches(self.cfg.train.micro_batch, self.cfg.train.eval_batches)]
        if self.pipeline:
            loss = self.pipeline.evaluate(batches, self.loss_fn,
                                          lambda: autocast(self.cfg.train.precision, self.device))
        else:
            loss = sum(self._loss(x, y).item() for x, y in batches) / len(batches)
        if self.context_parallel:  # each cp rank has the mean over its positions
            mean = torch.tensor(loss, device=self.device)
            self.comm.all_reduce(mean, self.cp_group, op="avg")
            loss = mean.item()
        return loss

    def sample(self) -> str | None:
        """A continuation of a line from the validation text (GPT only; train/sampling.py)."""
        tokenizer = self.data.tokenizer
        if tokenizer is None or self.cfg.run.sample_tokens == 0:
            return None
        window, _ = self.data.val.get(0, 1)
        return tokenizer.decode(generate(self, line_prompt(tokenizer, window[0]), self.cfg.run.sample_tokens).tolist())

    # -- the loop ------------------------------------------------------------
    def _own_optimizer(self):
        """The group whose ranks each keep their own optimizer state (local SGD's dp group), or None."""
        return self.replicas.dense if self.local_sgd else None

    def save(self, step: int) -> Path:
        world = self.mesh.group("world")
        team = ckpt.Team(world.rank, world.size, barrier=lambda: self.comm.barrier(world),
                         gather=lambda value: self.comm.all_gather_object(value, world))
        state = {"step": step, "world_size": self.runtime.env.world_size, "layout": self.mesh.dims.describe(),
                 "scaler": {k: float(v) if torch.is_tensor(v) else v for k, v in self.scaler.state_dict().items()}}
        if self.local_sgd:  # how many ranks' own optimizer states the checkpoint holds (run.py checks a resume)
            state["optimizer_per_rank"] = self.replicas.dense.size
        return ckpt.save_checkpoint(self.run_dir, step, self.model, self.optimizer, self.masters, state, team,
                                    zero=self.zero, tensor_parallel=self.tensor_parallel,
                                    own_optimizer=self._own_optimizer(),
                                    keep_last=self.cfg.run.keep_last,
                                    strike=lambda point: self.faults.strike(point, step))
