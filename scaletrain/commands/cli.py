"""The ``scaletrain`` command: train, finetune, parity, bench, schedule, plan, export, generate, prepare, run.

User mistakes (a ``UserError``, a bad flag) print one sentence on stderr and
exit with code 2, without a traceback; see CLI.md for the contract. A job
that fails (a rank died, the loss is not finite: ``JobFailed``) prints its
sentence and exits with code 1.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from pathlib import Path

# Before torch loads: its C++ side logs a warning with a stack trace for every
# socket a dead peer closed (the rendezvous store, gloo), pages of them before
# the one sentence that names the rank. Errors still show; a user's own
# TORCH_CPP_LOG_LEVEL=WARNING brings the warnings back. --debug-dist asks for
# them all (runtime/debug.py), and torch reads the level only when it loads.
if "--debug-dist" in sys.argv[1:]:
    os.environ["TORCH_CPP_LOG_LEVEL"] = "INFO"
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

from scaletrain.config import Config, add_config_flags, load_run_config, resolve  # noqa: E402
from scaletrain.config_checks import check_here  # noqa: E402
from scaletrain.errors import JobFailed, UserError  # noqa: E402
from scaletrain.models import TINY_PRESET  # noqa: E402
from scaletrain.paths import readable_dir, writable_file  # noqa: E402
from scaletrain.plan.hardware import DEVICES, Cluster, cpu_device, parse_size  # noqa: E402


class _Parser(argparse.ArgumentParser):
    """argparse, but a mistake is one sentence rather than usage plus error."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: {message}; see {self.prog} --help.\n")


