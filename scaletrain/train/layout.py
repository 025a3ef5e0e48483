"""The layout: what runs where, built once before the first step.

A `Layout` turns a plain model, its plan (models/spec.py: `ModelPlan`), the
training and parallel settings and the mesh into this rank's part of the
job: `parallelize` (parallel/parallelize.py) applies tp, cp, ep and pp in the
order they compose; then the per-block transforms inside each stage (recompute,
compile), the replicas made equal, and what holds the optimizer's tensors:
ZeRO's shards, fp32 master weights, or the weights themselves under a data
parallel wrapper. The optimizer and the bookkeeping the step needs (which
tensors it steps, which gradients count towards the norm, over which groups)
close it.

The step (train/stepper.py) runs over a layout and never builds one; a
layout never runs a step, nor builds a model: the command builds its models
from the seed (job/trainer.py: `build_run_model`), a user brings theirs (library.py). Nothing
here names a model: it reads the plan, so every layout of the same model
starts from the same weights, which is what makes parity checkable.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from scaletrain.config import ParallelConfig, TrainConfig
from scaletrain.data.batches import IGNORE_INDEX
from scaletrain.finetune.sliced import FolderSource, flat_reader, materialize
from scaletrain.kernels import head_loss, unavailable
from scaletrain.models.moe import moe_layers
from scaletrain.models.spec import ModelPlan
from scaletrain.optim import MasterWeights, build_optimizer, decay_groups
from scaletrain.optim.clip import folds_scale
from scaletrain.optim.stochastic_rounding import StochasticRounding
from scaletrain.parallel.batchnorm import RunningStatistics, synchronize_batchnorm
from scaletrain.parallel.data import DataParallel, JointDataParallel
from scaletrain.parallel.hybrid import zero_groups
from scaletrain.parallel.local_sgd import LocalSGD
from scaletrain.parallel.parallelize import parallelize
from scaletrain.parallel.pipeline.two_bw import delayed_update
from scaletrain.parallel.tensor import TensorParallel
from scaletrain.parallel.zero import ZeroDataParallel, layer_modules
from scaletrain.parallel.zero_adafactor import ShardedAdafactor
from scaletrain.parallel.zero_experts import JointZero
from scaletrain.runtime.comm import Comm
from scaletrain.runtime.mesh import Mesh
from scaletrain.techniques.compile import compile_blocks
from scaletrain.techniques.fp8 import Float8, convert_to_float8
from scaletrain.techniques.precision import compute_dtype
from scaletrain.techniques.recompute import apply_recompute
from scaletrain.train.memory import bytes_by_entry, model_bytes, optimizer_state, peak_resident_bytes
from scaletrain.train.replicas import Replicas
from scaletrain.train.step_weights import MasterCopies, ModelWeights, StepWeights, ZeroShards


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The cross-entropy summed over the trained positions (token or sample; a target of
    IGNORE_INDEX is left out) and divided by the number of positions, trained or not: the
    trainer turns it into the mean over the global batch's trained tokens (job/trainer.py)."""
    return F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten(), ignore_index=IGNORE_INDEX,
                           reduction="sum") / targets.numel()


def fused_loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """`loss_fn` by the fused cross-entropy kernel (kernels/cross_entropy.py), on given logits."""
    # Imported when chosen: importing Triton decorates its kernels (kernels/__init__.py).
    from scaletrain.kernels.cross_entropy import cross_entropy

    return cross_entropy(logits.flatten(0, -2), targets.flatten())


