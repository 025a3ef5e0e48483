"""``bench finetune``'s table and its bar chart of memory per rung (bench/finetune.py)."""

from __future__ import annotations

from pathlib import Path

from scaletrain.train.step_memory import ENTRIES, POINTS, total

MIB = 2**20


def _figures(row: dict, mode: str) -> dict | None:
    """What a row shows: its measurement, or its prediction; None for a rung that was to be measured
    and was predicted not to fit."""
    if "measured" in row:
        return row["measured"]
    return row["predicted"] if mode == "predicted" else None


def _size(nbytes: float) -> str:
    return f"{nbytes / 2**30:.2f}G" if nbytes >= 2**30 else f"{nbytes / MIB:.2f}M"


def format_table(result: dict) -> str:
    s = result["setup"]
    title = (f"bench finetune ({result['mode']}): {s['model']}, seq {s['seq_len']}, micro-batch {s['micro_batch']}, "
             f"on {result['device']} ({result['machine']})")
    timing = f"{'step s':>9}{'tokens/s':>10}{'loss':>8}" if result["mode"] == "measured" else f"{'on the GPU':>27}"
    header = (f"{'rung':<14}{'ranks':>6}" + "".join(f"{p.replace('_', ' '):>16}" for p in POINTS)
              + f"{'peak':>11}{timing}  flags")
    lines = [title, header]
    for name, row in result["rungs"].items():
        figures = _figures(row, result["mode"])
        if figures is None:
            predicted = row["predicted"]["peak_bytes"]
            lines.append(f"{name:<14}{row['ranks']:>6}  would run out of memory: the planner predicts "
                         f"{_size(predicted)} per rank  {row['flags']}")
            continue
        points = "".join(f"{_size(total(figures['points'][p])):>16}" for p in POINTS)
        if "loss" in figures:
            timed = f"{figures['step_s']:>9.3f}{figures['tokens_per_s']:>10.0f}{figures['loss']:>8.3f}"
        else:
            timed = f"{'out of memory' if row.get('would_run_out_of_memory') else 'fits':>27}"
        lines.append(f"{name:<14}{row['ranks']:>6}{points}{_size(figures['peak_bytes']):>11}{timed}  {row['flags']}")
    lines.append("Each point: parameters + gradients + optimizer state + saved activations at that moment of a "
                 "step (the most loaded rank); peak: the largest point, or the GPU allocator's peak.")
    if result["mode"] == "predicted":
        lines.append("Predicted by the planner (scaletrain plan's memory model): nothing ran; peak: the "
                     "planner's total, with its allowance for buffers, the loss's logits and fragmentation.")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    """Memory per rung as stacked bars (each rung's fullest point, by category), as a PNG."""
    import matplotlib

    matplotlib.use("Agg")  # no display: write files only
    import matplotlib.pyplot as plt

    rows = result["rungs"].values()
    largest = max(max(map(total, (_figures(r, result["mode"]) or r["predicted"])["points"].values())) for r in rows)
    unit, unit_name = (2**30, "GiB") if largest > 4 * 2**30 else (MIB, "MiB")
    names, stacks = [], {category: [] for category in ENTRIES}
    for name, row in result["rungs"].items():
        figures = _figures(row, result["mode"]) or row["predicted"]
        fullest = max(figures["points"].values(), key=total)
        names.append(f"{name}\n(out of memory)" if row.get("would_run_out_of_memory") else name)
        for category in ENTRIES:
            stacks[category].append(fullest[category] / unit)
    figure, ax = plt.subplots(figsize=(max(6.0, 0.8 * len(names)), 5))
    bottom = [0.0] * len(names)
    for category, values in stacks.items():
        ax.bar(names, values, bottom=bottom, label=category)
        bottom = [b + v for b, v in zip(bottom, values)]
    if result.get("device_memory"):
        ax.axhline(result["device_memory"] / unit, color="black", linestyle="--", label="the device's memory")
    ax.set_ylabel(f"{unit_name} per rank, at the step's fullest point")
    ax.set_title(f"bench finetune ({result['mode']}): {result['setup']['model']} on {result['device']}", fontsize=10)
    ax.tick_params(axis="x", labelrotation=45, labelsize=8)
    ax.legend(fontsize=8, loc="best")
    ax.grid(True, axis="y", alpha=0.3)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, format="png", dpi=120)
    plt.close(figure)
