"""``scaletrain bench adam``: the fused Triton AdamW against torch's foreach and fused AdamW.

An AdamW step is memory-bound: per fp32 parameter it must read the weight,
gradient and two moments and write back the weight and moments, 28 bytes,
for about a dozen flops (see kernels/adamw.py). The figure of merit is then
the achieved bandwidth

    bandwidth = 28 B x parameters / step time

as a fraction of the device's peak memory bandwidth (known GPUs, from a
table; otherwise none). The parameter sets have the real shapes of the
default planned preset at 124M parameters and of the same model grown to
about 1B (18 layers, width 2048), hundreds of tensors from 768-element gains to the embedding, in the
trainer's two decay groups: the multi-tensor launch is part of what is
measured.

The three optimizers step the same parameters with the same fixed
gradients, each with its own moments (the values do not change the time,
and sharing keeps the 1B set within 32 B/param), one step each in rotating
order, each timed from a synchronized start to a synchronized end, so CPU
launch overhead counts. Medians over the steps after ``--warmup`` (which
absorb Triton's compilation).

What to expect: torch's fused kernel also moves the 28 B minimum, so ours
should be about even with it (the gain of ours is the bf16 working copy
written in the same pass, which this race does not use); foreach makes
about ten passes over lists of tensors and is several times slower.

Without a GPU, ``TRITON_INTERPRET=1`` runs the same race on the CPU with
tiny sets, the kernel interpreted: a functional check; its times are
meaningless.
"""

from __future__ import annotations

import math
import time

import torch

from scaletrain.bench import machine, median, rotated
from scaletrain.config import Config
from scaletrain.errors import UserError
from scaletrain.kernels import interpreted, unavailable
from scaletrain.config import ModelConfig
from scaletrain.models import PLANNED_PRESET, family_config, spec_for

BYTES_PER_PARAM = 28  # read p, g, m, v; write p, m, v (fp32)
OURS = "TritonAdamW (kernels/adamw.py)"
FOREACH, FUSED = "torch AdamW foreach=True", "torch AdamW fused=True"
# Substrings of torch.cuda.get_device_name() -> peak memory bandwidth, bytes/s (vendor figures).
PEAK_BANDWIDTH = (("H200", 4.8e12), ("H100 80GB HBM3", 3.35e12), ("H100 SXM", 3.35e12),
                  ("A100-SXM4-80GB", 2.0e12), ("A100 80GB", 2.0e12))
# (model, vocabulary, positions) of each parameter set.
GPU_SETS = {"124m": (ModelConfig(name=PLANNED_PRESET), 50257, 1024),
            "1b": (ModelConfig(name=PLANNED_PRESET, n_layers=18, n_heads=16, d_model=2048), 50257, 2048)}
INTERPRETED_SETS = {"tiny": (ModelConfig(name=PLANNED_PRESET, n_layers=1, n_heads=2, d_model=32), 64, 16),
                    "small": (ModelConfig(name=PLANNED_PRESET, n_layers=2, n_heads=2, d_model=48), 128, 16)}
# Bytes per parameter the race holds: shared p and g, three optimizers' moments, and
# foreach's temporary sqrt(v).
_RACE_BYTES_PER_PARAM = 8 + 3 * 8 + 4
_LR, _BETAS, _WEIGHT_DECAY = 1e-4, (0.9, 0.95), 0.1


def peak_bandwidth(device: torch.device) -> float | None:
    """The device's peak memory bandwidth in bytes/s, when the table knows it."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_BANDWIDTH if key in name), None)


def parameter_shapes(parameter_set: tuple[ModelConfig, int, int]) -> list[tuple[int, ...]]:
    """The shapes of a set's model's parameters (a tied weight once), built without memory."""
    model_cfg, vocab_size, seq_len = parameter_set
    with torch.device("meta"):
        model = spec_for(model_cfg.name).build(family_config(model_cfg, vocab_size, seq_len))
        return [tuple(p.shape) for p in model.parameters()]


def run(cfg: Config, warmup: int) -> dict:
    """Race the three AdamWs over every parameter set; the results as ``bench --json`` prints them."""
    steps = cfg.train.steps
    if warmup >= steps:
        raise UserError(f"--warmup {warmup} leaves no timed step of --steps {steps}; "
                        f"raise --steps or lower --warmup.")
    if not interpreted() and not torch.cuda.is_available():
        raise UserError("bench adam measures a GPU's memory bandwidth; run it on a CUDA GPU, or with "
                        "TRITON_INTERPRET=1 for a functional run on CPU.")
    # The interpreter reads host memory through the pointer tables, so it races on the CPU.
    device = torch.device("cpu") if interpreted() else torch.device("cuda")
    if (why := unavailable(device)) is not None:
        raise UserError(why)
    peak = peak_bandwidth(device)
    sets = INTERPRETED_SETS if interpreted() else GPU_SETS
    rows = [_race_set(name, parameter_shapes(model), device, steps, warmup, peak)
            for name, model in sets.items()]
    return _report(rows, device, peak, steps, warmup)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _fits(n_params: int, device: torch.device) -> str | None:
    """Why the race over ``n_params`` parameters cannot fit the device's free memory, or None."""
    if device.type != "cuda":
        return None
    torch.cuda.empty_cache()  # the previous set's blocks, cached by torch, count as free here
    need, free = n_params * _RACE_BYTES_PER_PARAM, torch.cuda.mem_get_info(device)[0]
    if need <= free:
        return None
    return f"needs {need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free"


