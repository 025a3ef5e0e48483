"""A training run from start to end: check, prepare, launch, train, report.

Order matters for the user: every check that can fail on user input (values,
layout against world size and model, run folder, checkpoint to resume, data)
runs before any worker starts or any file is written, so a mistake costs one
sentence and leaves nothing behind. The launching process prepares the data
cache and the run folder, then runs the worker itself (one process, or under
torchrun/SLURM/MPI where every process is a worker) or spawns ``--nproc``
local workers.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from scaletrain.compile import COMPILE_NOTE
from scaletrain.config import Config, check_values
from scaletrain.dist.comm import Comm, Ledger
from scaletrain.dist.launch import ProcessEnv, detect_environment, init_distributed, shutdown, spawn_local
from scaletrain.dist.mesh import Mesh, ParallelDims
from scaletrain.errors import UserError
from scaletrain.kernels import unavailable
from scaletrain.models import gpt_config
from scaletrain.recompute import parse_policy
from scaletrain.train import checkpoint as ckpt
from scaletrain.train.data_setup import DataSpec, prepare_data
from scaletrain.train.memory import format_table as format_memory_table
from scaletrain.train.trainer import RunSummary, Trainer


def world_size_for(cfg: Config, env: ProcessEnv) -> int:
    if cfg.parallel.nproc > 1 and env.world_size > 1:
        raise UserError(f"--nproc spawns local workers, but this process is already one of "
                        f"{env.world_size} launched by {env.source}; drop --nproc.")
    return cfg.parallel.nproc if cfg.parallel.nproc > 1 else env.world_size


def resolve_layout(cfg: Config, world_size: int) -> tuple[Config, ParallelDims]:
    """Fill in dp and check the layout against the world and the model."""
    p = cfg.parallel
    dims = p.mesh_dims(world_size)
    parse_policy(cfg.train.recompute)
    if cfg.train.fused == "triton":
        reason = unavailable(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
        if reason:
            raise UserError(f"--fused triton: {reason}")
    if cfg.model.name == "mlp":
        for flag, used in (("--recompute", cfg.train.recompute != "none"), ("--compile", cfg.train.compile)):
            if used:
                raise UserError(f"{flag} applies to the GPT models' blocks; drop it for the mlp.")
        dims.validate_for_model(n_heads=None, n_layers=None, seq_len=None)
    else:
        g = gpt_config(cfg.model, vocab_size=1, seq_len=cfg.data.seq_len)
        if g.d_model % g.n_heads:
            raise UserError(f"--d-model {g.d_model} is not divisible by --n-heads {g.n_heads}; "
                            f"choose sizes where it is.")
        dims.validate_for_model(n_heads=g.n_heads, n_layers=g.n_layers, seq_len=cfg.data.seq_len,
                                n_experts=g.moe.experts if g.moe else None)
        if g.moe and g.moe.every > g.n_layers:
            raise UserError(f"--moe-every {g.moe.every} skips every one of the model's {g.n_layers} blocks; "
                            f"choose at most {g.n_layers}.")
        _, virtual = cfg.parallel.pipeline_sizes()
        if dims.pp * virtual > g.n_layers:
            raise UserError(f"--pp {dims.pp} with --virtual-stages {virtual} cuts the model into "
                            f"{dims.pp * virtual} stages, but it has {g.n_layers} layers; lower one of the two "
                            f"or raise --n-layers.")
    return cfg.replace(dp=dims.dp), dims


def default_out(cfg: Config) -> str:
    return str(Path("runs") / f"{cfg.model.name}-{time.strftime('%Y%m%d-%H%M%S')}")


def check_run_folder(cfg: Config) -> None:
    out = Path(cfg.run.out)
    if cfg.run.resume:
        latest = ckpt.latest_checkpoint(out)
        if latest is None:
            raise UserError(f"--resume found no complete checkpoint in {out}; start a new run "
                            f"without --resume or point --out at an earlier run.")
        done = int(latest.name.removeprefix("step_"))
        if done >= cfg.train.steps:
            raise UserError(f"the run in {out} already finished {done} of --steps {cfg.train.steps}; "
                            f"raise --steps to train further.")
        if cfg.run.stop_at is not None and cfg.run.stop_at <= done:
            raise UserError(f"--stop-at {cfg.run.stop_at} is not after step {done}, where the run in {out} "
                            f"resumes; give a later step or leave --stop-at out.")
    elif out.exists() and any(out.iterdir()):
        raise UserError(f"--out {out} already holds another run; choose a new folder or add --resume.")


def prepare_run(cfg: Config) -> DataSpec:
    """Everything before training that can fail on user input, then the folder."""
    check_values(cfg)
    check_run_folder(cfg)
    out = Path(cfg.run.out)
    spec = prepare_data(cfg, cache_dir=Path(cfg.data.cache_dir) if cfg.data.cache_dir else out.parent / ".cache")
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.toml").write_text(cfg.to_toml())
    return spec


def launch(cfg: Config) -> RunSummary:
    """The command line's door: validate, prepare, then run or spawn workers."""
    if cfg.run.out is None:
        cfg = cfg.replace(out=default_out(cfg))
    env = detect_environment()
    check_values(cfg)
    cfg, dims = resolve_layout(cfg, world_size_for(cfg, env))
    if env.rank == 0:
        print(f"# resolved configuration (saved as {cfg.run.out}/config.toml)\n{cfg.to_toml()}")
        print(f"layout {dims.describe()} on {dims.world_size} process(es)\n{dims.layout_table()}\n")
        if cfg.train.compile:
            print(COMPILE_NOTE)
    return execute(cfg, prepare_run(cfg) if cfg.parallel.nproc > 1 else None)


