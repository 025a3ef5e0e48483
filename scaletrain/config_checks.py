"""The settings that contradict each other, or the world they run in: each
refused in one sentence that says what to change, before any work starts.

`check_values` needs no model and no processes, so the launching process
runs it first; `resolve_layout` then sets the layout against the world's size
and the model's shape (the planner asks it of every layout it weighs); the
mesh's own sizes are checked where the mesh is built (runtime/mesh.py).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Collection

import torch

from scaletrain.config import AUTO, Config, ParallelConfig
from scaletrain.errors import UserError
from scaletrain.job.eval_tasks import check_settings as check_eval_tasks
from scaletrain.job.trackers import TRACKERS
from scaletrain.job.trackers import names as tracker_names
from scaletrain.kernels import unavailable
from scaletrain.kernels.head_loss import CHUNKED, head_is_whole
from scaletrain.models import CLASSIFIER, spec_for
from scaletrain.parallel.pipeline import schedules
from scaletrain.runtime.mesh import ParallelDims
from scaletrain.runtime.ray_launch import check_placement
from scaletrain.techniques.recompute import parse_policy

_POSITIVE = ("steps", "micro_batch", "grad_accum", "seq_len", "eval_batches", "nproc", "tp", "pp",
             "microbatches", "virtual_stages", "vocab_multiple", "cp", "ep", "shard_group", "vocab_size",
             "mlp_hidden", "n_layers", "n_heads", "d_model", "dp", "powersgd_rank", "moe_top_k", "moe_every",
             "log_every", "n_positions", "n_vocab",
             "sync_every")
_NON_NEGATIVE = ("warmup_steps", "weight_decay", "grad_clip", "eval_every", "checkpoint_every",
                 "sample_tokens", "min_lr_ratio", "moe_experts", "moe_aux_coef", "moe_z_coef", "keep_last",
                 "max_restarts", "momentum")
_ABOVE_ZERO = ("lr", "timeout", "bucket_mb", "norm_eps", "epochs")


def check_values(cfg: Config) -> None:
    """Range checks that need no model or world: one sentence per mistake."""
    _check_ranges(cfg)
    _check_dtypes(cfg)
    _check_trackers(cfg)
    _check_sharding(cfg)
    _check_run_control(cfg)
    _check_pipeline(cfg.parallel)
    _check_local_sgd(cfg)
    _check_mpi(cfg)
    _check_two_bw(cfg)
    _check_context(cfg)
    _check_experts(cfg)
    _check_fp8(cfg)
    _check_peak(cfg.train.peak_tflops)
    _check_adapter(cfg)
    _check_chat(cfg)
    _check_cuda_graphs(cfg)
    check_eval_tasks(cfg.train)


def _check_chat(cfg: Config) -> None:
    """The rendering switches of instruction records, which plain text has no use for."""
    d = cfg.data
    given = [flag for flag, value in (("--chat-template", d.chat_template), ("--train-on-inputs", d.train_on_inputs),
                                      ("--system-prompt", d.system_prompt)) if value]
    if given and not d.sft:
        raise UserError(f"{given[0]} shapes how instruction records are rendered; add --sft, or drop {given[0]}.")


def setting_warnings(cfg: Config, given: Collection[str] = ()) -> list[str]:
    """The settings of ``cfg`` that do nothing, one sentence each: warned, not refused (the run
    is valid, only not what was asked). ``given``: the options named explicitly (the library's
    ``setup``), so a default the configuration ignores says nothing."""
    t, p = cfg.train, cfg.parallel
    said = []
    if t.warmup_steps >= t.steps:
        said.append(f"warmup_steps={t.warmup_steps} (--warmup-steps) is not below steps={t.steps}, so the learning "
                    f"rate never reaches lr={t.lr:g}; lower warmup_steps or raise steps.")
    if "momentum" in given and t.optimizer != "sgd":
        said.append(f"momentum is SGD's, but the optimizer is {t.optimizer}; drop momentum or set optimizer='sgd'.")
    if "powersgd_rank" in given and p.compress != "powersgd":
        said.append("powersgd_rank sets PowerSGD's rank, but compress is not 'powersgd'; drop it or set "
                    "compress='powersgd'.")
    return said


def _check_adapter(cfg: Config) -> None:
    """``--adapter`` continues a PEFT adapter over the base it was made for; the folder itself is
    read with the base (job/base_model.py)."""
    if cfg.finetune.adapter and not cfg.finetune.base:
        raise UserError(f"--adapter {cfg.finetune.adapter} continues a PEFT adapter over the model it was made "
                        f"for; add --from with that base (a Hugging Face model folder, or one of our runs).")


def _check_fp8(cfg: Config) -> None:
    """``--precision fp8`` converts the blocks' linear layers (techniques/fp8.py): one sentence where
    a layout rewrote them into what it cannot convert."""
    if cfg.train.precision != "fp8":
        return
    p = cfg.parallel
    if p.pp > 1 and p.pp_schedule == "zb-h1":
        raise UserError("--precision fp8 does not combine with --pp-schedule zb-h1: zero bubble's deferred weight "
                        "pass computes dW = dy^T x from the bf16 tensors its backward kept, where fp8's weight "
                        "gradient is the product of their float8 casts, so the two would round apart; use another "
                        "schedule, or --precision bf16.")


def _check_ranges(cfg: Config) -> None:
    flat = cfg.flat()
    for name in _POSITIVE:
        if flat[name] is not None and flat[name] != AUTO and flat[name] < 1:
            raise UserError(f"--{name.replace('_', '-')} must be at least 1, not {flat[name]}.")
    for name in _NON_NEGATIVE:
        if flat[name] < 0:
            raise UserError(f"--{name.replace('_', '-')} must not be negative, not {flat[name]}.")
    if cfg.train.micro_batch == AUTO and cfg.model.name == CLASSIFIER:
        raise UserError("--micro-batch auto plans a decoder's memory; give the mlp a number, such as "
                        "--micro-batch 64.")
    if not 0 < cfg.data.val_fraction < 1:
        raise UserError(f"--val-fraction must be between 0 and 1, not {cfg.data.val_fraction}.")
    if not 0 <= cfg.model.dropout < 1:
        raise UserError(f"--dropout must be in [0, 1), not {cfg.model.dropout}.")
    for name in _ABOVE_ZERO:
        if flat[name] is not None and flat[name] <= 0:
            raise UserError(f"--{name.replace('_', '-')} must be positive, not {flat[name]}.")
    positions = cfg.model.n_positions
    if positions is not None and cfg.data.seq_len > positions:
        raise UserError(f"--seq-len {cfg.data.seq_len} is longer than the model's {positions} positions "
                        f"(--n-positions); choose a --seq-len of at most {positions}.")
    steps = cfg.train.steps  # None: still to be derived from --epochs (run_length.py), checked once it is
    if cfg.run.stop_at is not None and not 1 <= cfg.run.stop_at <= (steps or cfg.run.stop_at):
        raise UserError(f"--stop-at must lie between 1 and --steps ({steps}), not {cfg.run.stop_at}.")
    if cfg.train.epochs is not None and cfg.train.micro_batch == AUTO:
        raise UserError("--epochs counts steps of the global batch, which --micro-batch auto settles only once the "
                        "run has started; give --micro-batch a number, or --steps.")


def _check_dtypes(cfg: Config) -> None:
    if cfg.train.param_dtype == "bf16" and cfg.train.precision not in ("bf16", "fp8"):
        raise UserError(f"--param-dtype bf16 needs --precision bf16 or fp8 (autocast runs the matmuls in bf16 "
                        f"and keeps norms and the loss in fp32), not --precision {cfg.train.precision}.")
    _check_pure_bf16(cfg)


def _check_sharding(cfg: Config) -> None:
    """ZeRO, hybrid sharding and tensor (and sequence) parallelism against what they cannot hold."""
    if cfg.parallel.reduce_dtype == "bf16" and cfg.train.param_dtype != "bf16":
        raise UserError("--reduce-dtype bf16 reduces bf16 gradients, which only --param-dtype bf16 "
                        "produces; add it, or keep --reduce-dtype fp32.")
    if cfg.parallel.zero:
        for flag, used in (("--allreduce ring", cfg.parallel.allreduce != "backend"),
                           ("--compress", cfg.parallel.compress != "none")):
            if used:
                raise UserError(f"--zero {cfg.parallel.zero} does not combine with {flag}, which needs whole "
                                f"gradients where ZeRO keeps flat shards; drop one of the two.")
    _check_hybrid(cfg.parallel)
    p = cfg.parallel
    if cfg.train.offload == "base" and (p.zero != 3 or cfg.finetune.lora_rank < 1 or p.pp > 1 or p.ep > 1):
        raise UserError("--offload base keeps ZeRO-3's shards of a fine-tune's frozen base in host memory, and "
                        "only adapters (--lora-rank) over a ZeRO-3 base (--zero 3, no --pp or --ep, whose stages "
                        "and experts keep the base whole) have such shards; add --lora-rank and --zero 3, or "
                        "drop --offload base.")
    tp = cfg.parallel.tp
    if cfg.parallel.sp and tp < 2:
        raise UserError(f"--sp splits the sequence over the tp group, which needs --tp 2 or more, "
                        f"not --tp {tp}; add --tp or drop --sp.")
    if tp > 1:
        if cfg.parallel.sp and cfg.data.seq_len % tp:
            raise UserError(f"--sp splits each sequence of --seq-len {cfg.data.seq_len} over --tp {tp} "
                            f"ranks; choose a --seq-len divisible by {tp}.")
        if cfg.train.optimizer == "adafactor":
            raise UserError(f"--tp {tp} does not combine with --optimizer adafactor: Adafactor factors the "
                            f"second moment of whole weight matrices; drop one of the two.")


def _check_run_control(cfg: Config) -> None:
    """Non-finite handling, restarts, the launcher and the fused kernels."""
    if cfg.train.on_nan == "stop" and cfg.train.precision == "fp16":
        raise UserError("--on-nan stop contradicts --precision fp16, whose loss scaling finds its scale by "
                        "skipping the steps that overflow; use --on-nan skip or another precision.")
    if cfg.parallel.max_restarts and cfg.parallel.nproc < 2 and cfg.parallel.launcher == "local":
        raise UserError("--max-restarts restarts the workers that --nproc spawns; add --nproc, or under "
                        "torchrun give torchrun its own --max-restarts.")
    check_launcher(cfg.parallel)
    if cfg.train.fused == "triton" and cfg.train.optimizer not in ("adamw", "adamw8bit"):
        raise UserError("--fused triton fuses AdamW and 8-bit AdamW; drop it, or use --optimizer adamw "
                        "or adamw8bit.")


def _check_peak(peak: str | None) -> None:
    if peak is not None and peak != "measure":
        try:
            if float(peak) <= 0:
                raise ValueError
        except ValueError:
            raise UserError(f"--peak-tflops must be a positive number or 'measure', not {peak!r}.") from None


def check_here(cfg: Config, command: str) -> None:
    """`check_values`, for a command that starts its processes on this machine itself."""
    check_values(cfg)
    if cfg.parallel.launcher != "local":
        raise UserError(f"{command} starts its processes on this machine itself; drop --launcher "
                        f"{cfg.parallel.launcher}.")
    if cfg.parallel.layout == AUTO:  # chosen where a training run starts (planner/auto.py)
        raise UserError(f"{command} runs the layout it is given, and --layout auto is chosen by a training run "
                        f"(scaletrain train or finetune); give the sizes (--dp, --tp, --pp, --zero, ...) and drop "
                        f"--layout.")
    refuse_auto(cfg, command)


def refuse_auto(cfg: Config, command: str) -> None:
    """``--micro-batch auto`` is chosen where a training run starts (planner/fit.py); what compares
    or times runs of a set size needs the number."""
    if cfg.train.micro_batch == AUTO:
        raise UserError(f"--micro-batch auto is chosen by a training run (scaletrain train or finetune); {command} "
                        f"needs a number, such as --micro-batch 8.")


def check_launcher(p: ParallelConfig) -> None:
    """--launcher ray's own options: given only with it, and a placement Ray can make."""
    if p.launcher == "ray":
        check_placement(p.ray_placement(), p.nproc, p.backend)
        return
    for flag, used in (("--ray-address", p.ray_address is not None), ("--cpus-per-worker", p.cpus_per_worker != 1),
                       ("--gpus-per-worker", p.gpus_per_worker != 0)):
        if used:
            raise UserError(f"{flag} places Ray workers; add --launcher ray, or drop {flag}.")


