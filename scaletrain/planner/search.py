"""Which layouts the planner weighs, which the trainer would refuse, and their ranking.

A layout is a ``Config`` that differs from the user's base in its mesh sizes
(dp x tp x pp x cp x ep = the cluster's GPUs), ZeRO stage, sequence
parallelism, recompute policy, micro-batch and pipeline shape. Every layout
keeps the same global batch, so their tokens per step are equal and their
predicted tokens/s compare like for like. The trainer's own checks decide
which layouts are legal, so the planner never recommends one that
``scaletrain train`` would refuse, and it says why the others were dropped in
the trainer's own words.

The prediction is injected (``predict(cfg, world, vocab_size, cluster)``),
which keeps the search testable with a stand-in and the model of memory and
time in one place (planner/predict.py).
"""

from __future__ import annotations

import itertools
import math
import re
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from scaletrain.config import Config
from scaletrain.config_checks import check_values, resolve_layout
from scaletrain.errors import UserError
from scaletrain.job.base_model import check_layout
from scaletrain.parallel.pipeline.schedules import SCHEDULES
from scaletrain.planner.hardware import Cluster
from scaletrain.planner.prediction import Prediction

MESH = ("dp", "tp", "pp", "cp", "ep")
ZERO_STAGES = (0, 1, 2, 3)
ZERO3_GATHERS = ("round", "micro-batch")  # inside pipeline stages (parallel/zero3.py)
RECOMPUTE = ("none", "selective", "full")
INTERLEAVED_CHUNKS = 2
GIB, MIB = 2**30, 2**20

Predict = Callable[[Config, int, int, Cluster], Prediction]


@dataclass
class SearchResult:
    """The outcome of one search on ``cluster``.

    ``ranked`` fit the device, best first; ``too_big`` do not, smallest first.
    ``refused`` maps one example sentence of each kind of refusal (sentences
    that differ only in their numbers are one kind) to how many layouts it
    dropped; ``skipped`` maps why a legal layout was not predicted, because
    it could not win, to how many.
    """

    cluster: Cluster
    global_batch: int
    ranked: list[Prediction] = field(default_factory=list)
    too_big: list[Prediction] = field(default_factory=list)
    refused: dict[str, int] = field(default_factory=dict)
    skipped: dict[str, int] = field(default_factory=dict)

    @property
    def considered(self) -> int:
        return len(self.ranked) + len(self.too_big) + sum(self.refused.values()) + sum(self.skipped.values())

    def best(self) -> Prediction:
        """The recommendation, or a UserError that says why there is none."""
        if self.ranked:
            return self.ranked[0]
        if not self.too_big:
            example = next(iter(self.refused))
            raise UserError(f"the trainer would refuse every one of the {self.considered} layouts, most "
                            f"often because: {example.rstrip('.')}.")
        smallest, device = self.too_big[0], self.cluster.device
        raise UserError(f"no layout fits in the {size_text(device.memory_bytes)} of one {device.name}: the "
                        f"smallest needs {size_text(smallest.memory['total'])} per rank "
                        f"({layout_text(smallest)}); add GPUs, take a device with more memory, or "
                        f"shrink the model or the batch.")


def size_text(n: int) -> str:
    """Bytes in GiB, or in MiB below one GiB, where GiB would round to zero."""
    return f"{n / GIB:.1f} GiB" if n >= GIB else f"{n / MIB:.1f} MiB"


def layout_text(p: Prediction) -> str:
    """A layout in one compact line: ``dp4 tp2 pp1 zero1 sp recompute=selective mb4 ga2``."""
    lay = p.layout()
    parts = [f"dp{lay['dp']}", f"tp{lay['tp']}", f"pp{lay['pp']}"]
    parts += [f"{name}{lay[name]}" for name in ("cp", "ep") if lay[name] > 1]
    parts.append(f"zero{lay['zero']}")
    parts += [f"shard{lay['shard_group']}"] if "shard_group" in lay else []
    parts += [f"qw{lay['quantize_weights']}"] if "quantize_weights" in lay else []
    parts += [f"gather-{lay['zero3_gather']}"] if "zero3_gather" in lay else []
    if lay["sp"]:
        parts.append("sp")
    parts += [f"recompute={lay['recompute']}", f"mb{lay['micro_batch']}"]
    if lay["pp"] > 1:
        parts += [lay["pp_schedule"], f"m{lay['microbatches']}"]
        if lay["virtual_stages"] > 1:
            parts.append(f"v{lay['virtual_stages']}")
    parts.append(f"ga{lay['grad_accum']}")
    return " ".join(parts)


