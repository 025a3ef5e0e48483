"""BatchNorm under data parallelism (parallel/batchnorm.py): with ``sync_batchnorm=True`` a
layout trains as one process with the global batch; with or without it, every rank and every
checkpoint holds one set of running statistics, rank 0's; the synchronized layer's math against
torch's BatchNorm on the whole batch; the refusal of a model without BatchNorm."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import scaletrain
from scaletrain import UserError
from scaletrain.parallel.batchnorm import SyncedBatchNorm
from scaletrain.runtime import Comm, Mesh, ParallelDims
from scaletrain.runtime.spawn import spawn_local
from scaletrain.train import checkpoint as ckpt
from tests.distributed import run_distributed


def cnn() -> nn.Module:
    """Two convolutions with BatchNorm2d (the second's momentum None: a cumulative average), a
    linear layer with BatchNorm1d, and the classifier. No bias before a BatchNorm, which would
    subtract it again: its gradient would be rounding noise, which AdamW's steps magnify."""
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
        nn.Conv2d(8, 8, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(8, momentum=None), nn.ReLU(),
        nn.Flatten(), nn.Linear(8 * 4 * 4, 16, bias=False), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))


def image_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    return torch.randn(16, 3, 8, 8, generator=generator) * 2 + 1, torch.randint(0, 4, (16,), generator=generator)


def mean_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, targets)


# -- (a) a layout with synchronized statistics is one process with the global batch ----------------
@pytest.mark.parametrize("options", [dict(), pytest.param(dict(grad_accum=2), marks=pytest.mark.slow),
                                     pytest.param(dict(zero=3), marks=pytest.mark.slow)])
def test_synced_batchnorm_under_dp_matches_one_process(options):
    report = scaletrain.check_parity(cnn, image_batch, mean_cross_entropy, nproc=2, steps=3, lr=0.05,
                                     warmup_steps=1, sync_batchnorm=True, **options)
    assert report.passed, scaletrain.format_parity(report)


@pytest.mark.slow  # 14 s; the synced case runs by default
def test_without_sync_each_rank_normalizes_its_own_half():
    """Without sync_batchnorm each rank normalizes by its micro-batch's statistics: another
    function than one process's on the whole batch, so the same layout fails the rule."""
    report = scaletrain.check_parity(cnn, image_batch, mean_cross_entropy, nproc=2, steps=2, lr=0.05,
                                     warmup_steps=1)
    assert not report.passed
    assert abs(report.layout_losses[0] - report.reference_losses[0]) > 1e-3  # already the first forward


# -- (b) one set of running statistics, on every rank and in the checkpoint ---------------------
def _train_and_save(folder: str, sync_batchnorm: bool) -> tuple[dict, dict]:
    """Three steps on this rank's half of each global batch, then a checkpoint; the running
    statistics after the steps, and after the save."""
    torch.manual_seed(0)
    with scaletrain.setup(cnn(), lr=0.05, steps=3, warmup_steps=1, sync_batchnorm=sync_batchnorm) as engine:
        readers = engine.layout.replicas.batch
        for step in range(3):
            x, y = image_batch(step)
            half = x.shape[0] // readers.size
            rows = slice(readers.rank * half, (readers.rank + 1) * half)
            engine.train_step([(x[rows], y[rows])], mean_cross_entropy)
        trained = {name: buffer.clone() for name, buffer in engine.model.named_buffers()}
        engine.save(folder)
        saved = {name: buffer.clone() for name, buffer in engine.model.named_buffers()}
    return trained, saved


@pytest.mark.parametrize("sync_batchnorm", [False, True])
def test_every_rank_and_the_checkpoint_hold_rank_0s_running_statistics(tmp_path, sync_batchnorm):
    results = spawn_local(2, _train_and_save, (str(tmp_path), sync_batchnorm))
    (trained_0, saved_0), (trained_1, saved_1) = results[0], results[1]
    checkpoint = ckpt.read_model_tensors(ckpt.latest_checkpoint(Path(tmp_path)))
    assert len(saved_0) == 9  # running mean, variance and batch count of each of the three layers
    for name, buffer in saved_0.items():
        assert torch.equal(trained_1[name], trained_0[name]), f"{name} differs between the ranks after the steps"
        assert torch.equal(saved_1[name], buffer), f"{name} differs between the ranks"
        assert torch.equal(checkpoint[name], buffer), f"the checkpoint's {name} is not rank 0's"
    assert saved_0["1.num_batches_tracked"].item() == 3


