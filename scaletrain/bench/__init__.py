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

import torch


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


BENCHMARKS = ("techniques", "dp", "allreduce")