def _check_trackers(cfg: Config) -> None:
    """--tracker (job/trackers.py): known names, their packages installed."""
    for name in tracker_names(cfg.run.tracker):
        if name not in TRACKERS:
            raise UserError(f"--tracker {name} is not a tracker; choose among {', '.join(TRACKERS)}, "
                            f"comma-separated.")
        package, extra = ("ray", "ray") if name == "tune" else (name, name)
        if name != "tensorboard" and importlib.util.find_spec(package) is None:
            raise UserError(f"--tracker {name} needs the {package} package; pip install 'scaletrain[{extra}]' (or "
                            f"{package}), or drop it.")
    if cfg.run.register and "mlflow" not in tracker_names(cfg.run.tracker):
        raise UserError(f"--register {cfg.run.register} registers the model in MLflow's registry; add mlflow to "
                        f"--tracker, or drop --register.")


def _check_pure_bf16(cfg: Config) -> None:
    """--masters none and --stochastic-rounding (optim/stochastic_rounding.py)."""
    t, p = cfg.train, cfg.parallel
    if t.stochastic_rounding and t.masters != "none":
        raise UserError("--stochastic-rounding rounds the updates of bf16 weights that have no fp32 master; "
                        "add --masters none (with --param-dtype bf16), or drop it.")
    if t.stochastic_rounding and t.optimizer not in ("adamw", "sgd"):
        raise UserError(f"--stochastic-rounding steps AdamW or SGD, whose state follows the weight's dtype, "
                        f"not --optimizer {t.optimizer}; choose one of those, or drop it.")
    if t.masters != "none":
        return
    if t.param_dtype != "bf16":
        raise UserError("--masters none keeps the working weights as the only copy, which only makes sense "
                        "for bf16 weights; add --param-dtype bf16 (with --precision bf16).")
    if p.reduce_dtype != "bf16":
        raise UserError("--masters none keeps the gradients in bf16 as well; add --reduce-dtype bf16.")
    if t.offload == "optimizer":
        raise UserError("--offload optimizer moves the optimizer's own copy of the weights (the fp32 masters) and "
                        "its state to the host, and --masters none keeps no copy apart from the bf16 weights the "
                        "device computes with, which it steps in place; drop one of the two.")


