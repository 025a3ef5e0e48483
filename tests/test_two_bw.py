"""PipeDream-2BW: its never-drained steps as data, weight stashing (each micro-batch's forward
and backward on a stage run on one weight version), the 1-stale update against one device
running the same rule, and training beside 1F1B."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from scaletrain.commands.parity import run_parity
from scaletrain.config import Config
from scaletrain.job.data_setup import prepare_data
from scaletrain.parallel.pipeline.schedules import (
    bubble,
    bubble_formula,
    build,
    live_activations,
    simulate,
    two_bw_step,
)
from scaletrain.parallel.pipeline.two_bw import DelayedGradient
from tests.distributed import run_distributed
from tests.test_pipeline import _tied_weight_after_training
from tests.test_schedules import assert_receives_match_sends
from tests.trainers import build_trainer

SIZES = [(2, 2), (2, 5), (3, 3), (3, 7), (4, 4), (4, 8)]
STEPS = 4

# -- the schedule as data ------------------------------------------------------------------


@pytest.mark.parametrize("n,m", SIZES)
def test_each_micro_batch_is_forwarded_on_its_steps_version_and_backwarded_right_after_a_later_forward(n, m):
    """Over consecutive steps rank r forwards every micro-batch once, in step t those of version
    t, and backwards micro-batch j right after forwarding j + N-r-1: the backwards of a step belong
    to its own version or the one before, so two versions are in use at a time."""
    for r in range(n):
        lag = n - r - 1
        computed = [(t, a) for t in range(STEPS) for a in two_bw_step(n, m, t).compute(r)]
        order = [(a.kind, a.micro) for _, a in computed]
        assert [i for kind, i in order if kind == "F"] == list(range(STEPS * m))
        assert [i for kind, i in order if kind == "BW"] == list(range(STEPS * m - lag))
        for j in range(STEPS * m - lag):
            assert order.index(("BW", j)) == order.index(("F", j + lag)) + 1
        for t, a in computed:
            assert a.stage == r and a.micro // m in ((t,) if a.kind == "F" else (t - 1, t))


@pytest.mark.parametrize("n,m", SIZES)
def test_no_message_crosses_a_step_and_the_steps_respect_every_dependency(n, m):
    """Per step and pair of ranks, the receives are the sends in order (nothing is left in flight
    for the trainer's collectives between steps). Steps simulated one after the other, each after
    the step before has ended everywhere (those collectives), respect every dependency."""
    at, start = {}, 0.0
    for t in range(STEPS):
        schedule = two_bw_step(n, m, t)
        assert_receives_match_sends(schedule, n)
        spans = simulate(schedule)  # raises on a cycle of waits
        for rank in spans:
            for s in rank:
                at[s.action.kind, s.action.micro, s.action.stage] = (start + s.start, start + s.end)
        start += max(s.end for rank in spans for s in rank)
    for (kind, micro, stage), (begin, _) in at.items():
        needs = [("F", micro, stage - 1)] if kind == "F" and stage else []
        if kind == "BW":
            needs += [("F", micro, stage)] + ([("BW", micro, stage + 1)] if stage < n - 1 else [])
        assert all(at[need][1] <= begin for need in needs), (kind, micro, stage)


@pytest.mark.parametrize("n,m", SIZES)
def test_the_bubble_is_the_fill_alone_and_activations_as_1f1b(n, m):
    """(N-1) t_f idle per rank and step: (N-1)/(3M+N-1) for equal costs, below 1F1B's (N-1)/(M+N-1)."""
    steady = build("pipedream-2bw", n, m)
    assert bubble(simulate(steady)) == pytest.approx(bubble_formula("pipedream-2bw", n, m), abs=1e-12)
    assert bubble_formula("pipedream-2bw", n, m) == pytest.approx((n - 1) / (3 * m + n - 1))
    assert bubble_formula("pipedream-2bw", n, m) < bubble_formula("1f1b", n, m)
    assert [live_activations(steady.compute(r)) for r in range(n)] == [n - r for r in range(n)]


def test_fewer_micro_batches_than_stages_per_version_are_refused():
    with pytest.raises(ValueError, match="a third would still be in flight: choose --microbatches 4 or more, not 3"):
        build("pipedream-2bw", 4, 3)


# -- the 1-stale rule on one device ---------------------------------------------------------


def test_one_device_rule_steps_on_the_gradient_of_the_step_before():
    """W(t+1) = W(t) - lr g(t-1), each g(t) taken at W(t) on batch t, W(1) = W(0): by hand with SGD;
    and not the plain rule, which differs from the third step on."""
    torch.manual_seed(0)
    x, y = torch.randn(5, 8, 3), torch.randn(5, 8)

    def loss(w: torch.Tensor, t: int) -> torch.Tensor:
        return ((x[t] @ w - y[t]) ** 2).mean()

    w = torch.nn.Parameter(torch.randn(3))
    plain = w.detach().clone().requires_grad_(True)
    optimizer, plain_optimizer = torch.optim.SGD([w], lr=0.1), torch.optim.SGD([plain], lr=0.1)
    delayed = DelayedGradient([w])
    expected, held = w.detach().clone(), None
    for t in range(5):
        at = expected.clone().requires_grad_(True)
        grad = torch.autograd.grad(loss(at, t), at)[0]
        expected = expected if held is None else expected - 0.1 * held
        held = grad
        optimizer.zero_grad()
        loss(w, t).backward()
        if delayed.exchange(lambda p: p.grad):
            optimizer.step()
        plain_optimizer.zero_grad()
        loss(plain, t).backward()
        plain_optimizer.step()
        torch.testing.assert_close(w.detach(), expected, rtol=0, atol=1e-6)
    assert (w - plain).abs().max() > 1e-3


# -- a real pipeline: weight stashing, and training beside 1F1B ---------------------------------

TRAINED = 24  # steps of each schedule, two stages of gpt-tiny, M = 4


def _train_both(rank: int, n: int, cfg, spec) -> dict:
    """1F1B's losses, then 2BW's with every computation's weight version traced."""
    out = {}
    for schedule in ("1f1b", "pipedream-2bw"):
        trainer = build_trainer(rank, n, cfg.replace(pp_schedule=schedule), spec)
        if trainer.layout.pipeline.versions:
            trainer.layout.pipeline.versions.trace = []
        out[schedule] = [trainer.train_step(step) for step in range(cfg.train.steps)]
        out[f"{schedule} params bytes"] = trainer.layout.bytes_ledger()["params"]
    versions = trainer.layout.pipeline.versions
    newest = versions.buffers[max(versions.buffers)]
    return {**out, "trace": versions.trace, "kept": sorted(versions.buffers),
            "params_in_newest": all(p.data_ptr() == w.data_ptr() for p, w in zip(versions.params, newest))}


@pytest.fixture(scope="module")
def trained(corpus, tmp_path_factory) -> list[dict]:
    folder = tmp_path_factory.mktemp("two-bw")
    cfg = Config().replace(name="gpt-tiny", data=str(corpus), seq_len=32, micro_batch=4, steps=TRAINED,
                           warmup_steps=2, eval_every=0, eval_batches=1, sample_tokens=0, progress=False,
                           out=str(folder / "run"), cache_dir=str(folder / "cache"), nproc=2, pp=2)
    spec = prepare_data(cfg, Path(cfg.data.cache_dir))
    return run_distributed(_train_both, 2, cfg, spec, timeout_s=240)


def test_each_micro_batch_runs_forward_and_backward_on_one_version_and_two_are_kept(trained):
    """On both stages, the forward and the backward of every micro-batch record the version
    micro // M and the very same weights (a fingerprint of their values). Versions 0 and 1 are
    equal (W(1) = W(0)); each later one differs from the one before. A rank keeps exactly two
    versions, its parameters (what the optimizer and a checkpoint see) living in the newest: the
    memory ledger counts twice 1F1B's weights. The first step has no gradient to apply."""
    m = 4
    for rank, result in enumerate(trained):
        seen = {(kind, micro): (version, fingerprint) for kind, micro, _, version, fingerprint in result["trace"]}
        assert len(seen) == len(result["trace"])  # each computation once
        assert sorted(micro for kind, micro in seen if kind == "F") == list(range(TRAINED * m))
        lag = 1 - rank
        for micro in range(TRAINED * m - lag):
            assert seen["F", micro] == seen["BW", micro] and seen["F", micro][0] == micro // m
        by_version = {version: fingerprint for version, fingerprint in seen.values()}
        assert by_version[0] == by_version[1]
        assert all(by_version[v] != by_version[v + 1] for v in range(1, TRAINED - 1))
        assert result["kept"] == [TRAINED - 1, TRAINED] and result["params_in_newest"]
        assert result["pipedream-2bw params bytes"] == 2 * result["1f1b params bytes"]  # the memory ledger's
        norms = [record["grad_norm"] for record in result["pipedream-2bw"]]
        assert norms[0] is None and None not in norms[1:]


def test_2bw_converges_about_as_1f1b_does(trained):
    """The same steps from the same weights: the stale update lags, but the loss falls by at
    least 60% as much as under 1F1B (docs/pipeline-parallel.md has longer runs)."""
    losses = {s: [record["loss"] for record in trained[0][s]] for s in ("1f1b", "pipedream-2bw")}
    first = losses["1f1b"][0]
    assert losses["pipedream-2bw"][0] == first  # the same weights and batch before any update
    drop = {s: first - sum(curve[-4:]) / 4 for s, curve in losses.items()}
    assert drop["1f1b"] > 1.0 and drop["pipedream-2bw"] > 0.6 * drop["1f1b"]


# -- the update rule: one device running the same delayed update -------------------------------


@pytest.mark.numerics
@pytest.mark.parametrize("n,changes", [
    (2, {}),
    pytest.param(4, {"n_layers": 4, "microbatches": 4}, marks=pytest.mark.slow),
    pytest.param(2, {"microbatches": 3, "recompute": "full", "pp_balance": "time"}, marks=pytest.mark.slow),
    pytest.param(2, {"offload": "optimizer", "eval_every": 2}, marks=pytest.mark.slow),
], ids=["pp2", "pp4-m4", "recompute-timed-cuts-m3", "offload-eval"])
def test_2bw_equals_one_device_running_the_same_1_stale_update(tiny_cfg, n, changes):
    """scaletrain parity --nproc N --pp N --pp-schedule pipedream-2bw: losses, gradient norms and
    final weights within 1e-5 (fp32) of one process applying each step the gradient of the step
    before (M = 2N micro-batches as accumulation steps)."""
    report = run_parity(tiny_cfg.replace(nproc=n, pp=n, pp_schedule="pipedream-2bw", steps=STEPS, **changes),
                        tolerance=1e-5)
    assert report.passed, report.to_json()
    assert report.layout_grad_norms[0] is None and report.reference_losses[0] != report.reference_losses[-1]


@pytest.mark.slow
@pytest.mark.parametrize("changes", [
    dict(nproc=4, dp=2, micro_batch=2), dict(nproc=4, tp=2, sp=True), dict(nproc=4, cp=2), dict(nproc=2, compile=True),
], ids=["dp2", "tp2-sp", "cp2", "compile"])
def test_2bw_composes(tiny_cfg, changes):
    """Two stages of 2BW with two data-parallel replicas (each version's gradient averaged over
    dp), tensor and sequence parallelism, ring attention, or compiled blocks (which see each
    version's weights: a compiled block that kept the parameters would mix two versions'
    gradients and fail)."""
    report = run_parity(tiny_cfg.replace(pp=2, pp_schedule="pipedream-2bw", steps=STEPS, **changes),
                        tolerance=1e-5)
    assert report.passed, report.to_json()


@pytest.mark.slow
def test_bf16_working_weights_keep_the_tied_copies_one_weight(tiny_cfg):
    """bf16 weights with fp32 masters: after three steps (two updates) the first stage's embedding
    and the last stage's head are still bitwise equal."""
    cfg = tiny_cfg.replace(nproc=2, pp=2, pp_schedule="pipedream-2bw", steps=3, precision="bf16",
                           param_dtype="bf16")
    spec = prepare_data(cfg, Path(cfg.data.cache_dir))
    first, last = run_distributed(_tied_weight_after_training, 2, cfg, spec, timeout_s=120)
    assert first.dtype == torch.bfloat16 and torch.equal(first, last)