class Layout:
    """This rank's part of ``model`` (whole, the same on every rank; or on the meta device with
    ``source`` to read its weights from, each rank its own slices: finetune/sliced.py) under
    ``train`` and ``parallel`` on ``mesh``. ``plan`` says how it may be split (None: it may be
    replicated and sharded, not split); ``seq_len`` is that of every sequence (for cp);
    ``sample``, one micro-batch of inputs as the data holds it (all positions, on the host),
    is what ``--pp-balance time`` times the blocks on; ``fused_head``: the model is a decoder
    whose head and loss the fused cross-entropy kernel may take (`fused_loss_fn`); ``sync_batchnorm``:
    its BatchNorm layers normalize by the whole data-parallel batch's statistics (parallel/batchnorm.py)."""

    def __init__(self, model: nn.Module, plan: ModelPlan | None, train: TrainConfig, parallel: ParallelConfig,
                 mesh: Mesh, comm: Comm, device: torch.device, *, seq_len: int | None = None,
                 sample: torch.Tensor | None = None, source: FolderSource | None = None, fused_head: bool = False,
                 sync_batchnorm: bool = False):
        self.model, self.plan = model, plan or ModelPlan()
        self.train, self.parallel, self.mesh, self.comm, self.device = train, parallel, mesh, comm, device
        self.tp_group, self.pp_group = mesh.group("tp"), mesh.group("pp")
        self.cp_group, self.ep_group = mesh.group("cp"), mesh.group("ep")
        self.replicas = Replicas.of(mesh)  # who reads which samples, who holds which copies
        if sync_batchnorm:  # before any transform, which then finds its weights where they were
            synchronize_batchnorm(model, comm, self.replicas.batch)
        self.folder = source
        if not self.folder:
            self.model.to(device)
        self.micro_batches, virtual = parallel.pipeline_sizes()
        parts = parallelize(model, self.plan, mesh, comm, device, sequence_parallel=parallel.sp, seq_len=seq_len,
                            schedule=parallel.pp_schedule, micro_batches=self.micro_batches, virtual_stages=virtual,
                            balance_by=parallel.pp_balance, sample=sample,
                            read_weights=self._read_folder if self.folder else None)
        self.tensor_parallel, self.context_parallel = parts.tensor, parts.context
        self.expert_parallel, self.pipeline = parts.experts, parts.pipeline
        self.moe_layers = moe_layers(self.model)
        self._choose_the_loss(fused_head)
        self._transform_blocks()
        if not self.folder:  # every rank read the same file: equal already
            self.replicas.start_equal(self.model, comm, self.expert_parallel)  # before the masters copy them
        self.host_peak = peak_resident_bytes()  # the weights built or read, nothing of the optimizer's yet
        self._hold_optimizer_tensors()
        # BatchNorm's running estimates, one set over the copies of this stage (parallel/batchnorm.py)
        self.running_statistics = RunningStatistics(self.model, comm, self.replicas.dense)
        if self.folder and parallel.zero == 3:  # its units read their shards: their gradient shards came with them
            # what ZeRO-3 left unsharded (a frozen base inside pipeline stages or beside experts), whole
            materialize(self.model, self.folder, self.device, splits={}, tp_rank=self.tp_group.rank)
            self.host_peak = peak_resident_bytes()
        if self.folder and self.tensor_parallel:  # the weights have their storage now, for good
            self.tensor_parallel.hook_replicated_gradients(self.model)
        # PipeDream-2BW's 1-stale update: the pipeline's weight versions, or a delayed gradient
        self.delayed = delayed_update(parallel.pp_schedule, self.model,
                                      self.pipeline.versions if self.pipeline else None)
        self.norm_counted = self._counted_for_norm()
        counted = {id(t) for t in self.norm_counted}
        self.norm_uncounted = [t for t in self.step_params if id(t) not in counted]  # copies: checked apart
        # Over these groups the counted gradients add up to the whole model's, each element once: ZeRO's
        # group (with ep, the dense one, which spans the ep ranks' different experts too), or else ep.
        self.norm_groups = [self.tp_group, self.pp_group, self.zero.group if self.zero else self.ep_group]

    def _choose_the_loss(self, fused_head: bool) -> None:
        """The loss on the logits (tp's vocabulary-parallel one where tp splits them), or the head and
        the loss chunked (kernels/head_loss.py) where the head's weight is whole on this rank after the
        forward (not split by tp, not freed by ZeRO-3, not behind a pipeline's last stage, which gets
        --fused triton's kernel on its logits instead)."""
        t = self.train
        self.loss_fn = self.tensor_parallel.loss if self.tensor_parallel else loss_fn
        # a plain linear head: one with adapters or 4-bit weights (finetune/) keeps its own forward
        plain_head = isinstance(getattr(self.model, "head", None), nn.Linear)
        whole_head = fused_head and plain_head and head_loss.head_is_whole(self.tp_group.size, self.pp_group.size,
                                                                            self.parallel.zero)
        on_gpu = self.device.type == "cuda" and unavailable(self.device) is None  # Triton there to run the kernel
        self.fused_head_loss = whole_head and head_loss.chunked(t.head_loss, t.fused, on_gpu)
        if t.fused == "triton" and fused_head and self.tp_group.size == 1 and not whole_head:
            self.loss_fn = fused_loss_fn

    def _transform_blocks(self) -> None:
        """FP8 linear layers, recompute and compile, block by block, per pipeline stage (a sqrt segment
        must not cross a cut)."""
        stage_blocks = [s.blocks() for s in self.pipeline.stages] if self.pipeline else [self.blocks()]
        for blocks in stage_blocks:
            if self.train.precision == "fp8":  # the blocks' linear products in float8 (techniques/fp8.py)
                convert_to_float8(blocks, Float8.on(self.device))
            if self.train.recompute != "none":
                apply_recompute(self.model, self.train.recompute, blocks)
            if self.train.compile:
                compile_blocks(self.model, blocks, self.train.compile_mode)

    def blocks(self) -> list[nn.Module]:
        """The model's repeated blocks: the plan's stack, or every layer of its module lists."""
        stack = self.plan.block_stack
        return list(getattr(self.model, stack)) if stack else layer_modules(self.model)

    def _read_folder(self, tensor_parallel: TensorParallel | None) -> None:
        """Storage for this rank's meta weights, read from the folder; under ZeRO-3 the weights
        tensor parallelism left whole and a 4-bit base's codes stay meta, for ZeRO to read its
        shard of each (those it does not shard are read after it, whole)."""
        splits = tensor_parallel.splits if tensor_parallel else {}
        later = {id(t) for t in (*self.model.parameters(), *self.model.buffers()) if t not in splits} \
            if self.parallel.zero == 3 else set()
        materialize(self.model, self.folder, self.device, splits, self.tp_group.rank, skip=later)

    def _hold_optimizer_tensors(self) -> None:
        """What the optimizer steps and how gradients reach it: ZeRO's shards (with their own
        masters, or pure bf16's working shards: parallel/zero.py), or fp32 masters for bf16
        working weights or in host memory with --offload (optim/masters.py) under a
        data-parallel wrapper, or the weights."""
        t, p = self.train, self.parallel
        master_device = "cpu" if t.offload == "optimizer" else None
        self.masters: MasterWeights | None = None
        self.zero: ZeroDataParallel | JointZero | None = None
        groups = decay_groups(self.model, t.weight_decay)
        if p.zero:
            # A weight tied across stages is sharded alone, so its holders' shards line up.
            tied = [param for param, _ in self.pipeline.shared] if self.pipeline else []
            shard, replica = zero_groups(self.mesh, self.replicas.dense)  # --shard-group: parallel/hybrid.py
            # with ep, the dense weights over their copies' group and the experts over theirs
            self.zero = self.replicas.zero(self.model, self.comm, shard, self.expert_parallel, stage=p.zero,
                                           param_dtype=compute_dtype(t.param_dtype),
                                           reduce_dtype=compute_dtype(p.reduce_dtype),
                                           master_device=master_device, masters=t.masters != "none",
                                           base_device="cpu" if t.offload == "base" else None,
                                           bucket_mb=p.bucket_mb, own_units=tied,
                                           replica=replica, quantize_weights=p.quantize_weights,
                                           device=self.device, layers=self._zero_layers(),
                                           stages=[s.blocks() for s in self.pipeline.stages]
                                           if self.pipeline and p.zero == 3 else None, gather=p.zero3_gather,
                                           source=flat_reader(self.model, self.folder) if self.folder else None)
            groups = self.zero.optimizer_groups(groups)
            if self.pipeline and p.zero == 3:  # every run of the schedule inside ZeRO-3's gathers of a round
                self.pipeline.round_context = self.zero.gathering.round
        self.data_parallel: DataParallel | JointDataParallel | ZeroDataParallel | JointZero | None = self.zero
        if not self.zero:
            if t.masters == "none":  # pure bf16: the working weights are the only copy
                for param in self.model.parameters():
                    if param.is_floating_point():
                        param.data = param.detach().to(compute_dtype(t.param_dtype))
            elif t.param_dtype != "fp32" or master_device:
                self.masters = MasterWeights(self.model, compute_dtype(t.param_dtype), device=master_device)
                groups = self.masters.master_groups(groups)
            self.data_parallel = self.replicas.data_parallel(self.model, self.comm, p, t.seed, self.expert_parallel,
                                                             [q for group in groups for q in group["params"]], t.steps)
        # --sync-every N > 1: local SGD, the replicas averaged every N steps (parallel/local_sgd.py).
        self.local_sgd = self.data_parallel if isinstance(self.data_parallel, LocalSGD) else None
        if self.zero and t.optimizer == "adafactor":  # each matrix's factored statistics completed over the group
            self.optimizer = ShardedAdafactor(groups, t.lr, self.zero, self.comm)
        else:
            self.optimizer = build_optimizer(groups, t, self._embedding_steps() if t.optimizer == "adamw8bit" else [])
        # --stochastic-rounding: pure bf16's updates rounded at random (optim/stochastic_rounding.py)
        self.rounding = StochasticRounding(self.optimizer, t.seed) if t.stochastic_rounding else None
        # The fused AdamW writes the bf16 working weights in the pass that steps the masters
        # (not from host masters: the kernel reads and writes one device; not the 8-bit
        # AdamW's kernel, which leaves them to copy_master_to_model).
        fused_working_copy = (self.masters is not None and master_device is None and t.fused == "triton"
                              and t.optimizer == "adamw")
        if fused_working_copy:
            self.optimizer.attach_working_copies(self.masters.working_pairs())
        self.step_params = [q for group in groups for q in group["params"]]
        # the optimizer that takes the clipping's scale into its step, decided once (optim/clip.py)
        self.clip_into = self.optimizer if folds_scale(self.optimizer, self.device) else None
        # The update's three hooks over what the optimizer steps (train/step_weights.py).
        if self.zero:
            self.step_weights: StepWeights = ZeroShards(self.zero)
        elif self.masters:
            self.step_weights = MasterCopies(self.data_parallel, self.local_sgd, self.masters, self.optimizer,
                                             fused_working_copy)
        else:
            self.step_weights = ModelWeights(self.data_parallel, self.local_sgd)

    def exchange_delayed_gradients(self) -> bool:
        """Under PipeDream-2BW, this step's gradients swapped for the previous step's, which the
        update applies (parallel/pipeline/two_bw.py); whether there is a gradient to apply (not on
        the first step). Elsewhere always."""
        return self.delayed is None or self.delayed.exchange(self.data_parallel.gradient)

    def sum_shared_gradients(self) -> None:
        """A weight held by two pipeline stages (a tied embedding): each holder's gradient becomes the sum."""
        if self.pipeline:
            self.pipeline.sum_shared_gradients(self.data_parallel.gradient)

    def stepping_optimizer(self, step: int):
        """The optimizer, or with --stochastic-rounding the same whose updates step ``step`` (from 1)
        rounds at random (optim/stochastic_rounding.py)."""
        return self.optimizer if self.rounding is None else self.rounding.at(step)

    def _embedding_steps(self) -> list[torch.Tensor]:
        """The tensors the optimizer steps for the embedding tables (their masters, or under ZeRO
        this rank's pieces of them), whose 8-bit AdamW moments stay fp32 (optim/adamw8bit.py)."""
        tables = {id(q) for m in self.model.modules() if isinstance(m, nn.Embedding) for q in m.parameters()}
        if self.zero:
            return [piece.tensor for unit in self.zero.units for piece in unit.pieces if id(piece.param) in tables]
        return [self.stepped(q) for q in self.model.parameters() if id(q) in tables and q.requires_grad]

    def _zero_layers(self) -> list[nn.Module] | None:
        """ZeRO-3's units where the plan names the blocks (otherwise parallel/zero.py finds them)."""
        if self.parallel.zero != 3 or not self.plan.blocks:
            return None
        return [block for block in getattr(self.model, self.plan.blocks) if any(True for _ in block.parameters())]

    def local(self, *batch: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """A batch (inputs, targets[, documents]) on this rank's device; with cp, only this rank's
        positions of the inputs and targets (a packed row's documents stay whole: models/decoder.py)."""
        if self.device.type == "cuda":  # page-locked, so the copy is queued, not waited for
            batch = tuple(t.pin_memory().to(self.device, non_blocking=True) for t in batch)
        else:
            batch = tuple(t.to(self.device) for t in batch)
        if self.context_parallel:
            return (*(self.context_parallel.local(t) for t in batch[:2]), *batch[2:])
        return batch

    def stepped(self, param: nn.Parameter) -> torch.Tensor:
        """The tensor the optimizer steps for ``param``: its fp32 master, where there is one."""
        return self.masters.master_of(param) if self.masters else param

    def _counted_for_norm(self) -> list[torch.Tensor]:
        """The step tensors whose gradients this rank counts towards the model's
        gradient norm (optim/clip.py): not a replicated weight's copy on a tp rank
        but the first, not the tied embedding's copy on a later pipeline stage;
        under ZeRO, this rank's shards, which its group's shards complete (with ep, of the
        dense weights too: no ep rank's shard is a copy of another's)."""
        if self.zero:
            pairs = [(piece.tensor, piece.param) for unit in self.zero.units for piece in unit.pieces]
        else:
            pairs = [(self.stepped(p), p) for p in self.model.parameters() if p.requires_grad]
        copies_over_ep = None if self.zero else self.expert_parallel  # the dense weights' copies on ep ranks
        parts = [part for part in (self.tensor_parallel, self.pipeline, copies_over_ep) if part is not None]
        return [tensor for tensor, param in pairs if all(part.counts(param) for part in parts)]

    def named_step_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """What the optimizer steps, by parameter name: ZeRO's pieces, the masters, or the weights."""
        if self.zero:
            return [(piece.name, piece.tensor) for unit in self.zero.units for piece in unit.pieces]
        return [(name, self.stepped(p)) for name, p in self.model.named_parameters() if p.requires_grad]

    def dropout_rank(self, rank: int) -> int:
        """Which stream the dropout of ``rank`` (this one) draws from: its own, except that
        the ranks of a tp group share one when they hold the same activations (tensor
        parallelism without sp; parallel/tensor.py)."""
        if self.tensor_parallel and not self.tensor_parallel.sequence_parallel:
            return self.mesh.dims.rank_of({**self.mesh.coords, "tp": 0})
        return rank

    def own_optimizer(self):
        """The group whose ranks each keep their own optimizer state (local SGD's dp group), or None."""
        return self.replicas.dense if self.local_sgd else None

    def bytes_ledger(self) -> dict:
        """The bytes this rank holds, by entry (train/memory.py), activations aside."""
        if self.zero:
            tensors = self.zero.memory_tensors()
            tensors["optimizer"] += optimizer_state(self.optimizer)
            return bytes_by_entry(tensors)
        return model_bytes(self.model, self.optimizer, self.masters, self.data_parallel.gradient_buffers(),
                           held=self.delayed.memory_tensors() if self.delayed else None)
