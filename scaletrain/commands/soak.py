"""Soak test: thousands of steps of the tiny preset with periodic checkpoints, to show
that a long run holds still: flat memory, steady throughput, a bounded
communication ledger.

    python -m scaletrain.commands.soak [--steps 3000] [--checkpoint-every 250] [--nproc 1|2]
                                    [--out DIR] [--data PATH] [--json]

The run goes through ``scaletrain.commands.train.launch``, the path ``scaletrain
train`` takes, with short sequences and micro-batches (milliseconds a step on
a CPU); the figures come from what that run leaves behind: its
``metrics.jsonl``, its ``comm.json`` (``--report-comm``) and its checkpoints.
`summarize` is a pure function of the metrics records.

Memory. ``mem_bytes`` is the resident set size of the main rank's process
after each step (the CUDA peak on a GPU). A leak keeps something alive per
step (an activation, a record appended to a list) and shows as RSS rising
with the step number, so the verdict rests on the least-squares slope of RSS
over the steady phase, in bytes per 1000 steps. Beside it: the growth from
the phase's first step to its last, and the slope over its last half (a leak
climbs at a constant rate, memory still settling less and less). The steady
phase leaves out the first `WARMUP_SHARE` of the steps, where the allocator's
heap settles and RSS takes in the pages of the memory-mapped token file as
the randomly drawn windows first touch them (RSS counts a mapped file's
pages): with the standard library's 22 MB of tokens that lasts about 500
steps at this batch size and then stops, the file being resident, not
leaking. Memory settles more slowly after that: torch's foreach kernels
over a list of some twenty tensors (the gradients' norms) keep about 200
bytes per call up to about 2000 calls (some 390 KiB), so RSS creeps up by
about 200 bytes a step for the first 2000 steps and then stops; over 3000
steps that read as slopes of 0.1-0.6 MiB per 1000 steps, over 10000 as
none. "Flat" means a slope below `FLAT_SLOPE_BYTES`, 1 MiB per 1000 steps
(1 KiB a step), above that settling: one retained activation of this
model's micro-batch (4 x 32 x 64 fp32 values, 32 KiB) exceeds it 32 times
over; one retained metrics record (about 0.5 KiB) shows as half of it in
the figures, below the verdict's line, and in a longer run as a last-half
slope that does not fall.

Throughput. The medians of tokens/s over the first and last quarters of the
steady phase; "steady" when last / first lies in `THROUGHPUT_BAND`. A
slowdown caused by growing state (a list walked every step, a lengthening
autograd graph) is a trend over thousands of steps that takes the ratio out
of the band, while on a quiet two-core machine the quarters' medians of a
healthy run differ by less than 10%. Other work on the machine slows steps
at random moments and can drag one quarter's median far down; the fastest
tenth of the steps shows what the trainer does when it has the cores, so the
ratio of the quarters' 90th percentiles is reported beside, with the load
average before and after the run: a busy machine lowers the medians while
the fastest tenth holds, a slowing trainer lowers both. The trainer times a
step before it saves, so a save's own duration is in no step's time; its
after-effects (caches written over, memory to map again) fall on the next
step. The times of the checkpoint steps and of the steps after them are
reported apart, and both are left out of the medians.

Communication ledger. The `Ledger` keeps one counter triple (calls, bytes,
wire bytes) per rank, op and group, so it can grow only by gaining entries,
and a step that repeated itself (a collective issued once more per step than
the last) would show in its counts. Three short runs of the same
configuration calibrate it as

    ledger(steps, saves) = fixed + steps x per_step + saves x per_save

(n steps saving once, n + 1 steps saving once, n + 1 steps saving twice:
their differences are one step's and one save's counts, on every rank), and
the soak's comm.json must equal that prediction exactly, field by field:
the same entries, and each of thousands of steps adding what one step of a
short run added. One exception: the bytes of ``all_gather_object`` are the
pickled size of what is gathered (a checkpoint's file sizes and hashes, for
one), which varies by a few bytes from call to call, so they must agree
within `OBJECT_BYTES_TOLERANCE`; an object that grew with the run (a list of
every checkpoint so far, say) would still miss it by far. A single process
talks to nobody and its ledger stays empty, so the check says something
with ``--nproc 2``.

Live Python objects and tensors are not counted: that would need a hook in
the training loop while it runs; what they hold shows in RSS.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, redirect_stdout
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scaletrain.bench import machine
from scaletrain.commands.train import launch
from scaletrain.config import Config
from scaletrain.errors import UserError
from scaletrain.job.metrics import read_metrics
from scaletrain.models import TINY_PRESET
from scaletrain.train.checkpoint import complete_checkpoints

WARMUP_SHARE = 0.2
FLAT_SLOPE_BYTES = 2**20  # per 1000 steps
THROUGHPUT_BAND = (0.8, 1.25)
CALIBRATION_STEPS = 4
OBJECT_BYTES_TOLERANCE = 0.1
MIN_STEPS = 40  # a steady phase whose quarters hold a few clean steps each

# (rank, op, group, field) of one comm.json counter
Key = tuple[str, str, str, str]


def soak_config(out: Path, steps: int, checkpoint_every: int, nproc: int, data: str | None) -> Config:
    """The tiny preset at a few milliseconds a step, reporting its ledger, with nothing extra at the end."""
    return Config().replace(name=TINY_PRESET, data=data, seq_len=32, micro_batch=4, steps=steps,
                            checkpoint_every=checkpoint_every, nproc=nproc, eval_every=0, sample_tokens=0,
                            progress=False, report_comm=True, out=str(out))


def checkpoint_steps(steps: int, every: int) -> list[int]:
    """The steps after which the trainer saves: every ``every``-th and the last."""
    return sorted({*(range(every, steps + 1, every) if every else ()), steps})


def saved_steps(run_dir: Path) -> list[int]:
    """Steps of the complete checkpoints in a run folder."""
    return [int(path.name.removeprefix("step_")) for path in complete_checkpoints(run_dir)]


# -- the analysis: pure functions of the records ------------------------------
def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def _slope_per_1000_steps(records: list[dict[str, Any]]) -> float:
    """Least-squares slope of mem_bytes against the step number, per 1000 steps."""
    return statistics.linear_regression([r["step"] for r in records], [r["mem_bytes"] for r in records]).slope * 1000


def memory_figures(steady: list[dict[str, Any]]) -> dict[str, Any]:
    start, end = steady[0]["mem_bytes"], steady[-1]["mem_bytes"]
    slope = _slope_per_1000_steps(steady)
    return {"rss_start_bytes": start, "rss_end_bytes": end, "growth_bytes": end - start,
            "growth_share": (end - start) / start, "slope_bytes_per_1000_steps": slope,
            "slope_last_half_bytes_per_1000_steps": _slope_per_1000_steps(steady[len(steady) // 2:]),
            "threshold_bytes_per_1000_steps": FLAT_SLOPE_BYTES, "flat": slope < FLAT_SLOPE_BYTES}


def _fastest_tenth(tokens_per_s: list[float]) -> float:
    """The throughput that the fastest tenth of the steps reach (the 90th percentile)."""
    return statistics.quantiles(tokens_per_s, n=10)[-1] if len(tokens_per_s) > 1 else tokens_per_s[0]


def throughput_figures(clean: list[dict[str, Any]]) -> dict[str, Any]:
    quarter = max(1, len(clean) // 4)
    first = [r["tokens_per_s"] for r in clean[:quarter]]
    last = [r["tokens_per_s"] for r in clean[-quarter:]]
    ratio = statistics.median(last) / statistics.median(first)
    low, high = THROUGHPUT_BAND
    return {"first_quarter_tokens_per_s": statistics.median(first),
            "last_quarter_tokens_per_s": statistics.median(last), "ratio": ratio,
            "band": list(THROUGHPUT_BAND), "steady": low <= ratio <= high,
            "fastest_tenth_ratio": _fastest_tenth(last) / _fastest_tenth(first),
            "median_step_s": statistics.median(r["step_s"] for r in clean)}


def checkpoint_figures(by_step: dict[int, dict[str, Any]], saves: list[int]) -> dict[str, Any]:
    at = [by_step[s]["step_s"] for s in saves if s in by_step]
    after = [by_step[s + 1]["step_s"] for s in saves if s + 1 in by_step]
    return {"steps": saves, "step_s": at, "next_step_s": after,
            "step_s_median": _median(at), "next_step_s_median": _median(after)}


def summarize(records: list[dict[str, Any]], saves: list[int],
              warmup_share: float = WARMUP_SHARE) -> dict[str, Any]:
    """Memory, throughput and checkpoint figures of one run's metrics records,
    ``saves`` being the steps after which it saved (module docstring)."""
    by_step = {r["step"]: r for r in records}
    warmup = round(max(by_step) * warmup_share)
    steady = [r for r in records if r["step"] > warmup]
    disturbed = {*saves, *(s + 1 for s in saves)}
    return {"steps_recorded": len(records), "warmup_steps": warmup,
            "memory": memory_figures(steady),
            "throughput": throughput_figures([r for r in steady if r["step"] not in disturbed]),
            "checkpoints": checkpoint_figures(by_step, saves)}


# -- the ledger: calibrated by short runs, checked against the soak ------------
def flat_ledger(comm: dict[str, Any]) -> dict[Key, int]:
    """comm.json's nested {rank: {op: {group: {field: n}}}} as one counter per key."""
    return {(rank, op, group, field): value
            for rank, ops in comm.items() for op, groups in ops.items()
            for group, entry in groups.items() for field, value in entry.items()}


