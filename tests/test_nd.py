"""N-D parallelism: dp x pp x tp on one mesh, with ZeRO inside dp and sp inside
tp, proven against one device; checkpoints that move between layouts; the
mesh's rank order; the one combination refused.

Every parity run clips (``--grad-clip 0.5`` is below the tiny model's gradient
norm), so a norm that counted a replicated, tied or sharded gradient twice, or
missed one, would change every step's update; parity also compares the norms.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from scaletrain.commands.cli import main
from scaletrain.commands.parity import run_parity
from scaletrain.job.data_setup import prepare_data
from scaletrain.models import build_model
from scaletrain.runtime.mesh import ParallelDims
from scaletrain.train import checkpoint as ckpt
from tests.distributed import run_distributed
from tests.trainers import build_trainer, train_and_save

CLIP = 0.5

# Eight ranks: each schedule over dp2 x pp2 x tp2, ZeRO-1 and ZeRO-2 with sp, dp4 x pp2, pp2 x tp4.
EIGHT = {
    "dp2-pp2-tp2-gpipe": dict(dp=2, pp=2, tp=2, pp_schedule="gpipe"),
    "dp2-pp2-tp2-1f1b-sp": dict(dp=2, pp=2, tp=2, pp_schedule="1f1b", sp=True),
    "dp2-pp2-tp2-interleaved-zero1": dict(dp=2, pp=2, tp=2, pp_schedule="interleaved", n_layers=4, zero=1),
    "dp2-pp2-tp2-zb-h1-sp-zero2": dict(dp=2, pp=2, tp=2, pp_schedule="zb-h1", sp=True, zero=2),
    "dp4-tp2-sp-zero1": dict(dp=4, tp=2, sp=True, zero=1, micro_batch=2),
    "dp4-tp2-sp-zero2": dict(dp=4, tp=2, sp=True, zero=2, micro_batch=2),
    "dp4-pp2": dict(dp=4, pp=2, micro_batch=2),
    "pp2-tp4-accum-recompute": dict(pp=2, tp=4, grad_accum=2, recompute="full"),
}
# Eight ranks are all under `pytest -m slow` (as are the README's eight-rank commands).
EIGHT_IN_CI: set[str] = set()

FOUR = {
    "pp2-tp2-sp-interleaved": dict(pp=2, tp=2, sp=True, pp_schedule="interleaved", n_layers=4),
    "dp2-tp2-sp-zero1": dict(dp=2, tp=2, sp=True, zero=1),
    "dp2-tp2-zero2-accum": dict(dp=2, tp=2, zero=2, grad_accum=2),
    "dp2-tp2-zero3": dict(dp=2, tp=2, zero=3),
    "dp2-pp2-zero1-offload": dict(dp=2, pp=2, zero=1, offload="optimizer", micro_batch=2),
    "dp2-pp2-zero2-interleaved": dict(dp=2, pp=2, zero=2, pp_schedule="interleaved", n_layers=4,
                                      micro_batch=2),
    # tp outermost, pp innermost: the groups follow the order, the result does not change.
    "pp2-tp2-zb-h1-reordered": dict(pp=2, tp=2, pp_schedule="zb-h1", mesh_order="tp,dp,ep,cp,pp"),
}
# Representative ones CI runs; the rest under `pytest -m slow`.
FOUR_IN_CI = {"dp2-pp2-zero2-interleaved", "dp2-tp2-zero3", "pp2-tp2-zb-h1-reordered"}


def _matrix(layouts: dict, in_ci: set[str], n: int) -> list:
    return [pytest.param(n, changes, id=name, marks=() if name in in_ci else pytest.mark.slow)
            for name, changes in layouts.items()]


# Not rerun on the portable kernels: each strategy composed here is, by the two-rank parity
# tests of its own file (test_dp_training, test_tensor, test_pipeline, test_zero,
# test_cp_moe_training), and composing them adds groups, not other reductions.
@pytest.mark.parametrize("n,changes", _matrix(EIGHT, EIGHT_IN_CI, 8) + _matrix(FOUR, FOUR_IN_CI, 4))
def test_layout_reproduces_single_device_training(tiny_cfg, n, changes):
    """scaletrain parity --nproc N with the layout: losses, gradient norms and final
    weights within 1e-5 of one device (fp32) with the same global batch."""
    report = run_parity(tiny_cfg.replace(nproc=n, steps=3, grad_clip=CLIP, **changes), tolerance=1e-5)
    assert report.passed, report.to_json()
    assert all(norm > CLIP for norm in report.reference_grad_norms)  # clipping was active
    assert report.reference_losses[0] != report.reference_losses[-1]


def test_the_rank_table_follows_the_mesh_order():
    """tp innermost by default (a tp group is consecutive ranks, one node); a reordered
    mesh puts pp innermost instead."""
    default = ParallelDims.infer(8, pp=2, tp=2)
    assert default.group_ranks("tp", 0) == [0, 1] and default.group_ranks("pp", 0) == [0, 2]
    assert default.group_ranks("dp", 0) == [0, 4]
    reordered = ParallelDims.infer(8, pp=2, tp=2, order=("tp", "dp", "ep", "cp", "pp"))
    assert reordered.group_ranks("pp", 0) == [0, 1] and reordered.group_ranks("tp", 0) == [0, 4]
    lines = reordered.layout_table().splitlines()
    assert lines[0].split() == ["rank", "tp", "dp", "ep", "cp", "pp"]
    assert lines[1 + 5].split() == ["5", "1", "0", "0", "0", "1"]


def _deferring(rank: int, n: int, cfg, spec) -> list[str]:
    trainer = build_trainer(rank, n, cfg, spec)
    return sorted(name for name, m in trainer.layout.model.named_modules() if getattr(m, "store", None) is not None
                  and m.store is trainer.layout.pipeline.store)


def test_zero_bubble_defers_the_tensor_parallel_layers_weight_gradients(tiny_cfg):
    """ZB-H1 over pp2 x tp2: every column and row layer of a rank's stage (the tied
    head's too) holds its weight gradient back for W, as a plain linear layer does."""
    cfg = tiny_cfg.replace(nproc=4, pp=2, tp=2, pp_schedule="zb-h1")
    spec = prepare_data(cfg, Path(cfg.data.cache_dir))
    first, _, last, _ = run_distributed(_deferring, 4, cfg, spec, timeout_s=120)
    layers = ["attn.proj", "attn.qkv", "mlp.fc", "mlp.proj"]
    # Both ends keep `head`, the first stage as the module naming its tied embedding (never run there).
    assert first == [f"blocks.0.{layer}" for layer in layers] + ["head"]
    assert last == [f"blocks.1.{layer}" for layer in layers] + ["head"]


