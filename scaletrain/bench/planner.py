"""``scaletrain bench planner``: the planner's layouts trained here, predicted against measured.

The planner (planner/search.py) enumerates every layout of a model on N processes at one global
batch (dp x tp x pp x cp, ZeRO stage, sp, recompute, micro-batch, pipeline schedule) and predicts
each one's memory and step time (planner/predict.py). This bench trains them and sets the two side
by side, on the machine the planner plans for (planner/machine.py `this_machine`):

    --layouts core   one of each kind (`core`): dp N with ZeRO 0-3, full recompute, half the
                     micro-batch accumulated twice, tp 2 with and without sp, tp N, pp 2 and pp N
                     under 1F1B and interleaved, cp 2; each the enumerated layout with those
                     choices, the rest plain, at its largest micro-batch
    --layouts all    every legal layout the planner enumerates (hundreds: hours on a CPU)
    --layouts A,B    the named ones of `core`

and always the planner's pick, its fastest predicted layout of all it enumerates. Every layout
keeps the global batch --micro-batch x N sequences, so their tokens per step are equal.

Each layout runs as a user runs it: ``scaletrain train`` in a fresh process (its configuration
written as a TOML file, ``--report-memory``) for --steps steps, --rounds times, each round
passing through every layout (starting one further on each round), so that a slow spell of a
shared machine falls on all of them. Measured: the median of rank 0's step times after --warmup,
over all rounds; the memory ledger's params + grads + optimizer + activations_peak on its busiest
rank (memory.json: the second step); and, not compared, the largest ``mem_bytes`` rank 0 logged
(its whole process's resident set on a CPU, CUDA's peak on a GPU). Predicted: ``predict`` for the
same configuration, its step time and the same four rows on its busiest pipeline rank (``other``,
the allocator's allowance and the loss's logits, is not in the ledger, so not compared).

Reported: both figures and their ratio (predicted / measured) per layout; Spearman's rank
correlation of the step times (Spearman 1904: Pearson's correlation of the two rankings, tied
values at their mean rank); the share of layouts predicted within 20% of the measured step time
and within 10% of the measured memory; and the planner's pick against the fastest measured.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from scaletrain.bench import machine, rotated
from scaletrain.config import Config
from scaletrain.errors import UserError
from scaletrain.job.data_setup import prepare_data
from scaletrain.models import DEFAULT_PRESET
from scaletrain.planner.machine import this_machine
from scaletrain.planner.predict import predict
from scaletrain.planner.prediction import Prediction, as_flags
from scaletrain.planner.search import layout_text, layouts, refusal, search
from scaletrain.runtime.launch import detect_environment

PLANNER_DEFAULTS = {"name": DEFAULT_PRESET, "seq_len": 128, "micro_batch": 4, "steps": 7}
# the default preset deepened, so that 4 interleaved stages of 2 chunks each hold a block
DEEPER = {"n_layers": 8}
LEDGER_ROWS = ("params", "grads", "optimizer", "activations_peak")
PREDICTED_ROWS = ("params", "grads", "optimizer", "activations")
TIME_TOLERANCE, MEMORY_TOLERANCE = 0.20, 0.10
# what a core layout does not name: no model parallelism, sharding, recompute or accumulation
PLAIN = {"tp": 1, "pp": 1, "cp": 1, "ep": 1, "zero": 0, "sp": False, "recompute": "none", "grad_accum": 1}
MIB = 2**20


def defaults(given: set[str]) -> dict[str, Any]:
    """bench planner's defaults: the default preset at 8 blocks unless a model or its depth was given."""
    return {**PLANNER_DEFAULTS, **({} if given & {"name", "n_layers", "base"} else DEEPER)}


def core(n: int) -> dict[str, dict[str, Any]]:
    """``--layouts core`` on ``n`` processes: name -> the fields that pick the layout (module
    docstring); a pipeline takes two micro-batches per stage in one round."""
    half = n // 2
    pipelines = {f"pp-{'dp-' if pp < n else ''}{schedule}": {"dp": n // pp, "pp": pp, "pp_schedule": schedule,
                                                             "microbatches": 2 * pp}
                 for pp in dict.fromkeys((2, n)) for schedule in ("1f1b", "interleaved")}
    return {"dp": {"dp": n}, **{f"zero{stage}": {"dp": n, "zero": stage} for stage in (1, 2, 3)},
            "recompute": {"dp": n, "recompute": "full"}, "accumulation": {"dp": n, "grad_accum": 2},
            "tp-dp": {"dp": half, "tp": 2}, "tp-dp-sp": {"dp": half, "tp": 2, "sp": True}, "tp": {"dp": 1, "tp": n},
            **pipelines, "cp-dp": {"dp": half, "cp": 2}}


