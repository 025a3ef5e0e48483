"""What ``scaletrain plan`` shows: the ranked table, the JSON of CLI.md, the scatter plot.

Every figure is per rank, on the most loaded rank, because that rank is the
one that runs out of memory first.
"""

from __future__ import annotations

from pathlib import Path

from scaletrain.planner.hardware import Cluster
from scaletrain.planner.prediction import MEMORY_ROWS, Prediction, as_flags, training_options
from scaletrain.planner.search import GIB, MIB, SearchResult, layout_text, size_text

SHORT_ROWS = {"params": "params", "grads": "grads", "optimizer": "optim", "activations": "activ",
              "other": "other", "total": "total"}


def _unit(predictions: list[Prediction]) -> tuple[str, int]:
    """GiB, or MiB for models so small that GiB would print zeros."""
    largest = max((p.memory["total"] for p in predictions), default=0)
    return ("GiB", GIB) if largest >= GIB else ("MiB", MIB)


def _too_big_text(result: SearchResult, cluster: Cluster) -> str:
    device = cluster.device
    available = f"the {device.name} has {size_text(device.memory_bytes)}"
    if not result.too_big:
        return f"every predicted layout fits ({available})."
    smallest = result.too_big[0]
    return (f"{len(result.too_big)} predicted layouts do not fit: the smallest needs "
            f"{size_text(smallest.memory['total'])} per rank ({layout_text(smallest)}), {available}.")


def _reasons(title: str, counts: dict[str, int]) -> list[str]:
    if not counts:
        return []
    lines = [f"{sum(counts.values())} {title}:"]
    width = len(str(max(counts.values())))
    return lines + [f"  {count:>{width}}  {reason}" for reason, count in counts.items()]


def _cluster_text(cluster: Cluster) -> str:
    device = cluster.device
    return (f"{cluster.gpus} x {device.name} ({size_text(device.memory_bytes)} each, "
            f"{cluster.gpus_per_node} per node)")


def format_table(result: SearchResult, top: int, cluster: Cluster) -> str:
    """The best ``top`` layouts, one line each, then why the others were dropped."""
    shown = result.ranked[:top]
    unit, scale = _unit(shown)
    layouts = [layout_text(p) for p in shown]
    width = max([len("layout"), *map(len, layouts)])
    lines = [(f"{result.considered} layouts on {_cluster_text(cluster)}, {result.global_batch} sequences per step; "
              f"{len(result.ranked)} predicted to fit, best first. Memory per rank in {unit}.")]
    predicted = result.ranked + result.too_big
    if predicted:  # the training options are the same for every layout
        cfg = predicted[0].cfg
        offload = {"offload": cfg.train.offload} if cfg.train.offload != "none" else {}
        options = {"precision": cfg.train.precision, **offload, **training_options(cfg)}
        lines.append(f"Trained with {as_flags(options)}.")
    if shown:
        lines.append(f"{'#':>3}  {'layout':<{width}}" + "".join(f"{SHORT_ROWS[r]:>8}" for r in MEMORY_ROWS)
                     + f"{'step s':>10}{'tokens/s':>14}")
    for index, (p, text) in enumerate(zip(shown, layouts, strict=True), start=1):
        memory = "".join(f"{p.memory[row] / scale:>8.2f}" for row in MEMORY_ROWS)
        lines.append(f"{index:>3}  {text:<{width}}{memory}{p.step_s:>10.4g}{p.tokens_per_s:>14,.0f}")
    lines.append("")
    lines += _reasons("layouts the trainer would refuse", result.refused)
    lines += _reasons("legal layouts not predicted, as they could not win", result.skipped)
    lines.append(_too_big_text(result, cluster))
    return "\n".join(lines)


def _candidate(p: Prediction) -> dict:
    return {"layout": p.layout(), "memory_bytes": {row: int(p.memory[row]) for row in MEMORY_ROWS},
            "step_s": p.step_s, "tokens_per_s": p.tokens_per_s, "fits": p.fits}


def to_json(result: SearchResult, top: int) -> dict:
    """CLI.md's shape: the best ``top`` that fit, then the ``top`` smallest that do not.

    ``dropped`` says why every other layout is absent (reason -> count), so its
    counts and the ranked ones add up to all layouts considered.
    """
    device = result.cluster.device
    too_big = f"needs more than the {size_text(device.memory_bytes)} of one {device.name}"
    dropped = {**result.refused, **result.skipped}
    if result.too_big:
        dropped[too_big] = len(result.too_big)
    return {
        "candidates": [_candidate(p) for p in result.ranked[:top] + result.too_big[:top]],
        "dropped": dropped,
        "global_batch": result.global_batch,
        "cluster": {"device": device.name, "gpus": result.cluster.gpus,
                    "gpus_per_node": result.cluster.gpus_per_node, "memory_bytes": device.memory_bytes,
                    "peak_tflops": dict(device.tflops)},
    }


def plot(result: SearchResult, path: Path, cluster: Cluster) -> None:
    """Memory per rank against tokens/s for every predicted layout, as a PNG.

    Memory on a log axis: a pipeline of many stages and a replicated model
    differ by orders of magnitude. The line is the device's memory; right of
    it nothing runs.
    """
    import matplotlib

    matplotlib.use("Agg")  # no display: write files only
    import matplotlib.pyplot as plt

    figure, ax = plt.subplots(figsize=(9, 6))
    for group, style in ((result.ranked, {"marker": "o", "color": "tab:blue", "label": "fits"}),
                         (result.too_big, {"marker": "x", "color": "tab:red", "label": "does not fit"})):
        if group:
            ax.scatter([p.memory["total"] / GIB for p in group], [p.tokens_per_s for p in group], s=12,
                       alpha=0.6, **style)
    ax.axvline(cluster.device.memory_bytes / GIB, color="black", linestyle="--",
               label=f"{cluster.device.name} memory ({size_text(cluster.device.memory_bytes)})")
    if result.ranked:
        best = result.ranked[0]
        ax.scatter([best.memory["total"] / GIB], [best.tokens_per_s], marker="*", s=250, color="gold",
                   edgecolors="black", zorder=3, label=f"best: {layout_text(best)}")
    ax.set_xscale("log")
    ax.set_xlabel("memory per rank (GiB, most loaded rank)")
    ax.set_ylabel("predicted tokens/s")
    ax.set_title(f"scaletrain plan: {len(result.ranked) + len(result.too_big)} predicted layouts on "
                 f"{_cluster_text(cluster)}", fontsize=10)
    ax.legend(fontsize=8, loc="best")
    ax.grid(True, alpha=0.3)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, format="png", dpi=120)
    plt.close(figure)