def _add_train_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE", help="TOML file with any of the fields below "
                                                          "(flags override it)")
    add_config_flags(parser)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="scaletrain", description="Train neural networks at scale, every technique "
                                                    "from scratch, checked against one device.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    train = commands.add_parser(
        "train", help="train a model",
        description="Train a model. With no arguments: the small default model on the built-in corpus (the "
                    "Python standard library's source), on CPU, in one process.")
    _add_train_flags(train)

    finetune = commands.add_parser(
        "finetune", help="fine-tune a trained model, with LoRA or QLoRA adapters",
        description="Train on new data from a checkpoint or a Hugging Face model folder (--from), with its model "
                    "and tokenizer: every weight, "
                    "or LoRA adapters beside the frozen base (--lora-rank), the base stored in 4 bits with "
                    "--quantize nf4. Takes every flag of train.")
    _add_train_flags(finetune)

    parity = commands.add_parser(
        "parity", help="check a layout against single-device training",
        description="Train the single-device reference and the requested layout with the same seed, "
                    "data and global batch; compare per-step losses and final parameters. Exit code "
                    "0 when they agree within --tolerance, 1 when they do not. Defaults differ from "
                    f"train: --model {TINY_PRESET} --steps 10 --seq-len 64 --micro-batch 4 --cache-dir runs/.cache.")
    _add_train_flags(parity)
    parity.add_argument("--tolerance", type=float, default=1e-5,
                        help="largest relative difference allowed, per step and per tensor [1e-05]")
    parity.add_argument("--json", action="store_true", help="print one JSON object")

    from scaletrain.bench import BENCHMARKS
    from scaletrain.bench.techniques import TECHNIQUES
    from scaletrain.models import LADDER_PRESET

    bench = commands.add_parser(
        "bench", help="measure techniques side by side",
        description="Run the compared variants side by side, alternating step by step, and print "
                    "medians and ratios. techniques: every single-device technique against the plain "
                    "run, with its memory ledger and loss, in one process. dp: our data parallelism "
                    "against torch DistributedDataParallel on --nproc ranks. allreduce: the ring "
                    "all-reduce against the backend's, bus bandwidth from 4 KiB to 64 MiB on --nproc "
                    "ranks (--steps timed calls per size), plotted. prepare: scaletrain prepare's tokens/s "
                    "with 1 and --workers processes and its peak memory, on generated corpora of --gigabytes. "
                    "finetune: the fine-tuning ladder (docs/finetuning.md), each rung's memory at four points "
                    "of a step, peak, time and loss, measured here, or with --gpu-memory predicted for a GPU; "
                    f"its defaults: --model {LADDER_PRESET} --seq-len 128 --micro-batch 4 --steps 10. "
                    "throughput: our trainer's step against a plain PyTorch loop over our model and "
                    "transformers' model of the same family and size, each in its own process: tokens/s, "
                    "MFU, peak memory, losses (docs/performance.md). "
                    "Defaults differ from train: "
                    "--steps 20 --eval-batches 4 --cache-dir runs/.cache.")
    bench.add_argument("what", choices=BENCHMARKS, help="what to measure")
    bench.add_argument("--techniques", metavar="A,B", help=f"a subset of: {', '.join(TECHNIQUES)} "
                                                           f"[all; the baseline always runs]")
    bench.add_argument("--warmup", type=int, default=3, metavar="N",
                       help="first steps left out of the timing (metering, compilation) [3]")
    bench.add_argument("--plot", metavar="FILE",
                       help="where bench allreduce and bench finetune draw their figures [runs/bench-WHAT.png]")
    bench.add_argument("--rungs", metavar="A,B", help="bench finetune's rungs [all; dp, zero1-3, hybrid with --nproc]")
    bench.add_argument("--gpu-memory", metavar="SIZE",
                       help="bench finetune: predict every rung for an H100 with this much memory (80GB, 40GiB) "
                            "instead of measuring here")
    bench.add_argument("--gigabytes", default="0.5,3", metavar="A,B",
                       help="bench prepare's generated corpus sizes, in GB [0.5,3]")
    bench.add_argument("--folder", metavar="DIR", help="where bench prepare writes its corpora [a temporary folder]")
    bench.add_argument("--json", action="store_true", help="print one JSON object")
    _add_train_flags(bench)

    from scaletrain.parallel.pipeline.schedules import ALL_SCHEDULES, SCHEDULES

    # No defaults here: with --measured, a flag left out takes the run's value.
    schedule = commands.add_parser(
        "schedule", help="draw a pipeline schedule's timeline",
        description="Draw the pipeline timeline, one row per rank, and print the bubble fraction (the "
                    "idle share of each rank's step) against the papers' formula. Planned timelines "
                    "take one unit per chunk forward and equal forward, backward and weight-gradient "
                    "costs. With --measured, the sizes come from the run and its recorded step is "
                    "drawn beside the plan.")
    schedule.add_argument("--pp", type=int, metavar="N", help="pipeline ranks [4]")
    schedule.add_argument("--microbatches", type=int, metavar="M", help="micro-batches per step [8]")
    schedule.add_argument("--pp-schedule", choices=ALL_SCHEDULES,
                          help="the schedule (pipedream-2bw: one step of its steady state) [1f1b]")
    schedule.add_argument("--virtual-stages", type=int, metavar="V",
                          help="chunks per rank [2 for interleaved, else 1]")
    schedule.add_argument("--png", metavar="FILE", help="also draw a Gantt chart into this PNG")
    schedule.add_argument("--measured", metavar="RUN_DIR",
                          help="a training run's folder: draw the step it recorded (pipeline.json) too")
    schedule.add_argument("--json", action="store_true", help="print one JSON object instead of the drawing")

    from scaletrain.models import PLANNED_PRESET, PRESETS
    from scaletrain.plan.search import RECOMPUTE as PLANNED_RECOMPUTE

    plan = commands.add_parser(
        "plan", help="predict per-rank memory and step time of parallel layouts, recommend one",
        description="Weigh every parallel layout of a model on a cluster (dp x tp x pp x cp x ep, ZeRO "
                    "stage, sp, recompute, micro-batch, pipeline schedule) at the same global batch: "
                    "drop those the trainer would refuse, predict memory per rank (the most loaded one) "
                    "and step time for the others, and rank those that fit by tokens/s. A layout flag "
                    "fixes that choice; the others are searched.")
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
    plan.add_argument("--gpu", choices=(*DEVICES, "cpu"), default="H100",
                      help="the device; cpu: this machine, its peak measured, its memory shared by the "
                           "ranks of a node [H100]")
    plan.add_argument("--gpu-memory", metavar="SIZE",
                      help="memory of one device, such as 80GB, 40GiB or 512MB [the device's]")
    fixed = plan.add_argument_group("layout options (each one given is fixed, the others searched)")
    for name, meaning in (("dp", "data-parallel size"), ("tp", "tensor-parallel size (searched within a node)"),
                          ("pp", "pipeline stages"), ("cp", "context-parallel size"), ("ep", "expert-parallel size"),
                          ("micro-batch", "sequences per rank per micro-batch (searched in powers of two)"),
                          ("grad-accum", "micro-batches (pipeline rounds with --pp) accumulated per step"),
                          ("microbatches", "micro-batches per pipeline round [the whole per-rank batch]"),
                          ("virtual-stages", "stages per rank [2 for interleaved, else 1]")):
        fixed.add_argument(f"--{name}", type=int, metavar="N", help=meaning)
    fixed.add_argument("--zero", type=int, choices=(0, 1, 2, 3), help="ZeRO stage over the replicas")
    fixed.add_argument("--shard-group", type=int, metavar="N", help="ZeRO within groups of N ranks (hybrid)")
    fixed.add_argument("--quantize-weights", choices=("none", "int8"), help="ZeRO-3's gathers in int8")
    fixed.add_argument("--sp", action=argparse.BooleanOptionalAction, default=None,
                       help="sequence parallelism inside the tp group")
    fixed.add_argument("--recompute", choices=PLANNED_RECOMPUTE, help="activation checkpointing")
    fixed.add_argument("--pp-schedule", choices=SCHEDULES, help="pipeline schedule")
    model = plan.add_argument_group("model and precision options")
    model.add_argument("--precision", choices=("fp32", "bf16", "fp16"), help="[bf16 on a GPU, fp32 on cpu]")
    model.add_argument("--param-dtype", choices=("fp32", "bf16"), help="working weights' dtype [fp32]")
    model.add_argument("--offload", choices=("none", "optimizer"), help="optimizer state in host memory [none]")
    model.add_argument("--moe-experts", type=int, metavar="E", help="experts per MoE block [0: dense]")
    model.add_argument("--moe-top-k", type=int, metavar="K", help="experts per token [2]")
    plan.add_argument("--top", type=int, default=5, metavar="N", help="layouts shown [5]")
    plan.add_argument("--json", action="store_true", help="print one JSON object (CLI.md's shape)")
    plan.add_argument("--png", metavar="FILE", help="also plot memory per rank against tokens/s into this PNG")

    from scaletrain.train.export import DTYPES

    export = commands.add_parser(
        "export", help="write a checkpoint's model as one safetensors file or a Hugging Face folder",
        description="Write the model of a checkpoint, whatever layout saved it (dp, ZeRO shards, tp "
                    "slices, pipeline stages; LoRA adapters merged). --format safetensors: one unsharded "
                    "safetensors file, every key of the model's state_dict with its single-device shape, "
                    "the tied head included, and the step and the run's config.toml in the header. "
                    "--format hf: a folder transformers' AutoModelForCausalLM.from_pretrained loads "
                    "(config.json, safetensors, tokenizer files, generation_config.json). Written beside "
                    "the target and renamed into place, so nothing partial is ever left under its name.")
    export.add_argument("--from", dest="source", metavar="CKPT", required=True,
                        help="a checkpoint folder (RUN/checkpoints/step_NNNNNN), or a run folder for its "
                             "latest complete checkpoint")
    export.add_argument("--to", dest="target", metavar="FILE.safetensors|DIR", required=True,
                        help="the file to write (its folder must exist), or with --format hf the folder")
    export.add_argument("--format", choices=("safetensors", "hf"), default="safetensors",
                        help="one safetensors file, or a Hugging Face model folder [safetensors]")
    export.add_argument("--dtype", choices=DTYPES,
                        help="cast floating tensors to this dtype [as saved: fp32]")
    export.add_argument("--force", action="store_true", help="replace --to if it exists")

    from scaletrain.commands.prepare import add_prepare_parser
    from scaletrain.commands.run import add_run_parser
    from scaletrain.commands.sweep import add_sweep_parser

    add_prepare_parser(commands)
    add_run_parser(commands)
    add_sweep_parser(commands, _add_train_flags)

    generate = commands.add_parser(
        "generate", help="continue a prompt with a trained model or released weights",
        description="Continue --prompt with a model and print the prompt and its continuation. The model is "
                    "a Hugging Face model folder (config.json, model.safetensors, its shards or pytorch_model.bin, and "
                    "tokenizer.json or vocab.json with merges.txt; nothing is downloaded), or one of ours: a "
                    "run folder for its latest complete checkpoint, or a checkpoint folder, with the run's "
                    "tokenizer.")
    generate.add_argument("--from", dest="source", metavar="CKPT_OR_HF_DIR", required=True,
                          help="a Hugging Face model folder, a run folder, or RUN/checkpoints/step_NNNNNN")
    generate.add_argument("--prompt", metavar="TEXT", required=True, help="the text to continue")
    generate.add_argument("--tokens", type=int, default=100, metavar="N", help="tokens to add [100]")
    generate.add_argument("--temperature", type=float, default=0.8, metavar="T",
                          help="divides the logits before sampling: below 1 sharper, above 1 flatter, 0 "
                               "always the most likely token [0.8]")
    generate.add_argument("--top-k", type=int, default=50, metavar="K",
                          help="sample among the K most likely tokens (0: among all) [50]")
    generate.add_argument("--chat", action="store_true",
                          help="the prompt is a user's question in the model's chat template; print the answer "
                               "alone, up to its end (a model fine-tuned with --sft)")
    generate.add_argument("--seed", type=int, default=1234, metavar="N",
                          help="seed of the sampling: the same seed gives the same text [1234]")
    return parser


