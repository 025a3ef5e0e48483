"""Packed documents' attention on a GPU: FlexAttention over the blocks the documents leave in.

A packed row attends inside each document, causally (models/decoder.py):

    allowed(i, j) = j <= i  and  documents[i] == documents[j]

Handed to SDPA as a dense boolean mask [batch, 1, s, s], that mask takes SDPA
off its flash kernels (they take no mask), onto one that reads the mask for
every score. FlexAttention (Dong et al. 2024, "Flex Attention: A Programming
Model for Generating Optimized Attention Kernels") compiles the rule into a
flash-style kernel that works tile by tile (128 x 128 positions) and is told
which tiles to visit by a block mask:

    skipped  no allowed pair: a key tile after the query tile, or no document
             in common (most of a row of many short documents)
    full     every pair allowed: the key tile before the query tile, and both
             inside one document, so the kernel applies no mask at all
    partial  the rest (the diagonal, a document's edge): the rule is applied
             per score

With documents numbered in order along a row, a tile holds the documents
lo..hi (its first and last position's), two tiles share one exactly when
their ranges overlap, and both lie in one document when all four ends are
equal: the block mask comes from [batch, s/128] numbers, never from the
[s, s] grid. Each attention layer builds it again from the same documents (a
few small kernels, fused into the block's graph under --compile): cheap
beside the attention, but not yet measured on a GPU, nor is what skipping
tiles buys against a causal row. FlexAttention has no backward on a CPU (PyTorch 2.13) and no dropout, so
a CPU, or a model with attention dropout, keeps SDPA with the dense mask; it
runs compiled (eager FlexAttention is a reference that materializes scores).
"""

from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

TILE = 128  # positions per side of a FlexAttention tile (its default)


def document_block_mask(documents: torch.Tensor) -> BlockMask:
    """The causal, document-local block mask of packed rows, from documents [batch, s]
    (non-decreasing along each row): tiles skipped, full or partial (module docstring)."""
    batch, seq = documents.shape
    tiles = -(-seq // TILE)
    # A last, shorter tile repeats its last document: no new document enters its range. (torch.cat,
    # not F.pad's replicate mode, which CUDA implements for floating types only.)
    padded = torch.cat([documents, documents[:, -1:].expand(batch, tiles * TILE - seq)], dim=1)
    ends = padded.view(batch, tiles, TILE)
    lo, hi = ends[..., 0], ends[..., -1]  # [batch, tiles]: each tile's first and last document
    query_lo, query_hi = lo[:, :, None], hi[:, :, None]
    key_lo, key_hi = lo[:, None, :], hi[:, None, :]
    before = torch.ones(tiles, tiles, dtype=torch.bool, device=documents.device).tril()
    shared = before & (key_lo <= query_hi) & (query_lo <= key_hi)
    one_document = (query_lo == query_hi) & (key_lo == key_hi) & (query_lo == key_lo)
    full = shared & one_document & ~torch.eye(tiles, dtype=torch.bool, device=documents.device)
    partial = shared & ~full

    def mask_mod(b, h, q_index, kv_index):
        return (kv_index <= q_index) & (documents[b, q_index] == documents[b, kv_index])

    counts, indices = _tile_lists(partial)
    full_counts, full_indices = _tile_lists(full)
    return BlockMask.from_kv_blocks(counts, indices, full_counts, full_indices, BLOCK_SIZE=TILE,
                                    mask_mod=mask_mod, seq_lengths=(seq, seq))


def _tile_lists(visited: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A [batch, tiles, tiles] choice of key tiles per query tile as FlexAttention lists them:
    counts [batch, 1, tiles] and the chosen tiles' indices first [batch, 1, tiles, tiles]
    (one head: the mask is every head's)."""
    counts = visited.sum(-1, dtype=torch.int32)
    # visited tiles first, in order (a stable sort of 0 = visited, 1 = not; as integers, which every
    # device sorts)
    indices = torch.argsort((~visited).to(torch.int32), dim=-1, stable=True).to(torch.int32)
    return counts[:, None], indices[:, None]


def flex_document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            documents: torch.Tensor) -> torch.Tensor:
    """Attention of packed rows, q, k, v [batch, heads, s, head_dim], by FlexAttention: traced
    into the graph of a compiled block, else through its own compiled kernel."""
    attend = flex_attention if torch.compiler.is_compiling() else _COMPILED_FLEX_ATTENTION
    return attend(q, k, v, block_mask=document_block_mask(documents))


# Compiled on its first call, for each shape it meets: eager FlexAttention materializes the scores.
_COMPILED_FLEX_ATTENTION = torch.compile(flex_attention, dynamic=False)
