"""``scaletrain bench pp``: our pipeline parallelism against torch.distributed.pipelining.

Every process is one rank of a pp group (``--nproc`` ranks, one stage each,
no data parallelism). Both contenders cut the same model at the same places
(``balance(parameter_costs(...), nproc)``: contiguous ranges of blocks, the
embeddings on the first stage, the final norm and the head on the last),
each rank building the model whole from the same seed and keeping its
stage, so both start from the same weights. Each is raced under GPipe and
under 1F1B, four contenders in one race, step by step in rotating order,
each step after a barrier:

    --grad-accum rounds: forward and backward of M micro-batches through the
        schedule (``--microbatches M``, default 2 x nproc), each
        micro-batch's loss / (grad_accum x M) before its backward
    tied embedding: the first and the last stage add up their gradients
    clip the global gradient norm; AdamW step; zero the gradients

Contenders:

  ours  parallel/pipeline: ``PipelineParallel(model, spec.stages, ...)`` with
        ``--pp-schedule`` gpipe or 1f1b, ``train_round`` per round, then its
        ``sum_shared_gradients`` and ``clip_grad_norm_``, as the trainer runs it.
  peer  ``torch.distributed.pipelining``: this rank's stage (the same pruned
        model, ids or the residual stream in, the residual stream or the logits
        out) wrapped as the ``nn.Module`` of a ``PipelineStage``, driven by
        ``ScheduleGPipe`` or ``Schedule1F1B`` over the same process group;
        one ``schedule.step(ids, target=targets)`` per round. The tied
        embedding's two copies exchange their gradients with torch's own
        ``batch_isend_irecv`` and add them; the clip is torchtitan's rule for
        pipelines: ``get_total_norm`` of the stage's gradients (the head's
        copy of the embedding left out), squares summed over the group with
        ``all_reduce``, then ``clip_grads_with_norm_``.

Why this is the same work:

  - Same cuts (checked equal), same schedule, same micro-batches: the
    micro-batches of a step are read as the trainer reads them and handed
    whole to both; torch's ``step`` splits their concatenation back into the
    same M pieces. Both run the forwards in the same order (torch's 1F1B
    counts one more warm-up forward than ours because it counts the first
    forward of the steady state; the order is the same).
  - The same loss scaling: torch divides the gradients by M after the round
    (``scale_grads=True``, its default) while ours divides each micro-batch's
    loss before its backward. The peer is built with ``scale_grads=False``
    and the loss divided like ours, for two reasons: ``scale_grads`` divides
    every ``.grad`` of the stage, so with ``--grad-accum`` > 1 it would divide
    the earlier rounds' gradients again; and dividing at the same place gives
    the same rounding, so the losses can be compared closely.
  - The same shape information: ours is told the boundary shape
    ([micro_batch, seq, d_model], fp32); the peer's ``PipelineStage`` gets
    ``input_args`` and ``output_args`` (on the meta device), which puts torch
    in its STATIC mode. Without them torch runs DYNAMIC mode: at its first
    step every stage runs one extra forward and backward (the first on
    micro-batch 0, the others on empty tensors of the shapes received) and
    passes the pickled shapes on with ``send_object_list``, a one-off cost
    that the warm-up steps would hide anyway. In both modes its
    first step also passes a vote along the stages (two tiny transfers).
  - The losses of the last stage are kept per step (``.item()``, on the last
    rank only; the others hold no loss) and compared after the race: both
    compute the same function of the same weights on the same data.

What differs, and is what the ratio measures: the runtimes. Ours executes a
precomputed action list (schedules.py), posting each batch of transfers
with ``batch_isend_irecv`` and waiting only for its receives, sends waited
for at the end of the round. torch's schedules post the transfers of each
action as they come (GPipe one batch per action; 1F1B fuses a send with the
next receive and waits for both in its steady state), keep
each micro-batch's inputs and outputs in a ``fwd_cache``, and compute the
backward with ``torch.autograd.backward`` plus its own bookkeeping per
micro-batch (``stage_backward``). On CPU with gloo, both sides' transfers go
over local TCP.

gloo on CPU: torch.distributed.pipelining runs on CPU tensors and gloo as
is (``device=torch.device("cpu")``), in STATIC and in DYNAMIC mode alike: no
workaround was needed on torch 2.13. One trap of STATIC mode: the example
tensors' ``requires_grad`` decides whether a gradient crosses the cut. Meta
tensors made without it make torch derive no gradient metadata, so the
upstream stage never receives its output's gradient: its backward fails
("grad can be implicitly created only for scalar outputs") and the other
rank waits until ``--timeout``. The examples here require grad when they
are floating point (the ids do not).

With ``--pp-schedule pipedream-2bw`` a fifth contender joins the race: ours
under PipeDream-2BW (docs/pipeline-parallel.md), which torch has no peer for.
Its row gives its time against our 1F1B's; its losses differ from the
others' by design (each step applies the previous step's gradient, the
first step none).

Not read: ``--pp-schedule`` otherwise (both schedules are raced), ``--pp-balance``
(cut by parameter count), ``--virtual-stages`` (one stage per rank) and
``--precision`` (fp32). ``--microbatches`` and ``--grad-accum`` are.

A step's time is the slowest rank's; each contender reports the median over
the steps after ``--warmup``; the ratio is ours / torch per schedule, below
1.0 when ours is faster. The top-level ``ours``, ``peer`` and ``ratio`` are
1F1B's; ``schedules`` has both. The losses must agree step by step up to
rounding: the report gives the largest relative difference per schedule.
Measured: all four contenders' losses were equal bit for bit, step by step
(the tiny preset, and the small one over 12 steps), the two schedules included. A
missing tied-gradient sum shows from the second step (3e-4 at the tiny preset). A
gradient off by a constant factor (``scale_grads=True`` on top of the divided
loss: divided by M twice) shows only faintly, since AdamW and a clip that
bites are blind to a constant factor: 2e-5 by the third step at the tiny preset,
nothing for 3 steps at the small one, then 2e-2. So compare the losses tightly
(the test asks for 1e-6), not at 1e-4.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.nn.utils import clip_grads_with_norm_, get_total_norm

from scaletrain.bench import (
    Batches,
    largest_relative_gap,
    machine,
    race,
    race_rank,
    slowest_rank_medians,
    spawn_race,
    step_batches,
)
from scaletrain.config import Config
from scaletrain.errors import UserError
from scaletrain.job.data_setup import PreparedData
from scaletrain.models import CLASSIFIER, build_model, spec_for
from scaletrain.models.spec import tied_parameters
from scaletrain.optim import build_optimizer, decay_groups
from scaletrain.parallel.pipeline.parallel import PipelineParallel
from scaletrain.parallel.pipeline.partition import (
    Stage,
    balance,
    describe,
    keep_stages,
    parameter_costs,
)
from scaletrain.parallel.pipeline.schedules import PIPEDREAM_2BW
from scaletrain.runtime.comm import Comm
from scaletrain.runtime.mesh import Group, Mesh
from scaletrain.train.layout import loss_fn

OURS, PEER = "scaletrain PipelineParallel", "torch.distributed.pipelining"
SCHEDULES = ("gpipe", "1f1b")
PEER_SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


@dataclass
class Contender:
    """One implementation under one schedule: how it runs a round, sums the tied
    gradient and clips; its optimizer; what the race records."""

    name: str
    impl: str
    schedule: str
    model: nn.Module
    optimizer: torch.optim.Optimizer
    run_round: Callable[[Batches, float], float]
    sum_tied: Callable[[], None]
    clip: Callable[[], object]
    step_s: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)

    def train_step(self, batches: Batches, micro_batches: int) -> float:
        """One optimizer step on ``batches`` (``--grad-accum`` rounds of ``micro_batches``);
        the step's loss on the last stage, 0 on the other ranks."""
        self.model.train()
        rounds = len(batches) // micro_batches
        total = 0.0
        for r in range(rounds):
            total += self.run_round(batches[r * micro_batches:(r + 1) * micro_batches], rounds * micro_batches)
        self.sum_tied()
        self.clip()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return total