def _run(args: argparse.Namespace) -> int:
    from scaletrain.commands.run import run_command

    return run_command(args)


def _sweep(args: argparse.Namespace) -> int:
    from scaletrain.commands.sweep import sweep_command

    return sweep_command(resolve(args), args)


def _prepare(args: argparse.Namespace) -> int:
    from scaletrain.commands.prepare import run_prepare

    return run_prepare(args)


def _finetune(args: argparse.Namespace) -> int:
    if getattr(args, "from") is None and not args.resume:
        raise UserError("scaletrain finetune needs --from, the run folder, checkpoint or Hugging Face model folder to "
                        "start from.")
    return _train(args)


def _train(args: argparse.Namespace) -> int:
    from scaletrain.runtime.launch import detect_environment
    from scaletrain.commands.train import launch, print_summary

    base = None
    if args.resume:
        if args.out is None:
            raise UserError("--resume needs --out, the folder of the run to continue.")
        run_dir = readable_dir("--out", args.out, "the folder of the run to continue")
        # --stop-at limits one invocation; the resumed one sets its own, or runs to --steps.
        base = load_run_config(run_dir).replace(stop_at=None)
    summary = launch(resolve(args, base))
    if summary is not None and detect_environment().rank == 0:  # under a launcher, rank 0 speaks for the job
        print_summary(summary)
    return 0


