"""How fast one device does a step's arithmetic: matrix products at a rate that grows with
their size, attention at its kernel's rate, and the memory-bound rest at the memory's.

A fixed share of the peak cannot be right for every model: a matrix product
``[m, k] @ [k, n]`` fills the device only when it is large (a 125M model's
``768``-wide products run at a third of the rate of a 7B model's). So the
clock reads each product's rate from a measured curve, ``rate(m, sqrt(k n))``:
one H200's bf16 products ``[m, k] @ [k, k]`` (cuBLAS under torch 2.11,
``scripts/gpu_figures.py``'s ``gemm`` row, docs/performance.md), as a share
of the datasheet peak, read bilinearly in ``log2`` of both sides and held at
the table's edges. Other devices are assumed to reach the same shares of their
own peaks. Each product times three (forward, input gradient, weight gradient,
the same FLOPs), and the step's matrix products run at their FLOP-weighted
harmonic mean:

    rate_matmul = peak * sum_i F_i / sum_i (F_i / share(m_i, k_i, n_i))

over one block's products (q, k, v, the attention's output, the MLP's inputs
and output, an expert's at ``top_k / E`` of the tokens) and the head, each
split by tp, ``m`` the micro-batch's tokens on the rank.

Attention. The FLOPs formula counts the whole ``s x s`` square (``12 L a d s``
per token); a causal kernel computes half of it, at ``ATTENTION_SHARE`` of the
peak (cuDNN's flash kernels forward and backward on an H200 at head size 64:
364 and 342 TFLOP/s on the causal half, docs/performance.md):

    attention_s = F_attention / 2 / (peak * ATTENTION_SHARE)

Memory-bound work. Norms, rotary, activations, residuals, casts and the loss
move bytes rather than multiply: about ``ELEMENTWISE_PASSES`` times the bytes
a block saves for backward (planner/activations.py), and the loss's over the
logits, per micro-batch; and the optimizer reads and writes its weights and
state and reads the gradients once a step. Both at ``MEMORY_SHARE`` of the
memory's datasheet bandwidth (torch's fused AdamW moved 3.28 of the H200's
4.8 TB/s):

    memory_s = (PASSES * (blocks * block_bytes + loss_bytes) * micro_batches
                + 2 * (params + optimizer) + grads) / (bandwidth * MEMORY_SHARE)

``ELEMENTWISE_PASSES`` is the one constant set against a whole step (with 4
the clock gives our 1.1B model's H200 step within 2%, docs/performance.md);
the rest is measured kernel by kernel, and docs/planner.md checks the whole
against published tables it was not set against.

Activation compression (``--compress-activations``) adds its own memory-bound
work, not measured but counted the same way: each saved tensor is read and its
bf16 or int8 copy written in the forward, and the copy read and the tensor
written again in backward,

    compress_bytes = COMPRESSION_PASSES * blocks * (block_bytes + stored_block_bytes)

per micro-batch (an upper bound: it counts the few tensors kept as they are too).
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from dataclasses import dataclass

from scaletrain.models.spec import ModelShape
from scaletrain.planner import activations
from scaletrain.planner.hardware import Cluster

# TFLOP/s of bf16 [m, k] @ [k, k] on one H200 (rows: m; columns: k = n), each the median of 20
# products after 3, launch and synchronization included; against its 989.4 TFLOP/s datasheet peak.
SIDES = (256, 512, 1024, 2048, 4096, 8192)
MEASURED_TFLOPS = (
    (2, 6, 26, 86, 260, 543),
    (3, 11, 49, 169, 406, 652),
    (6, 25, 96, 288, 553, 730),
    (13, 50, 171, 407, 649, 777),
    (25, 93, 273, 538, 705, 791),
    (48, 165, 402, 631, 757, 780),
)
MEASURED_PEAK_TFLOPS = 989.4
ATTENTION_SHARE = 0.36
MEMORY_SHARE = 0.68
ELEMENTWISE_PASSES = 4.0
COMPRESSION_PASSES = 2  # --compress-activations: a saved tensor and its stored copy, moved in forward and backward


def matmul_share(m: int, k: int, n: int) -> float:
    """The share of the peak a product [m, k] @ [k, n] reaches (module docstring)."""
    return _bilinear(math.log2(max(m, 1)), math.log2(max(math.sqrt(k * n), 1))) / MEASURED_PEAK_TFLOPS


def _bilinear(row: float, column: float) -> float:
    logs = [math.log2(side) for side in SIDES]

    def bracket(value: float) -> tuple[int, float]:
        value = min(max(value, logs[0]), logs[-1])
        upper = min(max(bisect.bisect_left(logs, value), 1), len(logs) - 1)
        return upper - 1, (value - logs[upper - 1]) / (logs[upper] - logs[upper - 1])

    (i, di), (j, dj) = bracket(row), bracket(column)
    t = MEASURED_TFLOPS
    top = t[i][j] * (1 - dj) + t[i][j + 1] * dj
    bottom = t[i + 1][j] * (1 - dj) + t[i + 1][j + 1] * dj
    return top * (1 - di) + bottom * di


def block_products(m: ModelShape, tokens: int, tp: int) -> list[tuple[int, int, int]]:
    """One block's matrix products (rows, inner, outer) on a rank holding ``tokens`` tokens of
    the micro-batch, each split by tp; a mixture-of-experts block's at its experts' share."""
    attention = m.n_heads * m.head_dim // tp
    kv = m.n_kv_heads * m.head_dim // tp
    products = [(tokens, m.d_model, attention), (tokens, m.d_model, kv), (tokens, m.d_model, kv),
                (tokens, attention, m.d_model)]
    if m.moe_experts:
        routed = max(1, tokens * m.moe_top_k // m.moe_experts)
        hidden = m.moe_hidden // tp
        return products + [(routed, m.d_model, hidden)] * m.ffn_inputs * m.moe_experts \
            + [(routed, hidden, m.d_model)] * m.moe_experts
    hidden = m.ffn_hidden // tp
    return products + [(tokens, m.d_model, hidden)] * m.ffn_inputs + [(tokens, hidden, m.d_model)]


def matmul_rate_share(m: ModelShape, tokens: int, tp: int) -> float:
    """The FLOP-weighted share of the peak the step's matrix products reach (module docstring)."""
    products = block_products(m, tokens, tp) * m.n_layers + [(tokens, m.d_model, math.ceil(m.vocab / tp))]
    flops = [2 * rows * inner * outer for rows, inner, outer in products]
    seconds = sum(f / matmul_share(*product) for f, product in zip(flops, products))
    return sum(flops) / seconds


