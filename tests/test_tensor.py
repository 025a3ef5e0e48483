"""Tensor and sequence parallelism: parity with one device, gradients tensor by
tensor, the vocabulary-parallel loss, the communication and activation-memory
formulas, dropout streams, and checkpoints read back by other layouts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from scaletrain.commands.parity import run_parity
from scaletrain.job.data_setup import prepare_data
from scaletrain.models.gpt import GPT, GPTConfig
from scaletrain.models.gpt_spec import TENSOR_PLAN as GPT_PLAN
from scaletrain.parallel.tensor import (
    RegionRNG,
    Split,
    parallelize_tensor,
    split_sizes,
)
from scaletrain.runtime import Comm, Mesh, ParallelDims
from scaletrain.train.layout import loss_fn
from scaletrain.train.memory import ActivationMeter
from tests.distributed import run_distributed
from tests.trainers import build_trainer, train_and_save

# b, s, h, a, vocabulary, layers of the models built directly here
B, S, H, A, V = 2, 32, 64, 4, 256


def _gpt(layers: int = 2, vocab: int = V, dropout: float = 0.0) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=vocab, seq_len=S, n_layers=layers, n_heads=A, d_model=H, dropout=dropout))


def _batch(vocab: int = V) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return (torch.randint(0, vocab, (B, S), generator=generator),
            torch.randint(0, vocab, (B, S), generator=generator))


def _split_gpt(rank: int, n: int, *, sp: bool, layers: int = 2, vocab: int = V, dropout: float = 0.0):
    model = _gpt(layers, vocab, dropout)
    comm = Comm()
    tp = parallelize_tensor(model, GPT_PLAN, comm, Mesh.build(ParallelDims(tp=n), rank, n).group("tp"),
                            sequence_parallel=sp, dropout=dropout)
    return model, tp, comm


# -- the split ------------------------------------------------------------------


def test_splits_cover_the_full_tensor_once():
    """Every rank's pieces of a weight, put back at their offsets, rebuild it exactly:
    qkv's three blocks each split, a row split, an uneven vocabulary split."""
    full = torch.arange(12 * 6, dtype=torch.float32).view(12, 6)
    for split in (Split((12, 6), 0, 3, split_sizes(4, 2)), Split((12, 6), 1, 1, split_sizes(6, 3)),
                  Split((12, 6), 0, 1, split_sizes(12, 5))):
        rebuilt = torch.full_like(full, -1.0)
        for rank in range(len(split.sizes)):
            local = split.local(full, rank)
            for offsets, sizes, start in split.chunks(rank):
                region = tuple(slice(o, o + n) for o, n in zip(offsets, sizes))
                assert (rebuilt[region] == -1).all(), "pieces overlap"
                rebuilt[region] = local.narrow(split.dim, start, sizes[split.dim])
        assert torch.equal(rebuilt, full)
    assert split_sizes(10, 4) == (3, 3, 2, 2)


# -- gradients and the loss -------------------------------------------------------


def _gradients(rank: int, n: int, sp: bool) -> dict[str, float]:
    full = _gpt()
    model, tp, _ = _split_gpt(rank, n, sp=sp)
    x, y = _batch()
    reference, loss = loss_fn(full(x), y), tp.loss(model(x), y)
    reference.backward()
    loss.backward()
    diffs = {"loss": abs(loss.item() - reference.item()) / reference.item()}
    whole = dict(full.named_parameters())
    for name, p in model.named_parameters():
        split = tp.splits.get(p)
        want = split.local(whole[name].grad, rank) if split else whole[name].grad
        diffs[name] = ((p.grad - want).norm() / want.norm()).item()
    return diffs


@pytest.mark.parametrize("n,sp", [(2, False), (2, True), (4, True)])
def test_every_gradient_is_the_slice_of_the_single_device_one(n, sp):
    """One forward and backward: each rank's gradient of every tensor is its slice of
    the one-device gradient (replicated tensors whole), to fp32 rounding."""
    for rank, diffs in enumerate(run_distributed(_gradients, n, sp)):
        assert max(diffs.values()) < 2e-6, (rank, diffs)
        assert len(diffs) == 1 + 20  # the loss and every tensor of the 2-layer GPT


