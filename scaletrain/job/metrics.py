"""Per-step metrics: throughput, model FLOP utilization (MFU), memory.

MFU (Chowdhery et al. 2022, appendix B) is the share of the hardware's peak
that the model's own arithmetic would need at the measured speed:

    MFU = tokens_per_s * flops_per_token / (peak_flops_per_device * devices)

with ``flops_per_token`` from the model (6N + 12*L*d*s for a decoder, see
models/spec.py). Recomputation is not counted: it is overhead, which
is exactly what MFU is meant to expose. Peaks are dense (no sparsity) per
device for the run's precision. On a CPU there is no datasheet figure to
trust, so the peak is a flag or measured with a large fp32 matmul, and MFU is
reported as n/a (null in JSON) when neither is given.

Memory: ``mem_bytes`` is the CUDA peak allocated during the step on a GPU,
and the process's resident set size on a CPU (the whole process, so it is an
upper bound on what training itself holds).
"""

from __future__ import annotations

import json
import resource
import time
from pathlib import Path
from typing import Any

import torch

from scaletrain.config import Config
from scaletrain.job.trackers import Trackers

# Dense bf16 and tf32 tensor-core peaks from the vendor datasheets, TFLOP/s. An fp8 run's MFU is
# against the bf16 peak, so that fp8 and bf16 runs compare on one scale.
GPU_PEAK_TFLOPS = {
    "H200": {"bf16": 989.4, "fp16": 989.4, "fp32": 494.7, "fp8": 989.4},
    "H100": {"bf16": 989.4, "fp16": 989.4, "fp32": 494.7, "fp8": 989.4},
    "A100": {"bf16": 312.0, "fp16": 312.0, "fp32": 156.0, "fp8": 312.0},
}


def measure_peak_tflops(device: torch.device, size: int = 2048, repeats: int = 5) -> float:
    """Best-of-N fp32 matmul throughput: an achievable peak, not a datasheet one."""
    a = torch.randn(size, size, device=device)
    b = torch.randn(size, size, device=device)
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        a @ b
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best / 1e12


def peak_tflops(setting: str | None, device: torch.device, precision: str = "fp32") -> float | None:
    """The per-device peak for MFU: a number, 'measure', or a known GPU."""
    if setting == "measure":
        return measure_peak_tflops(device)
    if setting is not None:
        return float(setting)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, peaks in GPU_PEAK_TFLOPS.items():
            if key in name:
                return peaks[precision]
    return None


def mfu(tokens_per_s: float, flops_per_token: float, peak: float | None, devices: int) -> float | None:
    if peak is None:
        return None
    return tokens_per_s * flops_per_token / (peak * 1e12 * devices)


def resident_bytes() -> int:
    """Current resident set size of this process (Linux /proc; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
    except OSError:
        return 0
    return pages * resource.getpagesize()


def step_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        return peak
    return resident_bytes()


class MetricsWriter:
    """metrics.jsonl (one object per optimizer step), then the run's trackers (job/trackers.py).

    Only one rank writes, so the files are the run's, not a rank's.
    """

    def __init__(self, cfg: Config, run_dir: Path, *, append: bool):
        self._jsonl = open(run_dir / "metrics.jsonl", "a" if append else "w")
        self._trackers = Trackers(cfg, run_dir)

    def write(self, record: dict[str, Any]) -> None:
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        self._trackers.log(record)

    def close(self, outcome: str, final: Path | None = None) -> None:
        """``outcome``: finished, failed or stopped; ``final``: the run's last checkpoint, when it
        reached its last step (job/trackers.py)."""
        self._jsonl.close()
        self._trackers.finish(outcome, final)


def drop_records_after(path: Path, step: int) -> None:
    """On resume, forget steps logged after the checkpoint (they will be redone)."""
    if not path.exists():
        return
    kept = [line for line in path.read_text().splitlines()
            if line.strip() and json.loads(line)["step"] <= step]
    path.write_text("".join(line + "\n" for line in kept))


def read_metrics(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