def _check_hybrid(p: ParallelConfig) -> None:
    """--shard-group and --quantize-weights (parallel/hybrid.py); the divisibility of the
    dp group is checked with the mesh (runtime/mesh.py)."""
    if p.shard_group is not None and not p.zero:
        raise UserError(f"--shard-group {p.shard_group} shards ZeRO's state within groups of ranks, which "
                        f"needs --zero 1, 2 or 3; add --zero or drop --shard-group.")
    if p.quantize_weights != "none" and p.zero != 3:
        raise UserError(f"--quantize-weights {p.quantize_weights} compresses ZeRO-3's parameter all-gathers, "
                        f"which only --zero 3 makes; use --zero 3 or drop --quantize-weights.")


def _check_local_sgd(cfg: Config) -> None:
    p, every = cfg.parallel, cfg.parallel.sync_every
    if every == 1:
        return
    if p.zero:
        raise UserError(f"--sync-every {every} keeps a whole model and optimizer on every rank, which --zero "
                        f"{p.zero} shards over the same ranks; drop one of the two.")
    if p.compress != "none":
        raise UserError(f"--compress compresses the gradient all-reduce, which --sync-every {every} replaces "
                        f"with a parameter average every {every} steps; drop one of the two.")
    for flag, used in (("--tp", p.tp > 1), ("--pp", p.pp > 1), ("--cp", p.cp > 1), ("--ep", p.ep > 1)):
        if used:
            raise UserError(f"--sync-every {every} averages whole-model replicas (each rank keeps and steps the "
                            f"whole model between averages: parallel/local_sgd.py), and under {flag} no rank holds "
                            f"one; drop one of the two.")
    for flag, value in (("--checkpoint-every", cfg.run.checkpoint_every),
                        ("--stop-at", cfg.run.stop_at if cfg.run.stop_at != cfg.train.steps else None)):
        if value and value % every:
            lower = value - value % every
            raise UserError(f"{flag} {value} must be a multiple of --sync-every {every}, so that every "
                            f"checkpoint holds averaged replicas; choose "
                            f"{f'{lower} or ' if lower else ''}{lower + every}.")


