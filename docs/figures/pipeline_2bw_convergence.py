"""docs/figures/pipeline-2bw-convergence.png from the runs docs/pipeline-parallel.md lists:
RUNS/conv{lr}-{schedule}/metrics.jsonl for each learning rate and schedule.

    python docs/figures/pipeline_2bw_convergence.py RUNS OUT.png
"""

import json
import sys

import matplotlib

matplotlib.use("Agg")  # no display: write the file only
import matplotlib.pyplot as plt

RATES = ("1e-3", "3e-4")
SCHEDULES = {"1f1b": "#4c72b0", "pipedream-2bw": "#dd8452"}

runs, out = sys.argv[1], sys.argv[2]
figure, axes = plt.subplots(1, len(RATES), figsize=(11, 4), sharey=True)
for ax, lr in zip(axes, RATES):
    for schedule, colour in SCHEDULES.items():
        with open(f"{runs}/conv{lr}-{schedule}/metrics.jsonl") as f:
            rows = [json.loads(line) for line in f]
        ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], color=colour, alpha=0.45, lw=1)
        ax.plot(*zip(*[(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]), "o-", color=colour,
                label=f"{schedule}: train (thin), validation (dots)")
    ax.set_title(f"gpt-small, 2 stages, M = 8, micro-batch 4, --lr {lr}", fontsize=10)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
axes[0].set_ylabel("loss")
axes[0].legend(fontsize=8)
figure.tight_layout()
figure.savefig(out, dpi=120)