# -- (c) the synchronized layer's math ------------------------------------------------------
def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30)).item()


def _against_one_device(rank: int, n: int) -> None:
    """Each case: the whole batch through torch's BatchNorm on this process, and this rank's rows
    (3 of 8 on rank 0, 5 on rank 1: unequal shares) through a SyncedBatchNorm over the two ranks,
    for two training steps and an eval forward."""
    group = Mesh.build(ParallelDims(dp=n), rank, n).group("dp")
    comm = Comm()
    cases = [(nn.BatchNorm2d(4), (8, 4, 5, 5)), (nn.BatchNorm1d(6, momentum=None), (8, 6, 7)),
             (nn.BatchNorm1d(6, affine=False), (8, 6)), (nn.BatchNorm3d(3, track_running_stats=False), (8, 3, 2, 3, 2))]
    rows = slice(0, 3) if rank == 0 else slice(3, 8)
    for reference, shape in cases:
        torch.manual_seed(0)  # the same on both ranks: the reference, the batches, the output gradients
        if reference.affine:
            nn.init.normal_(reference.weight, 1.0, 0.3)
            nn.init.normal_(reference.bias, 0.0, 0.3)
        synced = SyncedBatchNorm.taking_over(_copy(reference), comm, group)
        for _ in range(2):
            x = torch.randn(shape) * 3 + 2
            grad_out = torch.randn(shape)
            whole = x.clone().requires_grad_()
            expected = reference(whole)
            expected.backward(grad_out)
            mine = x[rows].clone().requires_grad_()
            out = synced(mine)
            out.backward(grad_out[rows])
            name = f"{type(reference).__name__}{tuple(shape)}"
            assert _relative(out, expected[rows]) < 1e-6, f"{name}: output"
            assert _relative(mine.grad, whole.grad[rows]) < 1e-6, f"{name}: input gradient"
            for param, ref_param in zip(synced.parameters(), reference.parameters()):
                summed = param.grad.clone()
                comm.all_reduce(summed, group)  # each rank's share of the gradient, as data parallelism sums it
                assert _relative(summed, ref_param.grad) < 1e-6, f"{name}: weight or bias gradient"
                param.grad, ref_param.grad = None, None
            for buffer, ref_buffer in zip(synced.buffers(), reference.buffers()):
                assert _relative(buffer, ref_buffer) < 1e-6, f"{name}: running statistics"
        if reference.track_running_stats:  # eval normalizes by them (without, by each rank's batch, as torch's)
            synced.eval()
            reference.eval()
            x = torch.randn(shape)
            with torch.no_grad():
                assert _relative(synced(x[rows]), reference(x)[rows]) < 1e-6, f"{name}: eval output"


def _copy(norm: nn.Module) -> nn.Module:
    """A copy of ``norm``: its own tensors, the same values."""
    copy = type(norm)(norm.num_features, momentum=norm.momentum, affine=norm.affine,
                      track_running_stats=norm.track_running_stats)
    copy.load_state_dict(norm.state_dict())
    return copy


def test_synced_batchnorm_on_two_ranks_is_torchs_on_the_whole_batch():
    run_distributed(_against_one_device, 2)


# -- (d) the refusal ---------------------------------------------------------------------------
def test_sync_batchnorm_without_batchnorm_is_refused():
    mlp = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    with pytest.raises(UserError, match=r"sync_batchnorm=True synchronizes BatchNorm statistics, but the model has "
                                        r"none; drop it\."):
        scaletrain.setup(mlp, sync_batchnorm=True)


def test_sync_batchnorm_beside_a_threaded_gradient_reduction_is_refused():
    with pytest.raises(UserError, match=r"sync_batchnorm=True all-reduces in backward on the ranks whose gradients "
                                        r"allreduce='ring' or compress reduce on a side thread"):
        scaletrain.setup(cnn(), sync_batchnorm=True, allreduce="ring")