def _check_mpi(cfg: Config) -> None:
    p = cfg.parallel
    if p.backend != "mpi4py":
        return
    if p.nproc > 1:
        raise UserError(f"--backend mpi4py takes its processes from mpirun; run mpirun -n {p.nproc} scaletrain "
                        f"train ... without --nproc.")
    # Without a torch process group the main rank writes checkpoints alone, which holds
    # everything only when every rank holds the same whole model and optimizer.
    for flag, used in (("--tp", p.tp > 1), ("--pp", p.pp > 1), ("--cp", p.cp > 1), ("--ep", p.ep > 1),
                       ("--zero", p.zero > 0), ("--sync-every", p.sync_every > 1)):
        if used:
            raise UserError(f"--backend mpi4py has no torch process group, so the main rank writes every "
                            f"checkpoint alone, which holds the run only where every rank holds the same whole model "
                            f"and optimizer, and under {flag} the ranks hold different ones; drop {flag} or use "
                            f"--backend gloo.")
    if p.reduce_dtype == "bf16":
        raise UserError("--backend mpi4py reduces numpy buffers, and numpy has no bfloat16; use --reduce-dtype "
                        "fp32 or --backend gloo.")


def _check_context(cfg: Config) -> None:
    cp = cfg.parallel.cp
    if cp == 1:
        return
    if cfg.data.seq_len % (2 * cp):
        raise UserError(f"--cp {cp} cuts each sequence into {2 * cp} equal chunks (two per rank, for "
                        f"balanced causal work); choose a --seq-len divisible by {2 * cp}.")
    if cfg.parallel.sp and cfg.data.seq_len // cp % cfg.parallel.tp:
        raise UserError(f"--sp splits each rank's {cfg.data.seq_len // cp} positions over --tp "
                        f"{cfg.parallel.tp}; choose a --seq-len divisible by {cp * cfg.parallel.tp}.")
    if cfg.model.dropout > 0:
        raise UserError(f"--cp {cp} computes attention by ring attention, which has no dropout; "
                        f"use --dropout 0.")
    if cfg.train.compile:
        raise UserError(f"--compile cannot capture ring attention's point-to-point hops, which --cp {cp} "
                        f"puts in every block; drop --compile.")


