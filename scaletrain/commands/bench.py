"""``scaletrain bench WHAT``: the compared variants side by side, medians and ratios (docs/performance.md)."""

from __future__ import annotations

import argparse
import importlib
import json
from pathlib import Path

from scaletrain.bench import BENCHMARKS
from scaletrain.bench.techniques import TECHNIQUES
from scaletrain.config import Config, add_config_flags, given_values, resolve
from scaletrain.config_checks import check_here
from scaletrain.errors import UserError
from scaletrain.models import LADDER_PRESET
from scaletrain.paths import writable_file
from scaletrain.planner.hardware import parse_size


def add_parser(commands) -> None:
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
                    "planner: the planner's layouts for --nproc processes, each trained by scaletrain train, "
                    "predicted against measured step time and memory, with the rank correlation (docs/planner.md); "
                    "its defaults: the default model at 8 blocks, --seq-len 128 --micro-batch 4 (each layout "
                    "keeps 4 x N sequences a step) --steps 7. "
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
    bench.add_argument("--layouts", default="core", metavar="core|all|A,B",
                       help="bench planner's layouts: one of each kind, every one the planner enumerates (hours "
                            "on a CPU), or the named ones of core (dp, zero1, tp-dp-sp, pp-interleaved, ...) [core]")
    bench.add_argument("--rounds", type=int, default=None, metavar="R",
                       help="bench planner: passes through the layouts, alternating them [2]; bench throughput: "
                            "runs of each contender, alternating them, pooled [1]")
    bench.add_argument("--peers", default="plain,transformers", metavar="A,B",
                       help="bench throughput: the peers raced beside ours, of plain and transformers ('': ours "
                            "alone, its MFU) [plain,transformers]")
    bench.add_argument("--json", action="store_true", help="print one JSON object")
    add_config_flags(bench)
    bench.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from scaletrain.bench.techniques import BENCH_DEFAULTS

    if args.warmup < 0:
        raise UserError(f"--warmup must not be negative, not {args.warmup}.")
    defaults = {**BENCH_DEFAULTS, **_own_defaults(args)}
    cfg = resolve(args, Config().replace(**defaults))
    check_here(cfg, "bench")
    plot = Path(args.plot or Path("runs", f"bench-{args.what}.png"))
    if args.what in ("allreduce", "finetune"):  # the figures, drawn after the measurement
        writable_file("--plot", str(plot))
    result, table = _measure(args, cfg, plot)
    print(json.dumps(result) if args.json else table(result))
    return 0


def _own_defaults(args: argparse.Namespace) -> dict:
    """The defaults a bench sets beside every bench's (BENCH_DEFAULTS)."""
    from scaletrain.bench import finetune, planner

    if args.what == "finetune":
        return finetune.FINETUNE_DEFAULTS
    if args.what == "planner":
        return planner.defaults(set(given_values(args)))
    return {}


def _measure(args: argparse.Namespace, cfg: Config, plot: Path):
    """The bench's result and the function that draws it as a table."""
    from scaletrain.bench import allreduce, finetune, techniques

    if args.what == "finetune":
        from scaletrain.bench import finetune_report

        memory = parse_size(args.gpu_memory) if args.gpu_memory else None
        result = finetune.run(cfg, args.rungs, args.warmup, memory)
        finetune_report.plot(result, plot)
        return result, finetune_report.format_table
    if args.what == "planner":
        from scaletrain.bench import planner

        return planner.run(cfg, args.layouts, 2 if args.rounds is None else args.rounds, args.warmup), \
            planner.format_table
    if args.what == "techniques":
        return techniques.run(cfg, techniques.parse_selection(args.techniques), args.warmup), techniques.format_table
    if args.what in ("dp", "zero", "tp", "pp", "adam", "throughput"):  # a race of the config alone
        race = importlib.import_module(f"scaletrain.bench.{args.what}")
        rounds = {"rounds": 1 if args.rounds is None else args.rounds,
                  "peers": tuple(word for word in args.peers.split(",") if word)} if args.what == "throughput" else {}
        return race.run(cfg, args.warmup, **rounds), race.format_table
    if args.what == "load":
        from scaletrain.bench import load

        return load.run(cfg, Path(cfg.finetune.base) if cfg.finetune.base else None), load.format_table
    if args.what == "prepare":
        from scaletrain.bench import prepare

        return prepare.run(_sizes(args.gigabytes), (1, max(2, cfg.data.workers)), cfg.data.tokenizer,
                           cfg.data.vocab_size, Path(args.folder) if args.folder else None), prepare.format_table
    if args.what in ("softmax", "cross-entropy"):
        from scaletrain.bench import (
            softmax,  # its kernels import Triton, which only these need
        )

        race = softmax.run_softmax if args.what == "softmax" else softmax.run_cross_entropy
        return race(cfg, args.warmup), softmax.format_table
    return allreduce.run(cfg.parallel.nproc, repeats=cfg.train.steps, warmup=args.warmup, plot=plot,
                         timeout_s=cfg.parallel.timeout), allreduce.format_table


def _sizes(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(part) for part in text.split(","))
    except ValueError:
        raise UserError(f"--gigabytes {text} is not a list of numbers; write sizes such as 0.5,3.") from None
