"""The ``scaletrain`` command: train, parity, bench.

User mistakes (a ``UserError``, a bad flag) print one sentence on stderr and
exit with code 2, without a traceback; see CLI.md for the contract.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from scaletrain.config import Config, add_config_flags, check_values, load_run_config, resolve
from scaletrain.errors import UserError


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
        description="Train a model. With no arguments: the small GPT on the built-in corpus (the "
                    "Python standard library's source), on CPU, in one process.")
    _add_train_flags(train)

    parity = commands.add_parser(
        "parity", help="check a layout against single-device training",
        description="Train the single-device reference and the requested layout with the same seed, "
                    "data and global batch; compare per-step losses and final parameters. Exit code "
                    "0 when they agree within --tolerance, 1 when they do not. Defaults differ from "
                    "train: --model gpt-tiny --steps 10 --seq-len 64 --micro-batch 4 --cache-dir runs/.cache.")
    _add_train_flags(parity)
    parity.add_argument("--tolerance", type=float, default=1e-5,
                        help="largest relative difference allowed, per step and per tensor [1e-05]")
    parity.add_argument("--json", action="store_true", help="print one JSON object")

    from scaletrain.bench import BENCHMARKS
    from scaletrain.bench.techniques import TECHNIQUES

    bench = commands.add_parser(
        "bench", help="measure techniques side by side",
        description="Run the compared variants side by side, alternating step by step, and print "
                    "medians and ratios. techniques: every single-device technique against the plain "
                    "run, with its memory ledger and loss, in one process. dp: our data parallelism "
                    "against torch DistributedDataParallel on --nproc ranks. allreduce: the ring "
                    "all-reduce against the backend's, bus bandwidth from 4 KiB to 64 MiB on --nproc "
                    "ranks (--steps timed calls per size), plotted. Defaults differ from train: "
                    "--steps 20 --eval-batches 4 --cache-dir runs/.cache.")
    bench.add_argument("what", choices=BENCHMARKS, help="what to measure")
    bench.add_argument("--techniques", metavar="A,B", help=f"a subset of: {', '.join(TECHNIQUES)} "
                                                           f"[all; the baseline always runs]")
    bench.add_argument("--warmup", type=int, default=3, metavar="N",
                       help="first steps left out of the timing (metering, compilation) [3]")
    bench.add_argument("--plot", metavar="FILE", default=str(Path("runs", "bench-allreduce.png")),
                       help="where bench allreduce draws its figure [runs/bench-allreduce.png]")
    bench.add_argument("--json", action="store_true", help="print one JSON object")
    _add_train_flags(bench)

    from scaletrain.parallel.pipeline.schedules import SCHEDULES

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
    schedule.add_argument("--pp-schedule", choices=SCHEDULES, help="the schedule [1f1b]")
    schedule.add_argument("--virtual-stages", type=int, metavar="V",
                          help="chunks per rank [2 for interleaved, else 1]")
    schedule.add_argument("--png", metavar="FILE", help="also draw a Gantt chart into this PNG")
    schedule.add_argument("--measured", metavar="RUN_DIR",
                          help="a training run's folder: draw the step it recorded (pipeline.json) too")
    schedule.add_argument("--json", action="store_true", help="print one JSON object instead of the drawing")

    from scaletrain.export import DTYPES

    export = commands.add_parser(
        "export", help="write a checkpoint's model as one safetensors file",
        description="Write the model of a checkpoint, whatever layout saved it (dp, ZeRO shards, tp "
                    "slices, pipeline stages), as one unsharded safetensors file: every key of the "
                    "model's state_dict with its single-device shape, the tied head included, and the "
                    "step and the run's config.toml in the header. Written beside the target and "
                    "renamed into place, so no partial file is ever left under its name.")
    export.add_argument("--from", dest="source", metavar="CKPT", required=True,
                        help="a checkpoint folder (RUN/checkpoints/step_NNNNNN), or a run folder for its "
                             "latest complete checkpoint")
    export.add_argument("--to", dest="target", metavar="FILE.safetensors", required=True,
                        help="the file to write; its folder must exist")
    export.add_argument("--dtype", choices=DTYPES,
                        help="cast floating tensors to this dtype [as saved: fp32]")
    export.add_argument("--force", action="store_true", help="replace --to if it exists")
    return parser


def _train(args: argparse.Namespace) -> int:
    from scaletrain.dist.launch import detect_environment
    from scaletrain.train.run import launch, print_summary

    base = None
    if args.resume:
        if args.out is None:
            raise UserError("--resume needs --out, the folder of the run to continue.")
        # --stop-at limits one invocation; the resumed one sets its own, or runs to --steps.
        base = load_run_config(Path(args.out)).replace(stop_at=None)
    summary = launch(resolve(args, base))
    if summary is not None and detect_environment().rank == 0:  # under a launcher, rank 0 speaks for the job
        print_summary(summary)
    return 0


PARITY_DEFAULTS = Config().replace(name="gpt-tiny", steps=10, seq_len=64, micro_batch=4,
                                   warmup_steps=2, eval_every=0, eval_batches=1, sample_tokens=0,
                                   cache_dir=str(Path("runs", ".cache")))


def _parity(args: argparse.Namespace) -> int:
    from scaletrain.parity import format_table, run_parity

    report = run_parity(resolve(args, PARITY_DEFAULTS), tolerance=args.tolerance)
    if args.json:
        print(json.dumps(report.to_json()))
    else:
        print(format_table(report))
    return 0 if report.passed else 1


def _bench(args: argparse.Namespace) -> int:
    from scaletrain.bench import adam, allreduce, dp, pp, techniques, tp, zero
    from scaletrain.bench.techniques import BENCH_DEFAULTS

    if args.warmup < 0:
        raise UserError(f"--warmup must not be negative, not {args.warmup}.")
    cfg = resolve(args, Config().replace(**BENCH_DEFAULTS))
    check_values(cfg)
    if args.what == "techniques":
        result, table = techniques.run(cfg, techniques.parse_selection(args.techniques), args.warmup), \
            techniques.format_table
    elif args.what == "dp":
        result, table = dp.run(cfg, args.warmup), dp.format_table
    elif args.what == "zero":
        result, table = zero.run(cfg, args.warmup), zero.format_table
    elif args.what == "tp":
        result, table = tp.run(cfg, args.warmup), tp.format_table
    elif args.what == "pp":
        result, table = pp.run(cfg, args.warmup), pp.format_table
    elif args.what == "adam":
        result, table = adam.run(cfg, args.warmup), adam.format_table
    elif args.what in ("softmax", "cross-entropy"):
        from scaletrain.bench import softmax  # its kernels import Triton, which only these need

        run = softmax.run_softmax if args.what == "softmax" else softmax.run_cross_entropy
        result, table = run(cfg, args.warmup), softmax.format_table
    else:
        result = allreduce.run(cfg.parallel.nproc, repeats=cfg.train.steps, warmup=args.warmup,
                               plot=Path(args.plot), timeout_s=cfg.parallel.timeout)
        table = allreduce.format_table
    print(json.dumps(result) if args.json else table(result))
    return 0


def _schedule(args: argparse.Namespace) -> int:
    import shutil

    from scaletrain.parallel.pipeline import timeline

    result = timeline.load(args.pp_schedule, args.pp, args.microbatches, args.virtual_stages,
                           None if args.measured is None else Path(args.measured))
    if args.png:
        timeline.draw_png(Path(args.png), result.panels())
    if args.json:
        print(json.dumps(result.to_json()))
    else:  # colour and the terminal's width only for a person watching, never in pipes or files
        tty = sys.stdout.isatty()
        print(result.report(colour=tty, width=shutil.get_terminal_size().columns if tty else None))
    return 0


def _export(args: argparse.Namespace) -> int:
    from scaletrain.export import export

    print(export(Path(args.source), Path(args.target), args.dtype, args.force).describe())
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return {"train": _train, "parity": _parity, "bench": _bench, "schedule": _schedule,
                "export": _export}[args.command](args)
    except UserError as exc:
        print(f"scaletrain {args.command}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"scaletrain {args.command}: interrupted.", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
