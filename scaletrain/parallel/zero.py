"""ZeRO: data parallelism that shards the training state instead of replicating it.

Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion
Parameter Models". Instead of a whole copy on each of the ``N`` ranks, each
rank owns ``1/N`` of the training state and gathers the rest when it is used
(``N``: the dp group, or with ``--shard-group`` a shard group of it:
parallel/hybrid.py):

    stage 1 (P_os)     the optimizer state (and fp32 master weights) is sharded
    stage 2 (P_os+g)   and the reduced gradients
    stage 3 (P_os+g+p) and the parameters themselves

Layout. A unit's parameters are views into one flat buffer padded to a multiple
of ``N`` elements, ``S = ceil(numel / N)``, and rank ``r`` owns elements
``[r*S, (r+1)*S)``: contiguous ranges, as in DeepSpeed and torch's first FSDP,
so a gather lands in place with no copy. Stage 1 and 2 units are the gradient
buckets of ``--bucket-mb`` (parallel/data.py); stage 3 units are the model's
repeated layers plus a root unit of the rest (a decoder's embeddings, final
norm and head, one unit because the head's weight *is* the token embedding's).
Stage 3 gathers each unit just before forward or backward runs it, prefetching
the next (parallel/zero3.py). A fine-tune's frozen weights (a LoRA base) stay whole under
stages 1 and 2; stage 3 (without a pipeline or experts) cuts them into frozen units beside
the trained ones, module by module: sharded and gathered alike, never reduced nor stepped; a 4-bit
base's codes and scales (integer buffers) likewise, in units of bytes (parallel/zero_units.py).

Memory per rank, P parameters, fp32 AdamW (state K = 8 bytes/param: two moments):

    stage 0 (DP)   4P + 4P   + 8P           (parameters + gradients + optimizer)
    stage 1        4P + 4P   + 8P/N
    stage 2        4P + 4P/N + 8P/N
    stage 3        4P/N + 4P/N + 8P/N

with ``--param-dtype bf16`` (bf16 weights, fp32 master shard counted as
optimizer state, so K = 12; gradients reduced in fp32, ``--reduce-dtype``):

    stage 1        2P + 4P   + 12P/N
    stage 2        2P + 4P/N + 12P/N
    stage 3        2P/N + 4P/N + 12P/N

and pure bf16 (``--precision bf16-true``: ``--masters none``, gradients reduced in bf16) keeps no
fp32 copy at all: each rank's optimizer steps its bf16 shard of the working weights in place (with
``--stochastic-rounding``, optim/stochastic_rounding.py), from its bf16 gradient shard, AdamW's
moments in bf16 beside it (K = 4):

    stage 1        2P + 2P   + 4P/N
    stage 2        2P + 2P/N + 4P/N
    stage 3        2P/N + 2P/N + 4P/N

Each ``P/N`` is really ``S`` per unit (padding), plus a 4-byte step counter per
tensor the optimizer updates. Outside these totals: the units in use (stage 3:
the one computing, the one prefetched, the root unit from forward's start to
backward's end) and at most two units' unsharded gradients in flight (stages 2,
3). ``--offload optimizer`` (ZeRO-Offload, Ren et al. 2021) moves the master
shard, its gradient and the optimizer state to host memory.

Communication per step, B the bytes of the (padded) model in the working
dtype, ``(N-1)/N`` of every collective's bytes leaving each rank:

    stage 1, 2     reduce-scatter B + all-gather B            = DP's all-reduce (2 (N-1)/N B)
    stage 3        2 all-gathers + 1 reduce-scatter per unit  = 1.5 x DP, less one
                   gather of the root unit, which stays gathered from forward into backward
    clipping       ||g||^2 = all-reduce of each rank's sum of squares of its shard (one float)

Gradient accumulation: stage 1 accumulates full gradients and reduces once per
step, like DP; stages 2 and 3 reduce-scatter every micro-batch into the shard
(holding full gradients until the step would undo the point of stage 2), so
their traffic grows with ``--grad-accum``, and under a pipeline
(parallel/pipeline/) with its M micro-batches per round, which is why
pipelines usually pair with stage 1.

A unit's reduce-scatter starts as soon as its last gradient arrives, overlapping
the rest of backward, in whatever order units complete (interleaved pipeline
schedules; zero bubble's split of B and W). Every rank of the dp group runs the
same program on same-shaped batches, so collectives start in the same order on all
(a mixture's experts too: one that routing left without rows still gives its zero
gradient, models/moe.py). With expert parallelism, two instances, each over its own
``params`` and group: parallel/zero_experts.py.
Weights tied across pipeline stages (the first and last stages' token
embedding) get units of their own (``own_units``): shard boundaries depend
only on a unit's size and N, so both holders' shards cover the same elements
and their gradients are summed shard by shard (`gradient`).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch
from torch import nn

from scaletrain.optim.clip import clip_grad_norm_
from scaletrain.parallel.data import plan_buckets
from scaletrain.parallel.hybrid import ShardCollectives
from scaletrain.parallel.zero3 import PipelineGathering, StageThreeGathering
from scaletrain.parallel.zero_units import Piece, Unit, code_unit, moved_to, shardable_buffers
from scaletrain.runtime.comm import Comm, Pending
from scaletrain.runtime.mesh import Group

STAGES = (1, 2, 3)
# Reduce-scatters in flight at once (stages 2, 3): each holds a unit's
# unsharded gradient, so this bounds that memory while still overlapping.
MAX_IN_FLIGHT = 2


@dataclass
class FlatShard:
    """One tensor of the model as the group holds it: which elements of its
    row-major flattening each rank owns, and this rank's own (the checkpoint
    turns the spans into rectangular chunks of the tensor)."""

    shape: torch.Size
    spans: list[tuple[int, int, int]]  # (global rank, start, stop) for every rank of the group
    rank: int  # this process's global rank
    local: torch.Tensor  # 1-D: this rank's elements [start, stop)


def layer_modules(model: nn.Module) -> list[nn.Module]:
    """The repeated layers of a model, in forward order: every parameter-holding
    child of an ``nn.ModuleList`` or ``nn.Sequential`` not inside another such
    layer (a decoder's blocks, the mlp's linear layers). Stage 3 makes each a
    unit and the rest of the model the root unit."""
    layers: list[nn.Module] = []
    inside: set[int] = set()
    for container in model.modules():  # outer modules come first
        if id(container) in inside or not isinstance(container, (nn.ModuleList, nn.Sequential)):
            continue
        for child in container.children():
            if any(True for _ in child.parameters()):
                layers.append(child)
                inside.update(id(m) for m in child.modules())
    return layers


class ZeroDataParallel:
    """ZeRO stage 1, 2 or 3 over a data-parallel group (see the module docstring).

    Per optimizer step::

        for each micro-batch but the last:  with zero.no_sync(): loss.backward()
        final micro-batch:                  loss.backward()
        zero.finish_gradient_sync()         (each rank's grad shard is the average)
        zero.copy_grads_to_master()         (the shards to the fp32 masters, where they differ)
        zero.clip_grad_norm_(max_norm)      (the global norm, over all shards)
        optimizer.step()                    (an optimizer over `optimizer_groups(...)`)
        zero.publish()                      (masters -> working weights; stages 1, 2 all-gather)
        zero.zero_grad()

    ``param_dtype`` is the working weights' dtype, ``reduce_dtype`` that of the
    gradient reduction, ``master_device`` where the fp32 masters and the
    optimizer live (the host, for ``--offload optimizer``); ``masters=False``
    (pure bf16): none, the optimizer steps the working shard and its gradient
    shard themselves, in their own dtypes. ``own_units``:
    parameters sharded in a unit of their own (stages 1, 2; module docstring).
    ``replica`` (hybrid sharding: ``group`` is a shard group) and ``quantize_weights``
    (int8 gathers): parallel/hybrid.py. Every rank must start from the same weights.
    ``source`` (stage 3, a model loaded slice by slice: finetune/sliced.py) gives elements
    [lo, hi) of a weight (or a 4-bit base's code buffer) still on the meta device: each rank keeps
    only its shard of it.
    ``layers``: stage 3's units (default: `layer_modules`). ``stages`` (stage 3 inside pipeline
    stages): the blocks of each of this rank's stages, in forward order, its units, the rest of
    the rank's weights held per round (and ``own_units``, tied across stages, each alone), each
    block gathered per micro-batch or per round as ``gather`` says (parallel/zero3.py).
    ``params``: the parameters it shards (default: every trainable one), the rest left to another
    instance over another group; ``average_over``: the count the gradients' sum is divided by (default:
    the ranks it reduces over; expert parallelism's experts: parallel/zero_experts.py).
    ``base_device`` (``--offload base``): where the frozen units' shards live (the host: copied to the
    device for each gather, as ZeRO-Infinity and FSDP offload parameters), default the device.
    """

    def __init__(self, model: nn.Module, comm: Comm, group: Group, *, stage: int,
                 param_dtype: torch.dtype = torch.float32, reduce_dtype: torch.dtype = torch.float32,
                 master_device: torch.device | str | None = None, bucket_mb: float = 25.0,
                 own_units: Sequence[nn.Parameter] = (), replica: Group | None = None,
                 quantize_weights: str = "none", device: torch.device | None = None,
                 source: Callable[[nn.Parameter, int, int], torch.Tensor] | None = None,
                 layers: Sequence[nn.Module] | None = None, stages: Sequence[Sequence[nn.Module]] | None = None,
                 gather: str = "micro-batch", params: Sequence[nn.Parameter] | None = None,
                 average_over: int | None = None, masters: bool = True,
                 base_device: torch.device | str | None = None):
        if stage not in STAGES:
            raise ValueError(f"ZeRO stage must be one of {STAGES}, not {stage}")
        if stage == 3 and own_units and stages is None or stage < 3 and quantize_weights != "none":
            raise ValueError("own_units are for stages 1 and 2 and pipelines (ZeRO-3's follow the layers), "
                             "quantized gathers for 3")
        self.model, self.comm, self.group, self.stage, self.masters = model, comm, group, stage, masters
        self.collectives = ShardCollectives(comm, group, replica, quantize_weights)
        self.average_over = average_over or self.collectives.averaged_over
        self.device = device or next(model.parameters()).device
        self.source = source
        self.master_device = torch.device(master_device) if master_device is not None else self.device
        self._pinned = self.master_device.type == "cpu" and torch.cuda.is_available()
        self.names = {id(p): name for name, p in model.named_parameters()}
        trainable = [p for p in (model.parameters() if params is None else params) if p.requires_grad]
        mine = {id(p) for p in trainable}
        frozen_grouped: list[tuple[nn.Module, list[nn.Parameter]]] = []
        coded: list[tuple[nn.Module, list[torch.Tensor]]] = []
        if stage == 3:  # the root unit first (then a tied weight's alone), then the layers, in forward order
            layers = [block for blocks in stages for block in blocks] if stages is not None else \
                layer_modules(model) if layers is None else layers
            apart = {id(p) for layer in layers for p in layer.parameters()} | {id(p) for p in own_units}
            modules_and_params = [(model, [p for p in trainable if id(p) not in apart]),
                                  *((model, [p]) for p in own_units if p.requires_grad),
                                  *((layer, [p for p in layer.parameters() if id(p) in mine]) for layer in layers)]
            forward = [(module, params) for module, params in modules_and_params if params]
            grouped = forward[::-1]  # gradients complete in backward order; the root's (embeddings) last
            if params is None and stages is None:  # a fine-tune's frozen base: frozen units, cut as the layers'
                frozen = [(module, [p for p in chosen if not p.requires_grad and p.is_floating_point()])
                          for module, chosen in ((model, [p for p in model.parameters() if id(p) not in apart]),
                                                 *((layer, list(layer.parameters())) for layer in layers))]
                frozen_grouped = [(module, params) for module, params in frozen if params][::-1]
                in_layers = {id(m) for layer in layers for m in layer.modules()}
                holders = [(model, shardable_buffers(model, in_layers)),
                           *((layer, shardable_buffers(layer)) for layer in layers)]
                coded = [(module, tensors) for module, tensors in holders if tensors][::-1]
        else:  # gradient buckets, as data parallelism makes them, and the own units
            alone = {id(p) for p in own_units}
            rest = [p for p in trainable[::-1] if id(p) not in alone]
            grouped = [(None, params) for params in [*plan_buckets(rest, int(bucket_mb * 2**20), reduce_dtype),
                                                     *([p] for p in own_units if p.requires_grad)]]
        self.units = [self._build_unit(module, params, param_dtype, reduce_dtype) for module, params in grouped]
        self.frozen_units = [self._build_unit(module, params, param_dtype, reduce_dtype, frozen=True)
                             for module, params in frozen_grouped]
        self.frozen_units += [code_unit(module, tensors, self.group.size, self.group.rank, self.device,
                                        read=lambda t: self.source(t, 0, t.numel()))
                              for module, tensors in coded]
        if base_device is not None:
            for unit in self.frozen_units:
                unit.shard = unit.master = moved_to(torch.device(base_device), unit.shard)
        self._unit_of = {id(p): (unit, i) for unit in self.units for i, p in enumerate(unit.params)}
        for param in trainable:
            param.register_post_accumulate_grad_hook(self._on_gradient)
        self._syncing = True
        self._in_flight: deque[tuple[Unit, Pending, torch.Tensor, torch.Tensor]] = deque()
        # Stage 3: the units' full parameters exist only while they are used (parallel/zero3.py).
        self.gathering = None
        if stage == 3 and stages is not None:
            unit_of = {id(unit.module): unit for unit in self.units}
            per_stage = [[unit_of[id(block)] for block in blocks if id(block) in unit_of] for blocks in stages]
            held = [unit for unit in self.units if unit.module is model]
            self.gathering = PipelineGathering(per_stage, held, self.collectives, gather)
        elif stage == 3:  # a module's frozen unit just before its trained one, in forward order
            position = {id(module): i for i, (module, _) in enumerate(modules_and_params)}
            in_forward = sorted([*self.units, *self.frozen_units], key=lambda u: (position[id(u.module)], not u.frozen))
            self.gathering = StageThreeGathering(model, in_forward[::-1], self.collectives, self._flush)
        if stage == 2:
            model.register_forward_pre_hook(lambda *_: self._flush())

    @torch.no_grad()
    def _build_unit(self, module: nn.Module | None, params: list[nn.Parameter],
                    param_dtype: torch.dtype, reduce_dtype: torch.dtype, frozen: bool = False) -> Unit:
        """A unit of ``params`` (a frozen one: its working shard alone, zero_units.py); under stage 3
        its full values freed once built (one unit's at a time: zero3.py gathers them)."""
        n, rank = self.group.size, self.group.rank
        offsets = [0]
        for p in params:
            offsets.append(offsets[-1] + p.numel())
        shard_numel = math.ceil(offsets.pop() / n)
        start = rank * shard_numel
        flat = torch.zeros(shard_numel * n, dtype=torch.float32, device=self.device)
        for p, offset in zip(params, offsets):
            if p.is_meta:  # read from its file: this rank's range only
                lo, hi = max(offset, start), min(offset + p.numel(), start + shard_numel)
                if hi > lo:
                    flat[lo:hi].copy_(self.source(p, lo - offset, hi - offset))
            else:
                flat[offset:offset + p.numel()].copy_(p.detach().reshape(-1))
        # The fp32 master is taken before any rounding to the working dtype.
        full = flat.to(param_dtype)
        own = flat[start:start + shard_numel]
        shard = full[start:start + shard_numel] if self.stage < 3 else own.to(param_dtype, copy=True)
        # Stepped in place: fp32 working weights, or pure bf16's, which have no other copy.
        here = self.master_device == self.device
        in_place = frozen or here and (param_dtype == torch.float32 or not self.masters)
        master = shard if in_place else self._host_or_device(own)
        grad_full = torch.zeros(full.numel(), dtype=reduce_dtype, device=self.device) if self.stage == 1 else None
        grad = grad_full[start:start + shard_numel] if grad_full is not None else \
            torch.zeros(0 if frozen else shard_numel, dtype=reduce_dtype, device=self.device)
        master_grad = grad if frozen or here and (reduce_dtype == torch.float32 or not self.masters) else \
            self._host_or_device(torch.zeros(shard_numel))
        unit = Unit(params, offsets, shard_numel, full, shard, master, grad, master_grad, grad_full, module,
                    frozen=frozen)
        for i, param in enumerate(params):
            if param.is_meta:  # a tensor of another kind swapped in first (its shape, no storage of its own)
                placeholder = full.new_empty(()).expand(param.shape)
                torch.utils.swap_tensors(param, nn.Parameter(placeholder, requires_grad=param.requires_grad))
            param.data = unit.slot(full, i)  # the same Parameter objects, now views of the unit
            lo, hi = (offsets[i] + end - start for end in unit.span(i, rank))  # within the shard
            if hi > lo and not frozen:
                piece = nn.Parameter(master[lo:hi])
                piece.grad = master_grad[lo:hi]
                unit.pieces.append(Piece(param, self.names[id(param)], piece))
        if self.stage == 3:
            full.untyped_storage().resize_(0)
        return unit

    def _host_or_device(self, values: torch.Tensor) -> torch.Tensor:
        """An fp32 copy of ``values`` on the master device (pinned when that is the host of a GPU)."""
        out = torch.empty(values.shape, dtype=torch.float32, device=self.master_device, pin_memory=self._pinned)
        return out.copy_(values)

    # -- what the optimizer and the checkpoint see ---------------------------
    def optimizer_groups(self, param_groups: list[dict]) -> list[dict]:
        """The same optimizer groups (by model parameter) holding this rank's pieces instead."""
        pieces: dict[int, list[nn.Parameter]] = {}
        for unit in self.units:
            for piece in unit.pieces:
                pieces.setdefault(id(piece.param), []).append(piece.tensor)
        return [{**group, "params": [t for p in group["params"] for t in pieces.get(id(p), [])]}
                for group in param_groups]

    def flat_shards(self, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
        """This rank's part of the model (the fp32 masters, by ``state_dict`` key)
        and of the optimizer state (by parameter name), for the checkpoint."""
        shards: dict[int, tuple[FlatShard, Piece | None]] = {}
        for unit in [*self.units, *self.frozen_units]:
            pieces = {id(piece.param): piece for piece in unit.pieces}
            for i, param in enumerate(unit.params):
                piece = pieces.get(id(param))
                spans = [(global_rank, *unit.span(i, q)) for q, global_rank in enumerate(self.group.ranks)]
                # a frozen weight's elements: its working shard's (it has no master)
                local = piece.tensor.detach() if piece else unit.in_shard(unit.shard, i, self.group.rank) \
                    if unit.frozen else unit.master[:0]
                shards[id(param)] = (FlatShard(param.shape, spans, self.group.ranks[self.group.rank], local), piece)
        model = {key: shards[id(t)][0] if id(t) in shards else t.detach()
                 for key, t in self.model.state_dict(keep_vars=True).items()}
        optim = {}
        whole = getattr(optimizer, "whole_state", ())  # kept whole on each rank (parallel/zero_adafactor.py)
        for shard, piece in shards.values():
            if piece is not None and piece.tensor in optimizer.state:
                optim[piece.name] = {key: replace(shard, local=value) if torch.is_tensor(value) and
                                     value.shape == piece.tensor.shape and key not in whole else value
                                     for key, value in optimizer.state[piece.tensor].items()}
        return model, optim

    def memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The tensors this rank keeps, by ledger entry (the optimizer's state aside)."""
        sharded = {id(p) for unit in self.frozen_units for p in unit.params}
        return {
            # and, whole on every rank, what does not train and no frozen unit holds (a 4-bit base's codes
            # outside ZeRO-3)
            "params": [*(t for unit in [*self.units, *self.frozen_units] for t in (unit.full, unit.shard)),
                       *(p for p in self.model.parameters() if not p.requires_grad and id(p) not in sharded),
                       *(b for b in self.model.buffers() if id(b) not in sharded)],
            "grads": [t for unit in self.units for t in (unit.grad, unit.master_grad, unit.grad_full)
                      if t is not None],
            "optimizer": [unit.master for unit in self.units if unit.master is not unit.shard],
        }

    # -- the per-step protocol -------------------------------------------------
    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Stage 1: accumulate full gradients without communicating (every micro-batch
        but the last). Stages 2 and 3 reduce-scatter every micro-batch regardless."""
        self._syncing = self.stage > 1
        try:
            yield
        finally:
            self._syncing = True

    def finish_gradient_sync(self) -> None:
        """Launch what has not launched (parameters without a gradient contribute
        zeros) and wait for every reduction."""
        self._flush(final=True)
        while self._in_flight:
            self._complete_oldest()
        for unit in self.units:
            unit.reduced = unit.launched = False

    def gradient(self, param: nn.Parameter) -> torch.Tensor:
        """This rank's shard of ``param``'s reduced gradient after `finish_gradient_sync`
        (its elements of the flattened gradient; empty where the rank holds none)."""
        unit, i = self._unit_of[id(param)]
        return unit.in_shard(unit.grad, i, self.group.rank)

    def copy_grads_to_master(self) -> None:
        """The reduced shards into the fp32 masters' gradients, where those are apart
        (bf16 gradients, or masters in host memory)."""
        synced = False
        for unit in self.units:
            if unit.master_grad is not unit.grad:
                unit.master_grad.copy_(unit.grad, non_blocking=self._pinned)
                synced = synced or unit.grad.is_cuda
        if synced:  # asynchronous device->host copies must land before the host optimizer reads them
            torch.cuda.synchronize(self.device)

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale the gradient shards so that the global gradient norm is at most
        ``max_norm`` (torch's clip_grad_norm_ rule); returns the norm before clipping.
        Padding elements hold zeros, so each shard's sum of squares is exact."""
        grads = [unit.master_grad for unit in self.units]
        return clip_grad_norm_(grads, max_norm, counted=grads, comm=self.comm, groups=[self.group],
                               device=self.device)

    @torch.no_grad()
    def publish(self) -> None:
        """After the optimizer step: round the masters into the working shards;
        stages 1 and 2 then all-gather every unit's full parameters in place."""
        for unit in self.units:
            if unit.master is not unit.shard:
                unit.shard.copy_(unit.master, non_blocking=self._pinned)
        if self.stage < 3:
            # every rank's updated shard (S elements per unit) into each unit's full weights for the next forward
            gathers = [self.collectives.all_gather(unit.full, unit.shard) for unit in self.units]
            for pending in gathers:
                pending.wait()

    def zero_grad(self) -> None:
        """Forget the model's gradients (stage 1 overwrites its buffers on the next
        step's first gradient, as data parallelism does; the shards are overwritten
        by the next step's first reduce-scatter)."""
        for unit in self.units:
            unit.filled.clear()
            for param in unit.params:
                param.grad = None

    # -- inside backward: gradients to shards ---------------------------------
    @torch.no_grad()
    def _on_gradient(self, param: nn.Parameter) -> None:
        if param.grad is None:  # a backward that holds this weight's gradient back (zero bubble's B)
            return
        unit, i = self._unit_of[id(param)]
        if self.stage == 1:  # accumulate into the persistent full buffer, as data parallelism does
            view = unit.slot(unit.grad_full, i)
            if param.grad.data_ptr() != view.data_ptr():
                view.add_(param.grad) if i in unit.filled else view.copy_(param.grad)
                param.grad = view if view.dtype == param.dtype else None
            unit.filled.add(i)
            if not self._syncing:
                return
            if unit.launched:
                raise RuntimeError("a parameter's gradient arrived twice in one step, after its unit was "
                                   "reduced; run the extra backward inside no_sync()")
        else:  # this micro-batch's gradient into the staging buffer, then freed
            if unit.staging is None:
                unit.staging = self._new_staging(unit)
            view = unit.slot(unit.staging, i)
            view.add_(param.grad) if i in unit.arrived else view.copy_(param.grad)
            param.grad = None
        unit.arrived.add(i)
        if len(unit.arrived) == len(unit.params):
            self._launch(unit)

    def _new_staging(self, unit: Unit) -> torch.Tensor:
        staging = torch.empty(unit.full.numel(), dtype=unit.grad.dtype, device=self.device)
        staging[unit.offsets[-1] + unit.params[-1].numel():].zero_()  # the padding
        return staging

    def _launch(self, unit: Unit) -> None:
        """Start reduce-scattering this rank's share (1/N) of the unit's gradients."""
        unit.launched = True
        source = unit.grad_full if self.stage == 1 else unit.staging
        if source is None:  # stages 2, 3: no gradient at all this micro-batch
            source = self._new_staging(unit)
        contributed = unit.filled if self.stage == 1 else unit.arrived
        for i in range(len(unit.params)):
            if i not in contributed:
                unit.slot(source, i).zero_()
        unit.arrived.clear()
        unit.staging = None
        source.mul_(1.0 / self.average_over)
        # Stage 1 reduces in place into the rank's own slice; a step's first
        # reduction writes the shard, later micro-batches' are added to it.
        out = unit.grad if self.stage == 1 or not unit.reduced else torch.empty_like(unit.grad)
        unit.reduced = True
        # the unit's full gradient, pre-scaled, in; out come this rank's S averaged elements, the ones it steps
        pending = self.collectives.reduce_scatter(out, source)
        self._in_flight.append((unit, pending, out, source))
        if self.gathering:
            self.gathering.after_gradients(unit)  # its gradients are all in: backward needs it no more
        while self.stage > 1 and len(self._in_flight) > MAX_IN_FLIGHT:
            self._complete_oldest()

    def _complete_oldest(self) -> None:
        unit, pending, out, _ = self._in_flight.popleft()  # dropping `source` frees the staging
        pending.wait()
        if out is not unit.grad:
            unit.grad.add_(out)

    def _flush(self, final: bool = False) -> None:
        """Launch the units a backward left incomplete (parameters without a
        gradient): before the next micro-batch's forward (stages 2, 3), and at
        the end of the step, where every unit not yet reduced in the step
        launches too (with zeros, if nothing arrived), so no shard keeps the
        last step's gradient."""
        for unit in self.units:
            if self.stage == 1:
                pending = final and not unit.launched
            else:
                pending = bool(unit.arrived) or (final and not unit.reduced)
            if pending:
                self._launch(unit)
