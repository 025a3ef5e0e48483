"""Bytes per rank, predicted in the memory ledger's categories (train/memory.py).

``params``, ``grads``, ``optimizer`` follow from the weights the rank holds
(planner/inventory.py, ``P`` elements) and how the layout keeps them. With ``w``
the working weights' bytes (2 for ``--param-dtype bf16``, else 4), ``r`` the
gradient buckets' (``--reduce-dtype``), AdamW:

    no ZeRO     params w*P   grads r*P (the data-parallel buckets, which the gradients are views of)
                optimizer 8*P, plus the fp32 masters 4*P where the weights are bf16 or offloaded
                (the masters' gradients share the buckets when those are fp32 on the same device)
    ZeRO-1      params w*N*S per unit (S = ceil(unit / N): the padded buffer the shard is a view of)
                grads  r*N*S          optimizer (8 + masters 4)*S
    ZeRO-2      grads r*S             the rest as ZeRO-1
    ZeRO-3      params w*S            the rest as ZeRO-2

with the units cut as parallel/zero.py cuts them (gradient buckets of
``--bucket-mb``, the tied embedding alone under a pipeline; ZeRO-3: the
blocks and a root unit of the rest, a tied weight alone) and ``N`` the ranks
sharing the dense weights (dp x ep x cp), or with ``--shard-group`` the ranks
of a shard group. With expert parallelism there are two ZeROs, each counted
so with its own units and ``N`` and the two summed (parallel/zero_experts.py):
the dense weights over dp x ep x cp as above, and this rank's experts over
dp x cp, the ranks holding the same experts, in buckets of their own (no
tied weight) or under ZeRO-3 one unit per MoE layer (no root). Every
tensor the optimizer steps adds a 4-byte step counter. Adafactor keeps row
and column sums of each matrix (and full statistics of vectors) instead of
8 bytes per element; under ZeRO a rank holding a piece of a matrix keeps the
whole matrix's sums. This is the
familiar 2 + 4 + 12 = 18 bytes per parameter of mixed-precision AdamW
(``--param-dtype bf16``, fp32 buckets) and 4 + 4 + 8 = 16 in fp32. Pure bf16
(``--masters none``, ``--precision bf16-true``) has no master, and AdamW's moments and SGD's momentum
take the weights' 2 bytes: 2 + 2 + 4 = 8; under ZeRO its optimizer holds 4*S and no master, its
gradient shard the bf16 one the reduce-scatter wrote. SGD keeps one momentum buffer (or
none), 8-bit AdamW 2 bytes and two fp32 scales per block of 2048, the
codes of a partial last block padded (fp32 moments for tensors under 4096
elements and the embedding tables, whatever the weights' dtype). A LoRA
fine-tune's frozen base (and a 4-bit base's codes and scales, which are
buffers) counts under ``params`` whole on every rank, its adapters as above; under ZeRO-3 (no
pipeline, no expert parallelism) the frozen base is a ZeRO part of its own, cut as the layers are
(parallel/zero.py's frozen units): ``params`` w*S per unit, no gradient, no optimizer state, its
units gathered as the trained ones (the root's held from forward into backward); a 4-bit base's
codes and scales likewise, a part of units of bytes (S of each module's aligned bytes).

``--offload optimizer`` keeps the masters, their gradients and the
optimizer state in host memory: ``host``, not part of what the device must fit;
``--offload base`` keeps the frozen base's ZeRO-3 shards there (a unit is copied to
the device to be gathered, so only the gathered units count on it).

A rank with no data-parallel copy (and no compression) and gradients in the
weights' dtype reduces nothing, so it has no bucket: with masters its
``grads`` are the masters' alone, and autograd's own gradients, alive from
backward until the step copies them into the masters', count under ``other``.

``activations`` is the saved-activation peak of planner/activations.py.

``other`` is what the ledger does not count but the device must hold, all
upper bounds: communication buffers, each ZeRO's own (ZeRO-3's gathered
units: the root unit and the two largest layer units, the one computing and
the one prefetched, or of the experts the last MoE layer's, which stays
gathered from forward into backward, and two more; ZeRO-2 and 3's unsharded
gradients of the two units whose reduce-scatter is in flight; inside
pipeline stages the held units are the root's and a tied weight's, none of
the experts', and with ``--zero3-gather round`` every layer is gathered for
the round), and the loss's temporaries on the last stage (fp32 logits and
their gradient, ``8*b*s*V/t``; chunked, one chunk's logits, the hidden
states' gradient and the head's fp32 gradient: kernels/head_loss.py).
``allowance`` is 10% of all the rest, for the caching allocator's
fragmentation (memory reserved between blocks); the
CUDA context itself (about 0.5 GB) is outside ``torch.cuda.max_memory_allocated``
and outside the figures here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from scaletrain.config import Config
from scaletrain.optim.adamw8bit import BLOCK, MIN_8BIT
from scaletrain.parallel.data import plan_buckets
from scaletrain.parallel.zero_units import code_shard_bytes, shardable_buffers
from scaletrain.planner.inventory import RankWeights
from scaletrain.techniques.precision import compute_dtype

ALLOWANCE = 0.10
STEP_COUNTER = 4  # bytes: AdamW's and Adafactor's per-tensor step, an fp32 scalar
ZERO3_GATHERED_LAYERS = 2  # the layer unit computing and the one prefetched (parallel/zero.py)
IN_FLIGHT_UNITS = 2  # parallel/zero.py MAX_IN_FLIGHT


def dtype_bytes(dtype_name: str) -> int:
    return compute_dtype(dtype_name).itemsize


def optimizer_bytes(params: list[nn.Parameter] | list[int], optimizer: str, momentum: float = 0.0,
                    fp32_state: frozenset[int] = frozenset(), state_bytes: int = 4) -> int:
    """State of the optimizer for tensors of these shapes (or flat sizes), step counters included
    (SGD keeps none: one momentum buffer per weight, or with momentum 0 nothing; 8-bit AdamW
    keeps fp32 moments for the parameters whose ids are in ``fp32_state``, the embeddings).
    ``state_bytes``: AdamW's moments' and SGD's momentum's element, the weight's (pure bf16: 2)."""
    total = 0
    for p in params:
        shape = tuple(p.shape) if isinstance(p, nn.Parameter) else (p,)
        numel = math.prod(shape)
        if optimizer == "sgd":
            total += state_bytes * numel if momentum else 0
            continue
        if optimizer == "adamw8bit" and numel >= MIN_8BIT and id(p) not in fp32_state:
            blocks = -(-numel // BLOCK)  # each moment's codes keep their storage padded to whole blocks
            total += 2 * BLOCK * blocks + 8 * blocks  # and two fp32 scales a block
        elif optimizer == "adafactor" and len(shape) >= 2:
            total += 4 * (numel // shape[-1] + numel // shape[-2])
        elif optimizer == "adafactor":
            total += 4 * numel
        else:  # AdamW's moments; 8-bit AdamW's unquantized ones are fp32 whatever the weight
            total += 2 * (4 if optimizer == "adamw8bit" else state_bytes) * numel
        total += STEP_COUNTER
    return total


@dataclass(frozen=True, eq=False)
class ZeroPart:
    """One ZeRO instance of a rank (parallel/zero.py): the dense weights, or with expert parallelism
    this rank's experts (parallel/zero_experts.py), each sharded over its own group. ``units`` as the
    trainer cuts them; under stage 3 the first ``held`` of them stay gathered for long (without a
    pipeline from forward into backward, inside pipeline stages for the round), the rest are layers
    gathered around each use."""

    experts: bool
    units: list[list[nn.Parameter]]
    held: int = 0
    frozen: bool = False  # a fine-tune's frozen base under ZeRO-3: gathered, never reduced nor stepped
    in_bytes: bool = False  # a 4-bit base's codes under ZeRO-3: units of bytes (parallel/zero_units.py)

    def padded(self, n: int) -> list[int]:
        """Each unit's flat buffer over ``n`` ranks: its elements (a unit of codes: its aligned bytes)
        rounded up to a multiple of ``n``."""
        if self.in_bytes:
            return [n * code_shard_bytes(unit, n) for unit in self.units]
        return [n * math.ceil(sum(q.numel() for q in unit) / n) for unit in self.units]

    def element_bytes(self, w: int) -> int:
        """Bytes per element of its flat buffers: the working weights' ``w``, or one for codes."""
        return 1 if self.in_bytes else w


def zero_parts(weights: RankWeights, stage: int, bucket_mb: float, reduce_dtype: str) -> tuple[ZeroPart, ...]:
    """The rank's ZeRO instances: the dense part, and where it holds experts under expert parallelism
    the experts' part (kept on ``weights``: the memory and the traffic of every layout of a split read
    them, and they go when the weights do, a library user's module among them)."""
    key = (stage, bucket_mb, reduce_dtype)
    if key not in weights.zero_cuts:
        dense = [p for p in weights.params if id(p) not in weights.experts]
        experts = [p for p in weights.params if id(p) in weights.experts]
        parts = [_dense_part(weights, dense, stage, bucket_mb, reduce_dtype)]
        if experts:
            parts.append(_experts_part(weights, experts, stage, bucket_mb, reduce_dtype))
        if stage == 3 and not weights.experts and weights.n_stages == 1:
            parts += _frozen_parts(weights, parts[0])
        weights.zero_cuts[key] = tuple(parts)
    return weights.zero_cuts[key]


def _buckets(params: list[nn.Parameter], bucket_mb: float, reduce_dtype: str) -> list[list[nn.Parameter]]:
    """Stages 1 and 2: gradient buckets over ``params`` in reverse, as data parallelism cuts them."""
    return plan_buckets(params[::-1], int(bucket_mb * 2**20), compute_dtype(reduce_dtype))


def _layer_units(weights: RankWeights, mine: list[nn.Parameter]) -> list[list[nn.Parameter]]:
    """Stage 3: one unit per layer holding any of ``mine``, in forward order."""
    ids = {id(p) for p in mine}
    return [unit for layer in weights.layers if (unit := [p for p in layer.parameters() if id(p) in ids])]


def _dense_part(weights: RankWeights, params: list[nn.Parameter], stage: int, bucket_mb: float,
                reduce_dtype: str) -> ZeroPart:
    """Buckets and each tied weight alone; or under stage 3 the root unit of the weights outside the
    layers and each tied weight alone (held), then the layers."""
    tied = {id(p) for p in weights.tied}
    if stage < 3:
        rest = [p for p in params if id(p) not in tied]
        return ZeroPart(False, [*_buckets(rest, bucket_mb, reduce_dtype), *([p] for p in weights.tied)])
    apart = {id(p) for layer in weights.layers for p in layer.parameters()} | tied
    held = [unit for unit in ([p for p in params if id(p) not in apart], *([p] for p in weights.tied)) if unit]
    return ZeroPart(False, [*held, *_layer_units(weights, params)], held=len(held))


def _frozen_parts(weights: RankWeights, dense: ZeroPart) -> list[ZeroPart]:
    """Stage 3's frozen units (a fine-tune's base) and units of codes (a 4-bit base's), each cut by module:
    the root's (held), then each layer's. With no root unit at all, the last layer's units are the ones
    held from forward into backward (parallel/zero3.py)."""
    def frozen(module: nn.Module) -> list[torch.Tensor]:
        return [p for p in module.parameters() if not p.requires_grad and p.is_floating_point()]

    in_layers = {id(t) for layer in weights.layers for t in (*layer.parameters(), *layer.buffers())}
    picks = [(pick, [t for t in pick(weights.model) if id(t) not in in_layers]) for pick in (frozen, shardable_buffers)]
    root = bool(dense.held) or any(tensors for _, tensors in picks)
    parts = []
    for in_bytes, (pick, root_tensors) in enumerate(picks):
        layers = [unit for layer in weights.layers if (unit := pick(layer))]
        if root_tensors:
            parts.append(ZeroPart(False, [root_tensors, *layers], held=1, frozen=True, in_bytes=bool(in_bytes)))
        elif layers:
            last_held = not root and bool(pick(weights.layers[-1]))
            parts.append(ZeroPart(False, [layers[-1], *layers[:-1]] if last_held else layers, held=int(last_held),
                                  frozen=True, in_bytes=bool(in_bytes)))
    return parts


def _experts_part(weights: RankWeights, params: list[nn.Parameter], stage: int, bucket_mb: float,
                  reduce_dtype: str) -> ZeroPart:
    """Buckets; or under stage 3 one unit per MoE layer, no root. Without a pipeline the last of them
    is held from forward into backward (its forward ends last: parallel/zero3.py), listed first;
    inside pipeline stages none is held for the round."""
    if stage < 3:
        return ZeroPart(True, _buckets(params, bucket_mb, reduce_dtype))
    layers = _layer_units(weights, params)
    if weights.n_stages > 1:
        return ZeroPart(True, layers)
    return ZeroPart(True, [layers[-1], *layers[:-1]], held=1)


def _pieces_on_rank(unit: list[nn.Parameter], shard: int, rank: int) -> list[tuple[int, nn.Parameter]]:
    """The parts of ``unit``'s parameters inside ``rank``'s shard (the tensors it steps): their sizes and parameters."""
    pieces, offset = [], 0
    lo, hi = rank * shard, (rank + 1) * shard
    for p in unit:
        size = min(offset + p.numel(), hi) - max(offset, lo)
        if size > 0:
            pieces.append((size, p))
        offset += p.numel()
    return pieces


def _shard_state(cfg: Config, weights: RankWeights, units: list[list[nn.Parameter]], shards: list[int],
                 rank: int, state_bytes: int) -> int:
    """The optimizer state of ``rank``'s shards; 8-bit AdamW keeps the tables' moments in fp32 (AdamW's state,
    whatever the weights' dtype). ``state_bytes``: AdamW's moments' element (`optimizer_bytes`)."""
    t, tables, eight_bit = cfg.train, weights.tables, cfg.train.optimizer == "adamw8bit"
    pieces = [piece for unit, shard in zip(units, shards) for piece in _pieces_on_rank(unit, shard, rank)]
    if t.optimizer == "adafactor":  # a piece of a matrix keeps the whole matrix's factors (parallel/zero_adafactor.py)
        return optimizer_bytes([p if p.dim() >= 2 else size for size, p in pieces], t.optimizer)
    return (optimizer_bytes([size for size, p in pieces if id(p) not in tables], t.optimizer, t.momentum,
                            state_bytes=state_bytes)
            + optimizer_bytes([size for size, p in pieces if id(p) in tables], "adamw" if eight_bit else t.optimizer,
                              t.momentum, state_bytes=4 if eight_bit else state_bytes))


def weight_memory(cfg: Config, weights: RankWeights, shards: tuple[int, int], host_is_device: bool) -> dict[str, int]:
    """params, grads, optimizer, host and communication buffers of one rank, in bytes (module docstring);
    ``shards``: how many ranks ZeRO shards the dense weights over, and the experts."""
    t, p = cfg.train, cfg.parallel
    w, r = dtype_bytes(t.param_dtype), dtype_bytes(p.reduce_dtype)
    offload = t.offload == "optimizer"
    masters = (w != 4 and t.masters == "fp32") or offload  # pure bf16 (--masters none) steps the weights
    # The masters' gradients are their own tensors unless the buckets are fp32 on the same device.
    master_grads = masters and (r != 4 or (offload and not host_is_device))
    if p.zero:
        cut = zero_parts(weights, p.zero, p.bucket_mb, p.reduce_dtype)
        # what each part moves to the host: the optimizer's state, or a frozen base's shards (--offload base)
        parts = [_zero_memory(cfg, weights, part, shards[part.experts], w, r, masters, master_grads,
                              (t.offload == "base" if part.frozen else offload) and not host_is_device)
                 for part in cut]
        held = {key: sum(part[key] for part in parts) for key in parts[0]}
        # the frozen base's weights (and a 4-bit base's codes) are parts of their own when ZeRO-3 shards them:
        # then only the rest of the buffers
        codes = sum(code.numel() * code.element_size() for part in cut if part.in_bytes
                    for unit in part.units for code in unit)
        held["params"] += weights.untrained_bytes(0 if any(part.frozen for part in cut) else w) - codes
        return held
    n = weights.numel
    state = (optimizer_bytes(weights.params, t.optimizer, t.momentum, weights.tables, 4 if masters else w)
             + (4 * n if masters else 0))
    extra_grads = 4 * n if master_grads else 0
    host = state + extra_grads if offload and not host_is_device else 0
    grads, transient = r * n + extra_grads, 0
    if master_grads and shards[0] == 1 and p.compress == "none" and p.reduce_dtype == t.param_dtype:
        # Nothing to reduce, so no bucket (parallel/data.py): autograd's gradients, copied into the
        # masters' at the step and freed there, are the device's only until then.
        grads, transient = extra_grads, r * n
    return {"params": w * n + weights.untrained_bytes(w), "grads": grads, "optimizer": state, "host": host,
            "buffers": transient}


def _zero_memory(cfg: Config, weights: RankWeights, part: ZeroPart, n: int, w: int, r: int, masters: bool,
                 master_grads: bool, offloaded: bool) -> dict[str, int]:
    """One ZeRO part's bytes on a rank (`weight_memory`'s categories), its units sharded over ``n`` ranks."""
    stage = cfg.parallel.zero
    padded = part.padded(n)
    shards = [size // n for size in padded]
    shard_total = sum(shards)
    if part.frozen:  # the held units and the two largest layers gathered at once, as the trained ones
        gathered = sum(padded[:part.held]) + sum(sorted(padded[part.held:])[-ZERO3_GATHERED_LAYERS:])
        size = part.element_bytes(w)
        return {"params": size * shard_total, "grads": 0, "optimizer": 0, "host": size * shard_total if offloaded else 0,
                "buffers": size * gathered}
    # The ranks' states differ where 8-bit AdamW keeps some pieces in fp32 (the tables', and the
    # small ones): the fullest rank's is the prediction. Otherwise every rank's is rank 0's.
    ranks = range(n) if cfg.train.optimizer == "adamw8bit" else [0]
    state = max(_shard_state(cfg, weights, part.units, shards, rank, 4 if masters else w) for rank in ranks)
    state += 4 * shard_total if masters else 0
    extra_grads = 4 * shard_total if master_grads else 0
    buffers = 0
    if stage >= 2:
        buffers += IN_FLIGHT_UNITS * r * max(padded)
    if stage == 3:
        held, layers = padded[:part.held], padded[part.held:]
        # gathered at once: the held units, and the layer computing and the one prefetched, or
        # inside pipeline stages gathered per round, every layer (parallel/zero3.py)
        per_round = cfg.parallel.pp > 1 and cfg.parallel.zero3_gather == "round"
        buffers += w * (sum(held) + sum(layers if per_round else sorted(layers)[-ZERO3_GATHERED_LAYERS:]))
    return {"params": w * (shard_total if stage == 3 else sum(padded)),
            "grads": r * (sum(padded) if stage == 1 else shard_total) + extra_grads,
            "optimizer": state, "host": state + extra_grads if offloaded else 0, "buffers": buffers}
