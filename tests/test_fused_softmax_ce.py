"""The fused softmax and cross-entropy kernels against their references and torch's own.

Without a GPU the kernels run in Triton's interpreter, which must be chosen
before Triton is imported (``triton.jit`` picks it when it decorates), and is
slow: the shapes are tiny, and ``max_block`` is lowered so that a row of a
hundred elements already spans several blocks (the online two-pass path).
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

pytest.importorskip("triton", reason="the fused kernels are written in Triton")

import torch.nn.functional as F

from scaletrain.bench.softmax import format_table, run_cross_entropy, run_softmax
from scaletrain.config import Config
from scaletrain.kernels.cross_entropy import (
    cross_entropy,
    cross_entropy_reference,
    fused_linear_cross_entropy,
    fused_linear_cross_entropy_reference,
)
from scaletrain.kernels.head_loss import chunk_rows
from scaletrain.kernels.softmax import softmax, softmax_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# bf16 keeps 8 bits of mantissa: a result rounded to it is off by up to 2^-8 relative.
TOLERANCE = {torch.float32: {"atol": 1e-6, "rtol": 1e-5}, torch.bfloat16: {"atol": 1e-2, "rtol": 1e-2}}


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().requires_grad_()


def _close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    torch.testing.assert_close(actual.float(), expected.float(), **TOLERANCE[dtype])


# -- softmax -------------------------------------------------------------------

@pytest.mark.parametrize(("shape", "max_block", "dtype"), [
    ((3, 5, 37), 8192, torch.float32),    # one block, rows not a power of two
    ((4, 100), 16, torch.float32),        # seven blocks, the last one partial
    ((4, 100), 32, torch.bfloat16),
    ((2, 64), 64, torch.float32),         # exactly one full block
])
def test_softmax_matches_torch_and_reference(shape, max_block, dtype):
    generator = torch.Generator().manual_seed(0)
    x = (3 * torch.randn(shape, generator=generator)).to(DEVICE, dtype).requires_grad_()
    dy = torch.randn(shape, generator=generator).to(DEVICE, dtype)
    ours = softmax(x, max_block=max_block)
    ours.backward(dy)
    x_torch = _leaf(x)
    theirs = F.softmax(x_torch.float(), dim=-1)
    theirs.backward(dy.float())
    assert ours.dtype == dtype and x.grad.dtype == dtype
    _close(ours, theirs, dtype)
    _close(x.grad, x_torch.grad, dtype)
    _close(softmax_reference(x.detach()), theirs, dtype)


def test_softmax_of_another_dim_and_of_masked_rows():
    x = torch.randn(3, 4, 5, device=DEVICE)
    torch.testing.assert_close(softmax(x, dim=1), F.softmax(x, dim=1))
    # -inf in whole leading blocks (a masked prefix) must not poison the running sum
    x = torch.full((2, 40), float("-inf"), device=DEVICE)
    x[:, 30:] = torch.randn(2, 10, device=DEVICE)
    torch.testing.assert_close(softmax(x, max_block=8), F.softmax(x, dim=-1))


# -- cross-entropy on given logits -------------------------------------------

@pytest.mark.parametrize(("n", "vocab", "max_block", "dtype"), [
    (6, 100, 32, torch.float32),      # 100 words: four blocks, the last partial
    (5, 37, 4096, torch.float32),     # one block
    (6, 100, 32, torch.bfloat16),
])
def test_cross_entropy_matches_torch_and_reference(n, vocab, max_block, dtype):
    generator = torch.Generator().manual_seed(1)
    logits = (4 * torch.randn(n, vocab, generator=generator)).to(DEVICE, dtype).requires_grad_()
    targets = torch.randint(0, vocab, (n,), generator=generator).to(DEVICE)
    loss = cross_entropy(logits, targets, max_block=max_block)
    (3 * loss).backward()
    theirs_logits = _leaf(logits)
    theirs = F.cross_entropy(theirs_logits.float(), targets)
    (3 * theirs).backward()
    assert loss.dtype == torch.float32 and logits.grad.dtype == dtype
    torch.testing.assert_close(loss, theirs, atol=1e-5, rtol=1e-5)  # the sums are fp32 whatever the input
    _close(logits.grad, theirs_logits.grad, dtype)
    torch.testing.assert_close(cross_entropy_reference(logits.detach(), targets), theirs, atol=1e-5, rtol=1e-5)


def test_cross_entropy_in_place_writes_the_gradient_over_the_logits():
    logits = torch.randn(4, 50, device=DEVICE)
    targets = torch.randint(0, 50, (4,), device=DEVICE)
    expected = torch.softmax(logits, dim=-1)
    expected[torch.arange(4), targets] -= 1
    scratch = _leaf(logits)
    cross_entropy(scratch, targets, inplace=True, max_block=16).backward()
    torch.testing.assert_close(scratch.grad, expected / 4)
    assert torch.equal(scratch.detach(), scratch.grad)  # the logits are gone, the gradient in their place


# -- the fused head + cross-entropy, in chunks ----------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_linear_cross_entropy_matches_autograd_for_any_chunking(dtype):
    n, d, vocab = 10, 8, 37
    generator = torch.Generator().manual_seed(2)
    hidden = torch.randn(n, d, generator=generator).to(DEVICE, dtype)
    weight = torch.randn(vocab, d, generator=generator).to(DEVICE, dtype)
    targets = torch.randint(0, vocab, (n,), generator=generator).to(DEVICE)
    h, w = _leaf(hidden), _leaf(weight)
    expected = F.cross_entropy((h @ w.T).float(), targets)
    (2 * expected).backward()
    torch.testing.assert_close(fused_linear_cross_entropy_reference(hidden, weight, targets), expected)
    results = []
    for rows in (None, 1, 3, 10, 16):  # one row, uneven chunks, all rows, more than all
        h_ours, w_ours = _leaf(hidden), _leaf(weight)
        loss = fused_linear_cross_entropy(h_ours, w_ours, targets, chunk_rows=rows, max_block=16)
        (2 * loss).backward()
        torch.testing.assert_close(loss, expected, atol=1e-5, rtol=1e-5)
        _close(h_ours.grad, h.grad, dtype)
        _close(w_ours.grad, w.grad, dtype)
        assert h_ours.grad.dtype == dtype and w_ours.grad.dtype == dtype
        results.append((loss, h_ours.grad, w_ours.grad))
    for loss, grad_h, grad_w in results[1:]:  # chunking changes only the order of fp32 sums
        torch.testing.assert_close(loss, results[0][0], atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(grad_h, results[0][1], **TOLERANCE[dtype])
        torch.testing.assert_close(grad_w, results[0][2], **TOLERANCE[dtype])


def test_fused_linear_cross_entropy_takes_batch_dims_and_follows_autocast():
    generator = torch.Generator().manual_seed(3)
    hidden = torch.randn(2, 3, 8, generator=generator).to(DEVICE)
    weight = _leaf(torch.randn(29, 8, generator=generator).to(DEVICE))
    targets = torch.randint(0, 29, (2, 3), generator=generator).to(DEVICE)
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        loss = fused_linear_cross_entropy(hidden, weight, targets, chunk_rows=4)
        expected = F.cross_entropy((hidden @ weight.detach().T).float().flatten(0, 1), targets.flatten())
    loss.backward()
    assert weight.grad.dtype == torch.float32
    torch.testing.assert_close(loss, expected, atol=1e-5, rtol=1e-5)  # both from the same bf16 logits


def test_without_grad_mode_no_gradient_is_computed():
    hidden, weight = torch.randn(4, 8, device=DEVICE), torch.randn(16, 8, device=DEVICE, requires_grad=True)
    targets = torch.randint(0, 16, (4,), device=DEVICE)
    with torch.no_grad():
        loss = fused_linear_cross_entropy(hidden, weight, targets)
        logits = hidden @ weight.T
        before = logits.clone()
        cross_entropy(logits, targets, inplace=True)
    assert not loss.requires_grad
    torch.testing.assert_close(loss, F.cross_entropy(hidden @ weight.detach().T, targets))
    assert torch.equal(logits, before)  # not overwritten by a gradient nobody asked for


def test_default_chunk_holds_at_least_2048_rows_else_about_as_much_as_the_hidden_states():
    assert chunk_rows(8192, 768, 50304) == 2048           # 8192 / ceil(50304 / 768) = 124 rows: the floor
    assert chunk_rows(131072, 4096, 32000) == 16384       # 131072 / ceil(32000 / 4096) = 16384: as large as [N, d]
    assert chunk_rows(100000, 4096, 32000) == 16384       # 12500, up to a power of two
    assert chunk_rows(4, 768, 100) == 4                   # never more rows than there are


# -- the benchmark, as a functional run in the interpreter ----------------------

@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreted path of the bench is for CPU")
def test_benches_run_interpreted_on_tiny_shapes():
    cfg = Config().replace(steps=2)
    for run in (run_softmax, run_cross_entropy):
        result = run(cfg, warmup=1)
        assert result["interpreted"] is True
        assert result["ours"]["median_s"] > 0 and result["peer"]["median_s"] > 0
        assert result["ratio"] == pytest.approx(result["ours"]["median_s"] / result["peer"]["median_s"])
        assert result["max_abs_diff"] < 1e-4
        assert "interpreted" in format_table(result)


def test_ignored_targets_add_nothing_to_the_loss_nor_the_gradient():
    """IGNORE_INDEX rows (prompt tokens, padding): loss 0 and gradient 0, still counted in the mean's N,
    as the trainer's loss is (train/layout.py): the kernel, the fused head, and the reference agree."""
    n, d, vocab = 8, 6, 29
    generator = torch.Generator().manual_seed(5)
    hidden = torch.randn(n, d, generator=generator).to(DEVICE)
    weight = torch.randn(vocab, d, generator=generator).to(DEVICE)
    targets = torch.randint(0, vocab, (n,), generator=generator).to(DEVICE)
    targets[[1, 4, 5]] = -100
    h, w = _leaf(hidden), _leaf(weight)
    expected = F.cross_entropy((h @ w.T).float(), targets, ignore_index=-100, reduction="sum") / n
    expected.backward()
    logits = _leaf(hidden @ weight.T)
    loss = cross_entropy(logits, targets, max_block=16)
    loss.backward()
    torch.testing.assert_close(loss, expected, atol=1e-6, rtol=1e-5)
    assert logits.grad[[1, 4, 5]].abs().max() == 0
    torch.testing.assert_close(cross_entropy_reference(hidden @ weight.T, targets), expected, atol=1e-6, rtol=1e-5)
    h_ours, w_ours = _leaf(hidden), _leaf(weight)
    fused = fused_linear_cross_entropy(h_ours, w_ours, targets, chunk_rows=3, max_block=16)
    fused.backward()
    torch.testing.assert_close(fused, expected, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(h_ours.grad, h.grad, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(w_ours.grad, w.grad, atol=1e-6, rtol=1e-5)
