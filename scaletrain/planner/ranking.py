"""Does the planner rank layouts as this machine does?

``python -m scaletrain.planner.ranking [--nproc 2] [--steps 8] [--rounds 2]``
trains each layout below for a few steps (``scaletrain train`` in a fresh
process, as a user runs it), takes the median step time after the first
two steps, over ``--rounds`` passes through the list (alternating layouts,
so a slow spell of a shared machine falls on all of them), predicts the
same layouts on this machine as the planner's ``cpu`` device, and reports
both orders and Spearman's rank correlation between them. docs/planner.md
records a run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from scaletrain.config import Config
from scaletrain.job.data_setup import prepare_data
from scaletrain.job.metrics import measure_peak_tflops
from scaletrain.models import DEFAULT_PRESET
from scaletrain.planner.hardware import Cluster, cpu_device
from scaletrain.planner.predict import predict

# The default preset, 128 positions, 16 sequences per step on two ranks.
BASE = {"model": DEFAULT_PRESET, "seq-len": "128", "eval-every": "0", "eval-batches": "1", "sample-tokens": "0"}
LAYOUTS = {
    "dp2": {"micro-batch": "8"},
    "dp2 zero1": {"micro-batch": "8", "zero": "1"},
    "dp2 zero2": {"micro-batch": "8", "zero": "2"},
    "dp2 zero3": {"micro-batch": "8", "zero": "3"},
    "dp2 recompute full": {"micro-batch": "8", "recompute": "full"},
    "dp2 grad-accum 4": {"micro-batch": "2", "grad-accum": "4"},
    "tp2": {"micro-batch": "16", "tp": "2"},
    "tp2 sp": {"micro-batch": "16", "tp": "2", "sp": "true"},
    "pp2 1f1b": {"micro-batch": "4", "pp": "2", "microbatches": "4"},
    "pp2 gpipe": {"micro-batch": "4", "pp": "2", "microbatches": "4", "pp-schedule": "gpipe"},
    "pp2 zb-h1": {"micro-batch": "4", "pp": "2", "microbatches": "4", "pp-schedule": "zb-h1"},
    "cp2": {"micro-batch": "16", "cp": "2"},
}


def _flags(changes: dict[str, str]) -> list[str]:
    flags = []
    for name, value in {**BASE, **changes}.items():
        flags += [f"--{name}"] if value == "true" else [f"--{name}", value]
    return flags


def measure(name: str, steps: int, nproc: int, root: Path) -> float:
    """Median seconds per step of ``name`` after its first two steps."""
    out = root / name.replace(" ", "-")
    subprocess.run([sys.executable, "-m", "scaletrain", "train", "--nproc", str(nproc), "--steps", str(steps),
                    "--out", str(out), "--cache-dir", str(root / ".cache"), "--no-progress",
                    *_flags(LAYOUTS[name])], check=True, capture_output=True)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    shutil.rmtree(out)
    return statistics.median(r["step_s"] for r in records[2:])


def _config(name: str, root: Path) -> Config:
    fields = {key.replace("-", "_"): value for key, value in {**BASE, **LAYOUTS[name]}.items()}
    fields["name"] = fields.pop("model")
    typed = {key: (value == "true" if value == "true" else int(value) if value.isdigit() else value)
             for key, value in fields.items()}
    return Config().replace(cache_dir=str(root / ".cache"), **typed)


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rho: the Pearson correlation of the ranks (ties get their mean rank)."""
    def ranks(values: list[float]) -> list[float]:
        order = sorted(range(len(values)), key=values.__getitem__)
        result = [0.0] * len(values)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
                j += 1
            for k in range(i, j + 1):
                result[order[k]] = (i + j) / 2
            i = j + 1
        return result

    return statistics.correlation(ranks(a), ranks(b))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scaletrain.planner.ranking", description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="plan-ranking-"))
    vocab = prepare_data(_config("dp2", root), root / ".cache").vocab_size
    measured: dict[str, list[float]] = {name: [] for name in LAYOUTS}
    for _ in range(args.rounds):
        for name in LAYOUTS:
            measured[name].append(measure(name, args.steps, args.nproc, root))
    peak = measure_peak_tflops(torch.device("cpu"))
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    cluster = Cluster(cpu_device(peak, memory), args.nproc, args.nproc)
    rows = []
    for name in LAYOUTS:
        predicted = predict(_config(name, root), args.nproc, vocab, cluster).step_s
        rows.append((name, statistics.median(measured[name]), predicted))
    print(f"measured matmul peak {peak:.3f} TFLOP/s; {args.nproc} processes, {DEFAULT_PRESET}, "
          f"16 x 128 tokens a step")
    print(f"{'layout':<22}{'measured s':>12}{'predicted s':>13}{'rank meas':>11}{'rank pred':>11}")
    by_measured = sorted(rows, key=lambda r: r[1])
    by_predicted = sorted(rows, key=lambda r: r[2])
    for row in by_measured:
        print(f"{row[0]:<22}{row[1]:>12.3f}{row[2]:>13.3f}{by_measured.index(row) + 1:>11}"
              f"{by_predicted.index(row) + 1:>11}")
    rho = spearman([r[1] for r in rows], [r[2] for r in rows])
    print(f"Spearman rank correlation: {rho:.2f}")
    shutil.rmtree(root)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
