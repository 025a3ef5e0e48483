"""The collectives of one optimizer step on one rank, in the ledger's own terms.

Every figure is the ``bytes`` (and ``calls``) the communication ledger
(runtime/comm.py) records for the operation, and ``wire_bytes`` follow by the
same rule; a group of one records nothing. ``b`` sequences of ``s`` (the
rank's) positions per micro-batch, width ``h``, ``e`` bytes per autocast
activation (4 in fp32), ``w`` per weight, ``r`` per gradient bucket, ``K``
micro-batches per step (``--grad-accum`` x pipeline micro-batches):

data parallel   one all-reduce per gradient bucket per step, ``r`` x the bucket
                (after the last micro-batch only); with experts a second set over
                the experts' group. ZeRO-1: a reduce-scatter per unit per step and
                an all-gather per unit after the step (``w`` x the padded unit);
                ZeRO-2: the reduce-scatters every micro-batch; ZeRO-3, every
                micro-batch: the root unit gathered once, every layer unit twice
                (forward and backward), every unit reduce-scattered; inside
                pipeline stages the root and tied units once per round, the
                layers once per round (``--zero3-gather round``) or twice per
                micro-batch. A fine-tune's frozen base under ZeRO-3 (no pipeline,
                no experts): its frozen units gathered as the trained ones are,
                the root's once and each layer's twice, never reduce-scattered
                (parallel/zero.py); a 4-bit base's codes likewise, byte for byte
                (never quantized again by ``--quantize-weights``). The loss: a
                4-byte average over the same group. With ``--shard-group N`` all of
                ZeRO's collectives run in the shard group (units padded to N), and
                each reduce-scatter is followed by an all-reduce of the rank's shard
                (``r`` x unit / N) over the replica group (parallel/hybrid.py); with
                ``--quantize-weights int8`` or ``fp8`` ZeRO-3's gathers move N x
                ``quantized_shard_bytes(unit / N)``. With expert parallelism two
                ZeROs, each with these collectives over its own group and units
                padded to its own size (parallel/zero_experts.py): the dense
                weights' over dp x ep x cp, this rank's experts' over dp x cp,
                in buckets of their own, or under ZeRO-3 a unit per MoE layer
                and no root, the last of them held from forward into backward
                (gathered once per micro-batch, the others twice); inside
                pipeline stages the experts' layers as the dense ones, none held.
                Adafactor under ZeRO: two all-reduces per step over each ZeRO's group,
                4 (rows + columns) bytes a matrix, then 4 bytes a tensor
                (parallel/zero_adafactor.py).
tensor parallel per micro-batch and block, two regions (parallel/tensor.py): the
                attention, and the MLP unless a mixture of experts replaces it.
                Forward all-reduces of each region's output (``e*b*s*h``), backward
                all-reduces of its input's gradient (``4*b*s*h``, the fp32 norm
                output): a region crosses the group once each way whatever it
                holds, so grouped-query attention's narrower k and v change no
                size, nor do a SwiGLU's two input matrices. Outside the blocks: the
                embedding's output (``w``), the head's input gradient, the loss's
                max and sums (``4*b*s`` and ``8*b*s``). With sp each all-reduce
                becomes a reduce-scatter and an all-gather of the same full size,
                every column layer gathers its input again in backward
                (``e*b*s*h`` each: a fused qkv once, separate q, k and v three
                times, a SwiGLU's gate and up twice), and the gradients of the
                weights every rank holds whole are all-reduced every micro-batch.
                A LoRA fine-tune (finetune/lora.py): of its frozen columns only the
                adapted ones gather again, and the gradients of the adapters'
                factors tp leaves whole are all-reduced every micro-batch, sp or not;
                a frozen embedding's output needs no gradient, so the first region's
                backward collective (and sp's gather of the embedding's gradient)
                never runs, nor does a frozen head gather its input again.
                Recomputing a block runs its forward again up to its last saved
                tensor (PyTorch stops a recomputation there): the attention's
                collectives and the MLP's entry again, not the MLP's output's.
pipeline        per micro-batch and stage boundary: the activation forward and its
                gradient backward, ``4*b*s*h`` (/t with sp), a send on one side and a
                receive on the other; the tied embedding's gradient exchanged once per
                step between the first and last stage; the loss broadcast from the
                last stage (4 bytes).
context         per micro-batch and block, ring attention (parallel/context.py): cp-1
                sends of each K/V pair forward (``2*e*b*s*a*d/t``: k and v reach
                the ring repeated to the a query heads), cp-1 in backward
                plus cp of the fp32 dK/dV pair; as many receives.
experts         per micro-batch and expert layer (the blocks ``ModelShape.moe_in_block``
                names, with its E experts and top-k k): an all-gather of the routing counts
                (``ep*E*8``), and four all-to-alls (dispatch, combine, and their
                backward) of the routed rows. How many rows a rank sends depends on
                the router; the planner gives the mean over the ep ranks,
                ``e*b*s*k*h`` each, which their ledgers' average equals. The routing
                statistics of every MoE layer of the model are summed once per step
                over pp (each stage fills its layers' rows) and the batch group.
gradient norm   4 bytes over each of tp, pp and ep that is larger than one, under ZeRO
                its shard group in place of ep (train/layout.py ``norm_groups``: the
                dense shards span the ep ranks, whose experts differ); the
                non-finite flag over the world (train/nonfinite.py).

Evaluation, sampling and checkpoints are not part of a step and not counted.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

from scaletrain.config import Config
from scaletrain.parallel.data import plan_buckets
from scaletrain.parallel.hybrid import quantized_shard_bytes
from scaletrain.planner.activations import Shape
from scaletrain.planner.inventory import RankWeights
from scaletrain.planner.memory import ZeroPart, dtype_bytes, zero_parts
from scaletrain.runtime.comm import FIELDS, wire_bytes_of
from scaletrain.runtime.mesh import group_name, hybrid_group_name
from scaletrain.techniques.precision import compute_dtype


class Traffic:
    """Collectives added up the way the ledger adds them: {op: {group: {calls, bytes, wire_bytes}}}."""

    def __init__(self, sizes: dict[str, int]):
        self.sizes = sizes  # group name -> ranks
        self.entries: dict[str, dict[str, dict[str, int]]] = {}

    def add(self, op: str, group: str, nbytes: int, calls: int = 1, wire_bytes: int | None = None) -> None:
        size = self.sizes[group]
        if size == 1 or calls == 0:
            return
        entry = self.entries.setdefault(op, {}).setdefault(group, dict.fromkeys(FIELDS, 0))
        entry["calls"] += calls
        entry["bytes"] += calls * nbytes
        entry["wire_bytes"] += calls * (wire_bytes_of(op, size, nbytes) if wire_bytes is None else wire_bytes)


@dataclass(frozen=True)
class Groups:
    """Every group the trainer talks over: ``sizes`` by ledger name, the names of
    the three replica groups of train/replicas.py (dims of size one left out but dp),
    and of the groups ZeRO shards the dense weights over and replicates them across
    (`hybrid.zero_groups`); with expert parallelism ZeRO shards the experts over
    ``experts`` (parallel/zero_experts.py)."""

    sizes: dict[str, int]
    batch: str
    dense: str
    experts: str
    zero_shard: str
    zero_replica: str | None

    @classmethod
    def of(cls, cfg: Config, world: int) -> Groups:
        p = cfg.parallel
        dims = {"dp": world // (p.tp * p.pp * p.cp * p.ep), "tp": p.tp, "pp": p.pp, "cp": p.cp, "ep": p.ep}
        sizes = {**dims, "world": world}
        names = []
        for along in (("dp", "ep"), ("dp", "ep", "cp"), ("dp", "cp")):
            kept = tuple(d for d in along if d == "dp" or dims[d] > 1)
            names.append(group_name(kept))
            sizes[names[-1]] = math.prod(dims[d] for d in kept)
        if not (p.zero and p.shard_group):
            return cls(sizes, *names, zero_shard=names[1], zero_replica=None)
        mesh = p.mesh_dims(world)
        shard, replica = (hybrid_group_name(mesh, kind) for kind in ("shard", "replica"))
        sizes[shard], sizes[replica] = p.shard_group, sizes[names[1]] // p.shard_group
        return cls(sizes, *names, zero_shard=shard, zero_replica=replica)


def step_traffic(cfg: Config, world: int, weights: RankWeights, x: Shape, stages: list[int],
                 n_stages: int) -> dict:
    """One optimizer step's collectives on the rank holding ``weights`` (module docstring)."""
    p, t = cfg.parallel, cfg.train
    groups = Groups.of(cfg, world)
    traffic = Traffic(groups.sizes)
    dense, batch, experts_group = groups.dense, groups.batch, groups.experts
    micro, _ = p.pipeline_sizes()
    k = t.grad_accum * (micro if p.pp > 1 else 1)
    w, r = dtype_bytes(t.param_dtype), dtype_bytes(p.reduce_dtype)
    blocks = len(weights.blocks)
    recomputed = _recomputed_blocks(t.recompute, weights.blocks)
    m = x.model
    moe_layers = sum(1 for i in weights.blocks if m.moe_in_block(i))

    if p.tp > 1:
        _tensor_parallel(traffic, x, weights, blocks, blocks - moe_layers, recomputed, k, w)
    if p.cp > 1:
        pair = 2 * x.b * x.s * x.width // x.tp  # elements of a K/V (or dK/dV) pair, k and v repeated to a heads
        for op in ("send", "recv"):
            traffic.add(op, "cp", x.e * pair, calls=k * (p.cp - 1) * (2 * blocks + recomputed))
            traffic.add(op, "cp", 4 * pair, calls=k * p.cp * blocks)
    if p.ep > 1 and moe_layers:
        traffic.add("all_gather", "ep", p.ep * m.moe_experts * 8, calls=k * moe_layers)
        rows = x.b * x.s * m.moe_top_k * x.h * x.e
        traffic.add("all_to_all", "ep", rows, calls=4 * k * moe_layers)
    model_moe_layers = sum(1 for i in range(m.n_layers) if m.moe_in_block(i))
    if model_moe_layers:  # the routing record: a row per MoE layer of the model, on every rank (train/routing.py)
        for group in ("pp", batch):
            traffic.add("all_reduce", group, 8 * (model_moe_layers * m.moe_experts + model_moe_layers))
            traffic.add("all_reduce", group, 4)
    if p.pp > 1:
        boundary = 4 * x.b * x.s * x.h // (x.tp if x.sp else 1)
        for stage in stages:
            sends = (stage < n_stages - 1) + (stage > 0)  # activation forward, gradient backward
            traffic.add("send", "pp", boundary, calls=k * sends)
            traffic.add("recv", "pp", boundary, calls=k * sends)
        for param in weights.tied:
            shard = math.ceil(param.numel() / traffic.sizes[groups.zero_shard]) if p.zero else param.numel()
            traffic.add("send", "pp", r * shard)
            traffic.add("recv", "pp", r * shard)
        traffic.add("broadcast", "pp", 4)
    if p.zero:
        _zero(traffic, cfg, weights, groups, k, w, r)
    else:
        mine = [q for q in weights.params if id(q) not in weights.experts]
        theirs = [q for q in weights.params if id(q) in weights.experts]
        for group, params in ((dense, mine), (experts_group, theirs)):
            for bucket in plan_buckets(params[::-1], int(p.bucket_mb * 2**20), compute_dtype(p.reduce_dtype)):
                traffic.add("all_reduce", group, r * sum(q.numel() for q in bucket))
    # The gradient norm's sum of squares: under ZeRO its group's shards (with ep, the dense group's,
    # which spans the ep ranks' experts) hold every element once, else the ep ranks' experts do.
    for group in ("tp", "pp", groups.zero_shard if p.zero else "ep"):
        traffic.add("all_reduce", group, 4)
    traffic.add("all_reduce", "world", 4)  # the non-finite flag
    traffic.add("all_reduce", dense, 4)  # the loss
    return traffic.entries