def _race_set(name: str, shapes: list[tuple[int, ...]], device: torch.device, steps: int, warmup: int,
              peak: float | None) -> dict:
    n_params = sum(math.prod(shape) for shape in shapes)
    row = {"name": name, "params": n_params, "tensors": len(shapes)}
    if (why := _fits(n_params, device)) is not None:
        return {**row, "skipped": why}
    contenders = _contenders(shapes, device)
    times: dict[str, list[float]] = {contender: [] for contender in contenders}
    for step in range(steps):
        for contender in rotated(list(contenders), step):
            _synchronize(device)
            start = time.perf_counter()
            contenders[contender].step()
            _synchronize(device)
            times[contender].append(time.perf_counter() - start)
    return {**row, **{contender: _figures(median(ts[warmup:]), n_params, peak) for contender, ts in times.items()},
            "ratio": median(times[OURS][warmup:]) / median(times[FUSED][warmup:])}


def _contenders(shapes: list[tuple[int, ...]], device: torch.device) -> dict[str, torch.optim.Optimizer]:
    """The three AdamWs over one set of parameters with fixed gradients, in the trainer's decay groups."""
    # Imported here: it imports Triton, which decorates its kernels as it loads (kernels/__init__.py).
    from scaletrain.optim.fused_adamw import TritonAdamW

    generator = torch.Generator(device).manual_seed(0)
    params = []
    for shape in shapes:
        param = torch.randn(shape, device=device, generator=generator).mul_(0.02)
        param.grad = torch.randn(shape, device=device, generator=generator).mul_(1e-3)
        params.append(param)

    def groups() -> list[dict]:  # as optim/adamw.py's decay_groups; fresh dicts for each optimizer
        return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": _WEIGHT_DECAY},
                {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]

    return {OURS: TritonAdamW(groups(), lr=_LR, betas=_BETAS, eps=1e-8),
            FOREACH: torch.optim.AdamW(groups(), lr=_LR, betas=_BETAS, eps=1e-8, foreach=True),
            FUSED: torch.optim.AdamW(groups(), lr=_LR, betas=_BETAS, eps=1e-8, fused=True)}


def _figures(seconds: float, n_params: int, peak: float | None) -> dict:
    """A step's median time, its achieved bandwidth and that bandwidth's share of the peak."""
    bandwidth = BYTES_PER_PARAM * n_params / seconds
    return {"median_s": seconds, "gbps": bandwidth / 1e9,
            "peak_fraction": bandwidth / peak if peak is not None else None}


def _report(rows: list[dict], device: torch.device, peak: float | None, steps: int, warmup: int) -> dict:
    measured = [row for row in rows if "skipped" not in row]
    if not measured:
        raise UserError(f"bench adam: no parameter set fits this GPU's free memory "
                        f"({'; '.join(row['skipped'] for row in rows)}).")
    # The contract's single figures are the largest set's.
    largest = max(measured, key=lambda row: row["params"])
    result = {
        "what": "adam",
        "machine": machine(),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "interpreted": interpreted(),
        "peak_bandwidth_gbps": peak / 1e9 if peak is not None else None,
        "setup": {"steps": steps, "timed_steps": steps - warmup, "bytes_per_param": BYTES_PER_PARAM,
                  "lr": _LR, "betas": list(_BETAS), "weight_decay": _WEIGHT_DECAY},
        "ours": {"name": OURS, **largest[OURS]},
        "peer": {"name": FUSED, **largest[FUSED]},
        "peers": [{"name": name, **largest[name]} for name in (FOREACH, FUSED)],
        "ratio": largest["ratio"],
        "sets": rows,
    }
    if result["interpreted"]:
        result["note"] = ("TRITON_INTERPRET=1: the kernel ran in Triton's CPU interpreter; a functional "
                          "run, its times are meaningless.")
    return result


def format_table(result: dict) -> str:
    s = result["setup"]
    lines = [(f"bench adam: one AdamW step, {s['steps']} steps ({s['timed_steps']} timed), "
              f"{s['bytes_per_param']} B/param moved at least, on {result['machine']}")]
    if result["interpreted"]:
        lines.append(result["note"])
    names = (OURS, FOREACH, FUSED)
    header = f"{'set':<12}{'params':>14}{'tensors':>9}"
    for name in ("ours", "foreach", "fused"):
        header += f"{name + ' ms':>14}{'GB/s':>9}{'%peak':>7}"
    lines.append(header + f"{'ours/fused':>12}")
    for row in result["sets"]:
        line = f"{row['name']:<12}{row['params']:>14,}{row['tensors']:>9}"
        if "skipped" in row:
            lines.append(f"{line}  skipped: {row['skipped']}")
            continue
        for name in names:
            fraction = row[name]["peak_fraction"]
            line += (f"{row[name]['median_s'] * 1e3:>14.3f}{row[name]['gbps']:>9.1f}"
                     f"{'n/a' if fraction is None else f'{fraction:.0%}':>7}")
        lines.append(line + f"{row['ratio']:>12.2f}")
    peak = result["peak_bandwidth_gbps"]
    lines.append(f"GB/s: {BYTES_PER_PARAM} B x parameters / median step time; %peak: of "
                 f"{'an unknown peak' if peak is None else f'{peak:,.0f} GB/s'} ({result['device']}).")
    return "\n".join(lines)
