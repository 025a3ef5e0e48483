"""Adafactor: factored state size, the paper's formulas, torch's implementation, training."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F

from scaletrain.models.gpt import GPT, GPTConfig
from scaletrain.optim.adafactor import Adafactor, build_adafactor
from scaletrain.optim.adamw import build_adamw


def _state_elements(optimizer: torch.optim.Optimizer, p: torch.Tensor) -> int:
    return sum(t.numel() for t in optimizer.state[p].values() if torch.is_tensor(t))


@pytest.mark.parametrize("beta1, extra", [(None, 0), (0.9, 48 * 80)])
def test_state_is_rows_plus_columns(beta1, extra):
    n, m = 48, 80
    w = torch.nn.Parameter(torch.randn(n, m))
    b = torch.nn.Parameter(torch.randn(n))
    opt = Adafactor([w, b], lr=1e-3, beta1=beta1)
    w.grad, b.grad = torch.randn(n, m), torch.randn(n)
    opt.step()
    # n row sums + m column sums + the step counter (+ the momentum when asked for).
    assert _state_elements(opt, w) == n + m + 1 + extra
    assert _state_elements(opt, b) == n + 1 + (n if beta1 is not None else 0)

    adamw = torch.optim.AdamW([w], lr=1e-3)
    adamw.step()
    assert _state_elements(adamw, w) == 2 * n * m + 1


def _paper_reference(x0: torch.Tensor, grads: list[torch.Tensor], *, lr: float, wd: float,
                     beta1: float | None, eps1: float = 1e-30) -> tuple[torch.Tensor, float]:
    """Algorithm 4 written out with the paper's ones-vectors, one trailing
    matrix at a time; returns the final X and the largest RMS(U_t) seen."""
    x = x0.clone()
    n, m = x.shape[-2:]
    ones_n, ones_m = torch.ones(n, 1, dtype=x.dtype), torch.ones(m, 1, dtype=x.dtype)
    r = torch.zeros(*x.shape[:-2], n, 1, dtype=x.dtype)
    c = torch.zeros(*x.shape[:-2], 1, m, dtype=x.dtype)
    mom = torch.zeros_like(x)
    max_rms = 0.0
    for t, g in enumerate(grads, start=1):
        beta2 = 1 - t ** -0.8
        u = torch.empty_like(x)
        for idx in itertools.product(*map(range, x.shape[:-2])):
            sq = g[idx] ** 2 + eps1 * ones_n @ ones_m.T
            r[idx] = beta2 * r[idx] + (1 - beta2) * sq @ ones_m
            c[idx] = beta2 * c[idx] + (1 - beta2) * ones_n.T @ sq
            v = r[idx] @ c[idx] / (ones_n.T @ r[idx])
            u[idx] = g[idx] / v.sqrt()
        rms = (u.pow(2).mean()).sqrt().item()
        max_rms = max(max_rms, rms)
        u = u / max(1.0, rms / 1.0)
        if beta1 is not None:
            mom = beta1 * mom + (1 - beta1) * u
            u = mom
        x = x * (1 - lr * wd) - lr * u
    return x, max_rms


@pytest.mark.parametrize("shape", [(5, 7), (3, 4, 6)])
@pytest.mark.parametrize("beta1", [None, 0.9])
def test_update_matches_the_papers_formulas(shape, beta1):
    gen = torch.Generator().manual_seed(0)
    x0 = torch.randn(shape, generator=gen, dtype=torch.float64)
    # Gradients whose scale jumps, so that a stale V makes RMS(U) exceed d and
    # the clipping branch is exercised.
    grads = [torch.randn(shape, generator=gen, dtype=torch.float64) * s for s in (0.1, 5.0, 1.0, 20.0)]
    lr, wd = 0.05, 0.1
    expected, max_rms = _paper_reference(x0, grads, lr=lr, wd=wd, beta1=beta1)
    assert max_rms > 1.2, "the gradients were meant to trigger update clipping"

    p = torch.nn.Parameter(x0.clone())
    opt = Adafactor([p], lr=lr, beta1=beta1, weight_decay=wd)
    for g in grads:
        p.grad = g.clone()
        opt.step()
        assert torch.equal(p.grad, g), "the optimizer must not write into the gradient"
    torch.testing.assert_close(p.detach(), expected, rtol=1e-12, atol=1e-12)


def test_vector_keeps_a_full_second_moment():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(6, generator=gen, dtype=torch.float64)
    grads = [torch.randn(6, generator=gen, dtype=torch.float64) for _ in range(3)]
    p = torch.nn.Parameter(x.clone())
    opt = Adafactor([p], lr=0.1)
    v = torch.zeros_like(x)
    for t, g in enumerate(grads, start=1):
        beta2 = 1 - t ** -0.8
        v = beta2 * v + (1 - beta2) * (g ** 2 + 1e-30)
        u = g / v.sqrt()
        x = x - 0.1 * u / max(1.0, u.pow(2).mean().sqrt().item())
        p.grad = g.clone()
        opt.step()
    torch.testing.assert_close(p.detach(), x, rtol=1e-12, atol=1e-12)


def test_relative_step_equals_torch_adafactor():
    """With the paper's relative step, eps1 = 1e-30 and lr <= 1/sqrt(t),
    torch.optim.Adafactor runs the same algorithm (see the module docstring)."""
    gen = torch.Generator().manual_seed(2)
    shapes = [(5, 7), (3, 4, 6), (9,)]
    init = [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]
    ours = [torch.nn.Parameter(x.clone()) for x in init]
    theirs = [torch.nn.Parameter(x.clone()) for x in init]
    lr, wd = 0.01, 0.2
    opt = Adafactor(ours, lr=lr, relative_step=True, weight_decay=wd)
    ref = torch.optim.Adafactor(theirs, lr=lr, eps=(1e-30, 1e-3), d=1.0, weight_decay=wd,
                                foreach=False)
    for step in range(6):
        scale = 10.0 ** (step % 3 - 1)
        for a, b in zip(ours, theirs):
            g = torch.randn(a.shape, generator=gen, dtype=torch.float64) * scale
            a.grad, b.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
        for a, b in zip(ours, theirs):
            torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-12, atol=1e-12)
    # Same statistics too: torch keeps means where the paper keeps sums.
    a, b = ours[0], theirs[0]
    torch.testing.assert_close(opt.state[a]["row"], ref.state[b]["row_var"].squeeze(-1) * 7)
    torch.testing.assert_close(opt.state[a]["col"], ref.state[b]["col_var"].squeeze(-2) * 5)


def test_relative_step_differs_from_absolute():
    """relative_step scales lr by RMS(X): a parameter of RMS 10 moves 10x as far."""
    steps = {}
    for relative in (False, True):
        p = torch.nn.Parameter(torch.full((4, 4), 10.0, dtype=torch.float64))
        opt = Adafactor([p], lr=0.01, relative_step=relative)
        p.grad = torch.ones(4, 4, dtype=torch.float64)
        opt.step()
        steps[relative] = (10.0 - p.detach()).mean().item()
    assert steps[False] == pytest.approx(0.01)
    assert steps[True] == pytest.approx(0.1)


_CFG = GPTConfig(vocab_size=64, seq_len=32, n_layers=2, n_heads=4, d_model=64)
_PERIOD = 8


def _repeating_batch(gen: torch.Generator, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random 8-token patterns repeated: every token after the first period is
    the one 8 places back, a pattern a 2-layer GPT learns in ~100 steps."""
    pattern = torch.randint(0, _CFG.vocab_size, (batch, _PERIOD), generator=gen)
    seq = pattern.repeat(1, _CFG.seq_len // _PERIOD + 1)[:, :_CFG.seq_len + 1]
    return seq[:, :-1], seq[:, 1:]


def _train(build, steps: int = 100) -> float:
    """Loss on the predictable positions of held-out sequences after training."""
    torch.manual_seed(0)
    model = GPT(_CFG)
    opt = build(model)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x, y = _repeating_batch(gen, 32)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    x, y = _repeating_batch(torch.Generator().manual_seed(99), 256)
    with torch.no_grad():
        logits = model(x)[:, _PERIOD:]
    return F.cross_entropy(logits.flatten(0, 1), y[:, _PERIOD:].flatten()).item()


@pytest.mark.slow  # 25 s of training
def test_trains_a_gpt_about_as_well_as_adamw():
    adamw = _train(lambda m: build_adamw(m, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.0))
    adafactor = _train(lambda m: build_adafactor(m, lr=1e-2, weight_decay=0.0))
    chance = math.log(_CFG.vocab_size)  # 4.16
    # Measured: AdamW ~0.013, Adafactor (no momentum) ~0.044.
    assert adamw < 0.1
    assert adafactor < 0.1 * chance
    assert adafactor - adamw < 0.1, (adafactor, adamw)


def test_build_adafactor_uses_decay_groups():
    model = GPT(_CFG)
    opt = build_adafactor(model, lr=1e-3, weight_decay=0.1)
    matrices, vectors = opt.param_groups
    assert matrices["weight_decay"] == 0.1 and vectors["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in matrices["params"])
    assert all(p.dim() < 2 for p in vectors["params"])
    assert not opt.defaults["relative_step"] and opt.defaults["beta1"] is None