def _check_cuda_graphs(cfg: Config) -> None:
    """What a CUDA graph replay cannot follow (techniques/compile.py): one sentence for each."""
    t, p = cfg.train, cfg.parallel
    if t.compile_mode == "default":
        return
    if not t.compile:
        raise UserError(f"--compile-mode {t.compile_mode} says how --compile compiles; add --compile.")
    why = next((reason for given, reason in (
        (cfg.data.pack, "--pack gives each micro-batch its own documents' mask, and a graph replays the one it "
                        "recorded"),
        (p.pp > 1, f"--pp {p.pp} keeps several micro-batches in flight through a block, and each replay writes "
                   "into the outputs the one before still needs"),
        (p.zero == 3, "--zero 3 gathers each block's weights into fresh storage every step, and a graph reads the "
                      "addresses it recorded"),
        (p.tp > 1 or p.ep > 1, "tensor and expert parallelism communicate inside every block, and a replay would "
                               "run their collectives unseen by the communication ledger"),
        (cfg.model.moe_experts > 0, "a mixture of experts reads its routing's counts on the host inside each "
                                    "block, a sync a graph cannot hold"),
    ) if given), None)
    if why:
        raise UserError(f"--compile-mode {t.compile_mode} replays each block as a CUDA graph, but {why}; drop "
                        f"--compile-mode {t.compile_mode} (plain --compile still fuses the block's kernels).")