def _recomputed_blocks(policy: str, blocks: list[int]) -> int:
    """How many of these blocks run their forward again in backward."""
    if policy in ("none", "selective"):
        return 0
    if policy.startswith("every:"):
        every = int(policy.split(":")[1])
        return sum(1 for i in blocks if i % every == 0)
    return len(blocks)  # full, and sqrt's segments


def _tensor_parallel(traffic: Traffic, x: Shape, weights: RankWeights, blocks: int, mlps: int,
                     recomputed: int, k: int, w: int) -> None:
    """Megatron's f and g (parallel/tensor.py), per micro-batch (module docstring): in
    every block's attention, and in its MLP unless a mixture of experts replaces it."""
    full, act = 4 * x.b * x.s * x.h, x.e * x.b * x.s * x.h
    rows = x.b * x.s
    regions = blocks + mlps
    # a frozen embedding's output needs no gradient: the first region's input gradient is never
    # formed (nor reduced), and the embedding's own backward does not run
    entered = regions - (1 if weights.first and x.frozen_embedding and regions else 0)
    if not x.sp:
        reduces = [(act, regions + recomputed), (full, entered)]
        if weights.first:
            reduces.append((w * x.b * x.s * x.h, 1))
        if weights.last:
            reduces += [(full, 1), (4 * rows, 1), (8 * rows, 1)]
        for nbytes, calls in reduces:
            traffic.add("all_reduce", "tp", nbytes, calls=k * calls)
        for param in weights.adapter_factors:  # each rank's share through its partner's slice, summed
            traffic.add("all_reduce", "tp", w * param.numel(), calls=k)
        return
    # of a frozen base, only the adapted columns gather again: a frozen weight keeps no input
    columns = blocks * x.columns(True) + mlps * x.columns(False)
    gathers = [(full, regions + 2 * recomputed), (act, regions + columns)]  # enter; leave's backward, re-gathers
    scatters = [(act, regions + recomputed), (full, entered)]  # leave; enter's backward
    if weights.first:
        scatters.append((w * x.b * x.s * x.h, 1))
        gathers.append((w * x.b * x.s * x.h, 0 if x.frozen_embedding else 1))
    if weights.last:  # the head's input entered, and re-gathered for its weight's gradient unless frozen
        gathers += [(full, 1), (act, 0 if x.frozen_head else 1)]
        scatters.append((full, 1))
        traffic.add("all_reduce", "tp", 4 * rows, calls=k)
        traffic.add("all_reduce", "tp", 8 * rows, calls=k)
    for op, items in (("all_gather", gathers), ("reduce_scatter", scatters)):
        for nbytes, calls in items:
            traffic.add(op, "tp", nbytes, calls=k * calls)
    for param in weights.replicated:
        traffic.add("all_reduce", "tp", w * param.numel(), calls=k)


