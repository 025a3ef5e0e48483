"""``scaletrain bench dp``: our data parallelism against torch's DistributedDataParallel.

The same model (same initial weights), the same data shards, the same ranks
and the same training step, run by each contender in turn, step by step, so
that machine noise falls on all alike:

    micro-batches: forward, loss / grad_accum, backward (no_sync on all but the last)
    wait for the gradient average; clip the global norm; AdamW step; zero the gradients

Contenders: ours (parallel/data.py: bucketed, overlapped, gradients as bucket
views), torch DDP with ``gradient_as_bucket_view=True`` (its fastest setting,
the same memory layout as ours: the peer the ratio is taken against), and
torch DDP with its defaults. All use the same bucket size (``--bucket-mb``).
A step's time is the slowest rank's; each contender reports the median over
the steps after ``--warmup``. Since all start from the same weights and see
the same batches, their losses must agree step by step: the report gives the
largest relative difference, a check that the timing compares equal work.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

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
from scaletrain.job.data_setup import PreparedData
from scaletrain.models import build_model
from scaletrain.optim import build_optimizer, decay_groups
from scaletrain.parallel.data import DataParallel, replicate
from scaletrain.runtime.comm import Comm
from scaletrain.runtime.mesh import Mesh
from scaletrain.train.layout import loss_fn

OURS, PEER, PEER_DEFAULT = "scaletrain DataParallel", "torch DDP (gradient_as_bucket_view)", "torch DDP (defaults)"


@dataclass
class Contender:
    name: str
    model: nn.Module
    optimizer: torch.optim.Optimizer
    no_sync: Callable
    finish: Callable[[], None]
    zero_grad: Callable[[], None]
    step_s: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)


def run(cfg: Config, warmup: int) -> dict:
    """Spawn ``--nproc`` workers, race the contenders; the result as ``bench --json`` prints it."""
    return spawn_race(cfg, warmup, _worker, "dp", "data parallelism")


def _contenders(cfg: Config, prepared: PreparedData, data, comm: Comm, mesh: Mesh) -> list[Contender]:
    dp_group = mesh.group("dp")
    contenders = []
    for name in (OURS, PEER, PEER_DEFAULT):
        torch.manual_seed(cfg.train.seed)
        model = build_model(cfg.model, vocab_size=prepared.vocab_size, seq_len=cfg.data.seq_len,
                            n_features=data.n_features, n_classes=data.n_classes)
        if name == OURS:
            replicate([*model.parameters(), *model.buffers()], comm, dp_group)
            dp = DataParallel(model, comm, dp_group, bucket_mb=cfg.parallel.bucket_mb)
            no_sync, finish, zero = dp.no_sync, dp.finish_gradient_sync, dp.zero_grad
            wrapped = model
        else:
            wrapped = DistributedDataParallel(model, process_group=dp_group.handle,
                                              bucket_cap_mb=cfg.parallel.bucket_mb,
                                              gradient_as_bucket_view=name == PEER)
            no_sync, finish, zero = wrapped.no_sync, (lambda: None), (lambda: None)
        optimizer = build_optimizer(decay_groups(model, cfg.train.weight_decay), cfg.train)
        contenders.append(Contender(name, wrapped, optimizer, no_sync, finish, zero))
    return contenders


def _step(c: Contender, batches: Batches, cfg: Config) -> float:
    c.model.train()
    loss_sum = 0.0
    for micro, (x, y) in enumerate(batches):
        with nullcontext() if micro == len(batches) - 1 else c.no_sync():
            loss = loss_fn(c.model(x), y) / len(batches)
            loss.backward()
        loss_sum += loss.item()
    c.finish()
    params = [p for group in c.optimizer.param_groups for p in group["params"]]
    torch.nn.utils.clip_grad_norm_(params, cfg.train.grad_clip if cfg.train.grad_clip > 0 else float("inf"))
    c.optimizer.step()  # at the constant --lr the optimizer was built with
    c.optimizer.zero_grad(set_to_none=True)
    c.zero_grad()
    return loss_sum


def _worker(cfg: Config, prepared: PreparedData, warmup: int) -> dict:
    with race_rank(cfg, prepared, "dp") as rank:
        comm, data, dp = rank.comm, rank.data, rank.mesh.group("dp")
        contenders = _contenders(cfg, prepared, data, comm, rank.mesh)
        race(contenders, cfg.train.steps, lambda step: step_batches(data, cfg.train, dp, step),
             lambda c, batches, _: _step(c, batches, cfg), comm, dp)
        medians = slowest_rank_medians(contenders, warmup, comm, dp)
        return _report(cfg, contenders, medians, dp.size, warmup)


def _report(cfg: Config, contenders: list[Contender], medians: dict[str, float], ranks: int,
            warmup: int) -> dict:
    rows = {}
    reference = contenders[0].losses
    for c in contenders:
        rows[c.name] = {"name": c.name, "median_s": medians[c.name], "final_loss": c.losses[-1],
                        "max_loss_rel_diff_to_ours": largest_relative_gap(c.losses, reference)}
    t = cfg.train
    ours, peer, default = rows[OURS], rows[PEER], rows[PEER_DEFAULT]
    return {
        "what": "dp",
        "machine": machine(),
        "setup": {"model": cfg.model.name, "ranks": ranks, "seq_len": cfg.data.seq_len,
                  "micro_batch": t.micro_batch, "grad_accum": t.grad_accum, "steps": t.steps,
                  "timed_steps": t.steps - warmup, "bucket_mb": cfg.parallel.bucket_mb,
                  "torch_threads_per_rank": torch.get_num_threads()},
        "ours": ours,
        "peer": peer,
        "peers": [peer, default],
        "ratio": ours["median_s"] / peer["median_s"],
        "ratio_to_default_ddp": ours["median_s"] / default["median_s"],
    }


def format_table(result: dict) -> str:
    s = result["setup"]
    lines = [f"bench dp: {s['model']} on {s['ranks']} ranks, seq {s['seq_len']}, micro-batch "
             f"{s['micro_batch']} x {s['grad_accum']}, buckets {s['bucket_mb']} MiB, {s['steps']} steps "
             f"({s['timed_steps']} timed), on {result['machine']}",
             f"{'':<38}{'step s':>9}{'ours / it':>11}{'final loss':>12}{'loss diff':>11}"]
    for row in (result["ours"], *result["peers"]):
        lines.append(f"{row['name']:<38}{row['median_s']:>9.4f}"
                     f"{result['ours']['median_s'] / row['median_s']:>11.3f}{row['final_loss']:>12.4f}"
                     f"{row['max_loss_rel_diff_to_ours']:>11.1e}")
    lines.append("step s: median over the timed steps of the slowest rank; loss diff: largest relative "
                 "difference of a step's loss from ours (the same work was timed).")
    return "\n".join(lines)
