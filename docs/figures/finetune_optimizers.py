"""docs/figures/finetune-optimizers.png from the runs docs/finetuning.md lists:
RUNS/{run}/metrics.jsonl for AdamW, 8-bit AdamW, bf16 with fp32 masters, pure bf16 and pure bf16
with stochastic rounding.

    python docs/figures/finetune_optimizers.py RUNS OUT.png
"""

import json
import sys

import matplotlib

matplotlib.use("Agg")  # no display: write the file only
import matplotlib.pyplot as plt

PANELS = {"8-bit AdamW against AdamW (fp32 weights)": ("adamw", "adamw8bit"),
          "pure bf16 against fp32 masters (bf16 autocast)": ("bf16-mixed", "pure-bf16", "pure-bf16-sr")}
WINDOW = 20  # steps averaged: one step's loss is noisier than the runs' differences

runs, out = sys.argv[1], sys.argv[2]
figure, axes = plt.subplots(1, len(PANELS), figsize=(11, 4), sharey=True)
for ax, (title, names) in zip(axes, PANELS.items()):
    for name in names:
        with open(f"{runs}/{name}/metrics.jsonl") as f:
            rows = [json.loads(line) for line in f]
        losses = [r["loss"] for r in rows]
        smooth = [sum(losses[i - WINDOW:i]) / WINDOW for i in range(WINDOW, len(losses) + 1)]
        line, = ax.plot(range(WINDOW, len(losses) + 1), smooth, lw=1.2, label=f"{name}: train ({WINDOW}-step mean)")
        ax.plot(*zip(*[(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]), "o", color=line.get_color())
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("step")
    ax.set_ylim(1.7, 2.8)
    ax.grid(alpha=0.3)
axes[0].set_ylabel("loss (dots: validation)")
for ax in axes:
    ax.legend(fontsize=8)
figure.tight_layout()
figure.savefig(out, dpi=120)