PARITY_DEFAULTS = Config().replace(name=TINY_PRESET, steps=10, seq_len=64, micro_batch=4,
                                   warmup_steps=2, eval_every=0, eval_batches=1, sample_tokens=0,
                                   cache_dir=str(Path("runs", ".cache")))


def _parity(args: argparse.Namespace) -> int:
    from scaletrain.commands.parity import format_table, run_parity

    report = run_parity(resolve(args, PARITY_DEFAULTS), tolerance=args.tolerance)
    if args.json:
        print(json.dumps(report.to_json()))
    else:
        print(format_table(report))
    return 0 if report.passed else 1


def _bench(args: argparse.Namespace) -> int:
    from scaletrain.bench import allreduce, finetune, techniques
    from scaletrain.bench.finetune import FINETUNE_DEFAULTS
    from scaletrain.bench.techniques import BENCH_DEFAULTS

    if args.warmup < 0:
        raise UserError(f"--warmup must not be negative, not {args.warmup}.")
    defaults = {**BENCH_DEFAULTS, **(FINETUNE_DEFAULTS if args.what == "finetune" else {})}
    cfg = resolve(args, Config().replace(**defaults))
    check_here(cfg, "bench")
    plot = Path(args.plot or Path("runs", f"bench-{args.what}.png"))
    if args.what in ("allreduce", "finetune"):  # the figures, drawn after the measurement
        writable_file("--plot", str(plot))
    if args.what == "finetune":
        from scaletrain.bench import finetune_report

        memory = parse_size(args.gpu_memory) if args.gpu_memory else None
        result, table = finetune.run(cfg, args.rungs, args.warmup, memory), finetune_report.format_table
        finetune_report.plot(result, plot)
    elif args.what == "techniques":
        result, table = techniques.run(cfg, techniques.parse_selection(args.techniques), args.warmup), \
            techniques.format_table
    elif args.what in ("dp", "zero", "tp", "pp", "adam", "throughput"):  # a race of the config alone
        race = importlib.import_module(f"scaletrain.bench.{args.what}")
        result, table = race.run(cfg, args.warmup), race.format_table
    elif args.what == "load":
        from scaletrain.bench import load

        result, table = load.run(cfg, Path(cfg.finetune.base) if cfg.finetune.base else None), load.format_table
    elif args.what == "prepare":
        from scaletrain.bench import prepare

        result = prepare.run(_sizes(args.gigabytes), (1, max(2, cfg.data.workers)), cfg.data.tokenizer,
                             cfg.data.vocab_size, Path(args.folder) if args.folder else None)
        table = prepare.format_table
    elif args.what in ("softmax", "cross-entropy"):
        from scaletrain.bench import (
            softmax,  # its kernels import Triton, which only these need
        )

        run = softmax.run_softmax if args.what == "softmax" else softmax.run_cross_entropy
        result, table = run(cfg, args.warmup), softmax.format_table
    else:
        result = allreduce.run(cfg.parallel.nproc, repeats=cfg.train.steps, warmup=args.warmup,
                               plot=plot, timeout_s=cfg.parallel.timeout)
        table = allreduce.format_table
    print(json.dumps(result) if args.json else table(result))
    return 0


