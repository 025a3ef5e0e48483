"""Pure bf16 (--masters none) and its stochastically rounded update (optim/stochastic_rounding.py):
the rounding's expectation, small updates that survive it, the bytes, replicas kept equal,
an exact resume, and bad combinations refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from scaletrain.data import ByteTokenizer
from scaletrain.config_checks import check_values
from scaletrain.errors import UserError
from scaletrain.job.data_setup import prepare_data
from scaletrain.models import build_model
from scaletrain.optim.stochastic_rounding import StochasticRounding, round_stochastically
from tests.distributed import run_distributed
from tests.trainers import build_trainer, losses_of_run

PURE = dict(precision="bf16", param_dtype="bf16", reduce_dtype="bf16", masters="none")


def test_rounding_picks_a_neighbour_with_the_probability_that_makes_it_unbiased():
    lo = torch.tensor(1.0)
    hi = torch.nextafter(lo.bfloat16(), torch.tensor(2.0).bfloat16()).float()  # 1 + 2^-7
    x = torch.full((200_000,), float(lo + 0.3 * (hi - lo)))
    rounded = round_stochastically(x, torch.Generator().manual_seed(0)).float()
    assert set(rounded.unique().tolist()) == {lo.item(), hi.item()}
    assert (rounded == hi).float().mean().item() == pytest.approx(0.3, abs=0.01)
    exact = torch.tensor([1.0, -2.5, 0.0, 3.140625])  # already bf16 values: kept as they are
    assert torch.equal(round_stochastically(exact, torch.Generator()).float(), exact)


def _descend(rounding: bool, steps: int = 200) -> float:
    """SGD on a bf16 weight of 1 whose every update (1e-3) is under half bf16's spacing there."""
    weight = torch.nn.Parameter(torch.ones(4096, dtype=torch.bfloat16))
    optimizer = torch.optim.SGD([weight], lr=1e-3, momentum=0.0)
    stepper = StochasticRounding(optimizer, seed=0) if rounding else optimizer
    for step in range(steps):
        weight.grad = torch.ones_like(weight)
        (stepper.at(step) if rounding else stepper).step()
    return weight.float().mean().item()


def test_small_updates_vanish_rounded_to_nearest_and_survive_rounded_at_random():
    assert _descend(rounding=False) == 1.0  # 1 - 1e-3 rounds back to 1, every step
    assert _descend(rounding=True) == pytest.approx(1 - 200 * 1e-3, abs=0.01)  # fp32's answer, in expectation


def test_pure_bf16_keeps_weights_gradients_and_adamw_state_in_bf16(tiny_cfg):
    from scaletrain.commands.train import launch

    summary = launch(tiny_cfg.replace(report_memory=True, steps=3, **PURE))
    ledger = json.loads((summary.run_dir / "memory.json").read_text())["0"]
    params = list(build_model(tiny_cfg.model, vocab_size=ByteTokenizer().vocab_size, seq_len=tiny_cfg.data.seq_len).parameters())
    numel = sum(p.numel() for p in params)
    assert ledger["params"] == 2 * numel and ledger["grads"] == 2 * numel
    assert ledger["optimizer"] == 4 * numel + 4 * len(params)  # two bf16 moments, an fp32 step counter each
    losses = [json.loads(line)["loss"] for line in (summary.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert losses[-1] < losses[0]


def _replicated_weights_after_steps(rank: int, n: int, cfg, spec) -> list[torch.Tensor]:
    """The weights every rank holds whole (under tp: the norms), after the run's steps."""
    trainer = build_trainer(rank, n, cfg, spec)
    for step in range(cfg.train.steps):
        trainer.train_step(step)
    split = trainer.layout.tensor_parallel.splits if trainer.layout.tensor_parallel else {}
    return [p.detach().float() for p in trainer.layout.model.parameters() if p not in split]


@pytest.mark.parametrize("layout", [dict(dp=2, micro_batch=2), dict(tp=2)], ids=["dp2", "tp2"])
def test_replicas_draw_the_same_rounding_and_stay_equal(tiny_cfg, layout):
    cfg = tiny_cfg.replace(nproc=2, stochastic_rounding=True, **PURE, **layout)
    spec = prepare_data(cfg, Path(cfg.data.cache_dir))
    first, second = run_distributed(_replicated_weights_after_steps, 2, cfg, spec, timeout_s=120)
    assert first and all(torch.equal(a, b) for a, b in zip(first, second))


def test_a_rounded_run_resumes_exactly(tiny_cfg, tmp_path):
    cfg = tiny_cfg.replace(lr=3e-3, stochastic_rounding=True, **PURE)
    straight = losses_of_run(cfg, tmp_path / "straight")
    losses_of_run(cfg, tmp_path / "cut", stop_at=2)
    assert losses_of_run(cfg, tmp_path / "cut", resume=True) == straight


@pytest.mark.parametrize("changes, message", [
    (dict(masters="none"), "--masters none .* add --param-dtype bf16"),
    (dict(PURE, reduce_dtype="fp32"), "add --reduce-dtype bf16"),
    (dict(PURE, zero=2, offload="optimizer"), "--offload optimizer moves the optimizer's own copy .* --masters none"),
    (dict(stochastic_rounding=True), "--stochastic-rounding .* add --masters none"),
    (dict(PURE, stochastic_rounding=True, optimizer="adafactor"), "AdamW or SGD"),
])
def test_bad_combinations_are_refused_in_one_sentence(tiny_cfg, changes, message):
    with pytest.raises(UserError, match=message):
        check_values(tiny_cfg.replace(**changes))