def selection(text: str, n: int) -> list[str] | None:
    """``--layouts``: the core names it selects, or None for all; a UserError for an unknown name."""
    if text == "all":
        return None
    names = list(core(n)) if text == "core" else [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in core(n)]
    if unknown or not names:
        raise UserError(f"--layouts: no layout named {', '.join(unknown) or repr(text)}; give core, all, or names "
                        f"from {', '.join(core(n))}.")
    return names


def check(cfg: Config, layouts_text: str, rounds: int, warmup: int) -> list[str] | None:
    """What bench planner cannot measure, in one sentence, before any work starts; the selection."""
    n = cfg.parallel.nproc
    if n < 2:
        raise UserError("bench planner compares layouts across processes; give --nproc 2 or more.")
    if detect_environment().world_size > 1:
        raise UserError("bench planner starts its own processes; run it with --nproc N, not under a launcher.")
    if rounds < 1:
        raise UserError(f"--rounds must be at least 1, not {rounds}.")
    if warmup >= cfg.train.steps:
        raise UserError(f"--warmup {warmup} leaves no timed step of --steps {cfg.train.steps}; "
                        f"raise --steps or lower --warmup.")
    return selection(layouts_text, n)


def chosen(enumerated: list[Config], names: list[str] | None, n: int) -> tuple[dict[str, Config], list[str]]:
    """The layouts to run, by name (a core name, or the layout's own text with ``all``), and the
    core names the enumeration has no layout for."""
    if names is None:
        return {f"#{i + 1}": cfg for i, cfg in enumerate(enumerated)}, []
    flats = [cfg.flat() for cfg in enumerated]
    picked, missing = {}, []
    for name in names:
        wanted = {**PLAIN, **core(n)[name]}
        found = [i for i, flat in enumerate(flats) if all(flat[key] == value for key, value in wanted.items())]
        if found:
            picked[name] = enumerated[max(found, key=lambda i: enumerated[i].train.micro_batch)]
        else:
            missing.append(name)
    return picked, missing


def run(cfg: Config, layouts_text: str, rounds: int, warmup: int) -> dict:
    """Every chosen layout predicted and trained here; the result of ``bench planner --json``."""
    names = check(cfg, layouts_text, rounds, warmup)
    n = cfg.parallel.nproc
    load_before = os.getloadavg()[0]
    base = cfg.replace(report_memory=True, progress=False, resume=False, eval_every=0, sample_tokens=0,
                       checkpoint_every=0)
    vocab = prepare_data(base, cache_dir=Path(base.data.cache_dir)).vocab_size
    global_batch = base.train.micro_batch * n
    enumerated = [layout for layout in layouts(base, n, n, global_batch, set()) if refusal(layout, n) is None]
    cluster = this_machine(n, n, on_gpu=torch.cuda.is_available())
    pick = search(base, cluster, vocab, global_batch, set(), predict).best()
    picked, missing = chosen(enumerated, names, n)
    predictions: dict[str, Prediction] = {}
    for name, layout in {**picked, "pick": pick.cfg}.items():
        prediction = predict(layout, n, vocab, cluster)
        if layout_text(prediction) not in map(layout_text, predictions.values()):
            predictions[name] = prediction
    measured = _measure({name: p.cfg for name, p in predictions.items()}, n, rounds, warmup)
    rows = [_row(name, predictions[name], base, measured[name]) for name in predictions]
    t = base.train
    return {"what": "planner", "machine": machine(), "device": cluster.device.name,
            "peak_tflops": cluster.device.tflops[t.precision if t.precision in cluster.device.tflops else "fp32"],
            "setup": {"model": base.model.name, "n_layers": base.model.n_layers, "seq_len": base.data.seq_len,
                      "vocab_size": vocab, "nproc": n, "global_batch": global_batch, "steps": t.steps, "warmup": warmup,
                      "rounds": rounds, "precision": t.precision, "enumerated": len(enumerated),
                      "load_average": [load_before, os.getloadavg()[0]]},
            "not_enumerated": missing, "layouts": rows, **summary(rows, layout_text(pick))}


