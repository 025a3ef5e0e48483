"""``scaletrain bench finetune``: the fine-tuning ladder, one rung per row.

The memory lab of a fine-tuning course climbs a ladder: a full fine-tune runs out of memory,
so the batch shrinks, accumulation restores it, bf16 halves the weights (mixed, then pure),
SGD or 8-bit AdamW shrink the optimizer, recompute the activations, offload moves the
optimizer to the host, and LoRA and QLoRA freeze the base (in 4 bits). On several devices,
data parallelism is set against ZeRO's stages. Each rung here is that step, as flags:

    full            fp32 weights, AdamW, the given micro-batch B
    smaller-batch   micro-batch 1 (a smaller global batch: the memory it saves is activations)
    accumulation    micro-batch 1, B micro-batches accumulated: B's global batch again
    bf16-mixed      + --precision bf16 --param-dtype bf16 (bf16 weights, fp32 masters)
    pure-bf16       + --reduce-dtype bf16 --masters none (no master; gradients, state in bf16)
    pure-bf16-sr    + --stochastic-rounding
    sgd             pure bf16 with --optimizer sgd (one momentum buffer)
    adamw8bit       pure bf16 with --optimizer adamw8bit (2 bytes of state per weight)
    recompute       adamw8bit + --recompute full
    offload         bf16-mixed + --offload optimizer + --recompute full (ZeRO-Offload on one device)
    lora            bf16-mixed + --recompute full + --lora-rank 16 (a frozen base)
    qlora           lora + --quantize nf4 (the base in 4 bits)
    dp, zero1, zero2, zero3, hybrid   (with --nproc N) bf16-mixed over N processes
    lora-zero3      (with --nproc N) the lora rung's flags over N processes, its base sharded by ZeRO-3
    qlora-zero3     the same with the base in 4 bits (its codes sharded too: parallel/zero_units.py)

Measured (no ``--gpu-memory``): each rung trains ``--steps`` steps here, alone, in processes
of its own (one after the other, so a GPU's allocator figures are the rung's own), and reports
its step's memory at the four points (train/step_memory.py; the most loaded rank of a sharded
rung), the peak, the median step time after ``--warmup`` (at least 2 leaves out the second
step, which the memory meter slows), tokens/s and the final loss. A rung the planner predicts
not to fit this device's memory (a GPU's, or this host's) is reported as "would run out of
memory", with the prediction, instead of run.

Predicted (``--gpu-memory SIZE``): every rung is the planner's (planner/predict.py) for an H100
with SIZE of memory, with nothing run: the table of a GPU this machine does not have.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from scaletrain.bench import machine, median
from scaletrain.bench.techniques import flags_of
from scaletrain.config import Config
from scaletrain.config_checks import check_values
from scaletrain.errors import UserError
from scaletrain.job.base_model import as_finetune
from scaletrain.job.data_setup import PreparedData, prepare_data
from scaletrain.job.trainer import Trainer
from scaletrain.models import LADDER_PRESET
from scaletrain.planner.hardware import DEVICES, Cluster, cpu_device
from scaletrain.planner.predict import predict
from scaletrain.runtime.comm import Comm
from scaletrain.runtime.launch import detect_environment, init_distributed, shutdown
from scaletrain.runtime.mesh import Mesh
from scaletrain.runtime.spawn import spawn_local
from scaletrain.train.step_memory import POINTS, total

SINGLE = ("full", "smaller-batch", "accumulation", "bf16-mixed", "pure-bf16", "pure-bf16-sr", "sgd", "adamw8bit",
          "recompute", "offload", "lora", "qlora")
SHARDED = ("dp", "zero1", "zero2", "zero3", "hybrid", "lora-zero3", "qlora-zero3")
FINETUNE_DEFAULTS = {"name": LADDER_PRESET, "seq_len": 128, "micro_batch": 4, "steps": 10}
LORA_RANK = 16


def ladder(micro_batch: int, nproc: int) -> dict[str, dict[str, Any]]:
    """Every rung's flags (module docstring) as configuration fields; the sharded ones with ``nproc`` > 1."""
    accumulation = {"micro_batch": 1, "grad_accum": micro_batch}
    mixed = {**accumulation, "precision": "bf16", "param_dtype": "bf16"}
    pure = {**mixed, "reduce_dtype": "bf16", "masters": "none"}
    lora = {**mixed, "recompute": "full", "lora_rank": LORA_RANK}
    rungs = {
        "full": {}, "smaller-batch": {"micro_batch": 1}, "accumulation": accumulation, "bf16-mixed": mixed,
        "pure-bf16": pure, "pure-bf16-sr": {**pure, "stochastic_rounding": True}, "sgd": {**pure, "optimizer": "sgd"},
        "adamw8bit": {**pure, "optimizer": "adamw8bit"},
        "recompute": {**pure, "optimizer": "adamw8bit", "recompute": "full"},
        "offload": {**mixed, "offload": "optimizer", "recompute": "full"},
        "lora": lora, "qlora": {**lora, "quantize": "nf4"},
    }
    if nproc > 1:
        sharded = {"precision": "bf16", "param_dtype": "bf16", "nproc": nproc, "dp": nproc}
        rungs.update({"dp": sharded, **{f"zero{s}": {**sharded, "zero": s} for s in (1, 2, 3)}})
        if nproc >= 4 and nproc % 2 == 0:  # ZeRO-3 within pairs, the pairs' shards averaged
            rungs["hybrid"] = {**sharded, "zero": 3, "shard_group": 2}
        adapters = {**sharded, "zero": 3, "recompute": "full", "lora_rank": LORA_RANK}
        rungs.update({"lora-zero3": adapters, "qlora-zero3": {**adapters, "quantize": "nf4"}})
    return rungs