def run(cfg: Config, warmup: int) -> dict:
    """Spawn ``--nproc`` pp ranks, race the contenders; the result as ``bench --json`` prints it."""
    n = cfg.parallel.nproc
    if cfg.model.name == CLASSIFIER:
        raise UserError("bench pp cuts a decoder's blocks into stages; give a language model's --model, not the "
                        "mlp.")
    family = spec_for(cfg.model.name)
    layers = family.shape(family.configure(cfg.model, 1, cfg.data.seq_len)).n_layers
    if n > layers:
        raise UserError(f"bench pp cuts the model's {layers} blocks into --nproc {n} stages; give an "
                        f"--nproc of at most {layers}, or more --n-layers.")
    micro, _ = cfg.replace(pp=n).parallel.pipeline_sizes()
    if micro < n:
        raise UserError(f"torch's 1F1B needs at least as many micro-batches as stages; give "
                        f"--microbatches {n} or more, not {micro}.")
    return spawn_race(cfg, warmup, _worker, "pp", "pipeline parallelism", dim="pp")


def _max_norm(cfg: Config) -> float:
    return cfg.train.grad_clip if cfg.train.grad_clip > 0 else math.inf


def _ours(model: nn.Module, schedule: str, comm: Comm, mesh: Mesh, cfg: Config, sample: torch.Tensor,
          device: torch.device, ranges: list[range]) -> Contender:
    family = spec_for(cfg.model.name)
    width, micro, pp = family.shape(model.cfg).d_model, cfg.parallel.pipeline_sizes()[0], mesh.group("pp")
    pipeline = PipelineParallel(model, family.stages, comm, pp, schedule=schedule, micro_batches=micro,
                                virtual_stages=1, balance_by="params",
                                boundary=lambda batch, seq: ((batch, seq, width), torch.float32, device),
                                sample=sample, world=mesh.group("world"))
    if pipeline.ranges != ranges:
        raise RuntimeError(f"our cuts {pipeline.ranges} differ from the peer's {ranges}")
    params = list(model.parameters())

    def round_(batches: Batches, divisor: float) -> float:
        loss, _ = pipeline.train_round(lambda m: batches[m], loss_fn=loss_fn, divisor=divisor)
        return loss.item()

    applies = [True]  # PipeDream-2BW's first step has no gradient to apply: nothing to sum, clip or step

    def sum_tied() -> None:
        applies[0] = pipeline.versions is None or pipeline.versions.exchange(lambda p: p.grad)
        if applies[0]:
            pipeline.sum_shared_gradients(lambda p: p.grad)

    optimizer = build_optimizer(decay_groups(model, cfg.train.weight_decay), cfg.train)
    return Contender(f"{OURS} ({schedule})", OURS, schedule, model, optimizer, round_, sum_tied,
                     lambda: applies[0] and pipeline.clip_grad_norm_(params, _max_norm(cfg)))