def execute(cfg: Config, spec: DataSpec | None) -> RunSummary:
    """Run the worker here, or spawn ``--nproc`` local ones (the run prepared)."""
    if cfg.parallel.nproc > 1:
        return spawn_local(cfg.parallel.nproc, run_worker, (cfg, spec))[0]
    return run_worker(cfg, spec)


def run_worker(cfg: Config, spec: DataSpec | None) -> RunSummary:
    """One worker: join the group, (prepare if nobody did), train, report."""
    env = detect_environment()
    runtime = init_distributed(env, timeout_s=cfg.parallel.timeout)
    try:
        dims = cfg.parallel.mesh_dims(env.world_size)
        mesh = Mesh.build(dims, env.rank, env.world_size)
        comm = Comm(Ledger())
        world = mesh.group("world")
        if spec is None:  # no launching process prepared the run: rank 0 does, all learn the verdict
            outcome: DataSpec | str | None = None
            if runtime.is_main:
                try:
                    outcome = prepare_run(cfg)
                except UserError as exc:
                    outcome = str(exc)
            outcome = comm.all_gather_object(outcome, world)[0]
            if isinstance(outcome, str):
                raise UserError(outcome)
            spec = outcome
        trainer = Trainer(cfg, spec, runtime, mesh, comm, Path(cfg.run.out))
        if trainer.pipeline and runtime.is_main:
            schedule = trainer.pipeline.schedule
            print(f"pipeline: {schedule.name}, {schedule.micro_batches} micro-batches per round, "
                  f"{schedule.virtual_stages} stage(s) per rank\n{trainer.pipeline.layout}\n")
        summary = trainer.fit()
        if cfg.run.report_comm:
            write_comm_report(comm, world, Path(cfg.run.out), runtime.is_main)
        if cfg.run.report_memory:
            write_memory_report(trainer.memory_report(), comm, world, Path(cfg.run.out), runtime.is_main)
        if trainer.pipeline:
            write_pipeline_timeline(cfg, summary.steps_done, trainer.timeline, mesh, comm, Path(cfg.run.out))
        return summary
    finally:
        shutdown(runtime)


def write_comm_report(comm: Comm, world, run_dir: Path, is_main: bool) -> None:
    """comm.json: every rank's ledger, gathered to the main rank and printed."""
    mine = comm.ledger.to_json()
    table = comm.ledger.table()
    ledgers = comm.all_gather_object(mine, world)
    if is_main:
        (run_dir / "comm.json").write_text(json.dumps({str(r): l for r, l in enumerate(ledgers)}, indent=2))
        print(f"\ncommunication ledger, rank 0 (all ranks in {run_dir}/comm.json)\n{table}")


def write_memory_report(mine: dict, comm: Comm, world, run_dir: Path, is_main: bool) -> None:
    """memory.json: every rank's memory ledger, gathered to the main rank and printed."""
    ledgers = comm.all_gather_object(mine, world)
    if is_main:
        (run_dir / "memory.json").write_text(json.dumps({str(r): l for r, l in enumerate(ledgers)}, indent=2))
        print(f"\nmemory ledger, rank 0 (all ranks in {run_dir}/memory.json)\n{format_memory_table(mine)}")


def write_pipeline_timeline(cfg: Config, step: int, spans: list | None, mesh: Mesh, comm: Comm,
                            run_dir: Path) -> None:
    """pipeline.json: the computations of the run's last step on each pp rank of
    the first replica, in seconds from the step's start (``scaletrain schedule
    --measured`` draws them beside the plan)."""
    first_replica = all(mesh.coords[dim] == 0 for dim in ("dp", "ep", "cp", "tp"))
    mine = [{"kind": s.action.kind, "micro": s.action.micro, "stage": s.action.stage, "start": s.start,
             "end": s.end} for s in spans or ()] if first_replica else None
    gathered = comm.all_gather_object((mesh.coords["pp"], mine), mesh.group("world"))
    if mesh.rank != 0:
        return
    micro, virtual = cfg.parallel.pipeline_sizes()
    ranks = [entries for _, entries in sorted((pp, e) for pp, e in gathered if e is not None)]
    (run_dir / "pipeline.json").write_text(json.dumps(
        {"schedule": cfg.parallel.pp_schedule, "pp": len(ranks), "microbatches": micro,
         "virtual_stages": virtual, "step": step, "ranks": ranks}))


def print_summary(summary: RunSummary) -> None:
    entropy = summary.unigram_entropy
    line = f"\nfinished step {summary.steps_done}: train loss {summary.final_loss:.4f}"
    if summary.val_loss is not None:
        line += f", validation loss {summary.val_loss:.4f}"
    if entropy is not None:
        line += f" (unigram entropy of the corpus: {entropy:.4f} nats)"
    print(line)
    if summary.sample is not None:
        print(f"\n--- sample ---\n{summary.sample}\n--------------")
    print(f"metrics:    {summary.run_dir / 'metrics.jsonl'} (TensorBoard: {summary.run_dir / 'tensorboard'})")
    if summary.checkpoint is not None:
        print(f"checkpoint: {summary.checkpoint}")
