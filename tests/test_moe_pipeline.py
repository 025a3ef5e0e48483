"""Mixtures of experts inside pipeline stages: every schedule reproduces one device's training
(fp32, 1e-5 on losses, gradient norms and final weights), the routers' auxiliary losses joining
each stage's backward; expert parallelism inside the stages; the routers' record summed over the
stages; checkpoints of stages with experts resumed in other layouts; a user's model with
``scaletrain.MoE`` blocks through ``check_parity``.

Every parity run clips below the tiny model's gradient norm, so an auxiliary loss missing from a
stage's backward, or scaled other than one device scales it, changes the update within a step
(the router's gradient is where it shows first).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import scaletrain
from scaletrain import ModelPlan, StagePlan
from scaletrain.commands.parity import reference_config, run_parity
from scaletrain.config_checks import resolve_layout
from scaletrain.job.data_setup import prepare_data
from tests.distributed import run_distributed
from tests.trainers import build_trainer, train_and_save

CLIP = 0.5
MOE = dict(name="llama-tiny", moe_experts=4, moe_top_k=2)

LAYOUTS = {
    # two stages of one MoE block each, M = 4 micro-batches (2 x pp)
    "1f1b-capacity-z": (2, dict(pp=2, moe_capacity=1.0, moe_z_coef=1e-3)),
    "gpipe-every-2": (2, dict(pp=2, pp_schedule="gpipe", n_layers=4, moe_every=2)),
    "interleaved": (2, dict(pp=2, pp_schedule="interleaved", n_layers=4)),
    "zb-h1": (2, dict(pp=2, pp_schedule="zb-h1")),
    "pipedream-2bw": (2, dict(pp=2, pp_schedule="pipedream-2bw")),
    # the first stage holds no MoE layer (block 1 is the only one) and recomputes; two rounds a step
    "1f1b-recompute-accum": (2, dict(pp=2, n_layers=2, moe_every=2, recompute="full", microbatches=2,
                                     grad_accum=2)),
    # the all-to-alls over the ep group inside each stage
    "ep2-pp2": (4, dict(pp=2, ep=2, micro_batch=2)),
    "ep2-pp2-zb-h1": (4, dict(pp=2, ep=2, micro_batch=2, pp_schedule="zb-h1", moe_capacity=1.0)),
}
# In CI: 1F1B with capacity and the z-loss (tests/test_pipeline.py runs every schedule's
# runtime, and the auxiliary loss takes the same path through each); the rest under -m slow.
IN_CI = {"1f1b-capacity-z"}


@pytest.mark.numerics
@pytest.mark.parametrize("n,changes", [
    pytest.param(n, changes, id=name, marks=() if name in IN_CI else pytest.mark.slow)
    for name, (n, changes) in LAYOUTS.items()])
def test_experts_inside_stages_reproduce_single_device_training(tiny_cfg, n, changes):
    """scaletrain parity --nproc N --pp 2 --moe-experts 4: the layout against one device."""
    report = run_parity(tiny_cfg.replace(nproc=n, steps=3, grad_clip=CLIP, **MOE, **changes), tolerance=1e-5)
    assert report.passed, report.to_json()
    assert all(norm is None or norm > CLIP for norm in report.reference_grad_norms)  # clipping was active
    assert report.reference_losses[0] != report.reference_losses[-1]


def _records(rank: int, n: int, cfg, spec) -> list[dict]:
    trainer = build_trainer(rank, n, cfg, spec)
    return [trainer.train_step(step) for step in range(cfg.train.steps)]


def test_the_routers_record_sums_the_stages_as_one_device_counts(tiny_cfg):
    """moe_tokens, moe_dropped and moe_aux of a pipeline (each stage routing its own layers,
    assignments dropped at capacity) equal one device's with the same global batch, on every
    rank."""
    cfg, dims = resolve_layout(tiny_cfg.replace(nproc=2, pp=2, steps=2, n_layers=6, moe_every=2, moe_capacity=0.5,
                                                **MOE), 2)
    reference = reference_config(cfg, dims, Path(f"{cfg.run.out}-reference"))
    spec = prepare_data(cfg, Path(cfg.data.cache_dir))
    expected = run_distributed(_records, 1, reference, spec, timeout_s=120)[0]
    for records in run_distributed(_records, 2, cfg, spec, timeout_s=120):
        for got, want in zip(records, expected, strict=True):
            assert len(got["moe_tokens"]) == 3  # blocks 1, 3 and 5
            assert got["moe_tokens"] == want["moe_tokens"] and got["moe_dropped"] == want["moe_dropped"]
            assert got["moe_aux"] == pytest.approx(want["moe_aux"], rel=1e-5)
            assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
    assert 0 < expected[0]["moe_dropped"] < 1 and expected[0]["moe_aux"] > 0


RESHARD = {
    "pp2 to one process and to ep2": (
        dict(nproc=2, pp=2, microbatches=4),
        [dict(nproc=1, pp=1, microbatches=None, grad_accum=4),
         dict(nproc=2, pp=1, microbatches=None, ep=2, micro_batch=2, grad_accum=4)]),
    "ep2 pp2 to pp2 zb-h1": (
        dict(nproc=4, pp=2, ep=2, microbatches=4, micro_batch=2),
        [dict(nproc=2, ep=1, micro_batch=4, pp_schedule="zb-h1")]),
}


@pytest.mark.parametrize("saved,resumed", [
    pytest.param(*layouts, id=name, marks=() if name == "pp2 to one process and to ep2" else pytest.mark.slow)
    for name, layouts in RESHARD.items()])
def test_a_checkpoint_of_stages_with_experts_resumes_as_if_never_stopped(tiny_cfg, saved, resumed):
    """Saved after step 2 by the stages (each expert by the rank holding it), resumed in
    another layout: steps 3 and 4 equal the uninterrupted run's (fp32, 1e-5)."""
    base = tiny_cfg.replace(steps=4, grad_clip=CLIP, **MOE)
    cfg = base.replace(**saved)
    spec = prepare_data(cfg, Path(cfg.data.cache_dir))
    straight = run_distributed(train_and_save, cfg.parallel.nproc, cfg, spec, 2, timeout_s=300)[0]
    for layout in resumed:
        again = cfg.replace(**{"dp": None, "resume": True, **layout})
        losses = run_distributed(train_and_save, again.parallel.nproc, again, spec, None, timeout_s=300)[0]
        assert losses == pytest.approx(straight[2:], rel=1e-5), layout


