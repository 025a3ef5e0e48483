"""The planner's clock on a GPU (planner/compute.py): matrix products faster as they grow, the
measured curve read back at its own points, and whole steps against what one H200 measured
(docs/performance.md) and what llm-foundry published for MPT on H100s (docs/planner.md)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from scaletrain.commands.cli import main
from scaletrain.config import Config
from scaletrain.planner import activations, compute
from scaletrain.planner.curves import H200_BF16
from scaletrain.planner.hardware import Cluster, cpu_device
from scaletrain.planner.inventory import Planned


def test_the_curve_reads_back_its_measured_points_and_grows_with_either_side():
    curve = H200_BF16
    for i, rows in enumerate(curve.sides):
        for j, side in enumerate(curve.sides):
            assert curve.share(rows, side, side) == pytest.approx(curve.tflops[i][j] / curve.peak_tflops)
    # between the points and beyond them: never falling as a side grows, held at the edges
    sides = [2 ** (e / 4) for e in range(28, 60)]
    for rows in sides:
        shares = [curve.share(int(rows), int(s), int(s)) for s in sides]
        assert all(b >= a for a, b in zip(shares, shares[1:]))
    assert curve.share(65536, 65536, 65536) == curve.share(8192, 8192, 8192)


def test_a_wider_model_runs_its_products_nearer_the_peak():
    shares = []
    for name in ("gpt2-124m", "tinyllama-1.1b", "llama3-8b"):
        shape = _planned(name, seq=2048).shape
        shares.append(compute.matmul_rate_share(shape, tokens=4 * 2048, tp=1))
    assert shares == sorted(shares) and shares[0] < 0.6 < shares[-1] < 0.8


def test_tensor_parallel_products_are_narrower_and_slower():
    shape = _planned("llama3-8b", seq=2048).shape
    assert compute.matmul_rate_share(shape, 8192, tp=8) < compute.matmul_rate_share(shape, 8192, tp=1)


def test_a_cpu_keeps_a_share_of_its_measured_peak_for_every_flop():
    cluster = Cluster(cpu_device(0.1, 8 * 2**30), 1, 1)
    planned = _planned("gpt-small", 128)
    x = activations.shape_of(planned.shape, planned.tensor_plan, 4, 1, False, 1, "fp32", "fp32")
    clock = compute.clock(planned.shape, x, 4, True, 1, 10**6, "fp32", cluster)
    assert clock.matmul_flops_s == clock.attention_flops_s == pytest.approx(0.1e12 * 0.6)
    assert clock.memory_s == 0


def test_context_parallel_attention_goes_at_the_rings_measured_rate():
    """Ring attention writes its scores out block by block (parallel/context.py): a device that timed it
    (``ring_attention_share``) prices a cp run's attention at that rate, other layouts at the fused one's."""
    device = dataclasses.replace(cpu_device(0.1, 8 * 2**30), memory_gbps=10.0)
    ring = dataclasses.replace(device, ring_attention_share=device.attention_share / 4)
    planned = _planned("gpt-small", 128)
    for cp, slower in ((1, 1.0), (2, 4.0)):
        x = activations.shape_of(planned.shape, planned.tensor_plan, 4, 1, False, cp, "fp32", "fp32")
        fused, timed = (compute.clock(planned.shape, x, 4, True, 1, 10**6, "fp32", Cluster(d, 1, 1))
                        for d in (device, ring))
        assert fused.attention_flops_s == pytest.approx(slower * timed.attention_flops_s)


def test_a_recomputed_block_moves_its_forwards_elementwise_bytes_again():
    """Full recomputation reruns each block's forward: FORWARD_SHARE of its elementwise bytes once more;
    selective reruns the attention core alone, inside its fused kernel (planner/compute.py)."""
    cluster = Cluster(dataclasses.replace(cpu_device(0.1, 8 * 2**30), memory_gbps=10.0), 1, 1)
    planned = _planned("gpt-small", 128)
    x = activations.shape_of(planned.shape, planned.tensor_plan, 4, 1, False, 1, "fp32", "fp32")
    memory = {recompute: compute.clock(planned.shape, x, 4, False, 1, 0, "fp32", cluster, recompute).memory_s
              for recompute in ("none", "selective", "full", "every:2")}
    assert memory["selective"] == memory["none"]
    assert memory["full"] == pytest.approx(memory["none"] * (1 + compute.FORWARD_SHARE))
    assert memory["every:2"] == pytest.approx(memory["none"] * (1 + compute.FORWARD_SHARE / 2))


# (model, micro-batch, sequence, measured tokens/s): our trainer on one H200, bf16
# (scripts/gpu-figures.sh, 2026-11-27; docs/performance.md); gpt2-124m ran eager, tinyllama compiled.
MEASURED = [("tinyllama-1.1b", 4, 2048, 60_830), ("gpt2-124m", 16, 1024, 427_615)]


@pytest.mark.parametrize("name, micro, seq, measured", MEASURED, ids=[m[0] for m in MEASURED])
def test_one_h200s_measured_steps_are_predicted_within_15_percent(name, micro, seq, measured, capsys):
    best = _plan(capsys, "--model", name, "--gpu", "H200", "--gpus", "1", "--dp", "1", "--micro-batch", str(micro),
                 "--seq", str(seq), "--precision", "bf16")
    assert abs(best["tokens_per_s"] / measured - 1) < 0.15, (best["tokens_per_s"], measured)


def test_the_predicted_mfu_of_a_gpt_grows_with_its_width(capsys):
    """The trend of llm-foundry's MPT tables (docs/planner.md): wider models reach more of the peak."""
    mfu = []
    for layers, hidden, heads in ((12, 768, 12), (24, 2048, 16), (32, 4096, 32)):
        best = _plan(capsys, "--layers", str(layers), "--hidden", str(hidden), "--heads", str(heads), "--seq", "2048",
                     "--gpu", "H100", "--gpus", "1", "--dp", "1", "--micro-batch", "4", "--precision", "bf16",
                     "--gpu-memory", "400GB")
        weights = layers * 12 * hidden**2 + 50304 * hidden  # the blocks' matrices and the tied head
        mfu.append(best["tokens_per_s"] * (6 * weights + 12 * layers * hidden * 2048) / 989.4e12)
    assert mfu == sorted(mfu) and mfu[0] < 0.35 and 0.4 < mfu[-1] < 0.75


def _plan(capsys, *args: str) -> dict:
    assert main(["plan", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)["candidates"][0]


def _planned(name: str, seq: int) -> Planned:
    return Planned.of(Config().replace(name=name, seq_len=seq).model, 50304, seq)
