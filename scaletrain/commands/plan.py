"""``scaletrain plan``: every layout of a model on a cluster weighed, the ones that fit ranked by
predicted tokens/s (planner/, docs/planner.md).

The training flags that change memory or time are scaletrain train's own, each
made from its configuration field (config.py `add_field_flag`): one definition
for both commands. They are fixed for every layout the search weighs.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import replace
from pathlib import Path

from scaletrain.config import Config, ModelConfig, add_field_flag, field_of, with_preset_experts
from scaletrain.errors import UserError
from scaletrain.models import PLANNED_PRESET, PRESETS
from scaletrain.parallel.pipeline.schedules import SCHEDULES
from scaletrain.paths import writable_file
from scaletrain.planner.hardware import DEVICES, Cluster, Device, parse_size
from scaletrain.planner.prediction import TRAINING_OPTIONS
from scaletrain.planner.search import RECOMPUTE as PLANNED_RECOMPUTE

FIXED = ("dp", "tp", "pp", "cp", "ep", "zero", "sp", "recompute", "pp_schedule", "microbatches",
         "virtual_stages", "micro_batch", "grad_accum", "shard_group", "quantize_weights", "zero3_gather")
PLANNED_VOCAB = 50304  # a 50257-token byte-level BPE, rounded up to a multiple of 64
POSITIVE = ("layers", "hidden", "heads", "vocab", "seq", "global_batch", "gpus", "gpus_per_node", "top", "nproc",
            "dp", "tp", "pp", "cp", "ep", "micro_batch", "grad_accum", "microbatches", "virtual_stages",
            "moe_top_k", "shard_group")
NON_NEGATIVE = ("moe_experts", "lora_rank")
# scaletrain train's fields that change what a rank holds or how long its step takes
TRAINING_FIELDS = ("precision", "offload", *TRAINING_OPTIONS)
TRAINING_NOTE = ("As scaletrain train takes them, fixed for every layout, but for two defaults: --precision is bf16 "
                 "on a GPU, and --reduce-dtype bf16 with --masters none (which needs it). --lora-rank prices a "
                 "fine-tune of the preset: its base frozen (in 4 bits with --quantize nf4), adapters beside it (and "
                 "--lora-modules-to-save's modules trained whole). Their "
                 "memory is predicted, and of their time fp8's products, the optimizer's state traffic, a frozen "
                 "base's skipped weight gradients and compression's passes; not modelled: --stochastic-rounding, "
                 "--fused (priced as torch's fused AdamW), --offload's host step and transfers, a 4-bit base's "
                 "dequantization (docs/planner.md).")
LAYOUT_FLAGS = (("dp", "data-parallel size"), ("tp", "tensor-parallel size (searched within a node)"),
                ("pp", "pipeline stages"), ("cp", "context-parallel size"), ("ep", "expert-parallel size"),
                ("micro-batch", "sequences per rank per micro-batch (searched in powers of two)"),
                ("grad-accum", "micro-batches (pipeline rounds with --pp) accumulated per step"),
                ("microbatches", "micro-batches per pipeline round [the whole per-rank batch]"),
                ("virtual-stages", "stages per rank [2 for interleaved, else 1]"))


def add_parser(commands) -> None:
    plan = commands.add_parser(
        "plan", help="predict per-rank memory and step time of parallel layouts, recommend one",
        description="Weigh every parallel layout of a model on a cluster (dp x tp x pp x cp x ep, ZeRO "
                    "stage, sp, recompute, micro-batch, pipeline schedule) at the same global batch: "
                    "drop those the trainer would refuse, predict memory per rank (the most loaded one) "
                    "and step time for the others, and rank those that fit by tokens/s. A layout flag "
                    "fixes that choice; the others are searched.")
    _add_model_and_cluster(plan)
    fixed = plan.add_argument_group("layout options (each one given is fixed, the others searched)")
    for name, meaning in LAYOUT_FLAGS:
        fixed.add_argument(f"--{name}", type=int, metavar="N", help=meaning)
    fixed.add_argument("--zero", type=int, choices=(0, 1, 2, 3), help="ZeRO stage over the replicas")
    fixed.add_argument("--shard-group", type=int, metavar="N", help="ZeRO within groups of N ranks (hybrid)")
    fixed.add_argument("--quantize-weights", choices=("none", "int8"), help="ZeRO-3's gathers in int8")
    fixed.add_argument("--zero3-gather", choices=("round", "micro-batch"),
                       help="with --zero 3 and --pp: blocks gathered once per round or per micro-batch")
    fixed.add_argument("--sp", action=argparse.BooleanOptionalAction, default=None,
                       help="sequence parallelism inside the tp group")
    fixed.add_argument("--recompute", choices=PLANNED_RECOMPUTE, help="activation checkpointing")
    fixed.add_argument("--pp-schedule", choices=SCHEDULES, help="pipeline schedule")
    training = plan.add_argument_group("training options", TRAINING_NOTE)
    for name in TRAINING_FIELDS:
        add_field_flag(training, field_of(name), None)
    model = plan.add_argument_group("model options")
    model.add_argument("--moe-experts", type=int, metavar="E", help="experts per MoE block [0: dense]")
    model.add_argument("--moe-top-k", type=int, metavar="K", help="experts per token [2]")
    plan.add_argument("--top", type=int, default=5, metavar="N", help="layouts shown [5]")
    plan.add_argument("--json", action="store_true", help="print one JSON object (CLI.md's shape)")
    plan.add_argument("--png", metavar="FILE", help="also plot memory per rank against tokens/s into this PNG")
    _add_profile(plan)
    plan.set_defaults(handler=run)


def _add_profile(plan: argparse.ArgumentParser) -> None:
    profile = plan.add_argument_group(
        "machine profile", "--calibrate measures this machine (about a minute) into a profile that plan --gpu here, "
        "the gate, --micro-batch auto and --layout auto read: --profile FILE, else SCALETRAIN_PROFILE, else "
        "$XDG_CACHE_HOME/scaletrain/machines/<device>-<backend>.json (docs/planner.md, Calibration).")
    profile.add_argument("--calibrate", action="store_true",
                         help="measure this machine's products, attention, memory, launches and collectives and "
                              "write its profile")
    profile.add_argument("--profile", metavar="FILE",
                         help="the profile to write (with --calibrate) or plan with: alone, the machine it "
                              "describes; with --gpu here, this machine's, refused if it measured another device")
    profile.add_argument("--nproc", type=int, metavar="N",
                         help="with --calibrate: processes measured, the largest group [the GPUs, or 2 on a CPU]")
    profile.add_argument("--backend", choices=("gloo", "nccl", "mpi4py"),
                         help="with --calibrate or --gpu here: the backend measured or read [nccl with a GPU, "
                              "else gloo]")
    profile.add_argument("--quick", action="store_true",
                         help="with --calibrate: small ladders in a few seconds, a sanity check only")


def _add_model_and_cluster(plan: argparse.ArgumentParser) -> None:
    plan.add_argument("--model", default=PLANNED_PRESET, metavar="NAME",
                      help=f"model preset: {', '.join(PRESETS)} [{PLANNED_PRESET}]")
    plan.add_argument("--layers", type=int, metavar="L", help="transformer blocks [the preset's]")
    plan.add_argument("--hidden", type=int, metavar="H", help="hidden size d_model [the preset's]")
    plan.add_argument("--heads", type=int, metavar="A", help="attention heads [the preset's]")
    plan.add_argument("--vocab", type=int, metavar="V",
                      help=f"vocabulary size [the preset's, else {PLANNED_VOCAB}]")
    plan.add_argument("--seq", type=int, default=1024, metavar="S", help="tokens per sequence [1024]")
    plan.add_argument("--global-batch", type=int, metavar="G",
                      help="sequences per optimizer step, the same for every layout [micro-batch x grad-accum "
                           "x microbatches x the data-parallel size, each as given, else 8, 1, 1 and what the "
                           "given sizes leave of --gpus]")
    plan.add_argument("--gpus", type=int, default=8, metavar="N", help="devices in the cluster [8]")
    plan.add_argument("--gpus-per-node", type=int, metavar="N",
                      help="devices per node, joined by the fast link [min(8, --gpus)]")
    plan.add_argument("--gpu", choices=(*DEVICES, "cpu", "here"),
                      help="the device; cpu: this machine, its peak measured, its memory shared by the "
                           "ranks of a node; here: this machine as its profile describes it (--calibrate) "
                           "[H100, or the machine --profile describes]")
    plan.add_argument("--gpu-memory", metavar="SIZE",
                      help="memory of one device, such as 80GB, 40GiB or 512MB [the device's]")


def run(args: argparse.Namespace) -> int:
    from scaletrain.planner import report
    from scaletrain.planner.predict import predict
    from scaletrain.planner.search import derived_global_batch, search

    for names, least, wanted in ((POSITIVE, 1, "be at least 1"), (NON_NEGATIVE, 0, "not be negative")):
        for name in names:
            value = getattr(args, name)
            if value is not None and value < least:
                raise UserError(f"--{name.replace('_', '-')} must {wanted}, not {value}.")
    if args.calibrate:
        return _calibrate(args)
    for name in ("nproc", "quick"):
        if getattr(args, name):
            raise UserError(f"--{name} sets what --calibrate measures; add --calibrate or drop --{name}.")
    if args.png:
        writable_file("--png", args.png)
    profiled = _profiled_device(args)
    base = base_config(args, gpu=profiled.name != "cpu" if profiled else args.gpu != "cpu")
    cluster = _cluster(args, profiled)
    fixed = {name for name in FIXED if getattr(args, name) is not None}
    global_batch = args.global_batch or derived_global_batch(base, cluster.gpus, fixed)
    result = search(base, cluster, _vocab(args), global_batch, fixed, predict)
    result.best()  # none fits: one sentence, exit code 2
    if args.png:
        report.plot(result, Path(args.png), cluster)
    print(json.dumps(report.to_json(result, args.top)) if args.json
          else report.format_table(result, args.top, cluster))
    return 0


def _calibrate(args: argparse.Namespace) -> int:
    from scaletrain.planner.calibrate import calibrate, summary

    measured, path = calibrate(args.nproc, args.backend, args.profile, args.quick)
    if measured is not None:  # mpirun's rank 0 speaks for the others
        print(json.dumps(measured) if args.json else summary(measured, path))
    return 0


def _profiled_device(args: argparse.Namespace) -> Device | None:
    """The device of ``--gpu here`` (this machine's profile) or of ``--profile FILE`` alone (the
    machine the file describes), as each process of a node sees it; None for a preset or ``--gpu cpu``."""
    from scaletrain.planner import profile

    if args.profile and args.gpu not in (None, "here"):
        raise UserError(f"--profile {args.profile} describes its own device; drop --gpu {args.gpu}, or give "
                        f"--gpu here to plan for this machine with it.")
    if args.backend and args.gpu != "here":
        raise UserError(f"--backend {args.backend} chooses what --calibrate measures or which profile --gpu here "
                        f"reads; add one of them or drop --backend.")
    if args.gpu == "here":
        import torch

        on_gpu = args.backend == "nccl" if args.backend else torch.cuda.is_available()
        return profile.for_this_machine(on_gpu, args.backend, args.profile, required=True,
                                        processes=_per_node(args))
    if args.profile:
        return profile.device_of(profile.load(Path(args.profile), "--profile"), _per_node(args))
    return None


def _per_node(args: argparse.Namespace) -> int:
    """Devices (on a CPU: processes) per node."""
    per_node = args.gpus_per_node or min(8, args.gpus)
    if args.gpus % per_node:
        raise UserError(f"--gpus-per-node {per_node} must divide --gpus {args.gpus}; the nodes are equal.")
    return per_node


def _cluster(args: argparse.Namespace, profiled: Device | None) -> Cluster:
    """The devices to plan for. A CPU "node" is this machine (or the profile's): its ranks share its memory."""
    per_node = _per_node(args)
    if profiled is not None:
        device = replace(profiled, memory_bytes=profiled.memory_bytes // per_node) if profiled.name == "cpu" \
            else profiled
    elif args.gpu == "cpu":
        from scaletrain.planner.machine import this_cpu

        host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        device = this_cpu(host // per_node, per_node)
    else:
        device = DEVICES[args.gpu or "H100"]
    cluster = Cluster(device, args.gpus, per_node)
    return cluster.with_memory(parse_size(args.gpu_memory)) if args.gpu_memory else cluster


def base_config(args: argparse.Namespace, gpu: bool) -> Config:
    """The model, precision and fixed layout choices as one Config; the search fills in the rest."""
    if args.model not in PRESETS:
        raise UserError(f"--model {args.model} is not a model preset; choose one of {', '.join(PRESETS)}.")
    family = PRESETS[args.model]
    preset = family.shape(family.configure(ModelConfig(name=args.model), 1, args.seq))
    heads, width = args.heads or preset.n_heads, args.hidden or preset.d_model
    if width % heads:
        raise UserError(f"--hidden {width} is not divisible by --heads {heads}; choose sizes where it is.")
    model = {"name": args.model, "n_layers": args.layers, "d_model": args.hidden, "n_heads": args.heads,
             "seq_len": args.seq, "moe_experts": args.moe_experts, "moe_top_k": args.moe_top_k}
    training = {name: getattr(args, name) for name in TRAINING_FIELDS}
    training["precision"] = args.precision or ("bf16" if gpu else "fp32")
    if args.masters == "none" and args.reduce_dtype is None:
        training["reduce_dtype"] = "bf16"
    fixed = {name: getattr(args, name) for name in FIXED}
    given = {**model, **training, **fixed}
    return with_preset_experts(Config().replace(**{k: v for k, v in given.items() if v is not None}))


def _vocab(args: argparse.Namespace) -> int:
    return args.vocab or PRESETS[args.model].presets[args.model].get("n_vocab") or PLANNED_VOCAB