def _sizes(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(part) for part in text.split(","))
    except ValueError:
        raise UserError(f"--gigabytes {text} is not a list of numbers; write sizes such as 0.5,3.") from None


def _schedule(args: argparse.Namespace) -> int:
    import shutil

    from scaletrain.parallel.pipeline import timeline

    if args.png:
        writable_file("--png", args.png)
    if args.measured is not None:
        readable_dir("--measured", args.measured, "the folder of a run trained with --pp 2 or more")
    result = timeline.load(args.pp_schedule, args.pp, args.microbatches, args.virtual_stages,
                           None if args.measured is None else Path(args.measured))
    if args.png:
        timeline.draw_png(Path(args.png), result.panels(), timeline.Pale.of(result.schedule))
    if args.json:
        print(json.dumps(result.to_json()))
    else:  # colour and the terminal's width only for a person watching, never in pipes or files
        tty = sys.stdout.isatty()
        print(result.report(colour=tty, width=shutil.get_terminal_size().columns if tty else None))
    return 0


def _export(args: argparse.Namespace) -> int:
    if args.format == "hf":
        from scaletrain.finetune.export_hf import export_hf as export
    else:
        from scaletrain.train.export import export

    print(export(Path(args.source), Path(args.target), args.dtype, args.force).describe())
    return 0


def _generate(args: argparse.Namespace) -> int:
    from scaletrain.commands.generate import generate

    print(generate(Path(args.source), args.prompt, args.tokens, args.temperature, args.top_k, args.seed, args.chat))
    return 0


PLAN_FIXED = ("dp", "tp", "pp", "cp", "ep", "zero", "sp", "recompute", "pp_schedule", "microbatches",
              "virtual_stages", "micro_batch", "grad_accum", "shard_group", "quantize_weights")
PLANNED_VOCAB = 50304  # a 50257-token byte-level BPE, rounded up to a multiple of 64
PLAN_POSITIVE = ("layers", "hidden", "heads", "vocab", "seq", "global_batch", "gpus", "gpus_per_node", "top",
                 "dp", "tp", "pp", "cp", "ep", "micro_batch", "grad_accum", "microbatches", "virtual_stages",
                 "moe_top_k", "shard_group")