class StageModule(nn.Module):
    """This rank's stage of the pruned model as the ``nn.Module`` a ``PipelineStage``
    wraps: token ids (first stage) or the residual stream in, the residual
    stream or the logits (last stage) out. Its parameters are the stage's."""

    def __init__(self, stage: Stage):
        super().__init__()
        self.model = stage.model
        self.stage = stage

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.stage(x)


def _tied_gradient_sum(model: nn.Module, stage, pp: Group, ties) -> tuple[torch.Tensor | None, list[int],
                                                                          Callable[[], None]]:
    """The embedding a tied head shares, held by the first and the last stage (None on the others),
    those two ranks, and the exchange that leaves the sum of its two gradients on both."""
    tied = (dict(model.named_parameters()).get(ties[0][1]) if ties and (stage.is_first or stage.is_last)
            else None)
    holders = sorted({0, pp.size - 1})

    @torch.no_grad()
    def sum_tied() -> None:
        if tied is None or len(holders) == 1:
            return
        other = pp.ranks[holders[1] if pp.rank == holders[0] else holders[0]]
        theirs = torch.empty_like(tied.grad)  # the other holder's gradient, swapped for ours
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, tied.grad, other, pp.handle),
                                        dist.P2POp(dist.irecv, theirs, other, pp.handle)])
        for work in works:
            work.wait()
        tied.grad.add_(theirs)

    return tied, holders, sum_tied


