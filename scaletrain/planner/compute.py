"""How fast one device does a step's arithmetic: matrix products at a rate that grows with
their size, attention at its kernel's rate, and the memory-bound rest at the memory's.

A fixed share of the peak cannot be right for every model: a matrix product
``[m, k] @ [k, n]`` fills the device only when it is large (a 125M model's
``768``-wide products run at a third of the rate of a 7B model's). So the
clock reads each product's share of the peak from the device's curve
(planner/curves.py: measured on this machine by ``scaletrain plan
--calibrate``, or published for a preset). Each product times three
(forward, input gradient, weight gradient, the same FLOPs), and the step's
matrix products run at their FLOP-weighted harmonic mean:

    rate_matmul = peak * sum_i F_i / sum_i (F_i / share(m_i, k_i, n_i))

over one block's products (q, k, v, the attention's output, the MLP's inputs
and output, an expert's at ``top_k / E`` of the tokens) and the head, each
split by tp, ``m`` the micro-batch's tokens on the rank.

Attention. The FLOPs formula counts the whole ``s x s`` square (``12 L a d s``
per token); a causal kernel computes half of it. The device's
``attention_share`` is its rate on the formula's count (an H200's flash
kernels: 0.36 of the peak on the half, 0.72 on the whole):

    attention_s = F_attention / (peak * attention_share)

Context parallelism's ring attention (parallel/context.py) writes its scores out
block by block in fp32; where the device's calibration timed it
(``ring_attention_share``, planner/calibrate.py) a cp run's attention goes at
that share instead.

Memory-bound work. Norms, rotary, activations, residuals, casts and the loss
move bytes rather than multiply: about ``ELEMENTWISE_PASSES`` times the bytes
a block saves for backward (planner/activations.py), and the loss's over the
logits, per micro-batch. What a block computes in forward and again in
backward rather than keeping (models/lean_saves.py: an RMSNorm's x/rms and
1/rms, silu's output, and the autocast copies its column layers no longer each
make) counts as if kept, the bytes the constant was set against: those
tensors pass through memory all the same, twice where once kept; and the optimizer reads and writes its weights and
state and reads the gradients once a step. Both at the device's
``memory_share`` of its memory's bandwidth (torch's fused AdamW moved 3.28 of
the H200's 4.8 TB/s); a device of no known bandwidth (an uncalibrated CPU) has
no separate term, its FLOP rate covering the whole step:

    memory_s = (PASSES * (blocks * block_bytes + loss_bytes) * micro_batches
                + 2 * (params + optimizer) + grads) / (bandwidth * memory_share)

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

Materialised attention. Software before flash attention (a device with
``materialized_attention``, as 2021's Megatron-LM ran: arXiv 2104.04473)
writes each block's ``b (a/tp) s^2`` scores out and reads them back: the
score product writes them (2 bytes each in 16 bits), the fused
scale-mask-softmax reads and writes them (4), dropout reads them and writes
its output and its one-byte mask (5), the product with v reads them (2):
``MATERIALIZED_FORWARD_BYTES`` = 13 per score forward. Backward: the
probabilities' gradient written (2) and the dropped probabilities read for
v's gradient (2), dropout's backward reads the gradient and mask and writes
(5), softmax's reads the gradient and its output and writes (6), the two
products read the scores' gradient (4): ``MATERIALIZED_BACKWARD_BYTES`` = 19.
A block whose forward reruns (recomputation) pays the forward's bytes again.
These go at the memory's share of its bandwidth with the rest of the
memory-bound work, and the two batched products (``[s, d_head] @ [d_head, s]``
per head, the whole square) at the matrix curve's rate for their shape, the
heads' rows stacked:

    attention_matrix_s = (13 * (1 + rerun) + 19) * b * (a / tp) * s^2 * blocks * micro_batches / bandwidth
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from scaletrain.models.spec import ModelShape
from scaletrain.planner import activations
from scaletrain.planner.curves import H200_BF16, MatmulCurve
from scaletrain.planner.hardware import Cluster

ELEMENTWISE_PASSES = 4.0
# of a block's elementwise bytes and launches, the forward's: an operator reads its input and writes its
# output forward (2 passes) and, backward, reads the output's gradient and its saved input and writes the
# input's gradient (3); what a recomputed block pays again
FORWARD_SHARE = 0.4
COMPRESSION_PASSES = 2  # --compress-activations: a saved tensor and its stored copy, moved in forward and backward
MATERIALIZED_FORWARD_BYTES = 13  # per attention score, written out forward (module docstring)
MATERIALIZED_BACKWARD_BYTES = 19  # and backward


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


def matmul_rate_share(m: ModelShape, tokens: int, tp: int, curve: MatmulCurve = H200_BF16) -> float:
    """The FLOP-weighted share of the peak the step's matrix products reach on ``curve``'s device
    (module docstring)."""
    products = block_products(m, tokens, tp) * m.n_layers + [(tokens, m.d_model, math.ceil(m.vocab / tp))]
    flops = [2 * rows * inner * outer for rows, inner, outer in products]
    seconds = sum(f / curve.share(*product) for f, product in zip(flops, products))
    return sum(flops) / seconds


@dataclass(frozen=True)
class Clock:
    """One rank's arithmetic rates for a step: FLOP/s of its matrix products and of attention
    (on the formula's count), and the seconds of its memory-bound work."""

    matmul_flops_s: float
    attention_flops_s: float
    memory_s: float


def block_rerun_share(recompute: str) -> float:
    """The share of the blocks whose whole forward reruns in backward under ``recompute`` (``selective``
    reruns the attention core alone, inside its fused kernel)."""
    return 0.0 if recompute == "selective" else attention_rerun_share(recompute)


def attention_rerun_share(recompute: str) -> float:
    """The share of the blocks whose attention reruns its forward in backward under ``recompute``."""
    if recompute == "none":
        return 0.0
    return 1 / int(recompute.split(":")[1]) if recompute.startswith("every:") else 1.0


def norm_again(x: activations.Shape) -> int:
    """What an RMSNorm computes again in backward rather than keeping (models/lean_saves.py): its
    x/rms (kept before only for a trained weight's gradient) and 1/rms; a layer norm keeps all."""
    if x.model.norm_with_mean:
        return 0
    rows = x.b * x.s // (x.tp if x.sp else 1)
    return (0 if x.frozen else 4 * rows * x.h) + 4 * rows


def elementwise_bytes(x: activations.Shape) -> int:
    """The bytes a block's memory-bound work is counted by (module docstring): what it saves
    (`activations.block`), and what a block of RMSNorms and SwiGLU computes again in backward
    rather than keeping, or no longer casts for each column layer apart."""
    m, saved = x.model, activations.block(x)
    if m.norm_with_mean:  # layer norm and GELU: every tensor the work writes is kept
        return saved
    again = 2 * norm_again(x) + (m.ffn_inputs - 1) * x.e * x.b * x.s * m.ffn_hidden // x.tp  # silu's output
    if x.e < 4 and not (x.sp or x.float8):  # an autocast copy for each column layer but one per norm
        columns = x.columns(True) + x.columns(False)
        again += (columns - min(1, x.columns(True)) - min(1, x.columns(False))) * x.e * x.bsh
    if not m.learned_positions:
        again += (8 - 2 * x.e) * x.s * m.head_dim  # rotary's 16-bit pair for q's product and k's apart
    return saved + again


def clock(m: ModelShape, x: activations.Shape, blocks: int, last: bool, micro_batches: int,
          state_bytes: int, precision: str, cluster: Cluster, recompute: str = "none") -> Clock:
    """The clock of the busiest rank (``blocks`` blocks, the head if ``last``, ``state_bytes``
    of weights, gradients and optimizer state it updates) on ``cluster``'s device, under ``recompute``."""
    device = cluster.device
    peak = device.tflops[precision] * 1e12
    # fp8 runs the blocks' linear products in float8 (techniques/fp8.py), attention's own products in bf16
    attention_peak = device.tflops["bf16" if precision == "fp8" else precision] * 1e12
    matmul = peak * matmul_rate_share(m, x.b * x.s, x.tp, device.matmul)
    ring = x.cp > 1 and device.ring_attention_share is not None
    attention = attention_peak * (device.ring_attention_share if ring else device.attention_share)
    scores = x.b * (m.n_heads // x.tp) * x.s * x.s  # one block's attention scores on the rank
    if device.materialized_attention:  # two batched products per head, the heads' rows stacked
        attention = attention_peak * device.matmul.share(scores // x.s, m.head_dim, x.s)
    if not device.memory_gbps:  # no bandwidth known: the FLOP rates cover the whole step
        return Clock(matmul, attention, 0.0)
    # the elementwise work is on the tensors as computed: whole logits' worth of loss, however they
    # are stored (compressed) or chunked
    computed = dataclasses.replace(x, compress="none", chunked_loss=False)
    rerun = 1 + FORWARD_SHARE * block_rerun_share(recompute)
    passes = ELEMENTWISE_PASSES * (blocks * rerun * elementwise_bytes(computed)
                                   + (activations.head_and_loss(computed) + norm_again(computed) if last else 0))
    if x.compress != "none":  # each tensor read and its copy written in forward, the reverse in backward
        passes += COMPRESSION_PASSES * blocks * (activations.block(computed) + activations.block(x))
    if device.materialized_attention:
        forward = MATERIALIZED_FORWARD_BYTES * (1 + attention_rerun_share(recompute))
        passes += (forward + MATERIALIZED_BACKWARD_BYTES) * scores * blocks
    bandwidth = device.memory_gbps * 1e9 * device.memory_share
    return Clock(matmul_flops_s=matmul, attention_flops_s=attention,
                 memory_s=(passes * micro_batches + state_bytes) / bandwidth)