def _check_experts(cfg: Config) -> None:
    m, p = cfg.model, cfg.parallel
    if not m.moe_experts:
        if p.ep > 1:
            raise UserError(f"--ep {p.ep} divides the experts of a mixture of experts; add --moe-experts "
                            f"(a multiple of {p.ep}) or use --ep 1.")
        return
    if m.name == "mlp":
        raise UserError("--moe-experts replaces a decoder's MLP blocks; drop it for the mlp.")
    if m.moe_top_k > m.moe_experts:
        raise UserError(f"--moe-top-k {m.moe_top_k} routes each token to more experts than the "
                        f"{m.moe_experts} there are; choose at most {m.moe_experts}.")
    if m.moe_capacity is not None and m.moe_capacity <= 0:
        raise UserError(f"--moe-capacity must be positive, not {m.moe_capacity}; leave it out for "
                        f"dropless routing.")
    if p.ep > 1 and m.moe_experts % p.ep:
        raise UserError(f"--ep {p.ep} must divide the {m.moe_experts} experts; choose --moe-experts "
                        f"divisible by {p.ep}.")
    # Each sequence is one routing group (its capacity and balance loss): a layout
    # that splits a sequence over ranks would route its pieces apart.
    for flag, used in (("--cp", p.cp > 1), ("--sp", p.sp)):
        if used:
            raise UserError(f"{flag} splits each sequence over ranks, but a mixture of experts routes "
                            f"each sequence as one group; drop {flag} or --moe-experts.")
    # With --ep the experts' copies live across dp alone and the dense weights' across dp x ep,
    # so their gradients are reduced by two groups (train/replicas.py).
    if p.compress != "none" and p.ep > 1:
        raise UserError("--compress does not combine with --ep: a compressor averages each gradient over the "
                        "group that reduces it, and --ep sums the experts' gradients over dp but divides them "
                        "by dp x ep; drop one of the two.")


def _check_two_bw(cfg: Config) -> None:
    """What PipeDream-2BW's lagging update and never-drained pipeline cannot go with."""
    t, p, r = cfg.train, cfg.parallel, cfg.run
    if p.pp_schedule != schedules.PIPEDREAM_2BW:
        return
    for flag, used, why in (
            ("--grad-accum", t.grad_accum > 1 and p.pp > 1, "a weight version's gradient is that of its "
             "--microbatches micro-batches; give --microbatches M x A instead"),
            ("--zero", p.zero > 0, "ZeRO steps flat shards of the weights, where 2BW keeps two versions of "
             "whole ones; use --zero 0"),
            ("--precision fp16", t.precision == "fp16", "the loss scale could change between the steps over "
             "which a version's gradient accumulates; use bf16 or fp32"),
            ("--checkpoint-every, --resume, --stop-at or --max-restarts",
             bool(r.checkpoint_every or r.resume or r.stop_at or p.max_restarts),
             "between steps the older weight version and its micro-batches are still in flight, so the run "
             "saves only at its end; drop them")):
        if used:
            raise UserError(f"--pp-schedule pipedream-2bw does not combine with {flag}: {why}.")


