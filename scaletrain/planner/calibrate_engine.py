"""The trainer's fixed cost of an optimizer step, measured for ``scaletrain plan --calibrate``.

A step does more than its blocks' forward and backward: the next batch, the
embedding and the loss, the gradients' norm and clipping, the optimizer's loop
over its tensors, the learning rate, the step's metrics. Where one Python
thread dispatches every operator and also computes (a CPU), these add a fixed
time to every step whatever the model's size. The calibration trains the
smallest preset (`TINY_PRESET`: a hundred thousand weights, its arithmetic
negligible) with ``scaletrain train`` itself, in one process, and keeps the
median step less its blocks' launches:

    step_overhead_s = median(step_s after the first WARM steps) - blocks * block_overhead_s

(planner/step_time.py adds it to every step; planner/hardware.py `shared_cpu`
lets the processes of a run take turns at it where they outnumber the cores).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from scaletrain.errors import JobFailed
from scaletrain.models import PRESETS, TINY_PRESET

STEPS, WARM = 12, 4
TEXT = "".join(f"def step_{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(400))


def step_overhead_s(block_overhead_s: float) -> float:
    """The fixed seconds of one step (module docstring), at least 0."""
    with tempfile.TemporaryDirectory(prefix="scaletrain-calibrate-") as root:
        corpus = Path(root, "corpus.txt")
        corpus.write_text(TEXT)
        out = Path(root, "run")
        done = subprocess.run(
            [sys.executable, "-m", "scaletrain", "train", "--model", TINY_PRESET, "--data", str(corpus),
             "--seq-len", "16", "--micro-batch", "1", "--steps", str(STEPS), "--warmup-steps", "1", "--eval-every", "0",
             "--eval-batches", "1", "--sample-tokens", "0", "--no-progress", "--force", "--out", str(out),
             "--cache-dir", str(Path(root, "cache"))], capture_output=True, text=True, timeout=600)
        if done.returncode:
            raise JobFailed(f"plan --calibrate: the trainer's step could not be timed: {done.stderr.strip()[-500:]}")
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    step = statistics.median(r["step_s"] for r in records if r["step"] > WARM)
    return max(0.0, step - PRESETS[TINY_PRESET].presets[TINY_PRESET]["n_layers"] * block_overhead_s)