def _measure(configs: dict[str, Config], n: int, rounds: int, warmup: int) -> dict[str, dict]:
    """Each layout trained ``rounds`` times, the rounds alternating the layouts: its timed step
    times, its busiest rank's ledger, or why it failed."""
    results: dict[str, dict] = {name: {"step_s": []} for name in configs}
    with tempfile.TemporaryDirectory(prefix="scaletrain-bench-planner-") as root:
        for round_index in range(rounds):
            for name in rotated(list(configs), round_index):
                if "error" in results[name]:
                    continue
                run = train_once(configs[name], n, Path(root) / f"{round_index}-{name.replace('#', 'n')}")
                results[name]["step_s"] += run.get("step_s", [])[warmup:]
                results[name].update({key: value for key, value in run.items() if key != "step_s"})
                shown = f"{statistics.median(run['step_s'][warmup:]):.3f} s" if "step_s" in run else run["error"]
                print(f"bench planner: round {round_index + 1}/{rounds}, {name}: {shown}", file=sys.stderr, flush=True)
    return results


def train_once(cfg: Config, n: int, run_dir: Path) -> dict[str, Any]:
    """``cfg`` trained by ``scaletrain train`` in a fresh process: rank 0's step times and the
    ledger of the busiest rank, or the last line the run printed when it failed."""
    config = run_dir.with_suffix(".toml")
    config.write_text(cfg.to_toml())
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "scaletrain", "train", "--config", str(config), "--out", str(run_dir),
                           "--nproc", str(n)], capture_output=True, text=True)
    if done.returncode:
        last = (done.stderr.strip() or done.stdout.strip() or f"exit code {done.returncode}").splitlines()[-1]
        return {"error": f"scaletrain train failed: {last}"}
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    ledgers = [rank for rank in json.loads((run_dir / "memory.json").read_text()).values() if "params" in rank]
    shutil.rmtree(run_dir)
    return {"step_s": [record["step_s"] for record in records], "wall_s": time.perf_counter() - start,
            "memory_bytes": max(sum(ledger[row] for row in LEDGER_ROWS) for ledger in ledgers),
            "rank0_mem_bytes": max(record.get("mem_bytes") or 0 for record in records)}


def _row(name: str, prediction: Prediction, base: Config, measured: dict) -> dict[str, Any]:
    changes = {key: value for key, value in prediction.cfg.flat().items()
               if value != base.flat()[key] and value is not None}
    predicted = {"step_s": prediction.step_s,
                 "memory_bytes": max(sum(stage[row] for row in PREDICTED_ROWS) for stage in prediction.stages)}
    row: dict[str, Any] = {"name": name, "layout": layout_text(prediction), "flags": as_flags(changes),
                           "predicted": predicted}
    if "error" in measured:
        return {**row, "error": measured["error"]}
    shown = {"step_s": statistics.median(measured["step_s"]), "steps_s": measured["step_s"],
             "memory_bytes": measured["memory_bytes"], "rank0_mem_bytes": measured["rank0_mem_bytes"],
             "wall_s": measured["wall_s"]}
    return {**row, "measured": shown, "time_ratio": predicted["step_s"] / shown["step_s"],
            "memory_ratio": predicted["memory_bytes"] / shown["memory_bytes"]}


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rho: the Pearson correlation of the ranks (tied values at their mean rank);
    NaN where either list has fewer than two distinct values."""
    if len(set(a)) < 2 or len(set(b)) < 2:
        return float("nan")
    return statistics.correlation(ranks(a), ranks(b))


def ranks(values: list[float]) -> list[float]:
    """Each value's rank from 0, tied values at the mean of the ranks they span."""
    order = sorted(range(len(values)), key=values.__getitem__)
    result = [0.0] * len(values)
    first = 0
    while first < len(order):
        last = first
        while last + 1 < len(order) and values[order[last + 1]] == values[order[first]]:
            last += 1
        for position in range(first, last + 1):
            result[order[position]] = (first + last) / 2
        first = last + 1
    return result