def _plan_cluster(args: argparse.Namespace) -> Cluster:
    """The devices to plan for. A CPU "node" is this machine: its ranks share its memory."""
    per_node = args.gpus_per_node or min(8, args.gpus)
    if args.gpus % per_node:
        raise UserError(f"--gpus-per-node {per_node} must divide --gpus {args.gpus}; the nodes are equal.")
    if args.gpu == "cpu":
        import torch

        from scaletrain.train.metrics import measure_peak_tflops

        host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        device = cpu_device(measure_peak_tflops(torch.device("cpu")), host // per_node)
    else:
        device = DEVICES[args.gpu]
    cluster = Cluster(device, args.gpus, per_node)
    return cluster.with_memory(parse_size(args.gpu_memory)) if args.gpu_memory else cluster


def _plan_base(args: argparse.Namespace, gpu: bool) -> Config:
    """The model, precision and fixed layout choices as one Config; the search fills in the rest."""
    from scaletrain.config import ModelConfig
    from scaletrain.models import PRESETS

    if args.model not in PRESETS:
        raise UserError(f"--model {args.model} is not a model preset; choose one of {', '.join(PRESETS)}.")
    family = PRESETS[args.model]
    preset = family.shape(family.configure(ModelConfig(name=args.model), 1, args.seq))
    heads, width = args.heads or preset.n_heads, args.hidden or preset.d_model
    if width % heads:
        raise UserError(f"--hidden {width} is not divisible by --heads {heads}; choose sizes where it is.")
    if args.moe_experts is not None and args.moe_experts < 0:
        raise UserError(f"--moe-experts must not be negative, not {args.moe_experts}.")
    model = {"name": args.model, "n_layers": args.layers, "d_model": args.hidden, "n_heads": args.heads,
             "seq_len": args.seq, "precision": args.precision or ("bf16" if gpu else "fp32"),
             "param_dtype": args.param_dtype, "offload": args.offload, "moe_experts": args.moe_experts,
             "moe_top_k": args.moe_top_k}
    fixed = {name: getattr(args, name) for name in PLAN_FIXED}
    return Config().replace(**{k: v for k, v in {**model, **fixed}.items() if v is not None})


def _plan_vocab(args: argparse.Namespace) -> int:
    from scaletrain.models import PRESETS

    return args.vocab or PRESETS[args.model].presets[args.model].get("n_vocab") or PLANNED_VOCAB


def _plan(args: argparse.Namespace) -> int:
    from scaletrain.plan import report
    from scaletrain.plan.predict import predict
    from scaletrain.plan.search import derived_global_batch, search

    for name in PLAN_POSITIVE:
        value = getattr(args, name)
        if value is not None and value < 1:
            raise UserError(f"--{name.replace('_', '-')} must be at least 1, not {value}.")
    if args.png:
        writable_file("--png", args.png)
    base = _plan_base(args, gpu=args.gpu != "cpu")
    cluster = _plan_cluster(args)
    fixed = {name for name in PLAN_FIXED if getattr(args, name) is not None}
    global_batch = args.global_batch or derived_global_batch(base, cluster.gpus, fixed)
    result = search(base, cluster, _plan_vocab(args), global_batch, fixed, predict)
    result.best()  # none fits: one sentence, exit code 2
    if args.png:
        report.plot(result, Path(args.png), cluster)
    print(json.dumps(report.to_json(result, args.top)) if args.json
          else report.format_table(result, args.top, cluster))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return {"train": _train, "finetune": _finetune, "parity": _parity, "bench": _bench, "schedule": _schedule,
                "export": _export, "generate": _generate, "plan": _plan, "prepare": _prepare,
                "run": _run, "sweep": _sweep}[args.command](args)
    except UserError as exc:
        print(f"scaletrain {args.command}: {exc}", file=sys.stderr)
        return 2
    except JobFailed as exc:
        print(f"scaletrain {args.command}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"scaletrain {args.command}: interrupted.", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader of the output left (``| head``): stop quietly, as a shell tool does. Pointing
        # stdout at /dev/null keeps the interpreter's final flush from failing a second time.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


if __name__ == "__main__":
    sys.exit(main())
