"""Where a language model's head meets its loss: the logits whole, or a chunk of rows at a time.

Materialized, the head's logits [N, V] and what the loss makes of them grow
with the vocabulary: N = 8192 tokens (micro-batch 4 at seq 2048) over a
vocabulary of V = 128,256 words are 2.1 GB in bf16, and the trainer's fp32 copy, the
log-probabilities F.cross_entropy saves and their gradient add 4.2 GB each.
Chunked (kernels/cross_entropy.py, `fused_linear_cross_entropy`), the head
and the loss run on ``rows`` rows at a time and only one chunk's logits
exist: [rows, V] in the matmul's dtype, beside the head's fp32 gradient.

A chunk holds at least 2,048 rows. Fewer lose the head's matmul rate: on the
H200 (planner/compute.py's sweep) a product of 512 rows over k = n = 8,192 ran at
652 TFLOP/s against 777 for 2,048 rows, and 256 rows at 543, while the
weight's gradient, ``grad^T @ h``, sums over the chunk's rows and is thinner
still. Above that floor the chunk's logits are as large as the hidden states
[N, d] (Liger Kernel's choice, Hsu et al. 2024), so the loss needs about as
much memory as its input.

On a GPU the head and loss run chunked by default wherever the head's weight
is whole on the rank after the forward (no tensor parallelism splitting it,
no pipeline holding it on another stage, no ZeRO-3 freeing it); elsewhere, and
on a CPU, the logits are made whole (`--head-loss` chooses either).
"""

from __future__ import annotations

CHUNKED, LOGITS = "chunked", "logits"
MIN_CHUNK_ROWS = 2048


def chunk_rows(n: int, d: int, vocab: int) -> int:
    """Rows per chunk of N = ``n`` hidden states of width ``d`` over ``vocab`` words: a power
    of two, at least `MIN_CHUNK_ROWS`, else as many as give logits about the size of [N, d],
    never more than ``n`` (module docstring)."""
    as_large_as_input = -(-n // -(-vocab // d))
    rows = max(as_large_as_input, MIN_CHUNK_ROWS)
    return min(n, 1 << (rows - 1).bit_length())


def head_is_whole(tp: int, pp: int, zero: int) -> bool:
    """Whether the head's weight is whole on the rank that computes the loss: tensor parallelism
    splits it, a pipeline computes the logits inside its last stage, ZeRO-3 frees it after use."""
    return tp == 1 and pp == 1 and zero < 3


def chunked(head_loss: str | None, fused: str, on_gpu: bool) -> bool:
    """Whether the head and the loss run chunked where the head's weight is whole: as
    ``--head-loss`` says, else with ``--fused triton``, else on a GPU."""
    if head_loss is not None:
        return head_loss == CHUNKED
    return fused == "triton" or on_gpu


def chunk_bytes(n: int, d: int, vocab: int, matmul_bytes: int) -> int:
    """What the chunked head and loss hold beyond their input: one chunk's logits (their
    gradient written in place), the hidden states' gradient, and the head's fp32 gradient
    with the 16-bit product each chunk adds to it."""
    rows = chunk_rows(n, d, vocab)
    weight = vocab * d * (4 + (matmul_bytes if matmul_bytes < 4 else 0))
    return rows * vocab * matmul_bytes + n * d * matmul_bytes + weight