def selected(text: str | None, rungs: dict[str, dict]) -> list[str]:
    """``--rungs a,b``: those, in the ladder's order; all by default."""
    if not text:
        return list(rungs)
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in (*SINGLE, *SHARDED)]
    if unknown:
        raise UserError(f"--rungs: no rung named {', '.join(unknown)}; choose from {', '.join((*SINGLE, *SHARDED))}.")
    missing = [n for n in names if n not in rungs]
    if missing:
        raise UserError(f"--rungs {', '.join(missing)} compare{'s' if len(missing) == 1 else ''} processes; "
                        f"add --nproc 2 or more (4 or more, even, for hybrid).")
    return [n for n in rungs if n in names]


def rung_flags(changes: dict) -> str:
    """A rung's flags as a user types them (the process count shows in its own column)."""
    return flags_of({key: value for key, value in changes.items() if key not in ("nproc", "dp")})


def predicted_points(memory: dict[str, int]) -> dict[str, dict[str, int]]:
    """The planner's categories on the device at the four points: weights, gradient buffers
    (which persist between steps here) and state throughout, the saved activations after
    forward. What offload keeps on the host (the state, then the masters' gradients) is left out."""
    state_on_host = min(memory["host"], memory["optimizer"])  # the host holds the state, then master gradients
    held = {"params": memory["params"], "grads": memory["grads"] - (memory["host"] - state_on_host),
            "optimizer": memory["optimizer"] - state_on_host}
    return {point: {**held, "activations": memory["activations"] if point == "after_forward" else 0}
            for point in POINTS}


def _prediction(cfg: Config, vocab: int, cluster: Cluster) -> dict[str, Any]:
    """The planner's memory for one rung; its time model is left out (it prices a fine-tune's frozen,
    4-bit and adapter layers as the dense model's)."""
    world = cfg.parallel.nproc
    prediction = predict(cfg, world, vocab, Cluster(cluster.device, world, world))
    return {"points": predicted_points(prediction.memory), "peak_bytes": prediction.memory["total"],
            "fits": prediction.fits}


