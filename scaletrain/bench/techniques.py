"""``scaletrain bench techniques``: every single-device technique against the plain run.

The same model, data, seed and batch are trained once per technique, all in
one process and stepped round-robin (step 1 of every variant, then step 2,
...), so machine noise falls on all variants alike. For each one the table
gives the memory ledger of its first step (see train/memory.py: saved
activations at their peak; parameters, gradients and optimizer state at the
optimizer step), the median step time over the steps after ``--warmup``
(which absorb the ledger's own metering, torch.compile's compilation and
allocator warm-up), both as ratios to the baseline, and the loss it reached.

What to expect, from the formulas in docs/techniques.md: full recompute cuts
saved activations to the block inputs plus one block's at about 1/3 more
compute; bf16 autocast roughly halves activation bytes; ``--param-dtype
bf16`` halves the parameter bytes and adds 4 B/param of fp32 master;
compressed activations (techniques/compress_activations.py) store the compressible
saved bytes in half (bf16) or about a quarter (int8);
Adafactor's state is a small fraction of AdamW's; offload moves optimizer
bytes to the host (the same place, on a CPU-only machine).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from scaletrain.bench import machine, median
from scaletrain.config import Config
from scaletrain.errors import UserError
from scaletrain.job.data_setup import prepare_data
from scaletrain.job.trainer import Trainer
from scaletrain.runtime.comm import Comm, Ledger
from scaletrain.runtime.launch import detect_environment, init_distributed, shutdown
from scaletrain.runtime.mesh import Mesh, ParallelDims

# name -> the configuration fields that switch the technique on
TECHNIQUES: dict[str, dict] = {
    "baseline": {},
    "bf16": {"precision": "bf16"},
    "fp16": {"precision": "fp16"},
    "bf16-weights": {"precision": "bf16", "param_dtype": "bf16"},
    "fp8": {"precision": "fp8", "param_dtype": "bf16"},
    "recompute-full": {"recompute": "full"},
    "recompute-every2": {"recompute": "every:2"},
    "recompute-sqrt": {"recompute": "sqrt"},
    "recompute-selective": {"recompute": "selective"},
    "activations-bf16": {"compress_activations": "bf16"},
    "activations-int8": {"compress_activations": "int8"},
    "recompute-full-int8": {"recompute": "full", "compress_activations": "int8"},
    "compile": {"compile": True},
    "adafactor": {"optimizer": "adafactor"},
    "offload": {"offload": "optimizer"},
}

BENCH_DEFAULTS = {"steps": 20, "eval_every": 0, "eval_batches": 4, "sample_tokens": 0, "progress": False,
                  "cache_dir": str(Path("runs", ".cache"))}
_LEDGER_ROWS = ("activations_peak", "params", "grads", "optimizer")


def flags_of(changes: dict) -> str:
    """The command-line flags that turn a technique on, as a user would type them."""
    parts = []
    for key, value in changes.items():
        flag = "--" + key.replace("_", "-")
        parts.append(flag if value is True else f"{flag} {value}")
    return " ".join(parts) or "(none)"


@dataclass
class Variant:
    name: str
    trainer: Trainer
    step_s: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)


def parse_selection(text: str | None) -> list[str]:
    """``--techniques a,b``: the named ones, always with the baseline first."""
    if not text:
        return list(TECHNIQUES)
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in TECHNIQUES]
    if unknown:
        raise UserError(f"--techniques: no technique named {', '.join(unknown)}; choose from "
                        f"{', '.join(TECHNIQUES)}.")
    return ["baseline", *[n for n in names if n != "baseline"]]


def run(cfg: Config, names: list[str], warmup: int) -> dict:
    """Train every variant round-robin; the results as the JSON object of ``bench --json``."""
    if warmup >= cfg.train.steps:
        raise UserError(f"--warmup {warmup} leaves no timed step of --steps {cfg.train.steps}; "
                        f"raise --steps or lower --warmup.")
    if cfg.model.name == "mlp":
        raise UserError("bench techniques measures the language models (recompute and compile act "
                        "on their blocks); choose one of their presets.")
    cfg = cfg.replace(report_memory=True, resume=False)
    env = detect_environment()
    if env.world_size > 1 or cfg.parallel.nproc > 1:
        raise UserError("bench techniques runs in one process; launch it without --nproc or torchrun.")
    prepared = prepare_data(cfg, cache_dir=Path(cfg.data.cache_dir))
    runtime = init_distributed(env, timeout_s=cfg.parallel.timeout)
    try:
        mesh = Mesh.build(ParallelDims.infer(1), env.rank, 1)
        comm = Comm(Ledger())
        # train_step and evaluate write nothing, so no run folder is made.
        variants = [Variant(name, Trainer(cfg.replace(**TECHNIQUES[name]), prepared, runtime, mesh, comm,
                                          run_dir=Path(cfg.data.cache_dir)))
                    for name in names]
        for step in range(cfg.train.steps):
            for v in variants:
                start = time.perf_counter()
                record = v.trainer.train_step(step)
                v.step_s.append(time.perf_counter() - start)
                v.losses.append(record["loss"])
        return _report(cfg, variants, warmup)
    finally:
        shutdown(runtime)


def _report(cfg: Config, variants: list[Variant], warmup: int) -> dict:
    rows = {}
    for v in variants:
        ledger = v.trainer.memory_report()
        rows[v.name] = {
            "flags": flags_of(TECHNIQUES[v.name]),
            **{key: ledger[key] for key in _LEDGER_ROWS},
            "median_s": median(v.step_s[warmup:]),
            "first_step_s": v.step_s[0],
            "final_loss": v.losses[-1],
            "val_loss": v.trainer.evaluate(),
        }
    base = rows["baseline"]
    for row in rows.values():
        row["activations_ratio"] = row["activations_peak"] / base["activations_peak"]
        row["step_ratio"] = row["median_s"] / base["median_s"]
    techniques = {name: row for name, row in rows.items() if name != "baseline"}
    t = cfg.train
    return {
        "what": "techniques",
        "machine": machine(),
        "setup": {"model": cfg.model.name, "seq_len": cfg.data.seq_len, "micro_batch": t.micro_batch,
                  "grad_accum": t.grad_accum, "steps": t.steps, "timed_steps": t.steps - warmup},
        "peer": {"name": "baseline (fp32, no recompute, eager, AdamW on the device)", **base},
        # The contract's single figures: the median technique's step time and its ratio to the
        # baseline; the per-technique rows and ratios beside them.
        "ours": {"median_s": median([row["median_s"] for row in techniques.values()]),
                 "techniques": techniques},
        "ratio": median([row["step_ratio"] for row in techniques.values()]),
        "ratios": {name: row["step_ratio"] for name, row in techniques.items()},
    }


def format_table(result: dict) -> str:
    mib = 2**20
    s = result["setup"]
    title = (f"bench techniques: {s['model']}, seq {s['seq_len']}, micro-batch {s['micro_batch']}, "
             f"{s['steps']} steps ({s['timed_steps']} timed), on {result['machine']}")
    header = (f"{'technique':<20}{'act MiB':>9}{'x base':>8}{'params':>8}{'grads':>8}{'optim':>8}"
              f"{'step s':>9}{'x base':>8}{'loss':>8}{'val':>8}  flags")
    lines = [title, header]
    rows = {"baseline": result["peer"], **result["ours"]["techniques"]}
    for name, r in rows.items():
        lines.append(f"{name:<20}{r['activations_peak'] / mib:>9.2f}{r['activations_ratio']:>8.2f}"
                     f"{r['params'] / mib:>8.2f}{r['grads'] / mib:>8.2f}{r['optimizer'] / mib:>8.2f}"
                     f"{r['median_s']:>9.3f}{r['step_ratio']:>8.2f}{r['final_loss']:>8.3f}"
                     f"{r['val_loss']:>8.3f}  {r['flags']}")
    lines.append("MiB columns: saved activations at their peak, then parameters, gradients and optimizer "
                 "state (with fp32 masters) at the optimizer step; step s: median over the timed steps.")
    return "\n".join(lines)