def _check_pipeline(p: ParallelConfig) -> None:
    if p.pp == 1:
        for flag, used in (("--microbatches", (p.microbatches or 1) > 1),
                           ("--virtual-stages", (p.virtual_stages or 1) > 1)):
            if used:
                raise UserError(f"{flag} shapes a pipeline, which needs --pp 2 or more; add --pp, or use "
                                f"--grad-accum for more micro-batches per step.")
        return
    try:
        schedules.check(p.pp_schedule, p.pp, *p.pipeline_sizes())
    except ValueError as exc:
        raise UserError(f"{exc}.") from None


def resolve_layout(cfg: Config, world_size: int) -> tuple[Config, ParallelDims]:
    """Fill in dp and check the layout against the world and the model."""
    p = cfg.parallel
    dims = p.mesh_dims(world_size)
    if p.sync_every > 1 and dims.dp == 1:
        raise UserError(f"--sync-every {p.sync_every} averages data-parallel replicas, but this layout has one "
                        f"(dp 1); start more processes (--nproc) or drop --sync-every.")
    parse_policy(cfg.train.recompute)
    for flag, used in (("--fused triton", cfg.train.fused == "triton"),
                       ("--head-loss chunked", cfg.train.head_loss == CHUNKED)):
        reason = unavailable(torch.device("cuda" if torch.cuda.is_available() else "cpu"), flag) if used else None
        if reason:
            raise UserError(f"{flag}: {reason}")
    if cfg.train.head_loss == CHUNKED and not head_is_whole(dims.tp, dims.pp, p.zero):
        raise UserError(f"--head-loss chunked needs the head's weight whole on the rank that computes the loss, "
                        f"and --tp {dims.tp}, --pp {dims.pp}, --zero {p.zero} leave it split, on another stage "
                        f"or freed; drop --head-loss, or use --tp 1, --pp 1 and --zero below 3.")
    if cfg.model.name == CLASSIFIER:
        for flag, used in (("--recompute", cfg.train.recompute != "none"), ("--compile", cfg.train.compile)):
            if used:
                raise UserError(f"{flag} applies to a decoder's blocks; drop it for the mlp.")
        if cfg.train.head_loss is not None:
            raise UserError("--head-loss applies to a language model's head; drop it for the mlp.")
        dims.validate_for_model(n_heads=None, n_layers=None, seq_len=None)
    else:
        family = spec_for(cfg.model.name)
        g = family.configure(cfg.model, 1, cfg.data.seq_len)
        family.check(g, dims.tp)
        shape = family.shape(g)
        dims.validate_for_model(n_heads=shape.n_heads, n_layers=shape.n_layers, seq_len=cfg.data.seq_len,
                                n_experts=shape.moe_experts or None)
        if shape.moe_experts and shape.moe_every > shape.n_layers:
            raise UserError(f"--moe-every {shape.moe_every} skips every one of the model's {shape.n_layers} "
                            f"blocks; choose at most {shape.n_layers}.")
        _, virtual = cfg.parallel.pipeline_sizes()
        if dims.pp * virtual > shape.n_layers:
            raise UserError(f"--pp {dims.pp} with --virtual-stages {virtual} cuts the model into "
                            f"{dims.pp * virtual} stages, but it has {shape.n_layers} layers; lower one of the two "
                            f"or raise --n-layers.")
    return cfg.replace(dp=dims.dp), dims