# -- checkpoints between layouts ---------------------------------------------------------

# Layout A saves after step 2 of 4; layout B resumes from it. Each pair keeps the global batch
# (micro-batch x accumulation x micro-batches x dp) at 8 sequences.
RESHARD = {
    "dp2-tp2-sp-zero1 to pp2-tp2": (
        dict(nproc=4, dp=2, tp=2, sp=True, zero=1),
        dict(nproc=4, dp=1, pp=2, tp=2, microbatches=2)),
    "pp2-tp2 to dp4-zero2": (
        dict(nproc=4, pp=2, tp=2, microbatches=2),
        dict(nproc=4, dp=4, micro_batch=2, zero=2)),
    "dp2-pp2-zero2 to one process": (
        dict(nproc=4, dp=2, pp=2, zero=2, micro_batch=2, microbatches=2),
        dict(nproc=1, micro_batch=4, grad_accum=2)),
    "dp2-pp2-tp2-zero1 to dp2-tp2-zero3": (
        dict(nproc=8, dp=2, pp=2, tp=2, zero=1, micro_batch=2, microbatches=2),
        dict(nproc=4, dp=2, tp=2, zero=3, micro_batch=4)),
}
RESHARD_IN_CI = {"dp2-tp2-sp-zero1 to pp2-tp2", "dp2-pp2-zero2 to one process"}


def _run(cfg, spec, save_at):
    n = cfg.parallel.nproc
    return run_distributed(train_and_save, n, cfg, spec, save_at, timeout_s=300)[0]


@pytest.mark.numerics
@pytest.mark.parametrize("saved,resumed", [
    pytest.param(a, b, id=name, marks=() if name in RESHARD_IN_CI else pytest.mark.slow)
    for name, (a, b) in RESHARD.items()])
def test_a_checkpoint_resumes_in_another_layout_as_if_never_stopped(tiny_cfg, saved, resumed):
    """Saved under layout A after step 2 (weights and AdamW state as chunks of the full
    tensors), resumed under layout B: steps 3 and 4 equal the uninterrupted A run's
    (fp32, 1e-5), and the checkpoint exports as the tensors one device holds."""
    base = tiny_cfg.replace(steps=4, n_layers=4, grad_clip=CLIP)
    cfg = base.replace(**saved)
    spec = prepare_data(cfg, Path(cfg.data.cache_dir))
    straight = _run(cfg, spec, save_at=2)
    reference = base.replace(**{"nproc": 1, "dp": None, "tp": 1, "pp": 1, "sp": False, "zero": 0,
                                "microbatches": None, **resumed, "resume": True})
    again = _run(reference, spec, save_at=None)
    assert again == pytest.approx(straight[2:], rel=1e-5)

    checkpoint = Path(cfg.run.out) / "checkpoints" / "step_000002"
    target = Path(cfg.run.out).parent / "model.safetensors"
    assert main(["export", "--from", str(checkpoint), "--to", str(target)]) == 0
    model = build_model(cfg.model, vocab_size=spec.vocab_size, seq_len=cfg.data.seq_len)
    model.load_state_dict(load_file(target), strict=True)
    saved_tensors = ckpt.read_model_tensors(checkpoint)
    assert all(torch.equal(model.state_dict()[name], tensor) for name, tensor in saved_tensors.items())