def _entries(counters: dict[Key, int]) -> set[tuple[str, str, str]]:
    """The (rank, op, group) entries that were called."""
    return {key[:3] for key, value in counters.items() if key[3] == "calls" and value}


def _entries_by_rank(counters: dict[Key, int]) -> dict[str, int]:
    return dict(collections.Counter(rank for rank, _, _ in _entries(counters)))


def _calls_by_rank(counters: dict[Key, int]) -> dict[str, int]:
    calls: dict[str, int] = {}
    for (rank, _, _, field), value in counters.items():
        if field == "calls":
            calls[rank] = calls.get(rank, 0) + value
    return calls


def _without_callless(rates: dict[Key, int]) -> dict[Key, int]:
    """Bytes move only with calls: where an entry makes none per step (or save), a difference
    in its bytes between two runs is the varying size of a pickled object, not a rate."""
    return {k: 0 if rates[(*k[:3], "calls")] == 0 else value for k, value in rates.items()}


def _agrees(key: Key, predicted: int, observed: int) -> bool:
    """Exact, but for the bytes of gathered objects, which vary with their contents."""
    if key[1] == "all_gather_object" and key[3] != "calls":
        return abs(observed - predicted) <= OBJECT_BYTES_TOLERANCE * predicted
    return observed == predicted