def run(cfg: Config, names_text: str | None, warmup: int, gpu_memory: int | None) -> dict:
    """The ladder, predicted (``gpu_memory``) or measured here; the result of ``bench finetune --json``."""
    if detect_environment().world_size > 1:
        raise UserError("bench finetune starts its own processes; run it with --nproc N, not under a launcher.")
    if gpu_memory is None and warmup >= cfg.train.steps:
        raise UserError(f"--warmup {warmup} leaves no timed step of --steps {cfg.train.steps}; "
                        f"raise --steps or lower --warmup.")
    rungs = ladder(cfg.train.micro_batch, cfg.parallel.nproc)
    names = selected(names_text, rungs)
    base = cfg.replace(nproc=1, dp=None, report_memory=True, resume=False, progress=False)
    configs = {name: _rung_config(base.replace(**rungs[name])) for name in names}
    for config in configs.values():
        check_values(config)
    first = configs[names[0]]
    vocab = first.model.n_vocab or first.data.vocab_size
    if gpu_memory is not None:
        cluster = Cluster(DEVICES["H100"], 1, 1).with_memory(gpu_memory)
        rows = {name: {"flags": rung_flags(rungs[name]), "ranks": configs[name].parallel.nproc,
                       "predicted": _prediction(configs[name], vocab, cluster)} for name in names}
        for row in rows.values():
            if not row["predicted"]["fits"]:
                row["would_run_out_of_memory"] = True
        device = f"H100 with {gpu_memory / 1e9:g} GB (predicted)"
    else:
        rows, device = _measure(configs, rungs, warmup)
    t = cfg.train
    return {"what": "finetune", "machine": machine(), "device": device, "device_memory": gpu_memory,
            "mode": "predicted" if gpu_memory else "measured",
            "setup": {"model": cfg.model.name, "seq_len": cfg.data.seq_len, "micro_batch": t.micro_batch,
                      "steps": t.steps, "warmup": warmup},
            "rungs": rows, **_against_the_first(rows)}


def _rung_config(cfg: Config) -> Config:
    """A rung as it runs: with --from, its base's model and the adapters checked against it;
    without, the adapter rungs' base is the preset's initial weights, written when they run
    (`_write_base`)."""
    return as_finetune(cfg) if cfg.finetune.base else cfg


def _against_the_first(rows: dict[str, dict]) -> dict[str, Any]:
    """The bench contract's peer, ours and ratio: the first rung (the full fine-tune, unless
    --rungs leaves it out) against the others, by median step time where they ran, else by
    their peaks."""
    first, *others = rows
    shown = {name: row.get("measured", row["predicted"]) for name, row in rows.items()}
    timed = [name for name in others if "step_s" in shown[name]]
    figure = "median_s" if "step_s" in shown[first] and timed else "peak_bytes"
    value = {name: shown[name]["step_s" if figure == "median_s" else "peak_bytes"] for name in rows}
    pool = timed if figure == "median_s" else others
    ours = median([value[name] for name in pool]) if pool else float("nan")
    return {"peer": {"name": f"the {first} rung", figure: value[first]}, "ours": {figure: ours},
            "ratio": ours / value[first]}


def _this_machine(world: int) -> tuple[Cluster, str]:
    """``world`` ranks here, as the planner weighs them (a GPU's memory its own, else a share of
    the host's, where offloaded state counts too), and the device's name."""
    if torch.cuda.is_available():
        memory = torch.cuda.get_device_properties(0).total_memory
        return Cluster(DEVICES["H100"], world, world).with_memory(memory), torch.cuda.get_device_name()
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // world
    return Cluster(cpu_device(1.0, memory), world, world), "this host's CPU"