def summary(rows: list[dict], pick_layout: str) -> dict[str, Any]:
    """Spearman's rho of the step times, the shares within tolerance, and the pick against the
    fastest measured layout (over the layouts that ran)."""
    ran = [row for row in rows if "measured" in row]
    if not ran:
        return {"spearman": float("nan"), "within": {}, "pick": None, "fastest": None}
    rho = spearman([row["predicted"]["step_s"] for row in ran], [row["measured"]["step_s"] for row in ran])
    within = {"time": sum(abs(row["time_ratio"] - 1) <= TIME_TOLERANCE for row in ran) / len(ran),
              "memory": sum(abs(row["memory_ratio"] - 1) <= MEMORY_TOLERANCE for row in ran) / len(ran)}
    fastest = min(ran, key=lambda row: row["measured"]["step_s"])
    pick = next((row for row in ran if row["layout"] == pick_layout), None)
    pick_text = {"layout": pick_layout, "predicted_s": pick["predicted"]["step_s"] if pick else None,
                 "measured_s": pick["measured"]["step_s"] if pick else None,
                 "behind_fastest": pick["measured"]["step_s"] / fastest["measured"]["step_s"] - 1 if pick else None}
    return {"spearman": rho, "within": {"time_20pct": within["time"], "memory_10pct": within["memory"]},
            "pick": pick_text, "fastest": {"layout": fastest["layout"], "predicted_s": fastest["predicted"]["step_s"],
                                           "measured_s": fastest["measured"]["step_s"]}}


def format_table(result: dict) -> str:
    s = result["setup"]
    load = s["load_average"]
    depth = f" at {s['n_layers']} blocks" if s["n_layers"] else ""
    lines = [f"{s['model']}{depth}, {s['global_batch']} x {s['seq_len']} tokens a step, {s['nproc']} processes, "
             f"{s['precision']}, on {result['machine']}",
             f"planned for {result['device']} at "
             f"{result['peak_tflops']:.3g} TFLOP/s; median step after {s['warmup']} of {s['steps']}, "
             f"{s['rounds']} round{'s' if s['rounds'] > 1 else ''}; load average {load[0]:.1f} before, "
             f"{load[1]:.1f} after; memory: params + grads + optimizer + activations of the busiest rank"]
    labels = [row["layout"] + ("" if row["name"].startswith("#") else f" ({row['name']})")
              for row in result["layouts"]]
    width = max(map(len, labels)) + 2
    lines.append(f"{'layout':<{width}}{'pred s':>9}{'meas s':>9}{'ratio':>7}{'pred MiB':>10}{'meas MiB':>10}"
                 f"{'ratio':>7}")
    for label, row in zip(labels, result["layouts"]):
        p = row["predicted"]
        if "error" in row:
            lines.append(f"{label:<{width}}{p['step_s']:>9.3f}  {row['error']}")
            continue
        m = row["measured"]
        lines.append(f"{label:<{width}}{p['step_s']:>9.3f}{m['step_s']:>9.3f}{row['time_ratio']:>7.2f}"
                     f"{p['memory_bytes'] / MIB:>10.1f}{m['memory_bytes'] / MIB:>10.1f}{row['memory_ratio']:>7.2f}")
    if result["not_enumerated"]:
        lines.append(f"not among the planner's layouts here: {', '.join(result['not_enumerated'])}")
    ran = sum("measured" in row for row in result["layouts"])
    if not ran:
        return "\n".join([*lines, "no layout ran"])
    within = result["within"]
    lines += [f"Spearman's rank correlation of the step times: {result['spearman']:.2f} over {ran} layouts",
              f"within 20% of the measured step time: {round(within['time_20pct'] * ran)} of {ran}; "
              f"memory within 10%: {round(within['memory_10pct'] * ran)} of {ran}",
              pick_sentence(result["pick"], result["fastest"])]
    return "\n".join(lines)


def pick_sentence(pick: dict, fastest: dict) -> str:
    if pick["measured_s"] is None:
        return f"the planner's pick {pick['layout']} did not run"
    head = (f"the planner's pick {pick['layout']}: predicted {pick['predicted_s']:.3f} s, "
            f"measured {pick['measured_s']:.3f} s")
    if pick["layout"] == fastest["layout"]:
        return f"{head}, the fastest measured"
    return f"{head}, {pick['behind_fastest']:.0%} behind the fastest measured ({fastest['layout']}: " \
           f"{fastest['measured_s']:.3f} s)"
