"""Packed rows: several documents in one sequence, each attending only to itself.

The block-diagonal causal mask and the restarting positions (models/decoder.py)
make a packed row compute what each document computes alone, on every
attention path: the models' own (GPT's learned positions, the Llama family's
rotary ones), ring attention under context parallelism (parallel/context.py),
and the loss the trainer takes over the trained tokens only.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from scaletrain.config import ModelConfig
from scaletrain.data.batches import IGNORE_INDEX
from scaletrain.models import build_model, spec_for
from scaletrain.models.decoder import (
    causal_attention,
    document_mask,
    document_positions,
)
from scaletrain.parallel.context import (
    parallelize_context,
    ring_attention,
    zigzag_positions,
)
from scaletrain.runtime import Comm, Mesh, ParallelDims
from scaletrain.train.layout import loss_fn
from tests.distributed import run_distributed

pytestmark = pytest.mark.numerics  # every comparison here is of floating-point results

SEQ = 16
LENGTHS = (5, 7, 1)  # three documents, then padding (a document of its own) to SEQ


def _documents(lengths: tuple[int, ...] = LENGTHS, seq: int = SEQ) -> torch.Tensor:
    ids = [d for d, n in enumerate(lengths) for _ in range(n)]
    return torch.tensor([ids + [len(lengths)] * (seq - len(ids))])


def test_positions_restart_with_each_document():
    docs = torch.tensor([[0, 0, 0, 1, 1, 2, 3, 3], [0, 1, 1, 1, 1, 1, 1, 2]])
    assert document_positions(docs).tolist() == [[0, 1, 2, 0, 1, 0, 0, 1], [0, 0, 1, 2, 3, 4, 5, 0]]


def test_mask_is_block_diagonal_and_causal():
    docs = torch.tensor([[0, 0, 1, 1, 1]])
    want = torch.tensor([[1, 0, 0, 0, 0],
                         [1, 1, 0, 0, 0],
                         [0, 0, 1, 0, 0],
                         [0, 0, 1, 1, 0],
                         [0, 0, 1, 1, 1]], dtype=torch.bool)
    assert torch.equal(document_mask(docs, docs, causal=True)[0, 0], want)


def _model(name: str):
    torch.manual_seed(0)
    model = build_model(ModelConfig(name=name), vocab_size=61, seq_len=SEQ)
    return model.eval()


@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny"])
def test_a_packed_row_computes_each_document_alone(name):
    model = _model(name)
    generator = torch.Generator().manual_seed(1)
    pieces = [torch.randint(0, 61, (1, n), generator=generator) for n in LENGTHS]
    row = torch.cat([*pieces, torch.zeros(1, SEQ - sum(LENGTHS), dtype=torch.long)], dim=1)
    packed = model(row, documents=_documents())
    start = 0
    for piece in pieces:
        alone = model(piece)
        torch.testing.assert_close(packed[:, start:start + piece.shape[1]], alone, rtol=1e-5, atol=1e-5)
        start += piece.shape[1]


def _examples(generator: torch.Generator) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(inputs, targets) pairs of three examples, their prompts masked."""
    examples = []
    for n, prompt in ((5, 2), (6, 4), (3, 1)):
        tokens = torch.randint(0, 61, (n + 1,), generator=generator)
        targets = tokens[1:].clone()
        targets[:prompt] = IGNORE_INDEX
        examples.append((tokens[:-1], targets))
    return examples


@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny"])
def test_packed_loss_and_gradient_equal_the_unpacked_examples(name):
    """One packed row against the examples one by one, each padded to the row: the mean over
    the trained tokens (the trainer's normalization) and its gradient agree."""
    generator = torch.Generator().manual_seed(2)
    examples = _examples(generator)
    trained = sum(int((y != IGNORE_INDEX).sum()) for _, y in examples)

    packed_model, unpacked_model = _model(name), _model(name)
    lengths = tuple(len(x) for x, _ in examples)
    pad = SEQ - sum(lengths)
    x = torch.cat([e[0] for e in examples] + [torch.zeros(pad, dtype=torch.long)])[None]
    y = torch.cat([e[1] for e in examples] + [torch.full((pad,), IGNORE_INDEX)])[None]
    packed = loss_fn(packed_model(x, documents=_documents(lengths)), y) * y.numel() / trained
    packed.backward()

    unpacked = 0.0
    for inputs, targets in examples:
        padded_x = F.pad(inputs, (0, SEQ - len(inputs)))[None]
        padded_y = F.pad(targets, (0, SEQ - len(targets)), value=IGNORE_INDEX)[None]
        unpacked = unpacked + loss_fn(unpacked_model(padded_x), padded_y) * padded_y.numel() / trained
    unpacked.backward()

    torch.testing.assert_close(packed, unpacked, rtol=1e-5, atol=0)
    for (pname, p), q in zip(packed_model.named_parameters(), unpacked_model.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=pname)


def test_masked_targets_add_nothing_to_the_loss():
    logits = torch.randn(1, 4, 9)
    targets = torch.tensor([[3, IGNORE_INDEX, 5, IGNORE_INDEX]])
    want = F.cross_entropy(logits[0, [0, 2]], targets[0, [0, 2]], reduction="sum") / 4
    torch.testing.assert_close(loss_fn(logits, targets), want)


# -- ring attention with documents ---------------------------------------------------


def _ring_documents(seq: int) -> torch.Tensor:
    """Two rows cut unevenly, so documents straddle the zigzag chunks and ranks."""
    return torch.cat([_documents((3, 9, 2, 10), seq), _documents((1, 15, 6), seq)])


def _ring_run(rank: int, n: int) -> dict[str, float]:
    group, comm = Mesh.build(ParallelDims(cp=n), rank, n).group("cp"), Comm()
    seq = 32
    generator = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(2, 3, seq, 8, generator=generator) for _ in range(4))
    documents = _ring_documents(seq)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    want = causal_attention(*full, documents)
    want.backward(dout)
    positions = zigzag_positions(seq, n, rank)
    mine = [t[:, :, positions].clone().requires_grad_() for t in (q, k, v)]
    out = ring_attention(*mine, comm, group, documents)
    out.backward(dout[:, :, positions])
    diffs = {"out": (out - want[:, :, positions]).abs().max().item()}
    for name, got, whole in zip("qkv", mine, full):
        diffs["d" + name] = (got.grad - whole.grad[:, :, positions]).abs().max().item()
    return diffs


@pytest.mark.parametrize("n", [2, 4])
def test_ring_attention_keeps_each_document_apart(n):
    for diffs in run_distributed(_ring_run, n):
        assert max(diffs.values()) < 1e-5, diffs


def _cp_model_run(rank: int, n: int, name: str) -> float:
    model = _model(name)
    generator = torch.Generator().manual_seed(3)
    x = torch.randint(0, 61, (2, SEQ), generator=generator)
    documents = torch.cat([_documents((5, 7, 1)), _documents((2, 2, 9))])
    want = model(x, documents=documents)
    group, comm = Mesh.build(ParallelDims(cp=n), rank, n).group("cp"), Comm()
    cp = parallelize_context(model, comm, group, seq_len=SEQ, position_modules=spec_for(name).position_modules)
    got = model(cp.local(x), documents=documents)
    return (got - cp.local(want)).abs().max().item()


@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny"])
def test_a_model_split_along_packed_rows_matches_one_device(name):
    assert max(run_distributed(_cp_model_run, 2, name)) < 1e-5