# -- a user's model through the library ------------------------------------------------------


class ExpertBlock(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.moe = scaletrain.MoE(width, scaletrain.MoEConfig(experts=4, top_k=2, hidden=32, z_coef=1e-3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.moe(self.norm(x))


class ExpertStack(nn.Module):
    def __init__(self, vocab: int = 64, width: int = 16, layers: int = 2):
        super().__init__()
        self.tok = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(ExpertBlock(width) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(width), nn.Linear(width, vocab, bias=False)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.tok(ids)

    def unembed(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(x))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.unembed(x)


PLAN = ModelPlan(stages=StagePlan(stack="blocks", first=("tok",), last=("norm", "head"), enter="embed",
                                  leave="unembed"), width=16)


def token_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, 64, (8, 13), generator=torch.Generator().manual_seed(step))
    return tokens[:, :-1], tokens[:, 1:]


@pytest.mark.slow
def test_check_parity_of_a_users_experts_inside_stages():
    """scaletrain.check_parity with a plan that cuts a user's MoE blocks into two ZB-H1 stages."""
    report = scaletrain.check_parity(ExpertStack, token_batch, nproc=2, steps=2, lr=3e-3, warmup_steps=1, plan=PLAN,
                                     pp=2, pp_schedule="zb-h1", microbatches=4)
    assert report.passed, scaletrain.format_parity(report)