def _measure(configs: dict[str, Config], rungs: dict[str, dict], warmup: int) -> tuple[dict, str]:
    """Every rung run here, those predicted not to fit reported instead."""
    first = next(iter(configs.values()))
    prepared = prepare_data(first, cache_dir=Path(first.data.cache_dir))
    rows: dict[str, dict] = {}
    device_name = ""
    with tempfile.TemporaryDirectory(prefix="scaletrain-finetune-") as tmp:
        folder = Path(tmp)
        base_run = None
        for name, cfg in configs.items():
            row = {"flags": rung_flags(rungs[name]), "ranks": cfg.parallel.nproc}
            world = cfg.parallel.nproc
            cluster, device_name = _this_machine(world)
            prediction = _prediction(cfg, prepared.vocab_size, cluster)
            row["predicted"] = prediction
            rows[name] = row
            if not prediction["fits"]:
                row["would_run_out_of_memory"] = True
                continue
            if cfg.finetune.lora_rank and not cfg.finetune.base:  # --from, or the preset's initial weights
                base_run = base_run or _write_base(cfg.replace(lora_rank=0, quantize="none"), prepared, folder)
                cfg = cfg.replace(base=str(base_run))
            cfg = as_finetune(cfg)
            # Each rung in processes of its own: its allocator's figures, and the memory it leaves, are its own.
            ranks = spawn_local(world, _rung_worker, (cfg.replace(out=str(folder / name)), prepared, warmup))
            row["measured"] = _merged(ranks)
    return rows, device_name


def _write_base(cfg: Config, prepared: PreparedData, folder: Path) -> Path:
    """The adapter rungs' base: the preset's initial weights, saved as a run folder (by a process of its own)."""
    run_dir = folder / "base"
    run_dir.mkdir()
    (run_dir / "config.toml").write_text(cfg.to_toml())
    spawn_local(1, _rung_worker, (cfg.replace(out=str(run_dir)), prepared, None))
    return run_dir


def _rung_worker(cfg: Config, prepared: PreparedData, warmup: int | None) -> dict | None:
    """One rank of a rung: its steps measured (`_train`); with ``warmup`` None, the model's
    initial weights saved as the run's step 0 instead."""
    env = detect_environment()
    runtime = init_distributed(env, timeout_s=cfg.parallel.timeout)
    try:
        mesh = Mesh.build(cfg.parallel.mesh_dims(env.world_size), env.rank, env.world_size)
        if warmup is None:
            Trainer(cfg, prepared, runtime, mesh, Comm(), Path(cfg.run.out)).save(0)
            return None
        return _train(cfg, prepared, runtime, mesh, warmup)
    finally:
        shutdown(runtime)


def _train(cfg: Config, prepared: PreparedData, runtime, mesh: Mesh, warmup: int) -> dict:
    """One rung's steps on this rank: its four points, peak, step times and losses."""
    trainer = Trainer(cfg, prepared, runtime, mesh, Comm(), Path(cfg.run.out))
    cuda = runtime.device.type == "cuda"
    times, losses = [], []
    for step in range(cfg.train.steps):
        if cuda:
            torch.cuda.synchronize(runtime.device)
        start = time.perf_counter()
        losses.append(trainer.train_step(step)["loss"])  # .item(): the step is done
        times.append(time.perf_counter() - start)
    ledger = trainer.memory_report()
    points = ledger["points"]
    peak = max([total(row) for row in points.values()] + [row.get("cuda_peak", 0) for row in points.values()])
    step_s = median(times[warmup:])
    return {"points": points, "peak_bytes": peak, "activations_peak": ledger["activations_peak"],
            "step_s": step_s, "tokens_per_s": trainer.tokens_per_step / step_s, "loss": losses[-1]}


def _merged(ranks: dict[int, dict]) -> dict:
    """A sharded rung: the most loaded rank's figures, every rank's points beside them."""
    fullest = max(ranks.values(), key=lambda r: r["peak_bytes"])
    return {**fullest, "step_s": max(r["step_s"] for r in ranks.values()),
            "per_rank": {str(rank): r["points"] for rank, r in sorted(ranks.items())}}
