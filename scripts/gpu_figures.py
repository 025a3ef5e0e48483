"""Every GPU figure the docs still lack, in one call: ``scripts/gpu-figures.sh OUT [--tiny]``.

Runs, each as a ``scaletrain`` command of its own with ``--json`` (so one failure costs its row,
not the rest), with nothing but the machine's own torch, Triton and transformers:

  throughput   bench throughput on the GPU presets (docs/performance.md): tinyllama-1.1b and
               gpt2-124m compiled, llama3.2-1b eager, each beside a plain loop and
               transformers
  kernels      bench adam, softmax and cross-entropy (docs/kernels.md)
  ladder       bench finetune's first rungs on tinyllama-1.1b, with the allocator's figures
  planner      a gpt2-124m step's CUDA peak (train --report-memory) beside the planner's
               prediction for the same layout (plan --json)
  profile      torch.profiler over three of our compiled tinyllama steps: the kernels that take the
               time, the host syncs, and the share of the step the GPU sat idle
  gemm         one matrix product's rate as its sides grow: the planner's efficiency curve
  packing      the same instruction records trained packed (FlexAttention over the documents' tiles)
               and unpacked (one per row, padded): positions per second, and their ratio
  fp8          --precision fp8 against bf16 on Llama 3 8B's shapes cut to two layers, eager and
               compiled: tokens per second, and their ratio (``--rows fp8`` runs it alone)

and writes OUT/figures.json (every command, its seconds, exit code and JSON) and OUT/figures.md
(the tables), rewritten after every row. Each row carries an estimate of its seconds on one
H200: measured where the first two runs (2026-11-27) ran it (tinyllama's three-contender
throughput 200-240 s, the profile 31-38 s, gpt2 eager 50 s, the planner 27 s, the three kernel
benches 53 s), else by its compilations (about a minute for each contender's) and steps. The
rows come in two tiers, each planned to fit one call of ``--budget SECONDS`` (470 s, under
eight minutes with start-up): the goals' rows (tinyllama's throughput and its profile,
compiled gpt2-124m's MFU with ours alone, packed against unpacked, fp8 against bf16 compiled)
by default, 460 s by their estimates; the rest with ``--more``, 395 s. The plan, each row's
estimate and the running total, is printed first (``--plan`` prints it alone); a row whose
estimate is over what is left of the budget is recorded as skipped rather than started, and
each row's time limit is cut to what is left. Inductor's compiled kernels are kept in
OUT/inductor-cache, so the profile reuses the headline's and a second call or a rerun after a
fix compiles only what changed. ``--rows tinyllama,gpt2`` runs only the rows whose names hold
one of the words, of either tier. ``--tiny`` runs every row on tiny models with fp32 and no
compilation: the dry run a CPU machine can make (the Triton benches then need
TRITON_INTERPRET=1, which it sets).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent  # this checkout: importable without an install
sys.path.insert(0, str(ROOT))
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))

# (row, arguments after `scaletrain`, time limit in seconds, estimate on one H200 in seconds, tier) on a GPU,
# and in the dry run; tier 1: the rows the goals need (docs/performance.md), run first and by default; tier 2
# (--more): the rest. The estimates: the rows' times on 2026-11-27's two H200 runs where measured, else by
# their compilations (about 60 s for a model's, its contenders each their own) and steps.
GPU = [
    ("throughput tinyllama-1.1b", ["bench", "throughput", "--model", "tinyllama-1.1b", "--seq-len", "2048",
                                   "--micro-batch", "4", "--precision", "bf16", "--compile", "--steps", "16",
                                   "--warmup", "6"], 300, 220, 1),
    # the goal is its MFU: ours alone, one compilation
    ("throughput gpt2-124m", ["bench", "throughput", "--model", "gpt2-124m", "--seq-len", "1024", "--micro-batch", "16",
                              "--precision", "bf16", "--compile", "--steps", "20", "--warmup", "5", "--peers", ""],
     120, 60, 1),
    ("throughput gpt2-124m reduce-overhead", ["bench", "throughput", "--model", "gpt2-124m", "--seq-len", "1024",
                                              "--micro-batch", "16", "--precision", "bf16", "--compile",
                                              "--compile-mode", "reduce-overhead", "--steps", "20", "--warmup", "5",
                                              "--peers", ""], 120, 60, 2),
    ("throughput llama3.2-1b", ["bench", "throughput", "--model", "llama3.2-1b", "--seq-len", "2048",
                                "--micro-batch", "4", "--precision", "bf16", "--steps", "15", "--warmup", "5"],
     150, 60, 2),
    ("adam", ["bench", "adam"], 60, 20, 2),
    ("softmax", ["bench", "softmax"], 60, 15, 2),
    ("cross-entropy", ["bench", "cross-entropy"], 60, 20, 2),
    ("ladder", ["bench", "finetune", "--model", "tinyllama-1.1b", "--seq-len", "1024", "--micro-batch", "4",
                "--steps", "4", "--warmup", "2", "--rungs", "full,bf16-mixed,pure-bf16,adamw8bit,recompute"],
     240, 120, 2),
]
TINY = [
    ("throughput llama-tiny", ["bench", "throughput", "--model", "llama-tiny", "--seq-len", "64", "--micro-batch", "2",
                               "--steps", "4", "--warmup", "1"], 300, 0, 1),
    ("throughput gpt-tiny", ["bench", "throughput", "--model", "gpt-tiny", "--seq-len", "64", "--micro-batch", "2",
                             "--steps", "4", "--warmup", "1", "--peers", ""], 300, 0, 1),
    ("adam", ["bench", "adam"], 300, 0, 2),
    ("ladder", ["bench", "finetune", "--model", "llama-tiny", "--seq-len", "32", "--micro-batch", "2", "--steps", "3",
                "--warmup", "1", "--rungs", "full,recompute"], 300, 0, 2),
]
# the rows of their own, after the throughputs: (row, time limit, estimate on one H200, tier)
OWN_ROWS = [("profile", 240, 40, 1), ("packing", 200, 70, 1), ("fp8", 240, 70, 1), ("fp8 eager", 200, 50, 2),
            ("planner", 240, 30, 2), ("gemm", 40, 20, 2)]
PACKED = {"gpu": ("tinyllama-1.1b", 2048, 4, 12), "tiny": ("llama-tiny", 64, 2, 6)}  # model, seq, micro, steps
PLANNED = {"gpu": ("gpt2-124m", 1024, 8), "tiny": ("gpt-tiny", 64, 4)}  # model, seq, micro-batch
# Llama 3 8B's matrix shapes cut to the layers one GPU holds: model, layers, seq, micro-batch, steps
FP8 = {"gpu": ("llama3-8b", 2, 2048, 2, 12), "tiny": ("llama-tiny", 2, 64, 2, 6)}
SYNCS = ("aten::_local_scalar_dense", "cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
VOCAB = 50304  # the planner's default vocabulary, given to the real run too (the byte tokenizer has 256)
GPU_BUDGET_S = 470  # the whole on a GPU within eight minutes, start-up included


def run(row: str, args: list[str], limit: float, work: Path) -> dict:
    """``scaletrain ARGS --json``: its seconds, exit code, and JSON (or the end of its stderr)."""
    start = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, "-m", "scaletrain", *args, "--json"], capture_output=True, text=True,
                              timeout=limit, cwd=work)
        result = {"row": row, "command": "scaletrain " + " ".join(args), "rc": done.returncode}
        if done.returncode == 0:
            result["json"] = json.loads(done.stdout.strip().splitlines()[-1])
        else:
            result["error"] = done.stderr[-2000:]
    except subprocess.TimeoutExpired:
        result = {"row": row, "command": "scaletrain " + " ".join(args), "rc": None, "error": f"over {limit} s"}
    result["seconds"] = round(time.perf_counter() - start, 1)
    print(f"{row}: {result['rc']} in {result['seconds']} s", flush=True)
    return result


def _median_rate(run: Path, skip: int = 3) -> float:
    """The median tokens/s of a run's steps after the first ``skip`` (compilation, allocator warm-up)."""
    rows = map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
    timed = sorted(row["tokens_per_s"] for row in rows if "tokens_per_s" in row)[skip:]
    return timed[len(timed) // 2]


def _train_rate(args: list[str], run_dir: Path, limit: float, work: Path) -> tuple[float | None, str | None]:
    """``scaletrain train ARGS`` into ``run_dir``, in a process of its own: its median tokens/s after
    the first three steps, or what went wrong."""
    try:
        done = subprocess.run([sys.executable, "-m", "scaletrain", "train", *args, "--sample-tokens", "0",
                               "--eval-every", "0", "--no-progress", "--out", str(run_dir)],
                              capture_output=True, text=True, timeout=limit, cwd=work)
    except subprocess.TimeoutExpired:
        return None, f"{run_dir.name} over {limit:.0f} s"
    if done.returncode:
        return None, done.stderr[-1000:]
    return _median_rate(run_dir), None


def _race(row: str, runs: dict[str, list[str]], limit: float, work: Path) -> tuple[dict, dict[str, float]]:
    """Each of ``runs`` (name -> ``scaletrain train`` arguments) in a process of its own, within its
    share of ``limit``: the row's result (with the errors of those that failed) and the others' rates."""
    start = time.perf_counter()
    rates, errors = {}, []
    for name, args in runs.items():
        rate, error = _train_rate(args, work / f"{row}-{name.replace(' ', '-')}", limit / len(runs), work)
        if error:
            errors.append(error)
        else:
            rates[name] = rate
    result = {"row": row, "rc": 1 if errors else 0, "seconds": round(time.perf_counter() - start, 1)}
    if errors:
        result["error"] = "\n".join(errors)
    return result, rates


def fp8_row(size: str, limit: float, work: Path, compiled: bool = True, row: str = "fp8") -> dict:
    """``--precision fp8`` against bf16 (both over fp32 masters) on Llama 3 8B's shapes, compiled (or
    eager), each run in a process of its own (techniques/fp8.py; the tiny dry run: eager only)."""
    model, layers, seq, micro, steps = FP8[size]
    shape = ["--model", model, "--n-layers", str(layers), "--seq-len", str(seq), "--micro-batch", str(micro),
             "--steps", str(steps), "--param-dtype", "bf16"]
    compiled = compiled and size == "gpu"
    runs = {precision + (" compiled" if compiled else ""): [*shape, "--precision", precision,
                                                            *(["--compile"] if compiled else [])]
            for precision in ("bf16", "fp8")}
    result, rates = _race(row, runs, limit, work)
    if result["rc"] == 0:
        ratios = {kind: rates[f"fp8{kind}"] / rates[f"bf16{kind}"]
                  for kind in ("", " compiled") if f"fp8{kind}" in rates}
        result["json"] = {"model": model, "n_layers": layers, "seq_len": seq, "micro_batch": micro,
                          "tokens_per_s": rates, "ratio": ratios}
    print(f"{row}: {result['rc']} in {result['seconds']} s", flush=True)
    return result


def planner_check(size: str, limit: float, work: Path) -> dict:
    """A real step's memory (CUDA's peak on a GPU) beside the planner's prediction of the same layout."""
    model, seq, micro = PLANNED[size]
    precision = ["--precision", "bf16"] if size == "gpu" else []
    start = time.perf_counter()
    train = subprocess.run([sys.executable, "-m", "scaletrain", "train", "--model", model, "--seq-len", str(seq),
                            "--micro-batch", str(micro), "--n-vocab", str(VOCAB), "--steps", "3", "--report-memory",
                            "--sample-tokens", "0",
                            "--eval-every", "0", "--no-progress", *precision, "--out", str(work / "planned-run")],
                           capture_output=True, text=True, timeout=limit * 2 / 3, cwd=work)
    plan = subprocess.run([sys.executable, "-m", "scaletrain", "plan", "--model", model, "--gpus", "1", "--dp", "1",
                           "--micro-batch", str(micro), "--seq", str(seq), "--vocab", str(VOCAB), *precision,
                           "--json"], capture_output=True, text=True,
                          timeout=limit / 3, cwd=work)
    result = {"row": "planner", "rc": max(train.returncode, plan.returncode),
              "seconds": round(time.perf_counter() - start, 1)}
    if result["rc"] == 0:
        ledger = json.loads((work / "planned-run" / "memory.json").read_text())["0"]
        predicted = json.loads(plan.stdout)["candidates"][0]
        counted = sum(ledger[key] for key in ("params", "grads", "optimizer", "activations_peak"))
        result["json"] = {"ledger": ledger, "counted_bytes": counted, "cuda_peak": ledger.get("cuda_peak"),
                          "predicted": predicted}
    else:
        result["error"] = (train.stderr + plan.stderr)[-2000:]
    print(f"planner: {result['rc']} in {result['seconds']} s", flush=True)
    return result


def packing(size: str, limit: float, work: Path) -> dict:
    """Synthetic instruction records (answers of 40 to 1,500 characters, so a row packs several)
    trained packed and unpacked, each for a few steps in a process of its own: the median of their
    positions per second after the first three steps (compilation, allocator warm-up)."""
    model, seq, micro, steps = PACKED[size]
    records = [{"instruction": f"Describe fox number {i}.", "output": "Rusty runs. " * (4 + (i * 37) % 125)}
               for i in range(2000)]
    (work / "instructions.json").write_text(json.dumps(records))
    precision = ["--precision", "bf16"] if size == "gpu" else []
    runs = {name: ["--model", model, "--data", str(work / "instructions.json"), "--sft", pack, "--seq-len", str(seq),
                   "--micro-batch", str(micro), "--steps", str(steps), *precision]
            for name, pack in (("packed", "--pack"), ("unpacked", "--no-pack"))}
    result, rates = _race("packing", runs, limit, work)
    if result["rc"] == 0:
        result["json"] = {"model": model, "seq_len": seq, "micro_batch": micro, "tokens_per_s": rates,
                          "ratio": rates["packed"] / rates["unpacked"]}
    print(f"packing: {result['rc']} in {result['seconds']} s", flush=True)
    return result


def profile_row(size: str, limit: float, work: Path) -> dict:
    """The profile below, in a process of its own (its time limited, its CUDA memory its own)."""
    start = time.perf_counter()
    try:
        tiny = ["--tiny"] if size == "tiny" else []
        done = subprocess.run([sys.executable, __file__, str(work), "--profile", *tiny],
                              capture_output=True, text=True, timeout=limit, cwd=work)
        result = {"row": "profile", "rc": done.returncode}
        if done.returncode == 0:
            result["json"] = json.loads(done.stdout.strip().splitlines()[-1])
        else:
            result["error"] = done.stderr[-2000:]
    except subprocess.TimeoutExpired:
        result = {"row": "profile", "rc": None, "error": f"over {limit:.0f} s"}
    result["seconds"] = round(time.perf_counter() - start, 1)
    print(f"profile: {result['rc']} in {result['seconds']} s", flush=True)
    return result


def profile(size: str, work: Path) -> dict:
    """torch.profiler over three of our training steps (after two of warm-up): the ten ops or
    kernels with the most device time (CPU time on a CPU), and the share of the steps' wall time
    the device spent in none of them (idle: host work, launches, synchronizations)."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as profiler

    from scaletrain.config import Config
    from scaletrain.job.data_setup import prepare_data
    from scaletrain.job.trainer import Trainer
    from scaletrain.runtime import Comm, Mesh
    from scaletrain.runtime.launch import detect_environment, init_distributed, shutdown
    from scaletrain.runtime.mesh import ParallelDims

    start = time.perf_counter()
    gpu = size == "gpu"
    cfg = Config().replace(name="tinyllama-1.1b" if gpu else "llama-tiny", seq_len=2048 if gpu else 64,
                           micro_batch=4 if gpu else 2, precision="bf16" if gpu else "fp32", steps=5, compile=gpu,
                           sample_tokens=0, eval_every=0, progress=False, cache_dir=str(work / "cache"),
                           out=str(work / "profiled-run"))
    prepared = prepare_data(cfg, Path(cfg.data.cache_dir))
    runtime = init_distributed(detect_environment(), timeout_s=None)
    try:
        one_rank = Mesh.build(ParallelDims.infer(1), 0, 1)
        trainer = Trainer(cfg, prepared, runtime, one_rank, Comm(), work / "profiled-run")
        for step in range(2):
            trainer.train_step(step)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        wall = time.perf_counter()
        with profiler(activities=activities) as trace:
            for step in range(2, 5):
                trainer.train_step(step)
        wall = time.perf_counter() - wall
    finally:
        shutdown(runtime)
    on_device = torch.cuda.is_available()
    key = "self_device_time_total" if on_device else "self_cpu_time_total"
    events = sorted(trace.key_averages(), key=lambda e: getattr(e, key), reverse=True)
    # the device's own work: its kernels and copies (an aten op's device time is its kernels' again)
    work = [e for e in events if (e.device_type == DeviceType.CUDA if on_device else e.key.startswith("aten::"))]
    busy_us = sum(getattr(e, key) for e in work)
    top = [{"name": e.key, "ms": getattr(e, key) / 1e3, "calls": e.count} for e in work[:15]]
    # the host waiting on the device inside the steps: each one leaves the GPU's queue empty after it
    syncs = {e.key: e.count for e in events if e.key in SYNCS}
    return {"model": cfg.model.name, "steps": 3, "wall_s": wall, "device_busy_s": busy_us / 1e6,
            "idle_share": max(0.0, 1 - busy_us / 1e6 / wall) if on_device else None, "host_syncs": syncs,
            "top": top, "seconds": time.perf_counter() - start}


def gemm_sweep(size: str, limit: float, work: Path) -> dict:
    """The rate of one matrix product [m, k] @ [k, n] in bf16 (fp32 in the dry run) as it grows:
    the curve the planner's clock reads matrix-product efficiency from (docs/planner.md). Each
    point: the median of timed products after warm-up, on random data."""
    import torch

    start = time.perf_counter()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    sides = (256, 512, 1024, 2048, 4096, 8192) if size == "gpu" else (64, 128, 256)
    points = []
    for m in sides:
        for k in sides:
            a, b = torch.randn(m, k, device=device, dtype=dtype), torch.randn(k, k, device=device, dtype=dtype)
            points.append({"m": m, "k": k, "n": k, "tflops": 2 * m * k * k / _median_seconds(lambda: a @ b) / 1e12})
            if time.perf_counter() - start > limit:
                break
    print(f"gemm: 0 in {time.perf_counter() - start:.1f} s", flush=True)
    return {"row": "gemm", "rc": 0, "seconds": round(time.perf_counter() - start, 1),
            "json": {"dtype": str(dtype), "points": points}}


def _median_seconds(work: Callable[[], object], repeats: int = 20) -> float:
    import torch

    for _ in range(3):
        work()
    times = []
    for _ in range(repeats):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        work()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def markdown(results: list[dict], device: str) -> str:
    lines = [f"# GPU figures on {device}", "", "| row | exit | seconds | figures |", "| --- | --- | ---: | --- |"]
    for r in results:
        lines.append(f"| {r['row']} | {r['rc']} | {r['seconds']} | {_headline(r)} |")
    for r in results:
        if r["row"].startswith("throughput") and r["rc"] == 0:
            lines += ["", f"## {r['row']}", "", "| contender | step s | tokens/s | MFU | peak GiB | ours / it |",
                      "| --- | ---: | ---: | ---: | ---: | ---: |"]
            for row in (r["json"]["ours"], *r["json"]["peers"]):
                share = "n/a" if row["mfu"] is None else f"{row['mfu']:.1%}"
                lines.append(f"| {row['name']} | {row['median_s']:.4f} | {row['tokens_per_s']:,.0f} | {share} | "
                             f"{row['peak_memory_bytes'] / 2**30:.2f} | {row.get('ratio', 1.0):.3f} |")
        if r["row"] == "profile" and r["rc"] == 0:
            lines += ["", "## profile: our step's top ops", "", "| op | ms | calls |", "| --- | ---: | ---: |"]
            lines += [f"| `{t['name'][:80]}` | {t['ms']:.2f} | {t['calls']} |" for t in r["json"]["top"]]
    return "\n".join(lines) + "\n"


def _headline(result: dict) -> str:
    if result["rc"] != 0:
        return "failed: " + result.get("error", "").strip().splitlines()[-1][:120] if result.get("error") else "failed"
    figures = result["json"]
    if result["row"].startswith("throughput"):
        ours = figures["ours"]
        share = "n/a" if ours["mfu"] is None else f"{ours['mfu']:.1%}"
        return (f"{ours['tokens_per_s']:,.0f} tokens/s, MFU {share}"
                + (f", ratio {figures['ratio']:.3f} to {figures['peer']['name']}" if figures["peer"] else ""))
    if result["row"] == "planner":
        predicted = figures["predicted"]["memory_bytes"]
        counted = predicted["params"] + predicted["grads"] + predicted["optimizer"] + predicted["activations"]
        peak = "" if figures["cuda_peak"] is None else f"CUDA peak {figures['cuda_peak'] / 2**30:.2f} GiB against " \
            f"{predicted['total'] / 2**30:.2f} predicted; "
        return (f"{peak}the ledger's {figures['counted_bytes'] / 2**20:,.1f} MiB against "
                f"{counted / 2**20:,.1f} predicted")
    if result["row"] == "profile":
        idle = figures["idle_share"]
        syncs = sum(figures["host_syncs"].values())
        return (f"{figures['wall_s']:.3f} s for 3 steps, {syncs} host syncs"
                + ("" if idle is None else f", GPU idle {idle:.1%}"))
    if result["row"] == "packing":
        rates = figures["tokens_per_s"]
        return (f"packed {rates['packed']:,.0f} against unpacked {rates['unpacked']:,.0f} positions/s: "
                f"ratio {figures['ratio']:.3f}")
    if result["row"] == "fp8":
        return ", ".join(f"fp8 / bf16{kind or ' eager'}: {ratio:.3f}" for kind, ratio in figures["ratio"].items())
    if result["row"] == "gemm":
        best = max(figures["points"], key=lambda p: p["tflops"])
        return (f"{len(figures['points'])} products, at most {best['tflops']:.0f} TFLOP/s "
                f"(m={best['m']}, k=n={best['k']})")
    ratio = figures.get("ratio")
    peer = figures.get("peer", {}).get("name", "the peer")
    return "" if ratio is None else f"ratio {ratio:.3f} (ours / {peer})"


def jobs_for(size: str, tier: int | None) -> list[tuple[str, Callable[[float, Path], dict], float, float]]:
    """The rows to run, in order (the throughputs, the headline first and the profile right after it, then
    the rows of their own), each with its job, time limit and estimate; ``tier``: only that tier's."""
    own = {"profile": functools.partial(profile_row, size), "packing": functools.partial(packing, size),
           "fp8": functools.partial(fp8_row, size), "fp8 eager": functools.partial(fp8_row, size, compiled=False,
                                                                                 row="fp8 eager"),
           "planner": functools.partial(planner_check, size), "gemm": functools.partial(gemm_sweep, size)}
    if size == "tiny":  # the dry run compiles nothing: its fp8 row is eager already
        own.pop("fp8 eager")
    rows = [(row, functools.partial(run, row, command), limit, estimate, level)
            for row, command, limit, estimate, level in (TINY if size == "tiny" else GPU)]
    limit, estimate, level = OWN_ROWS[0][1:]
    rows[1:1] = [("profile", own.pop("profile"), limit, 0 if size == "tiny" else estimate, level)]
    after_throughput = 1 + max(i for i, (row, *_) in enumerate(rows) if row.startswith("throughput"))
    rows[after_throughput:after_throughput] = [(row, own[row], limit, 0 if size == "tiny" else estimate, level)
                                               for row, limit, estimate, level in OWN_ROWS if row in own]
    return [(row, job, limit, estimate) for row, job, limit, estimate, level in rows if tier in (None, level)]


def plan_lines(jobs: list, budget: float) -> list[str]:
    """Each row's estimate and the running total against ``budget``: what the run expects to fit."""
    lines, total = [], 0.0
    for row, _, _, estimate in jobs:
        total += estimate
        lines.append(f"{row:<40}{estimate:>6.0f} s{total:>8.0f} s{'' if total <= budget else '  over the budget'}")
    return [*lines, f"by its estimates: {total:.0f} s of the {budget:.0f} s budget"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path, help="folder for figures.json and figures.md")
    parser.add_argument("--tiny", action="store_true", help="tiny models, fp32, no compilation: a CPU dry run")
    parser.add_argument("--budget", type=float, default=None,
                        help="seconds for the whole (default: 470 on a GPU, none with --tiny): a row whose estimate "
                             "is over what is left is skipped, and each row's time limit is cut to what is left")
    parser.add_argument("--more", action="store_true",
                        help="the second call's rows: those the goals do not need (tier 2); the default runs the "
                             "goals' rows (tier 1), the dry run both")
    parser.add_argument("--rows", default=None,
                        help="run only the rows whose names contain one of these comma-separated words "
                             "(such as tinyllama,gpt2,profile), of either tier")
    parser.add_argument("--plan", action="store_true", help="print the rows and their estimates, run nothing")
    parser.add_argument("--profile", action="store_true", help=argparse.SUPPRESS)  # the profile row's own process
    args = parser.parse_args()
    size = "tiny" if args.tiny else "gpu"
    if args.tiny:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if args.profile:
        print(json.dumps(profile(size, args.out.resolve())))  # out: the working folder its parent gave
        return 0
    budget = args.budget if args.budget is not None else (float("inf") if args.tiny else GPU_BUDGET_S)
    jobs = jobs_for(size, None if args.tiny or args.rows else 2 if args.more else 1)
    if args.rows:
        wanted = [name.strip() for name in args.rows.split(",")]
        jobs = [job for job in jobs if any(name in job[0] for name in wanted)]
    print("\n".join(plan_lines(jobs, budget)), flush=True)
    if args.plan:
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out.resolve()
    # Inductor's compiled kernels kept beside the figures: the profile row reuses the headline's, and a
    # second call or a rerun on the same machine (after a fix) pays only for what changed
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(out / "inductor-cache"))
    import torch

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    deadline = time.monotonic() + budget
    results = []
    work = Path(tempfile.mkdtemp(prefix="gpu-figures-"))  # the runs' folders and caches, apart from the two files
    for row, job, limit, estimate in jobs:
        left = deadline - time.monotonic()
        if left < max(30, estimate):
            results.append({"row": row, "rc": None, "seconds": 0,
                            "error": f"skipped: its estimate of {estimate:.0f} s is over the {left:.0f} s left"})
        else:
            results.append(job(min(limit, left), work))
        # written after every row, so a run stopped from outside keeps what it measured
        (out / "figures.json").write_text(json.dumps({"device": device, "results": results}, indent=2))
        (out / "figures.md").write_text(markdown(results, device))
    shutil.rmtree(work, ignore_errors=True)
    print(f"wrote {out / 'figures.json'} and {out / 'figures.md'}")
    return 0 if all(r["rc"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
