"""``scaletrain schedule``: a pipeline schedule's timeline, planned or as a run recorded it
(parallel/pipeline/timeline.py)."""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from scaletrain.parallel.pipeline.schedules import ALL_SCHEDULES
from scaletrain.paths import readable_dir, writable_file


def add_parser(commands) -> None:
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
    schedule.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
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
