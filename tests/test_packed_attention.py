"""Packed rows' FlexAttention path (models/packed_attention.py): its block mask, built from the
documents' tile ends, is the rule's own block mask; its attention is SDPA's with the dense mask;
it visits only the tiles the documents leave in; and it compiles into one graph. The CPU runs
FlexAttention forward only (PyTorch has no CPU backward for it), which is what is checked here;
on a GPU the trainer takes this path for packed rows."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from scaletrain.models.decoder import causal_attention, document_mask, uses_flex
from scaletrain.models.packed_attention import TILE, document_block_mask, flex_document_attention


def _documents(lengths: list[list[int]], seq: int) -> torch.Tensor:
    """Rows of documents of the given lengths, the rest of each row one more (padding) document."""
    rows = []
    for row in lengths:
        ids = torch.repeat_interleave(torch.arange(len(row)), torch.tensor(row))[:seq]
        rows.append(torch.cat([ids, torch.full((seq - len(ids),), len(row))]))
    return torch.stack(rows)


LAYOUTS = {
    "short documents": ([[50, 300, 7, 129, 1, 200, 90], [128] * 4, [1000]], 512),
    "a ragged last tile": ([[100, 100, 100], [299], [3, 4, 5, 6]], 300),
    "one document per row": ([[1000], [1000]], 640),
}


@pytest.mark.parametrize("lengths, seq", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_the_block_mask_is_the_rule_s_own(lengths, seq):
    documents = _documents(lengths, seq)
    ours = document_block_mask(documents)
    theirs = create_block_mask(lambda b, h, q, kv: (kv <= q) & (documents[b, q] == documents[b, kv]),
                               documents.shape[0], None, seq, seq, device="cpu", BLOCK_SIZE=TILE)
    assert torch.equal(ours.to_dense(), theirs.to_dense())


@pytest.mark.numerics
@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")  # the reference, on purpose
@pytest.mark.parametrize("lengths, seq", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_flex_attention_over_the_block_mask_is_sdpa_with_the_dense_mask(lengths, seq):
    documents = _documents(lengths, seq)
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(documents.shape[0], 2, seq, 16, generator=generator) for _ in range(3))
    with torch.no_grad():  # FlexAttention has no backward on a CPU
        flex = flex_attention(q, k, v, block_mask=document_block_mask(documents))
    dense = F.scaled_dot_product_attention(q, k, v, attn_mask=document_mask(documents, documents, causal=True))
    assert (flex - dense).norm() / dense.norm() < 1e-5


def test_only_the_tiles_the_documents_leave_in_are_visited():
    seq = 4 * TILE
    # Documents exactly one tile long: each query tile sees its own tile only, and masked (causal).
    tiles_apart = document_block_mask(_documents([[TILE] * 4], seq))
    assert tiles_apart.kv_num_blocks.tolist() == [[[1, 1, 1, 1]]]
    assert tiles_apart.full_kv_num_blocks.tolist() == [[[0, 0, 0, 0]]]
    assert tiles_apart.kv_indices[0, 0, :, 0].tolist() == [0, 1, 2, 3]
    # One document: every earlier tile is full (no mask applied), the diagonal partial.
    whole = document_block_mask(_documents([[seq]], seq))
    assert whole.kv_num_blocks.tolist() == [[[1, 1, 1, 1]]]
    assert whole.full_kv_num_blocks.tolist() == [[[0, 1, 2, 3]]]
    # Documents of positions 0-137, 138-393 and 394-511: the second spans tiles 1 to 3, so tiles
    # 2 and 3 see tile 1 (partially) and not tile 0, which holds the first document only.
    crossing = document_block_mask(_documents([[TILE + 10, 2 * TILE, TILE - 10]], seq))
    visited = crossing.to_dense()[0, 0]
    assert visited.tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0], [0, 1, 1, 1]]


def test_the_cpu_keeps_sdpa_with_the_dense_mask():
    assert not uses_flex(torch.zeros(1, 1, 4, 16), 0.0)  # a CUDA tensor with dropout 0.0 is the GPU's case
    documents = _documents([[2, 2]], 4)
    q, k, v = (torch.randn(1, 1, 4, 16) for _ in range(3))
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=document_mask(documents, documents, causal=True))
    assert torch.equal(causal_attention(q, k, v, documents), expected)


def test_the_block_mask_and_flex_attention_compile_into_one_graph():
    """What a compiled block traces on a GPU: the block mask from the documents and the attention,
    with no graph break (fullgraph raises on one), forward only on a CPU."""
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    if not torch.cuda.is_available() and not pick_vec_isa():
        pytest.skip("Inductor compiles FlexAttention for a CPU only with a vector ISA (AVX2 or AVX-512), which "
                    "this CPU lacks or ATEN_CPU_CAPABILITY=default turns off")
    documents = _documents([[100, 200, 12], [312]], 312)
    compiled = torch.compile(flex_document_attention, fullgraph=True, dynamic=False)
    q, k, v = (torch.randn(2, 2, 312, 16) for _ in range(3))
    with torch.no_grad():
        out = compiled(q, k, v, documents)
    dense = F.scaled_dot_product_attention(q, k, v, attn_mask=document_mask(documents, documents, causal=True))
    assert (out - dense).norm() / dense.norm() < 1e-5
