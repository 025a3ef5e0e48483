"""``scaletrain bench WHAT``: side-by-side measurements, printed as tables and JSON.

Every benchmark runs the things it compares in one process, alternating
between them step by step, so that whatever else the machine is doing at a
moment falls on all of them alike; it reports medians and ratios, and names
the machine it ran on, since figures mean nothing without it.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

import torch

from scaletrain.config import Config, TrainConfig
from scaletrain.errors import UserError
from scaletrain.job.data_setup import PreparedData, open_data, prepare_data
from scaletrain.job.trainer import first_sample
from scaletrain.runtime.comm import Comm
from scaletrain.runtime.launch import detect_environment, init_distributed, shutdown
from scaletrain.runtime.mesh import Group, Mesh, ParallelDims
from scaletrain.runtime.spawn import spawn_local


def machine() -> str:
    """CPU model and core count (and the GPU, when there is one), plus torch's version."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as info:
            cpu = next(line.split(":", 1)[1].strip() for line in info if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    text = f"{cpu}, {os.cpu_count()} cores visible, {torch.get_num_threads()} torch threads"
    if torch.cuda.is_available():
        text += f", {torch.cuda.get_device_name()}"
    return f"{text}, torch {torch.__version__}"


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


class Racer(Protocol):
    """What `race` records for a contender: its name, and per step its time and loss."""

    name: str
    step_s: list[float]
    losses: list[float]


R = TypeVar("R", bound=Racer)
Batches = list[tuple[torch.Tensor, torch.Tensor]]


def spawn_race(cfg: Config, warmup: int, worker: Callable[[Config, Any, int], dict], what: str,
               compares: str, *, dim: str = "dp") -> dict:
    """Check the arguments of ``bench WHAT`` for a race across ``--nproc`` processes,
    prepare the data, and run ``worker(cfg, spec, warmup)`` in each, the processes
    forming the mesh dim ``dim`` (the others of size 1); rank 0's result."""
    n = cfg.parallel.nproc
    if n < 2:
        raise UserError(f"bench {what} compares {compares} across processes; give --nproc 2 or more.")
    if warmup >= cfg.train.steps:
        raise UserError(f"--warmup {warmup} leaves no timed step of --steps {cfg.train.steps}; "
                        f"raise --steps or lower --warmup.")
    if detect_environment().world_size > 1:
        raise UserError(f"bench {what} starts its own processes; run it with --nproc N, not under a launcher.")
    prepared = prepare_data(cfg, cache_dir=Path(cfg.data.cache_dir))
    return spawn_local(n, worker, (cfg.replace(**{"dp": 1, dim: n}), prepared, warmup))[0]


@dataclass
class RaceRank:
    """One process of a race that `spawn_race` started: its mesh (every rank
    along one dim), its door to the network, its device and the opened data."""

    mesh: Mesh
    comm: Comm
    device: torch.device
    data: Any


@contextmanager
def race_rank(cfg: Config, prepared: PreparedData, dim: str) -> Iterator[RaceRank]:
    """Join the race's process group as one rank along ``dim``; leave it on exit."""
    env = detect_environment()
    runtime = init_distributed(env, timeout_s=cfg.parallel.timeout)  # also gives each rank its share of cores
    try:
        mesh = Mesh.build(ParallelDims(**{dim: env.world_size}), env.rank, env.world_size)
        yield RaceRank(mesh, Comm(), runtime.device, open_data(prepared, cfg))
    finally:
        shutdown(runtime)


def rotated(items: Sequence[R], step: int) -> list[R]:
    """``items`` starting from the ``step``-th, cyclically: raced in this order,
    no contender always runs right after the same one."""
    first = step % len(items)
    return [*items[first:], *items[:first]]


def step_batches(data: Any, t: TrainConfig, group: Group, step: int) -> Batches:
    """This rank's micro-batches of ``step`` (its slice of the global batch, as the trainer reads it)."""
    return [data.train.get(first_sample(step, m, t.grad_accum, group.size, group.rank, t.micro_batch),
                           t.micro_batch) for m in range(t.grad_accum)]


def race(contenders: Sequence[R], steps: int, batches_at: Callable[[int], Batches],
         train_step: Callable[[R, Batches, int], float], comm: Comm, group: Group) -> None:
    """Train every contender ``steps`` steps on the same batches, step by step in
    rotating order, each step after a barrier so that all ranks start it together;
    appends each step's time and ``train_step``'s loss to the contender."""
    for step in range(steps):
        batches = batches_at(step)
        for c in rotated(contenders, step):
            comm.barrier(group)
            start = time.perf_counter()
            c.losses.append(train_step(c, batches, step))
            c.step_s.append(time.perf_counter() - start)


def slowest_rank_medians(contenders: Sequence[Racer], warmup: int, comm: Comm, group: Group) -> dict[str, float]:
    """Each contender's median step time over the steps after ``warmup``, a
    step taking as long as its slowest rank did (it is done only when every rank is)."""
    ranks = comm.all_gather_object({c.name: c.step_s for c in contenders}, group)
    return {c.name: median([max(times) for times in zip(*(rank[c.name] for rank in ranks))][warmup:])
            for c in contenders}


def largest_relative_gap(values: Sequence[float], reference: Sequence[float]) -> float:
    """The largest ``|value - reference| / |reference|``, element by element."""
    return max(abs(a - b) / abs(b) for a, b in zip(values, reference, strict=True))


BENCHMARKS = ("techniques", "dp", "zero", "tp", "pp", "allreduce", "adam", "softmax", "cross-entropy", "load",
              "prepare", "finetune", "throughput", "planner")