@dataclass
class LedgerModel:
    """``ledger(steps, saves) = fixed + steps x per_step + saves x per_save``, counter by counter."""

    fixed: dict[Key, int]
    per_step: dict[Key, int]
    per_save: dict[Key, int]

    @classmethod
    def calibrate(cls, steps: int, short: dict[Key, int], longer: dict[Key, int],
                  saved_twice: dict[Key, int]) -> LedgerModel:
        """From runs of ``steps`` steps saving once, ``steps + 1`` saving once, ``steps + 1`` saving twice."""
        keys = short.keys() | longer.keys() | saved_twice.keys()
        per_step = _without_callless({k: longer.get(k, 0) - short.get(k, 0) for k in keys})
        per_save = _without_callless({k: saved_twice.get(k, 0) - longer.get(k, 0) for k in keys})
        fixed = {k: short.get(k, 0) - steps * per_step[k] - per_save[k] for k in keys}
        return cls(fixed, per_step, per_save)

    def predict(self, steps: int, saves: int) -> dict[Key, int]:
        return {k: self.fixed[k] + steps * self.per_step[k] + saves * self.per_save[k] for k in self.fixed}


def ledger_check(model: LedgerModel, observed: dict[Key, int], steps: int, saves: int,
                 short: dict[Key, int]) -> dict[str, Any]:
    """The soak's ledger against the model's prediction; ``short`` is the shortest
    calibration run's, whose entries the soak's must equal."""
    predicted = model.predict(steps, saves)
    # A counter missing from a ledger is zero there (ops that never ran have no entry).
    mismatched = sorted("/".join(key) for key in predicted.keys() | observed.keys()
                        if not _agrees(key, predicted.get(key, 0), observed.get(key, 0)))
    return {"entries": _entries_by_rank(observed), "entries_short_run": _entries_by_rank(short),
            "calls": _calls_by_rank(observed), "calls_per_step": _calls_by_rank(model.per_step),
            "calls_per_save": _calls_by_rank(model.per_save), "calls_fixed": _calls_by_rank(model.fixed),
            "mismatched": mismatched,
            "constant": not mismatched and _entries(observed) == _entries(short)}