DEFAULT_SEQUENCES_PER_READER = 8


def derived_global_batch(base: Config, world: int, fixed: set[str]) -> int:
    """The global batch a user meant without writing it: ``micro_batch x grad_accum x
    microbatches x readers``, each factor as given, else 8 sequences, 1 and 1.

    ``readers`` are the ranks that read different sequences (dp x ep): the
    given ``--dp`` (times ``--ep``), else as many as the given model-parallel
    sizes leave of the world, so that every layout the search tries can split
    the batch (fewer readers accumulate more). Sizes that do not divide the
    world are the search's to refuse, in its own sentence.
    """
    p, t = base.parallel, base.train
    if "dp" in fixed:
        readers = p.dp * (p.ep if "ep" in fixed else 1)
    else:
        readers = max(1, world // math.prod(getattr(p, name) for name in ("tp", "pp", "cp") if name in fixed))
    per_reader = t.micro_batch if "micro_batch" in fixed else DEFAULT_SEQUENCES_PER_READER
    for name in ("grad_accum", "microbatches"):
        if name in fixed:
            per_reader *= getattr(t if name == "grad_accum" else p, name)
    return per_reader * readers


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _choices(name: str, options: tuple | list, base_value: object, fixed: set[str]) -> tuple | list:
    """``options``, or only the base's value when the user fixed ``name``."""
    return (base_value,) if name in fixed else options


def meshes(base: Config, world: int, gpus_per_node: int, fixed: set[str]) -> Iterator[dict[str, int]]:
    """Every dp x tp x pp x cp x ep = ``world`` worth trying.

    tp stays inside a node (it divides ``gpus_per_node``): its collectives run in
    every layer, and across nodes they would crawl. cp > 1 only where the
    sequence cuts into 2 x cp equal chunks, ep > 1 only for a mixture of
    experts. A size the user fixed is taken as given, so that the trainer's
    checks, not these shortcuts, say what is wrong with it.
    """
    p, seq = base.parallel, base.data.seq_len
    sizes = {
        "tp": [t for t in _divisors(world) if gpus_per_node % t == 0],
        "pp": _divisors(world),
        "cp": [c for c in _divisors(world) if c == 1 or seq % (2 * c) == 0],
        "ep": _divisors(world) if base.model.moe_experts else [1],
    }
    options = [_choices(name, sizes[name], getattr(p, name), fixed) for name in ("tp", "pp", "cp", "ep")]
    for tp, pp, cp, ep in itertools.product(*options):
        model_parallel = tp * pp * cp * ep
        if world % model_parallel:
            continue
        dp = world // model_parallel
        if "dp" in fixed and p.dp != dp:
            continue
        yield {"dp": dp, "tp": tp, "pp": pp, "cp": cp, "ep": ep}


def _split(base: Config, pp: int, per_rank: int, micro_batch: int, schedule: str | None,
           fixed: set[str]) -> dict | None:
    """The batch fields for one micro-batch, or None where it does not split ``per_rank``.

    Without a pipeline the micro-batches are accumulated; a pipeline takes the
    whole per-rank batch in one round (more micro-batches, a smaller bubble)
    unless the user fixed their number, and needs at least one per stage.
    """
    p = base.parallel
    virtual = p.virtual_stages if "virtual_stages" in fixed else None
    if per_rank % micro_batch:
        return None
    if "grad_accum" in fixed:  # the accumulation given: per_rank = micro_batch x grad_accum x microbatches
        rounds = base.train.grad_accum
        if (per_rank // micro_batch) % rounds or (pp == 1 and per_rank != micro_batch * rounds):
            return None
        per_rank //= rounds
    else:
        rounds = None
    if pp == 1:
        return {"micro_batch": micro_batch, "grad_accum": rounds or per_rank // micro_batch,
                "virtual_stages": virtual, "microbatches": p.microbatches if "microbatches" in fixed else None}
    microbatches = p.microbatches if "microbatches" in fixed else per_rank // micro_batch
    if per_rank % (micro_batch * microbatches) or microbatches < pp:
        return None
    if rounds is not None and per_rank != micro_batch * microbatches:
        return None
    if schedule == "interleaved":
        if microbatches % pp:
            return None
        virtual = virtual or INTERLEAVED_CHUNKS
    return {"micro_batch": micro_batch, "grad_accum": rounds or per_rank // (micro_batch * microbatches),
            "microbatches": microbatches, "pp_schedule": schedule, "virtual_stages": virtual}


def _batch_ladders(base: Config, mesh: dict[str, int], global_batch: int,
                   fixed: set[str]) -> Iterator[list[dict]]:
    """Per pipeline schedule, the splits of the global batch by ascending micro-batch.

    ``global_batch = micro_batch x grad_accum x microbatches x dp x ep``: the dp
    and ep ranks read different sequences, the others share theirs.
    """
    readers = mesh["dp"] * mesh["ep"]
    if global_batch % readers:
        return
    per_rank = global_batch // readers
    powers = [2**k for k in range(per_rank.bit_length()) if per_rank % 2**k == 0]
    sizes = _choices("micro_batch", powers, base.train.micro_batch, fixed)
    schedules = _choices("pp_schedule", SCHEDULES, base.parallel.pp_schedule, fixed) if mesh["pp"] > 1 \
        else (None,)
    for schedule in schedules:
        ladder = [split for mb in sizes if (split := _split(base, mesh["pp"], per_rank, mb, schedule, fixed))]
        if ladder:
            yield ladder


def _sharding(base: Config, mesh: dict[str, int], fixed: set[str]) -> Iterator[dict]:
    """zero, sp and ZeRO-3's gathers: ZeRO needs copies to shard over (dp x cp x ep > 1: the
    dense weights' group), sp a tp group, the choice of gathering per round or per micro-batch a
    pipeline under ZeRO-3."""
    zero = ZERO_STAGES if mesh["dp"] * mesh["cp"] * mesh["ep"] > 1 else (0,)
    sp = (False, True) if mesh["tp"] > 1 else (False,)
    for stage, split in itertools.product(_choices("zero", zero, base.parallel.zero, fixed),
                                          _choices("sp", sp, base.parallel.sp, fixed)):
        gathers = ZERO3_GATHERS if stage == 3 and mesh["pp"] > 1 else (base.parallel.zero3_gather,)
        for gather in _choices("zero3_gather", gathers, base.parallel.zero3_gather, fixed):
            yield {"zero": stage, "sp": split, "zero3_gather": gather}


Ladder = list[list[Config]]


def _ladders(base: Config, world: int, gpus_per_node: int, global_batch: int,
             fixed: set[str]) -> Iterator[Ladder]:
    """The layouts, grouped so that the search can skip what cannot win.

    One ladder per choice of everything but micro-batch and recompute; its rungs
    go up in micro-batch (so in memory), each rung's layouts from the lightest
    recompute to the heaviest (less memory, more time).
    """
    recompute = _choices("recompute", RECOMPUTE, base.train.recompute, fixed)
    for mesh in meshes(base, world, gpus_per_node, fixed):
        for sharding, ladder in itertools.product(_sharding(base, mesh, fixed),
                                                  _batch_ladders(base, mesh, global_batch, fixed)):
            yield [[base.replace(**mesh, **sharding, recompute=policy, **split) for policy in recompute]
                   for split in ladder]


def layouts(base: Config, world: int, gpus_per_node: int, global_batch: int,
            fixed: set[str]) -> Iterator[Config]:
    """Every layout to weigh: ``base`` with its layout fields replaced, the global batch kept.

    Fields named in ``fixed`` (config field names: ``tp``, ``zero``,
    ``micro_batch``, ``pp_schedule``, ...) keep ``base``'s value.
    """
    for ladder in _ladders(base, world, gpus_per_node, global_batch, fixed):
        for rung in ladder:
            yield from rung


def refusal(cfg: Config, world: int) -> str | None:
    """The sentence with which ``scaletrain train`` would refuse ``cfg`` on ``world`` ranks, or None.

    The trainer's own gates, in its order: the range checks, then the layout
    against the world and the model (heads, layers, stages, experts), and a
    fine-tune's adapters against the layouts they compose with.
    """
    try:
        check_values(cfg)
        # whether this machine can run --fused triton's kernels is no question of the cluster planned for
        resolve_layout(cfg.replace(fused="none"), world)
        if cfg.finetune.lora_rank or cfg.finetune.quantize != "none":
            check_layout(cfg)
    except UserError as exc:
        return str(exc)
    return None


class _Refusals:
    """Refused layouts counted by kind of reason, with the first sentence of each kind."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.kinds: Counter[str] = Counter()
        self.examples: dict[str, str] = {}

    def legal(self, cfg: Config) -> bool:
        reason = refusal(cfg, self.world)
        if reason is None:
            return True
        kind = re.sub(r"\d+", "N", reason)  # "--tp 8 must divide..." and "--tp 16 must divide..." are one
        self.kinds[kind] += 1
        self.examples.setdefault(kind, reason)
        return False

    def counts(self) -> dict[str, int]:
        """Example sentence -> layouts, the most frequent reason first."""
        return {self.examples[kind]: count for kind, count in self.kinds.most_common()}


LIGHTER_FITS = "a lighter recompute of the same layout fits, and more recompute only costs time"
SMALLER_TOO_BIG = "the same layout with a smaller micro-batch already does not fit"


def _climb(ladder: Ladder, refusals: _Refusals, predict: Callable[[Config], Prediction],
           skipped: Counter[str]) -> Iterator[Prediction]:
    """Predict a ladder's legal layouts, skipping those that cannot win.

    Memory does not fall as the micro-batch grows, so a recompute policy too
    big at one micro-batch is too big at every larger one; and recompute only
    adds time, so once a policy fits, a heavier one at the same micro-batch
    would rank below it.
    """
    too_big: set[str] = set()
    for rung in ladder:
        fitted = False
        for cfg in filter(refusals.legal, rung):
            policy = cfg.train.recompute
            if policy in too_big or fitted:
                skipped[SMALLER_TOO_BIG if policy in too_big else LIGHTER_FITS] += 1
                continue
            prediction = predict(cfg)
            fitted = prediction.fits
            if not fitted:
                too_big.add(policy)
            yield prediction


def _unsplittable(base: Config, world: int, gpus_per_node: int, global_batch: int,
                  fixed: set[str]) -> UserError:
    """Why no layout came out: the fixed sizes, or the global batch."""
    given = {name: getattr(base.parallel, name) for name in MESH if name in fixed}
    flags = " x ".join(f"--{name} {size}" for name, size in given.items())
    product = math.prod(given.values())
    if world % product:
        return UserError(f"{flags}{f' = {product}' if len(given) > 1 else ''} does not divide the {world} GPUs; "
                         f"choose sizes whose product divides {world}.")
    if next(meshes(base, world, gpus_per_node, fixed), None) is None:
        return UserError(f"{flags} cannot be completed to a mesh of {world} GPUs (tp stays inside a node of "
                         f"{gpus_per_node}, cp must cut --seq into 2 x cp chunks, ep needs --moe-experts); "
                         f"fix fewer sizes.")
    unit = world * math.prod(getattr(base.train if name in ("micro_batch", "grad_accum") else base.parallel,
                                     name) or 1 for name in ("micro_batch", "grad_accum", "microbatches")
                             if name in fixed)
    return UserError(f"--global-batch {global_batch} cannot be split into equal micro-batches over the "
                     f"data-parallel ranks of any layout of {world} GPUs; choose a multiple of {unit}.")


def _rank_key(p: Prediction) -> tuple[float, int]:
    return -p.tokens_per_s, p.memory["total"]


def search(base: Config, cluster: Cluster, vocab_size: int, global_batch: int, fixed: set[str],
           predict: Predict) -> SearchResult:
    """Weigh every layout of ``base`` on ``cluster``: refuse, predict, rank.

    ``predict(cfg, world, vocab_size, cluster)`` is planner/predict.py's, or a stand-in.
    """
    world, refusals, skipped = cluster.gpus, _Refusals(cluster.gpus), Counter()
    result = SearchResult(cluster, global_batch)
    found = False
    for ladder in _ladders(base, world, cluster.gpus_per_node, global_batch, fixed):
        found = True
        for prediction in _climb(ladder, refusals, lambda cfg: predict(cfg, world, vocab_size, cluster), skipped):
            (result.ranked if prediction.fits else result.too_big).append(prediction)
    if not found:
        raise _unsplittable(base, world, cluster.gpus_per_node, global_batch, fixed)
    result.ranked.sort(key=_rank_key)
    result.too_big.sort(key=lambda p: p.memory["total"])
    result.refused, result.skipped = refusals.counts(), dict(skipped)
    return result