def _zero(traffic: Traffic, cfg: Config, weights: RankWeights, groups: Groups, k: int, w: int, r: int) -> None:
    """Every ZeRO part's collectives, each over its own group: the dense weights' over the shard
    group, the experts' over the experts' group (parallel/zero_experts.py)."""
    p = cfg.parallel
    for part in zero_parts(weights, p.zero, p.bucket_mb, p.reduce_dtype):
        group, replica = (groups.experts, None) if part.experts else (groups.zero_shard, groups.zero_replica)
        _zero_part(traffic, cfg, part, group, replica, k, w, r)


def _zero_part(traffic: Traffic, cfg: Config, part: ZeroPart, group: str, replica: str | None, k: int, w: int,
               r: int) -> None:
    p = cfg.parallel
    stage, n = p.zero, traffic.sizes[group]
    padded = part.padded(n)
    # a frozen base's units are only gathered
    scatters = 0 if part.frozen else 1 if stage == 1 else k
    # Units of one size (a model's equal blocks) are added at once: the ledger sums them alike.
    for size, count in Counter(padded).items() if scatters else ():
        traffic.add("reduce_scatter", group, r * size, calls=scatters * count)
        if replica:
            traffic.add("all_reduce", replica, r * size // n, calls=scatters * count)
    # each matrix's row and column sums, each tensor's sum of U^2
    if cfg.train.optimizer == "adafactor" and not part.frozen:
        params = [q for unit in part.units for q in unit]
        factors = sum(q.numel() // q.shape[-1] + q.numel() // q.shape[-2] for q in params if q.dim() >= 2)
        if factors:
            traffic.add("all_reduce", group, 4 * factors)
        traffic.add("all_reduce", group, 4 * len(params))
    if stage < 3:
        for size, count in Counter(padded).items():
            traffic.add("all_gather", group, w * size, calls=count)
        return

    def gathered(size: int) -> int:
        if part.in_bytes:  # a 4-bit base's codes move as they are
            return size
        return n * quantized_shard_bytes(size // n) if p.quantize_weights != "none" else w * size

    held, layers = padded[:part.held], padded[part.held:]
    # A pipeline gathers its held units once per round, and its layers once per round or for
    # each micro-batch's forward and backward (parallel/zero3.py); without one, every micro-batch
    # gathers the held unit once (the root, or the experts' last layer: held into backward) and
    # each other layer twice.
    rounds = cfg.train.grad_accum if p.pp > 1 else k
    per_layer = rounds if p.pp > 1 and p.zero3_gather == "round" else 2 * k
    for size, count in Counter(held).items():
        traffic.add("all_gather", group, gathered(size), calls=rounds * count)
    for size, count in Counter(layers).items():
        traffic.add("all_gather", group, gathered(size), calls=per_layer * count)