@dataclass(frozen=True)
class Clock:
    """One rank's arithmetic rates for a step: FLOP/s of its matrix products and of attention
    (on the formula's count), and the seconds of its memory-bound work."""

    matmul_flops_s: float
    attention_flops_s: float
    memory_s: float


def clock(m: ModelShape, x: activations.Shape, blocks: int, last: bool, micro_batches: int,
          state_bytes: int, precision: str, cluster: Cluster) -> Clock:
    """The clock of the busiest rank (``blocks`` blocks, the head if ``last``, ``state_bytes``
    of weights, gradients and optimizer state it updates); on a CPU a fixed share of the
    measured peak for every FLOP and no separate memory term (planner/hardware.py)."""
    peak = cluster.device.tflops[precision] * 1e12
    # fp8 runs the blocks' linear products in float8 (techniques/fp8.py), attention's own products in bf16
    attention_peak = cluster.device.tflops["bf16" if precision == "fp8" else precision] * 1e12
    if cluster.device.name == "cpu":
        rate = peak * cluster.device.efficiency
        return Clock(rate, rate, 0.0)
    tokens = x.b * x.s
    # the elementwise work is on the tensors as computed: whole logits' worth of loss, however they
    # are stored (compressed) or chunked
    computed = dataclasses.replace(x, compress="none", chunked_loss=False)
    passes = ELEMENTWISE_PASSES * (blocks * activations.block(computed)
                                   + (activations.head_and_loss(computed) if last else 0))
    if x.compress != "none":  # each tensor read and its copy written in forward, the reverse in backward
        passes += COMPRESSION_PASSES * blocks * (activations.block(computed) + activations.block(x))
    bandwidth = cluster.device.memory_gbps * 1e9 * MEMORY_SHARE
    return Clock(matmul_flops_s=peak * matmul_rate_share(m, tokens, x.tp),
                 attention_flops_s=2 * attention_peak * ATTENTION_SHARE,  # the formula's square, the kernel's half
                 memory_s=(passes * micro_batches + state_bytes) / bandwidth)
