"""docs/figures/fp8-loss.png from the two runs docs/techniques.md lists (FP8): RUNS/bf16-mixed and
RUNS/fp8, each a metrics.jsonl of 300 steps. Left, both training losses (a moving mean) and their
validation points; right, fp8's loss minus bf16's, step by step and in the mean.

    python docs/figures/fp8_loss.py RUNS OUT.png
"""

import json
import sys

import matplotlib

matplotlib.use("Agg")  # no display: write the file only
import matplotlib.pyplot as plt

WINDOW = 20  # steps averaged: one step's loss is noisier than the two runs' difference


def records(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def moving_mean(values: list[float]) -> list[float]:
    return [sum(values[i - WINDOW:i]) / WINDOW for i in range(WINDOW, len(values) + 1)]


runs, out = sys.argv[1], sys.argv[2]
runs_by_name = {name: records(f"{runs}/{name}/metrics.jsonl") for name in ("bf16-mixed", "fp8")}
figure, (curves, gap) = plt.subplots(1, 2, figsize=(11, 4))
for name, rows in runs_by_name.items():
    line, = curves.plot(range(WINDOW, len(rows) + 1), moving_mean([r["loss"] for r in rows]), lw=1.2,
                        label=f"{name}: train ({WINDOW}-step mean)")
    curves.plot(*zip(*[(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]), "o", color=line.get_color())
curves.set_title("llama-small, 300 steps: fp8 products against bf16 (fp32 masters both)", fontsize=10)
curves.set_ylabel("loss (dots: validation)")
difference = [a["loss"] - b["loss"] for a, b in zip(runs_by_name["fp8"], runs_by_name["bf16-mixed"], strict=True)]
gap.plot(range(1, len(difference) + 1), difference, lw=0.6, alpha=0.5, label="per step")
gap.plot(range(WINDOW, len(difference) + 1), moving_mean(difference), lw=1.5, label=f"{WINDOW}-step mean")
gap.axhline(0, color="black", lw=0.6)
gap.set_title("fp8's training loss minus bf16's", fontsize=10)
for ax in (curves, gap):
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
figure.tight_layout()
figure.savefig(out, dpi=120)