def _peer(model: nn.Module, schedule: str, pp: Group, cfg: Config, ranges: list[range],
          device: torch.device) -> Contender:
    n, t, c = pp.size, cfg.train, spec_for(cfg.model.name).shape(model.cfg)
    micro = cfg.parallel.pipeline_sizes()[0]
    ties = tied_parameters(model)
    (stage,) = keep_stages(model, spec_for(cfg.model.name).stages, ranges, [pp.rank])
    module = StageModule(stage)
    b, s = t.micro_batch, cfg.data.seq_len

    def meta(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        # requires_grad marks what a gradient flows back through: without it torch never
        # receives (or sends) the gradient of that activation (see the docstring).
        return torch.empty(shape, dtype=dtype, device="meta", requires_grad=dtype.is_floating_point)

    # STATIC mode: the shapes crossing each cut, as ours is given them (see the docstring).
    inputs = meta(b, s, dtype=torch.long) if stage.is_first else meta(b, s, c.d_model)
    outputs = meta(b, s, c.vocab) if stage.is_last else meta(b, s, c.d_model)
    pipe = PipelineStage(module, pp.rank, n, device, input_args=inputs, output_args=outputs, group=pp.handle)
    scale: list[float] = [1.0]  # the divisor of the running step, read by the loss
    driver = PEER_SCHEDULES[schedule](pipe, micro, loss_fn=lambda logits, y: loss_fn(logits, y) / scale[0],
                                      scale_grads=False)

    def round_(batches: Batches, divisor: float) -> float:
        scale[0] = divisor
        args = (torch.cat([x for x, _ in batches]),) if stage.is_first else ()
        target = torch.cat([y for _, y in batches]) if stage.is_last else None
        losses: list[torch.Tensor] = []
        driver.step(*args, target=target, losses=losses if stage.is_last else None, return_outputs=False)
        total = torch.zeros((), device=device)
        for loss in losses:
            total += loss.detach()
        return total.item()

    tied, holders, sum_tied = _tied_gradient_sum(model, stage, pp, ties)
    params = list(module.parameters())
    counted = [p for p in params if not (p is tied and pp.rank != holders[0])]  # the tied weight once

    def clip() -> torch.Tensor:
        squares = get_total_norm([p.grad for p in counted if p.grad is not None]).square()
        dist.all_reduce(squares, group=pp.handle)
        total = squares.sqrt()
        if math.isfinite(_max_norm(cfg)):  # as ours: no clip, no scaling by 1
            clip_grads_with_norm_(params, _max_norm(cfg), total)
        return total

    optimizer = build_optimizer(decay_groups(model, t.weight_decay), t)
    return Contender(f"{PEER} ({schedule})", PEER, schedule, module, optimizer, round_, sum_tied, clip)


def _worker(cfg: Config, prepared: PreparedData, warmup: int) -> dict:
    with race_rank(cfg, prepared, "pp") as rank:
        mesh, comm, device, data = rank.mesh, rank.comm, rank.device, rank.data
        pp, dp = mesh.group("pp"), mesh.group("dp")
        micro, _ = cfg.parallel.pipeline_sizes()
        # A step reads grad_accum x M micro-batches, as the trainer does with pp.
        reads = replace(cfg.train, grad_accum=cfg.train.grad_accum * micro)

        def batches_at(step: int) -> Batches:  # dp has one rank: every pp rank reads the whole batch
            return [(x.to(device), y.to(device)) for x, y in step_batches(data, reads, dp, step)]

        def fresh_model() -> nn.Module:
            torch.manual_seed(cfg.train.seed)  # the same initial weights for all
            return build_model(cfg.model, vocab_size=prepared.vocab_size, seq_len=cfg.data.seq_len).to(device)

        ranges = balance(parameter_costs(fresh_model(), spec_for(cfg.model.name).stages), pp.size)
        sample = batches_at(0)[0][0]
        contenders = []
        for schedule in SCHEDULES:
            contenders += [_ours(fresh_model(), schedule, comm, mesh, cfg, sample, device, ranges),
                           _peer(fresh_model(), schedule, pp, cfg, ranges, device)]
        if cfg.parallel.pp_schedule == PIPEDREAM_2BW:
            contenders.append(_ours(fresh_model(), PIPEDREAM_2BW, comm, mesh, cfg, sample, device, ranges))

        def train_step(c: Contender, batches: Batches, step: int) -> float:
            torch.manual_seed(cfg.train.seed + step)  # the same dropout draws for all, with --dropout
            return c.train_step(batches, micro)

        race(contenders, cfg.train.steps, batches_at, train_step, comm, pp)
        medians = slowest_rank_medians(contenders, warmup, comm, pp)
        # Only the last stage holds the losses: everyone takes its.
        losses = comm.all_gather_object({c.name: c.losses for c in contenders}, pp)[pp.size - 1]
        return _report(cfg, contenders, medians, losses, ranges, warmup, device)


def _report(cfg: Config, contenders: list[Contender], medians: dict[str, float], losses: dict[str, list[float]],
            ranges: list[range], warmup: int, device: torch.device) -> dict:
    schedules, rows = {}, {c.name: {"name": c.impl, "schedule": c.schedule, "median_s": medians[c.name],
                                    "final_loss": losses[c.name][-1], "losses": losses[c.name]}
                           for c in contenders}
    for schedule in SCHEDULES:
        ours, peer = (rows[c.name] for c in contenders if c.schedule == schedule)
        peer["max_loss_rel_diff_to_ours"] = largest_relative_gap(peer["losses"], ours["losses"])
        schedules[schedule] = {"ours": ours, "peer": peer, "ratio": ours["median_s"] / peer["median_s"],
                               "max_loss_rel_diff": peer["max_loss_rel_diff_to_ours"]}
    for c in contenders:
        if c.schedule == PIPEDREAM_2BW:  # no peer: against our 1F1B
            schedules[c.schedule] = {"ours": rows[c.name],
                                     "ratio_to_1f1b": rows[c.name]["median_s"] / schedules["1f1b"]["ours"]["median_s"]}
    t, n = cfg.train, len(ranges)
    micro, _ = cfg.parallel.pipeline_sizes()
    top = schedules["1f1b"]
    return {
        "what": "pp",
        "machine": machine(),
        "nproc": n,
        "steps": t.steps,
        "warmup": warmup,
        "setup": {"model": cfg.model.name, "pp": n, "dp": 1, "seq_len": cfg.data.seq_len,
                  "micro_batch": t.micro_batch, "microbatches": micro, "grad_accum": t.grad_accum,
                  "timed_steps": t.steps - warmup, "grad_clip": t.grad_clip, "device": device.type,
                  "stages": describe(ranges, spec_for(cfg.model.name).stages).splitlines(),
                  "stage_layers": [[r.start, r.stop] for r in ranges],
                  "peer_shapes": "static (input_args, output_args given)",
                  "torch_threads_per_rank": torch.get_num_threads()},
        "ours": top["ours"],
        "peer": top["peer"],
        "ratio": top["ratio"],
        "max_loss_rel_diff": max(row["max_loss_rel_diff"] for row in schedules.values() if "peer" in row),
        "schedules": schedules,
    }


def format_table(result: dict) -> str:
    s = result["setup"]
    title = (f"bench pp: {s['model']} over {result['nproc']} pp ranks ({s['device']}), seq {s['seq_len']}, "
             f"{s['microbatches']} micro-batches of {s['micro_batch']} x {s['grad_accum']} rounds, "
             f"{result['steps']} steps ({s['timed_steps']} timed), on {result['machine']}")
    header = f"{'schedule':<10}{'ours s':>9}{'torch s':>9}{'ours / torch':>14}{'ours loss':>11}{'torch loss':>12}" \
             f"{'loss diff':>11}"
    rows = [f"{name:<10}{row['ours']['median_s']:>9.4f}{row['peer']['median_s']:>9.4f}{row['ratio']:>14.3f}"
            f"{row['ours']['final_loss']:>11.4f}{row['peer']['final_loss']:>12.4f}{row['max_loss_rel_diff']:>11.1e}"
            for name, row in result["schedules"].items() if "peer" in row]
    two_bw = result["schedules"].get(PIPEDREAM_2BW)
    if two_bw:
        rows.append(f"{'2bw':<10}{two_bw['ours']['median_s']:>9.4f}{'-':>9}{'-':>14}"
                    f"{two_bw['ours']['final_loss']:>11.4f}{'-':>12}{'-':>11}   {two_bw['ratio_to_1f1b']:.3f} x our 1f1b")
    return "\n".join([title, "; ".join(s["stages"]), header, *rows,
                      (f"ours: {result['ours']['name']}; torch: {result['peer']['name']} (PipelineStage, "
                       f"ScheduleGPipe / Schedule1F1B). step s: median over the timed steps of the slowest "
                       f"rank; loss: the last stage's, final step; loss diff: largest relative difference of "
                       f"a step's loss from ours (the same work was timed).")])