def _vocab_loss(rank: int, n: int, vocab: int, ignored: bool = False) -> dict:
    generator = torch.Generator().manual_seed(2)
    logits = torch.randn(5, 7, vocab, generator=generator, dtype=torch.float64) * 3
    targets = torch.randint(0, vocab, (5, 7), generator=generator)
    if ignored:  # prompt tokens and padding: left out of the sum, still counted in the mean's positions
        targets[:, ::3] = -100

    def reference(z: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(z.flatten(0, 1), targets.flatten(), reduction="sum") / targets.numel()

    want_loss = reference(logits.clone().requires_grad_())
    full = logits.clone().requires_grad_()
    reference(full).backward()
    _, tp, comm = _split_gpt(rank, n, sp=False, vocab=vocab)
    split = Split(tuple(logits.shape), 2, 1, tp.vocab.sizes)  # the logits' last dim, as the head splits it
    local = split.local(logits, rank).requires_grad_()
    before = comm.ledger.snapshot()
    loss = tp.loss(local, targets)
    traffic = comm.ledger.since(before)
    loss.backward()
    return {"loss": (loss.item(), want_loss.item()),
            "grad": (local.grad - split.local(full.grad, rank)).abs().max().item(), "traffic": traffic}


def test_vocabulary_parallel_cross_entropy_never_gathers_the_logits():
    """Uneven vocabulary slices (10 over 4 ranks): the loss and its gradient equal
    F.cross_entropy's, and the only traffic is the max and the (sum, target logit)
    pair per position: 3 numbers of 8 bytes each, never a logit row."""
    for result in run_distributed(_vocab_loss, 4, 10):
        got, want = result["loss"]
        assert got == pytest.approx(want, rel=1e-12)
        assert result["grad"] < 1e-15
        assert result["traffic"] == {"all_reduce": {"tp": {"calls": 2, "bytes": 3 * 35 * 8,
                                                           "wire_bytes": 2 * 3 * 3 * 35 * 8 // 4}}}


def test_vocabulary_parallel_cross_entropy_leaves_ignored_targets_out():
    """Targets of -100 add nothing to the loss nor the gradient, as F.cross_entropy's ignore_index."""
    for result in run_distributed(_vocab_loss, 2, 10, True):
        got, want = result["loss"]
        assert got == pytest.approx(want, rel=1e-12)
        assert result["grad"] < 1e-15


def _generation_logits(rank: int, n: int) -> float:
    full = _gpt(vocab=10)
    model, tp, _ = _split_gpt(rank, n, sp=True, vocab=10)
    prompt = torch.randint(0, 10, (1, 5), generator=torch.Generator().manual_seed(3))
    full.eval()
    model.eval()
    with torch.no_grad(), tp.generation():
        return (model(prompt) - full(prompt)).abs().max().item()


def test_generation_gathers_whole_logits_for_any_prompt_length():
    """Sampling needs every logit: under generation() the head gathers the uneven
    vocabulary slices (10 over 4 ranks), and sp steps aside for a 5-token prompt."""
    assert max(run_distributed(_generation_logits, 4)) < 1e-6


# -- parity ---------------------------------------------------------------------------


# The portable-kernel rerun (marker numerics) takes the two-rank cases: four ranks cut the same
# sums into more partial sums, on the same kernels.
# Four ranks: the README's `scaletrain parity --nproc 4 --tp 4 --sp` runs in tests/test_readme.py.
@pytest.mark.parametrize("n,sp", [pytest.param(2, False, marks=pytest.mark.numerics),
                                  pytest.param(4, False, marks=pytest.mark.slow),
                                  pytest.param(2, True, marks=pytest.mark.numerics),
                                  pytest.param(4, True, marks=pytest.mark.slow)])
def test_tensor_parallel_reproduces_single_device_training(tiny_cfg, n, sp):
    """scaletrain parity --nproc N --tp N [--sp]: losses and weights within 1e-5 (fp32)."""
    report = run_parity(tiny_cfg.replace(nproc=n, tp=n, sp=sp, steps=4), tolerance=1e-5)
    assert report.passed, report.to_json()
    assert report.reference_losses[0] != report.reference_losses[-1]


@pytest.mark.parametrize("changes", [
    # dp2 x tp2 x sp: the README's `scaletrain parity --model llama-tiny --nproc 4 --dp 2 --tp 2 --sp`.
    pytest.param(dict(nproc=4, tp=2, dp=2, sp=True, micro_batch=2), marks=pytest.mark.slow),
    dict(nproc=2, tp=2, sp=True, recompute="full", grad_accum=2),
    pytest.param(dict(nproc=2, tp=2, recompute="selective", offload="optimizer"), marks=pytest.mark.slow),
    pytest.param(dict(nproc=2, tp=2, sp=True, compile=True), marks=pytest.mark.slow),
], ids=["dp2-tp2-sp", "sp-recompute-accum", "selective-offload", "sp-compile"])
def test_tensor_parallel_composes(tiny_cfg, changes):
    report = run_parity(tiny_cfg.replace(steps=3, **changes), tolerance=1e-5)
    assert report.passed, report.to_json()


# -- the communication ledger ------------------------------------------------------------


def _traffic(rank: int, n: int, sp: bool, layers: int) -> dict:
    model, tp, comm = _split_gpt(rank, n, sp=sp, layers=layers)
    x, y = _batch()
    start = comm.ledger.snapshot()
    loss = tp.loss(model(x), y)
    forward = comm.ledger.since(start)
    middle = comm.ledger.snapshot()
    loss.backward()
    return {"forward": forward, "backward": comm.ledger.since(middle)}


def _calls_and_bytes(traffic: dict, op: str) -> tuple[int, int]:
    entry = traffic.get(op, {}).get("tp", {"calls": 0, "bytes": 0})
    return entry["calls"], entry["bytes"]


# without sp (slow): its all-reduces are counted again in tests/test_plan.py's ledgers
@pytest.mark.parametrize("sp", [pytest.param(False, marks=pytest.mark.slow), True])
def test_communication_per_block_matches_megatron(sp):
    """Per block, forward and backward each: 2 all-reduces of b*s*h fp32 values without
    sp; with sp 2 all-gathers and 2 reduce-scatters of the same buffers instead (the same
    bytes on the wire), plus in backward one re-gather per column-parallel layer and one
    small all-reduce per layer-norm tensor's partial gradient. Measured as the difference
    between a 3-block and a 1-block model, so embeddings, head and loss cancel out."""
    n, blocks, activation = 2, 2, 4 * B * S * H
    one, three = (run_distributed(_traffic, n, sp, layers)[0] for layers in (1, 1 + blocks))
    per_block = {phase: {op: tuple((a - b) // blocks for a, b in zip(_calls_and_bytes(three[phase], op),
                                                                    _calls_and_bytes(one[phase], op)))
                         for op in ("all_reduce", "all_gather", "reduce_scatter")}
                 for phase in ("forward", "backward")}
    if not sp:
        for phase in ("forward", "backward"):
            assert per_block[phase] == {"all_reduce": (2, 2 * activation), "all_gather": (0, 0),
                                        "reduce_scatter": (0, 0)}, phase
        return
    assert per_block["forward"] == {"all_reduce": (0, 0), "all_gather": (2, 2 * activation),
                                    "reduce_scatter": (2, 2 * activation)}
    norm_tensors = 4  # two layer norms, a weight and a bias each, of h values
    assert per_block["backward"] == {"all_reduce": (norm_tensors, norm_tensors * 4 * H),
                                     "all_gather": (2 + 2, 4 * activation),
                                     "reduce_scatter": (2, 2 * activation)}


# -- activation memory ---------------------------------------------------------------


def _activation_peak(rank: int, n: int, sp: bool, layers: int) -> int:
    model, tp, _ = _split_gpt(rank, n, sp=sp, layers=layers)
    x, y = _batch()
    with ActivationMeter(model) as meter:
        tp.loss(model(x), y).backward()
    return meter.peak


def _block_bytes(n: int, sp: bool) -> int:
    """Korthikanti's per-block activation memory, fp32 with dropout 0 and a fused
    attention kernel (parallel/tensor.py's docstring derives it)."""
    if sp:
        return S * B * H * 64 // n + 4 * B * S * (4 + A) // n
    return S * B * H * (16 + 48 // n) + 4 * B * S * (4 + A // n)


def _one_device_peak(layers: int) -> int:
    model = _gpt(layers)
    x, y = _batch()
    with ActivationMeter(model) as meter:
        loss_fn(model(x), y).backward()
    return meter.peak


# without sp (slow): the planner's tp activations against the ledger, tests/test_plan.py
@pytest.mark.parametrize("n,sp", [pytest.param(2, False, marks=pytest.mark.slow), (2, True),
                                  pytest.param(4, False, marks=pytest.mark.slow),
                                  pytest.param(4, True, marks=pytest.mark.slow)])
def test_activation_memory_per_block_matches_korthikanti(n, sp):
    """Saved activations of one block, measured as the difference between a 2-block and
    a 1-block model, are exactly the formula: without sp only the attention and MLP
    interiors shrink by t, with sp everything does."""
    peaks = [run_distributed(_activation_peak, n, sp, layers)[0] for layers in (1, 2)]
    assert peaks[1] - peaks[0] == _block_bytes(n, sp)
    assert _one_device_peak(2) - _one_device_peak(1) == _block_bytes(1, False) == _block_bytes(1, True)


# -- dropout streams ------------------------------------------------------------------


def _streams(rank: int, n: int) -> dict:
    rng = RegionRNG(rank % 2, torch.device("cpu"))
    torch.manual_seed(5)
    before = torch.rand(3)
    rng.enter()
    inside = torch.rand(3)
    rng.exit()
    return {"before": before, "inside": inside, "after": torch.rand(3)}


def test_region_streams_differ_inside_and_agree_outside():
    ranks = run_distributed(_streams, 2)
    assert torch.equal(ranks[0]["before"], ranks[1]["before"])
    assert not torch.equal(ranks[0]["inside"], ranks[1]["inside"])
    assert torch.equal(ranks[0]["after"], ranks[1]["after"])


def _train_with_dropout(rank: int, n: int, cfg, spec) -> dict:
    trainer = build_trainer(rank, n, cfg, spec)
    losses = [trainer.train_step(step)["loss"] for step in range(cfg.train.steps)]
    replicated = {name: p.detach().clone() for name, p in trainer.layout.model.named_parameters()
                  if p not in trainer.layout.tensor_parallel.splits}
    return {"losses": losses, "replicated": replicated}


@pytest.mark.parametrize("sp", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_dropout_agrees_where_activations_are_replicated(tiny_cfg, sp):
    """With dropout 0.1 the replicated weights (norms, position embedding) stay bitwise
    equal across the tp ranks: the masks on replicated activations agreed, while the
    per-rank streams inside the regions (and, with sp, everywhere) did not break them.
    Recomputation replays the masks: the same losses with full recompute."""
    cfg = tiny_cfg.replace(nproc=2, tp=2, sp=sp, dropout=0.1, steps=3)
    spec = prepare_data(cfg, Path(cfg.data.cache_dir))
    plain = run_distributed(_train_with_dropout, 2, cfg, spec, timeout_s=120)
    for name, tensor in plain[0]["replicated"].items():
        assert torch.equal(tensor, plain[1]["replicated"][name]), name
    recomputed = run_distributed(_train_with_dropout, 2, cfg.replace(recompute="full"), spec, timeout_s=120)
    assert recomputed[0]["losses"] == pytest.approx(plain[0]["losses"], rel=1e-6)
    no_dropout = run_distributed(_train_with_dropout, 2, cfg.replace(dropout=0.0), spec, timeout_s=120)
    assert no_dropout[0]["losses"][1:] != pytest.approx(plain[0]["losses"][1:], rel=1e-4)


# -- checkpoints across layouts ------------------------------------------------------


@pytest.mark.slow  # about 20 s; a tp2-sp checkpoint resumed in another layout by default: tests/test_nd.py
def test_checkpoint_saved_by_one_layout_resumes_in_another(tiny_cfg):
    """Saved split over tp2 with sp, the run continues exactly in one process and over
    dp2: the files hold full tensors' chunks, weights and AdamW moments alike."""
    cfg = tiny_cfg.replace(nproc=2, tp=2, sp=True, steps=4)
    spec = prepare_data(cfg, Path(cfg.data.cache_dir))
    straight = run_distributed(train_and_save, 2, cfg, spec, 2, timeout_s=120)[0]
    for n, layout in ((1, dict(tp=1, sp=False)), (2, dict(tp=1, sp=False, dp=2, micro_batch=2)),
                      (2, dict(tp=2, sp=False))):
        resumed_cfg = cfg.replace(nproc=n, resume=True, **layout)
        resumed = run_distributed(train_and_save, n, resumed_cfg, spec, None, timeout_s=120)[0]
        assert resumed == pytest.approx(straight[2:], rel=1e-5), layout
