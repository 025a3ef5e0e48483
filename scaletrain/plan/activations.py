"""Saved activations of our GPT, per micro-batch, as the memory ledger's meter counts them.

Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
Transformer Models", section 4.1) count what one transformer layer keeps for
backward: ``s*b*h*(34 + 5*a*s/h)`` bytes with 16-bit activations, dropout
masks and the a*s*s attention matrix. Our block differs in ways that change
the count, so the planner counts our own layers, tensor by tensor (``b``
sequences of ``s`` positions, width ``h``, ``a`` heads, ``t`` the tp size,
``e`` bytes per activation: 2 under bf16/fp16 autocast, else 4):

    ln1 input (the fp32 residual stream)      4*b*s*h          /t with sp
    ln1 mean and rstd (fp32)                  8*b*s            /t with sp
    qkv input (ln1 output, cast to e)         e*b*s*h          /t with sp (its own chunk; backward re-gathers it)
    q, k, v (one tensor, qkv's output)        3*e*b*s*h/t
    attention output                          e*b*s*h/t        (its transpose is proj's input: a view)
    attention log-sum-exp (fp32)              4*b*a*s/t        (a fused kernel: no a*s*s matrix)
    ln2 input, mean and rstd                  as ln1
    fc input (ln2 output, cast to e)          e*b*s*h          /t with sp
    GELU input (fc's output)                  4*e*b*s*h/t
    proj input (GELU's output)                4*e*b*s*h/t
    under autocast of fp32 weights: their e-byte copies (qkv, proj, fc, proj): 12*e*h*h/t

fp32 without tp: ``64*b*s*h + 16*b*s + 4*a*b*s`` bytes per layer; bf16
autocast: ``36*b*s*h`` + the same small terms + the weight copies (against
Korthikanti's 34: our residual stream and norms stay fp32, there are no
dropout masks and no attention matrix). With context parallelism ``s`` is a
rank's ``s/cp`` positions, and ring attention returns its output laid out by
heads, so proj's input is a copy: ``+e*b*s*h/t``.

Outside the blocks: the token ids and positions (int64) on the first stage,
and on the tp group the vocabulary embedding's local ids and mask; on the
last stage ln_f as a norm, the head's input, and the loss: log-softmax keeps
its fp32 output ``4*b*s*V`` (vocabulary-parallel: the softmax ``4*b*s*V/t``
with local ids and mask), plus the targets.

Recomputation (recompute.py) changes which of these are alive at the peak:

    none        everything, at the end of the forward
    selective   drops the log-sum-exp (the attention output stays: proj saves it)
    full        only each block's input (4*b*s*h, /t with sp) through the forward;
                in backward one block's tensors again while it is recomputed,
                after the loss's tensors are gone: L*input + block - input + ids
    every:K     blocks 0, K, 2K, ... as under full, the others as none
    sqrt        segments of ceil(sqrt L) blocks as units: segment inputs, plus
                one whole segment in backward

A pipeline rank holds several micro-batches at once: the schedule's
``live_activations`` (schedules.py) count how many of its chunks' forward
activations are alive at most, which the planner multiplies by one chunk's.

Left out: dropout (masks and SDPA's math path; the planner assumes
``--dropout 0``), and the mixture-of-experts layers' routed copies, whose size
depends on the routing (the planner counts an expert layer as the dense MLP
it replaces, plus the router's fp32 probabilities).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from scaletrain.models.gpt import GPTConfig


@dataclass(frozen=True)
class Shape:
    """One micro-batch on one rank: ``b`` sequences of ``s`` (the rank's) positions."""

    b: int
    s: int
    h: int
    heads: int
    vocab: int  # padded rows of the head
    tp: int = 1
    sp: bool = False
    cp: int = 1
    e: int = 4  # bytes of an autocast activation
    cast_weights: bool = False  # autocast saves 16-bit copies of fp32 weights

    @property
    def bsh(self) -> int:
        return self.b * self.s * self.h


def shape_of(gpt: GPTConfig, micro_batch: int, tp: int, sp: bool, cp: int, precision: str,
             param_dtype: str) -> Shape:
    autocast = precision in ("bf16", "fp16")
    return Shape(b=micro_batch, s=gpt.seq_len // cp, h=gpt.d_model, heads=gpt.n_heads, vocab=gpt.padded_vocab,
                 tp=tp, sp=sp, cp=cp, e=2 if autocast else 4, cast_weights=autocast and param_dtype == "fp32")


def block_input(x: Shape) -> int:
    """The residual stream entering a block: all full recomputation keeps of it."""
    return 4 * x.bsh // (x.tp if x.sp else 1)


def block(x: Shape) -> int:
    """Bytes one transformer block saves for backward (module docstring)."""
    t, e = x.tp, x.e
    seq_split = t if x.sp else 1
    norm = 4 * x.bsh // seq_split + 8 * x.b * x.s // seq_split
    linear_input = e * x.bsh // seq_split
    total = 2 * norm + 2 * linear_input
    total += 3 * e * x.bsh // t + e * x.bsh // t + attention_stats(x)  # q, k, v; output; lse
    total += 8 * e * x.bsh // t  # GELU's input and output
    if x.cast_weights:
        total += 12 * e * x.h * x.h // t
    if x.cp > 1:
        total += e * x.bsh // t  # ring attention's output, copied into proj's layout
    return total


def attention_stats(x: Shape) -> int:
    """The attention's fp32 log-sum-exp: what selective recomputation drops."""
    return 4 * x.b * x.heads * x.s // x.tp


def inputs(x: Shape) -> int:
    """The first stage's int64 token ids and positions (and the vocabulary embedding's ids and mask)."""
    ids = 8 * x.b * x.s + 8 * x.s
    if x.tp > 1:
        ids += 9 * x.b * x.s
    return ids


def head_and_loss(x: Shape) -> int:
    """The last stage's final norm, head input and loss (module docstring), targets included."""
    seq_split = x.tp if x.sp else 1
    norm = 4 * x.bsh // seq_split + 8 * x.b * x.s // seq_split
    head_input = x.e * x.bsh // seq_split + (x.e * x.vocab * x.h // x.tp if x.cast_weights else 0)
    rows = x.b * x.s
    loss = 4 * rows * math.ceil(x.vocab / x.tp) + 8 * rows
    loss += 9 * rows if x.tp > 1 else 4  # local ids and mask; or nll's total weight
    return norm + head_input + loss


def chunk_peak(x: Shape, blocks: int, first: bool, last: bool, recompute: str) -> tuple[int, int]:
    """(bytes alive after a chunk's forward, the most alive at once while it goes
    backward) for one micro-batch through ``blocks`` blocks, under ``recompute``."""
    ends = (inputs(x) if first else 0) + (head_and_loss(x) if last else 0)
    kept_ids = (inputs(x) if first else 0) + (8 * x.b * x.s if last else 0)  # alive until the end
    full, one = block(x), block_input(x)
    if recompute == "none" or blocks == 0:
        after = blocks * full + ends
        return after, after
    if recompute == "selective":
        after = blocks * (full - attention_stats(x)) + ends
        return after, after
    if recompute == "sqrt":
        segment = math.ceil(math.sqrt(blocks))
        segments = math.ceil(blocks / segment)
        after = segments * one + ends
        return after, segments * one + segment * full - one + kept_ids
    every = 1 if recompute == "full" else int(recompute.split(":")[1])
    checkpointed = [i % every == 0 for i in range(blocks)]
    kept = [one if c else full for c in checkpointed]
    after = sum(kept) + ends
    # In backward, block i reruns with the blocks before it still holding their share.
    during = max(sum(kept[:i]) + full + kept_ids for i in range(blocks) if checkpointed[i])
    return after, max(after, during)


def weight_grad_inputs(x: Shape, blocks: int, last: bool) -> int:
    """What a split backward keeps from B to W (pipeline/weight_grad.py): the inputs of
    the linear layers whose weight gradient waits, attention and MLP projections and,
    unless sp computes them at once with their re-gathered input, qkv, fc and the head."""
    rows = x.e * x.bsh
    per_block = rows // x.tp + 4 * rows // x.tp + (0 if x.sp else 2 * rows)
    return blocks * per_block + (rows if last and not x.sp else 0)


def schedule_peak(order: list, stage_bytes: dict[int, tuple[int, int, int]]) -> int:
    """The most saved bytes a rank holds while running ``order`` (its compute
    actions, one micro-batch each), with ``stage_bytes[stage]`` = `chunk_peak`
    and `weight_grad_inputs` of each of its stages: a forward adds the chunk's
    bytes, a backward's peak sits on top of what the other micro-batches hold,
    and the bytes go when the backward is complete; a split backward (zero
    bubble) keeps the weight gradients' inputs from B until W."""
    live = peak = 0
    for action in order:
        after, during, kept = stage_bytes[action.stage]
        if action.kind == "F":
            live += after
            peak = max(peak, live)
        elif action.kind in ("BW", "B"):
            peak = max(peak, live - after + during)
            live -= after if action.kind == "BW" else after - kept
        elif action.kind == "W":
            live -= kept
    return peak