# -- running -------------------------------------------------------------------
@contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    """Training's own printing (the resolved configuration, the ledger table),
    from this process and from the workers it spawns, which inherit file
    descriptor 1, goes to stderr, so that stdout carries the report alone."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        with redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def train(cfg: Config) -> Path:
    """One run through the public training path; its folder."""
    print(f"soak: training {cfg.train.steps} steps in {cfg.run.out}", file=sys.stderr)
    with _stdout_to_stderr():
        launch(cfg)
    return Path(cfg.run.out)


def read_ledger(run_dir: Path) -> dict[Key, int]:
    return flat_ledger(json.loads((run_dir / "comm.json").read_text()))


def calibrate_ledger(out: Path, nproc: int, data: str | None, steps: int = CALIBRATION_STEPS) -> tuple[
        LedgerModel, dict[Key, int]]:
    """The ledger model from three short runs (module docstring), and the shortest run's ledger."""
    runs = {"short": (steps, 0), "longer": (steps + 1, 0), "saved_twice": (steps + 1, steps)}
    ledgers = {name: read_ledger(train(soak_config(out / f"ledger-{name}", n, every, nproc, data)))
               for name, (n, every) in runs.items()}
    return LedgerModel.calibrate(steps, **ledgers), ledgers["short"]


def verdict(report: dict[str, Any]) -> list[str]:
    """The names of the checks that failed."""
    checks = {"memory flat": report["memory"]["flat"], "throughput steady": report["throughput"]["steady"],
              "ledger constant": report["comm"]["constant"],
              "every checkpoint written": report["checkpoints"]["written"] == report["checkpoints"]["steps"]}
    return [name for name, ok in checks.items() if not ok]


def soak(steps: int, checkpoint_every: int, nproc: int, out: Path, data: str | None = None) -> dict[str, Any]:
    """Train the soak run and the ledger's calibration runs under ``out``; the report."""
    if steps < MIN_STEPS:
        raise UserError(f"--steps {steps} leaves too few steps to compare the steady phase's quarters; "
                        f"give at least {MIN_STEPS}.")
    load_before = os.getloadavg()[0]
    run_dir = train(soak_config(out / "soak", steps, checkpoint_every, nproc, data))
    saves = checkpoint_steps(steps, checkpoint_every)
    report = {"run_dir": str(run_dir), "steps": steps, "checkpoint_every": checkpoint_every, "nproc": nproc,
              "machine": machine(), "load_average": [load_before, os.getloadavg()[0]],
              **summarize(read_metrics(run_dir / "metrics.jsonl"), saves)}
    report["checkpoints"]["written"] = saved_steps(run_dir)
    model, short = calibrate_ledger(out, nproc, data)
    report["comm"] = ledger_check(model, read_ledger(run_dir), steps, len(saves), short)
    report["failed"] = verdict(report)
    report["passed"] = not report["failed"]
    return report


# -- the report ----------------------------------------------------------------
def _mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB"


def _ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1000:.1f} ms"


