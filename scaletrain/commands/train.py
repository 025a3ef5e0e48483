"""``scaletrain train`` and ``scaletrain finetune``: a training run from start to end: check,
prepare, launch, train, report.

Order matters for the user: every check that can fail on user input (values,
layout against world size and model, run folder, checkpoint to resume, data)
runs before any worker starts or any file is written, so a mistake costs one
sentence and leaves nothing behind. The launching process prepares the data
cache and the run folder, then runs the worker itself (one process, or under
torchrun/SLURM/MPI where every process is a worker) or spawns ``--nproc``
local workers.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from scaletrain.config import (
    AUTO,
    Config,
    add_config_flags,
    given_values,
    load_run_config,
    resolve,
)
from scaletrain.config_checks import check_values, resolve_layout, setting_warnings
from scaletrain.data.digits import NUM_CLASSES, NUM_FEATURES
from scaletrain.errors import JobFailed, UserError
from scaletrain.finetune.adapters import add_adapters, trained_names
from scaletrain.finetune.lora import ADAPTER_FILE, rank_above_width, save_adapters
from scaletrain.job.base_model import as_finetune
from scaletrain.job.data_setup import PreparedData, prepare_data, save_run_tokenizer
from scaletrain.job.eval_tasks import training_tasks
from scaletrain.job.interrupt import interrupts_explained
from scaletrain.job.loop import RunSummary, fit, loss_text
from scaletrain.job.reports import (
    write_comm_report,
    write_memory_report,
    write_pipeline_timeline,
)
from scaletrain.job.trainer import Trainer
from scaletrain.models import build_model, spec_for
from scaletrain.paths import readable_dir, writable_dir
from scaletrain.planner.auto import (
    Planned,
    announce,
    kept_axes,
    plan_for_run,
    plan_in_workers,
    report_measured,
)
from scaletrain.planner.fit import (
    chosen_sentence,
    device_memory,
    largest_fitting,
    measured_sentence,
)
from scaletrain.planner.gate import Machine, check_run
from scaletrain.restart import continue_after_restart
from scaletrain.resume_layout import resumed_layout
from scaletrain.run_length import length_from_command, settle_steps
from scaletrain.runtime.comm import Comm
from scaletrain.runtime.debug import (
    RankLog,
    check_same_config,
    check_same_parameters,
    debug_environment,
)
from scaletrain.runtime.desync import CollectiveTracker
from scaletrain.runtime.health import Health
from scaletrain.runtime.launch import (
    CLUSTER_TIMEOUT_S,
    ProcessEnv,
    check_backend,
    connect,
    default_timeout,
    detect_environment,
    init_distributed,
    restart_attempt,
    shutdown,
)
from scaletrain.runtime.mesh import Mesh, ParallelDims
from scaletrain.runtime.ray_launch import launch_ray, ray_cluster
from scaletrain.runtime.spawn import WorkerKilled, spawn_local
from scaletrain.techniques.compile import COMPILE_NOTE
from scaletrain.train import checkpoint as ckpt
from scaletrain.train.manifest import verify_checkpoint


def add_parser(commands) -> None:
    train = commands.add_parser(
        "train", help="train a model",
        description="Train a model. With no arguments: the small default model on the built-in corpus (the "
                    "Python standard library's source), on CPU, in one process.")
    add_config_flags(train)
    train.set_defaults(handler=run)
    finetune = commands.add_parser(
        "finetune", help="fine-tune a trained model, with LoRA or QLoRA adapters",
        description="Train on new data from a checkpoint or a Hugging Face model folder (--from), with its model "
                    "and tokenizer: every weight, "
                    "or LoRA adapters beside the frozen base (--lora-rank), the base stored in 4 bits with "
                    "--quantize nf4. Takes every flag of train.")
    add_config_flags(finetune)
    finetune.set_defaults(handler=run_finetune)


def run_finetune(args: argparse.Namespace) -> int:
    if getattr(args, "from") is None and not args.resume:
        raise UserError("scaletrain finetune needs --from, the run folder, checkpoint or Hugging Face model folder to "
                        "start from.")
    return run(args)


def run(args: argparse.Namespace) -> int:
    """``scaletrain train``: the flags over the TOML file (over the run's own settings with
    ``--resume``), launched; rank 0 prints the summary."""
    base = None
    if args.resume:
        if args.out is None:
            raise UserError("--resume needs --out, the folder of the run to continue.")
        run_dir = readable_dir("--out", args.out, "the folder of the run to continue")
        # --stop-at limits one invocation; the resumed one sets its own, or runs to --steps.
        base = load_run_config(run_dir).replace(stop_at=None)
    cfg = length_from_command(resolve(args, base), set(given_values(args)))  # --steps, or --epochs to derive them
    if base is not None:  # the saved layout on this world: dp derived, the global batch kept
        cfg, change = resumed_layout(base, cfg, set(given_values(args)), world_size_for(cfg, detect_environment()))
        if change and detect_environment().rank == 0:
            print(change)
    summary = launch(cfg, set(given_values(args)))
    if summary is not None and detect_environment().rank == 0:  # under a launcher, rank 0 speaks for the job
        print_summary(summary)
    return 0


def world_size_for(cfg: Config, env: ProcessEnv) -> int:
    if cfg.parallel.nproc > 1 and env.world_size > 1:
        raise UserError(f"--nproc spawns local workers, but this process is already one of "
                        f"{env.world_size} launched by {env.source}; drop --nproc.")
    return cfg.parallel.nproc if cfg.parallel.nproc > 1 else env.world_size


def default_out(cfg: Config) -> str:
    return str(Path("runs") / f"{cfg.model.name}-{time.strftime('%Y%m%d-%H%M%S')}")


def check_run_folder(cfg: Config) -> None:
    out = Path(cfg.run.out)
    writable_dir("--out", out)
    if cfg.run.resume:
        latest = ckpt.latest_checkpoint(out)
        if latest is None and restart_attempt() > 0:
            return  # restarted before its first checkpoint: the run starts over in its folder
        if latest is None:
            raise UserError(f"--resume found no complete checkpoint in {out}; start a new run "
                            f"without --resume or point --out at an earlier run.")
        done = int(latest.name.removeprefix("step_"))
        if cfg.train.steps is not None and done >= cfg.train.steps:  # None: derived from --epochs, checked then
            raise UserError(f"the run in {out} already finished {done} of --steps {cfg.train.steps}; "
                            f"raise --steps to train further.")
        if cfg.run.stop_at is not None and cfg.run.stop_at <= done:
            raise UserError(f"--stop-at {cfg.run.stop_at} is not after step {done}, where the run in {out} "
                            f"resumes; give a later step or leave --stop-at out.")
        check_optimizer_layout(latest, cfg)
    elif out.exists() and any(out.iterdir()):
        raise UserError(f"--out {out} already holds another run; choose a new folder or add --resume.")


def check_resumable(cfg: Config, prepared: PreparedData) -> None:
    """Before a resume: the newest checkpoint is whole (its manifest's sizes and
    hashes) and of this model (the shapes in its metadata, the vocabulary's too)."""
    latest = ckpt.latest_checkpoint(Path(cfg.run.out)) if cfg.run.resume else None
    if latest is None:
        return
    verify_checkpoint(latest)
    # A fine-tune's checkpoint holds its adapters (and NF4 codes, which quantizing computes from
    # the weights' values: on the CPU, as meta tensors have none).
    with torch.device("cpu" if cfg.finetune.quantize == "nf4" else "meta"):
        model = build_model(cfg.model, vocab_size=prepared.vocab_size, seq_len=cfg.data.seq_len,
                            n_features=NUM_FEATURES, n_classes=NUM_CLASSES)
        if cfg.finetune.base:
            add_adapters(model, cfg.finetune, spec_for(cfg.model.name))
    ckpt.check_fits(latest, {key: tuple(t.shape) for key, t in model.state_dict().items()})


def check_optimizer_layout(path: Path, cfg: Config) -> None:
    """Local SGD saves each rank's own optimizer state (one row per rank), any other run one
    state for all: a resume must keep to the kind, and to the number of rows."""
    try:
        saved = json.loads((path / ckpt.STATE_FILE).read_text()).get("optimizer_per_rank")
    except (OSError, ValueError):
        return  # a damaged checkpoint, which check_resumable's verification names
    wanted = cfg.parallel.dp if cfg.parallel.sync_every > 1 else None
    if saved == wanted:
        return
    if saved is None:
        raise UserError(f"checkpoint {path} holds one optimizer state for every rank, but --sync-every "
                        f"{cfg.parallel.sync_every} keeps one per rank; resume without --sync-every.")
    raise UserError(f"checkpoint {path} holds the optimizer states of local SGD's {saved} ranks; resume with "
                    f"--sync-every above 1 over {saved} data-parallel ranks.")


def prepare_run(cfg: Config) -> tuple[Config, PreparedData]:
    """Everything before training that can fail on user input, then the folder: the run's settings
    as its config.toml records them (the steps of --epochs derived: run_length.py), and its data."""
    check_values(cfg)
    check_run_folder(cfg)
    out = Path(cfg.run.out)
    prepared = prepare_data(cfg, cache_dir=Path(cfg.data.cache_dir) if cfg.data.cache_dir else out.parent / ".cache")
    settled = settle_steps(cfg, prepared)
    if settled is not cfg:  # the steps derived: a resume given --epochs again may have done them already
        check_run_folder(settled)
    cfg = settled
    check_resumable(cfg, prepared)
    out.mkdir(parents=True, exist_ok=True)
    save_run_tokenizer(prepared, out)  # what a fine-tune from this run, or generate, tokenizes with
    (out / "config.toml").write_text(cfg.to_toml())
    return cfg, prepared


def launch(cfg: Config, given: set[str] = frozenset()) -> RunSummary:
    """The command line's door: validate, prepare, then run or spawn workers (--layout auto keeps ``given``)."""
    cfg = as_finetune(cfg)  # first: a fine-tune's default folder is named after its base's model
    if cfg.run.out is None:
        cfg = cfg.replace(out=default_out(cfg))
    with interrupts_explained(Path(cfg.run.out)):  # Ctrl-C: one line saying how to go on
        return _check_and_start(cfg, kept_axes(cfg, given))


def _check_and_start(cfg: Config, kept: frozenset[str] | None = None) -> RunSummary:
    """`launch`'s checks, then the run prepared and started; ``kept``: the sizes --layout auto
    keeps, while it is still to choose (planner/auto.py), else None."""
    env = detect_environment()
    check_values(cfg)
    training_tasks(cfg.train)  # the harness's tasks found and their data read before the run folder is made
    # A torchrun restart, maybe on another world (an elastic node range): every rank reads the run's
    # config.toml here, before the group forms, so before rank 0 rewrites it (restart.py).
    cfg, relaid, kept = continue_after_restart(cfg, world_size_for(cfg, env), kept)  # its layout, or re-planned
    if relaid and env.rank == 0:
        print(relaid)
    world = world_size_for(cfg, env)
    planned = plan_for_run(cfg, world, world, check_backend(cfg.parallel.backend, env) == "nccl", kept,
                           calibrate_if_missing=True) if kept is not None and env.world_size == 1 else None
    cfg, kept = (planned.cfg, None) if planned else (cfg, kept)  # the launching process chose for its workers
    cfg, dims = resolve_layout(cfg, world_size_for(cfg, env))
    timeout = CLUSTER_TIMEOUT_S
    if cfg.parallel.launcher == "local":  # Ray's workers, not this process, have the devices to check
        backend = check_backend(cfg.parallel.backend, env)
        timeout = default_timeout(backend, env)
        # a run predicted not to fit this machine's memory stops here (planner/gate.py); auto's search was its gate
        if planned is None and kept is None:
            check_run(cfg, dims.world_size,
                      Machine.here(backend == "nccl", max(cfg.parallel.nproc, env.local_world_size), env.local_rank))
    if cfg.parallel.timeout is None:  # the number in config.toml, the same in every worker
        cfg = cfg.replace(timeout=timeout)
    if cfg.parallel.debug_dist:
        debug_environment()  # before any process group; workers spawned below inherit it
    if cfg.parallel.launcher == "ray":
        with ray_cluster(cfg.parallel.ray_placement(), cfg.parallel.nproc):
            return execute(*prepare_started(cfg, dims))
    if cfg.parallel.nproc == 1:  # every process a worker: under a launcher rank 0 chooses --layout auto's layout
        return run_worker(cfg, None, kept, planned)
    started = prepare_started(cfg, dims)
    announce(planned, Path(started[0].run.out))
    return execute(*started)


def prepare_started(cfg: Config, dims: ParallelDims) -> tuple[Config, PreparedData]:
    """The run prepared (`prepare_run`), then announced by the process that prepared it: its
    configuration as saved, its layout and warnings, printed only once nothing can refuse the run."""
    cfg, prepared = prepare_run(cfg)
    print(f"# resolved configuration (saved as {cfg.run.out}/config.toml)\n{cfg.to_toml()}")
    print(f"layout {dims.describe()} on {dims.world_size} process(es)\n{dims.layout_table()}\n")
    if cfg.train.compile:
        print(COMPILE_NOTE)
    for sentence in setting_warnings(cfg):
        print(f"warning: {sentence}", file=sys.stderr)
    return cfg, prepared


def execute(cfg: Config, prepared: PreparedData | None) -> RunSummary:
    """Run the worker here, or start ``--nproc`` ones, on this machine or Ray's cluster (the run prepared)."""
    p, out = cfg.parallel, Path(cfg.run.out)
    try:
        if p.launcher == "ray":
            return launch_ray(p.nproc, run_worker, (cfg, prepared), placement=p.ray_placement(),
                              max_restarts=p.max_restarts, name=out.name, storage=out / "ray", timeout_s=p.timeout)
        if p.nproc > 1:
            return spawn_local(p.nproc, run_worker, (cfg, prepared), max_restarts=p.max_restarts)[0]
    except WorkerKilled as exc:
        raise JobFailed(f"{exc}; {restart_hint(out)}.") from None
    return run_worker(cfg, prepared)


def run_worker(cfg: Config, prepared: PreparedData | None, kept: frozenset[str] | None = None,
               planned: Planned | None = None) -> RunSummary:
    """One worker: join the group, (choose --layout auto's layout keeping ``kept``, prepare) if nobody did, train;
    ``planned``: the choice this one process made before it joined."""
    env = detect_environment()
    debug = cfg.parallel.debug_dist
    # --debug-dist: a log per rank, from the start where the launching process made the run folder.
    rank_log = RankLog(Path(cfg.run.out), env.rank, env.world_size, echo=env.rank == 0) \
        if debug and prepared is not None else None
    try:
        runtime = init_distributed(env, timeout_s=cfg.parallel.timeout, backend=cfg.parallel.backend)
    except BaseException:
        if rank_log:
            rank_log.close()
        raise
    health = Health(env, runtime.timeout_s) if runtime.torch_group else None
    trainer: Trainer | None = None
    try:
        cfg, chosen_here = plan_in_workers(cfg, kept, runtime)  # before the mesh: it is the chosen layout's
        planned = chosen_here or planned
        dims = cfg.parallel.mesh_dims(env.world_size)
        tracker = CollectiveTracker()  # the desync detector's record: who a timed-out collective waits for
        mesh, comm = connect(runtime, dims, tracker)
        if health:
            health.track(tracker)
        world = mesh.group("world")
        if debug:  # every rank started alike, before rank 0 writes anything
            check_same_config(comm, world, cfg.to_dict())
        cfg, prepared, predicted = _agreed_start(cfg, prepared, runtime, env, comm, world)
        if runtime.is_main:
            announce(planned, Path(cfg.run.out))
        if debug and rank_log is None:
            rank_log = RankLog(Path(cfg.run.out), env.rank, env.world_size, echo=env.rank == 0)
        trainer = Trainer(cfg, prepared, runtime, mesh, comm, Path(cfg.run.out))
        _announce(trainer, runtime.is_main, debug, comm, world)
        summary = _train_and_report(trainer, cfg, predicted, runtime.is_main, mesh, comm)
        # Every rank done before any leaves, through the tracked door: a rank still waiting in a
        # collective of the run (one that another rank skipped) is named here, not left to time out.
        comm.barrier(world)
        return summary
    except Exception as exc:
        reported = explain_failure(exc, health, trainer.where if trainer else "before training", Path(cfg.run.out))
        if reported is exc:
            raise
        raise reported from None
    finally:
        if health:
            health.stop()
        shutdown(runtime, barrier=False)
        if rank_log:
            rank_log.close()


def _agreed_start(cfg: Config, prepared: PreparedData | None, runtime, env: ProcessEnv, comm: Comm,
                  world) -> tuple[Config, PreparedData, dict | None]:
    """What rank 0 decides and every rank learns: the run's settings after a restart, its data
    (prepared here if no launching process did), and ``--micro-batch auto``'s choice with its
    predicted memory by row (None without auto); a refusal on rank 0 is every rank's."""
    outcome: tuple[Config, PreparedData, dict | None] | str | None = None
    if runtime.is_main:
        try:
            cfg = continue_after_restart(cfg, env.world_size)[0]  # workers --max-restarts restarts: one world
            if prepared is None:
                cfg, prepared = prepare_started(cfg, cfg.parallel.mesh_dims(env.world_size))
            cfg, predicted = choose_micro_batch(cfg, prepared, runtime.device, env)
            outcome = (cfg, prepared, predicted)
        except UserError as exc:
            outcome = str(exc)
    outcome = comm.all_gather_object(outcome, world)[0]
    if isinstance(outcome, str):
        raise UserError(outcome)
    return outcome


def _announce(trainer: Trainer, is_main: bool, debug: bool, comm: Comm, world) -> None:
    """Before the first step: with --debug-dist, every copy of each weight checked alike (dense
    ones over dense, experts over experts); the parameter counts, an adapter rank above a layer's
    width (warned), a resume and a pipeline's schedule said."""
    layout = trainer.layout
    if debug:
        experts = layout.expert_parallel.expert_params if layout.expert_parallel else {}
        for group, mine in ((layout.replicas.dense, False), (layout.replicas.experts, True)):
            check_same_parameters(comm, world, group.ranks,
                                  [(n, p) for n, p in layout.model.named_parameters() if (p in experts) == mine])
    if is_main:
        print(trainer.parameter_counts)
    wasted_rank = rank_above_width(layout.model) if is_main else None
    if wasted_rank:
        print(f"warning: {wasted_rank}", file=sys.stderr)
    if trainer.start_step and is_main:
        print(f"resumed from checkpoint step_{trainer.start_step:06d}")
    if layout.pipeline and is_main:
        schedule = layout.pipeline.schedule
        print(f"pipeline: {schedule.name}, {schedule.micro_batches} micro-batches per round, "
              f"{schedule.virtual_stages} stage(s) per rank\n{layout.pipeline.layout}\n")


def _train_and_report(trainer: Trainer, cfg: Config, predicted: dict | None, is_main: bool, mesh: Mesh,
                      comm: Comm) -> RunSummary:
    """The run's steps, then what it leaves beside its metrics: the LoRA adapters, the
    communication and memory reports, --micro-batch auto's prediction against the measure, and a
    pipeline's recorded timeline."""
    layout, run_dir, world = trainer.layout, Path(cfg.run.out), mesh.group("world")
    try:
        summary = fit(trainer)
    except torch.OutOfMemoryError:
        if predicted is None:
            raise
        raise JobFailed(f"--micro-batch auto chose {cfg.train.micro_batch}, which the planner predicted to "
                        f"fit in {predicted['total'] / 2**30:.2f} GiB, but a step ran out of memory; give "
                        f"--micro-batch {max(cfg.train.micro_batch // 2, 1)}.") from None
    if cfg.finetune.lora_rank and is_main and summary.checkpoint:  # whole, from the final checkpoint: not the base
        trained = trained_names(cfg.finetune, spec_for(cfg.model.name), layout.model.cfg)
        save_adapters(ckpt.read_model_tensors(summary.checkpoint, trained), run_dir / ADAPTER_FILE,
                      {"rank": str(cfg.finetune.lora_rank), "alpha": str(cfg.finetune.lora_alpha),
                       "targets": cfg.finetune.lora_targets, "base": str(cfg.finetune.base),
                       "step": str(summary.steps_done)})
    if cfg.run.report_comm:
        write_comm_report(comm, world, run_dir, is_main)
    if cfg.run.report_memory:
        write_memory_report(trainer.memory_report(), comm, world, run_dir, is_main)
    if predicted is not None and is_main:
        print(measured_sentence(cfg.train.micro_batch, predicted, trainer.memory_report()))
    if is_main:
        report_measured(cfg, run_dir, trainer.start_step)
    if layout.pipeline:
        write_pipeline_timeline(cfg, summary.steps_done, trainer.timeline, mesh, comm, run_dir)
    return summary


def choose_micro_batch(cfg: Config, prepared: PreparedData, device: torch.device,
                       env: ProcessEnv) -> tuple[Config, dict | None]:
    """``--micro-batch auto`` made a number (planner/fit.py), with the memory ledger on so that the
    first step measures it, and its predicted bytes by row; any other micro-batch as it is (None)."""
    if cfg.train.micro_batch != AUTO:
        return cfg, None
    memory = device_memory(device, env.local_world_size)
    micro_batch, predicted = largest_fitting(cfg, env.world_size, prepared.vocab_size, memory, device.type == "cuda")
    print(chosen_sentence(micro_batch, predicted, memory))
    return cfg.replace(micro_batch=micro_batch, report_memory=True), predicted


def explain_failure(exc: Exception, health: Health | None, where: str, run_dir: Path) -> Exception:
    """What this rank's failure is reported as. Its own (a sentence, or a bug with
    its traceback): as it is, after telling the others. A collective that failed
    because another rank did: a `JobFailed` naming that rank (runtime/health.py), the rank it
    waits for and where that rank is (runtime/desync.py), or, when every member is in it and
    it timed out, the collective; ``where``: where the run stood (``in step 3``)."""
    if health is None:
        return exc
    if isinstance(exc, (UserError, JobFailed)):
        health.failed(str(exc))
        return exc
    culprit = health.diagnose() or health.desync() or health.stuck(exc)
    if culprit is None:
        health.failed(f"{type(exc).__name__}: {ckpt.failure_reason(exc)}")
        return exc
    health.leave()
    return JobFailed(f"{culprit}, so rank {health.env.rank} stopped {where}; {restart_hint(run_dir)}.")


def restart_hint(run_dir: Path) -> str:
    """How to go on after the job failed: from which checkpoint, by which command."""
    latest = ckpt.latest_checkpoint(run_dir)
    if latest is None:
        return "the run has no complete checkpoint yet: run the same command again"
    return (f"its newest complete checkpoint is {latest.name}: run the same command with --resume to go on from "
            f"there (a launch with --max-restarts, ours or torchrun's, does it by itself)")


def print_summary(summary: RunSummary) -> None:
    entropy = summary.unigram_entropy
    line = f"\nfinished step {summary.steps_done}: train loss {loss_text(summary.final_loss)}"
    if summary.val_loss is not None:
        line += f", validation loss {loss_text(summary.val_loss)}"
    if entropy is not None:
        line += f" (unigram entropy of the corpus: {entropy:.4f} nats)"
    print(line)
    if summary.sample is not None:
        print(f"\n--- sample ---\n{summary.sample}\n--------------")
    print(f"metrics:    {summary.run_dir / 'metrics.jsonl'} (TensorBoard: {summary.run_dir / 'tensorboard'})")
    if summary.checkpoint is not None:
        print(f"checkpoint: {summary.checkpoint}")