def _memory_text(r: dict[str, Any]) -> str:
    m = r["memory"]
    return (f"memory (mem_bytes of rank 0: RSS on a CPU), steady phase = steps {r['warmup_steps'] + 1}-"
            f"{r['steps']}:\n  start {_mib(m['rss_start_bytes'])}, end {_mib(m['rss_end_bytes'])}, growth "
            f"{m['growth_bytes'] / 2**20:+.2f} MiB ({m['growth_share']:+.2%})\n"
            f"  slope {m['slope_bytes_per_1000_steps'] / 2**20:+.3f} MiB per 1000 steps "
            f"(flat below {_mib(m['threshold_bytes_per_1000_steps'])}); over its last half "
            f"{m['slope_last_half_bytes_per_1000_steps'] / 2**20:+.3f} MiB")


def _throughput_text(r: dict[str, Any]) -> str:
    t = r["throughput"]
    return ("throughput (tokens/s medians; checkpoint steps and the steps after them left out):\n"
            f"  first quarter {t['first_quarter_tokens_per_s']:,.0f}, last quarter "
            f"{t['last_quarter_tokens_per_s']:,.0f}, ratio {t['ratio']:.3f} (steady within "
            f"{t['band'][0]}-{t['band'][1]}); the fastest tenth's ratio {t['fastest_tenth_ratio']:.3f}; "
            f"median step {_ms(t['median_step_s'])}")


def _checkpoints_text(r: dict[str, Any]) -> str:
    c = r["checkpoints"]
    return (f"checkpoints: {len(c['steps'])} planned, {len(c['written'])} written; their steps "
            f"{_ms(c['step_s_median'])} median, the steps after them {_ms(c['next_step_s_median'])} median "
            f"(slowest {_ms(max(c['next_step_s'], default=None))})")


def _comm_text(r: dict[str, Any]) -> str:
    comm = r["comm"]
    rank0 = {key: figures.get("0", 0) for key, figures in comm.items() if key.startswith(("calls", "entries"))}
    agreement = ("comm.json equals the calibrated prediction on every rank" if not comm["mismatched"]
                 else f"comm.json differs from the prediction at {', '.join(comm['mismatched'])}")
    return (f"communication ledger (rank 0): {rank0['entries']} entries ({rank0['entries_short_run']} after "
            f"{CALIBRATION_STEPS} steps), {rank0['calls']} calls = {rank0['calls_fixed']} once + "
            f"{rank0['calls_per_step']} per step + {rank0['calls_per_save']} per save; {agreement}")


def format_report(r: dict[str, Any]) -> str:
    head = (f"soak: {TINY_PRESET}, {r['steps']} steps on {r['nproc']} process(es), a checkpoint every "
            f"{r['checkpoint_every']} steps, in {r['run_dir']}\n"
            f"machine: {r['machine']}; 1-minute load average {r['load_average'][0]:.2f} before the run, "
            f"{r['load_average'][1]:.2f} after")
    verdict_line = "verdict: " + ("PASS" if r["passed"] else f"FAIL ({', '.join(r['failed'])})")
    return "\n".join([head, _memory_text(r), _throughput_text(r), _checkpoints_text(r), _comm_text(r),
                      verdict_line])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scaletrain.commands.soak",
                                     description=f"Soak test: a long {TINY_PRESET} run with periodic checkpoints; "
                                                 "memory, throughput and the communication ledger over time.")
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--checkpoint-every", type=int, default=250)
    parser.add_argument("--nproc", type=int, default=1, choices=(1, 2))
    parser.add_argument("--out", type=Path, default=None,
                        help="folder for the soak run and the ledger's calibration runs "
                             "(default: runs/soak-<time>)")
    parser.add_argument("--data", default=None, help="corpus (default: the Python standard library's source)")
    parser.add_argument("--json", action="store_true", help="print the report as one JSON object")
    args = parser.parse_args(argv)
    out = args.out or Path("runs") / f"soak-{time.strftime('%Y%m%d-%H%M%S')}"
    try:
        report = soak(args.steps, args.checkpoint_every, args.nproc, out, args.data)
    except UserError as exc:
        print(f"soak: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(report) if args.json else format_report(report))
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
