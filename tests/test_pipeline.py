"""Pipeline parallelism: the cuts, the split backward, parity with one device for
every schedule, the bytes each rank sends, the activations each schedule keeps
alive, the recorded timeline, and checkpoints read back by other layouts."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from scaletrain.commands.cli import main
from scaletrain.commands.parity import run_parity
from scaletrain.commands.train import launch
from scaletrain.config import Config
from scaletrain.job.data_setup import prepare_data
from scaletrain.models.gpt import GPT, GPTConfig
from scaletrain.models.gpt_spec import STAGES as GPT_STAGES
from scaletrain.parallel.pipeline.partition import (
    Costs,
    balance,
    keep_stages,
    parameter_costs,
    shared_parameters,
)
from scaletrain.parallel.pipeline.weight_grad import WeightGradStore, make_deferrable
from tests.distributed import run_distributed
from tests.trainers import build_trainer, train_and_save


def _gpt(layers: int = 4) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=64, seq_len=16, n_layers=layers, n_heads=2, d_model=32))


def _tokens() -> torch.Tensor:
    return torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))


# -- the cuts ----------------------------------------------------------------------


def test_balance_minimises_the_most_loaded_stage():
    assert balance(Costs((1.0,) * 8), 4) == [range(2), range(2, 4), range(4, 6), range(6, 8)]
    uneven = balance(Costs((1.0,) * 6), 4)
    assert [i for r in uneven for i in r] == list(range(6)) and max(map(len, uneven)) == 2
    # A heavy embedding leaves the first stage fewer layers, a heavy head the last.
    assert balance(Costs((1.0,) * 6, first=2.0), 2) == [range(2), range(2, 6)]
    assert balance(Costs((1.0,) * 6, last=2.0), 2) == [range(4), range(4, 6)]
    assert balance(Costs((5.0, 1.0, 1.0, 1.0, 1.0, 1.0)), 2) == [range(1), range(1, 6)]
    with pytest.raises(ValueError, match="cannot cut 2 layers into 3"):
        balance(Costs((1.0, 1.0)), 3)


def test_parameter_costs_count_the_tied_head_on_both_ends():
    model = _gpt()
    costs = parameter_costs(model, GPT_STAGES)
    block = sum(p.numel() for p in model.blocks[0].parameters())
    assert costs.layers == (block,) * 4
    assert costs.first == 64 * 32 + 16 * 32  # token and position embeddings
    assert costs.last == 64 * 32 + 2 * 32  # the head's copy of the tied weight, the final norm


def test_stages_keep_the_names_one_device_gives_and_compose_to_the_model():
    full = _gpt()
    x = _tokens()
    ranges = balance(Costs((1.0,) * 4), 4)
    assert shared_parameters(full, GPT_STAGES, ranges) == {"tok_emb.weight": [0, 3]}
    names = {}
    hidden = x
    for s in range(4):
        [stage] = keep_stages(copy.deepcopy(full), GPT_STAGES, ranges, [s])
        names[s] = {name for name, _ in stage.model.named_parameters()}
        hidden = stage(hidden)
    assert torch.equal(hidden, full(x))
    assert names[0] == {"tok_emb.weight", "pos_emb.weight", *_block_names(full, 0)}
    assert names[1] == set(_block_names(full, 1))
    # The last stage keeps the tied weight under its canonical name, beside the head.
    assert names[3] == {"tok_emb.weight", "ln_f.weight", "ln_f.bias", *_block_names(full, 3)}
    assert set().union(*names.values()) == {name for name, _ in full.named_parameters()}


def _block_names(model: GPT, i: int) -> list[str]:
    return [f"blocks.{i}.{name}" for name, _ in model.blocks[i].named_parameters()]


def test_a_rank_with_two_chunks_keeps_both_and_nothing_between():
    model = _gpt(layers=4)
    stages = keep_stages(model, GPT_STAGES, balance(Costs((1.0,) * 4), 4), [0, 2])
    assert [len(list(b.parameters())) > 0 for b in model.blocks] == [True, False, True, False]
    assert [s.index for s in stages] == [0, 2] and stages[0].is_first and not stages[1].is_last


# -- backward in two halves (zero bubble) ----------------------------------------------


def test_weight_gradients_held_back_until_flushed_equal_autograd():
    plain, split = _gpt(2), _gpt(2)
    store = WeightGradStore()
    assert make_deferrable(split, store) == 2 * 4 + 1  # qkv, proj, fc, proj per block; the head
    heard = []  # B calls a weight's hooks without a gradient; W with the gradient

    def hear(p: torch.nn.Parameter) -> None:
        heard.append(None if p.grad is None else p.grad.clone())

    split.blocks[0].mlp.fc.weight.register_post_accumulate_grad_hook(hear)
    x = _tokens()
    plain(x).square().mean().backward()
    with store.deferring("m0"):
        split(x).square().mean().backward()
    fc = split.blocks[0].mlp.fc.weight
    assert fc.grad is None and split.blocks[0].ln1.weight.grad is not None  # norms are not held back
    store.flush("m0")
    for (name, p), (_, q) in zip(plain.named_parameters(), split.named_parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-7, msg=name)
    assert heard[:-1] == [None] * (len(heard) - 1) and torch.equal(heard[-1], fc.grad)
    assert store.pending == {}


def test_deferrable_linear_outside_deferring_is_a_plain_linear():
    plain, split = _gpt(2), _gpt(2)
    make_deferrable(split, WeightGradStore())
    x = _tokens()
    for model in (plain, split):
        model(x).square().mean().backward()
    for p, q in zip(plain.parameters(), split.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-7)


# -- forward only: evaluation and generation ------------------------------------------


def _forward_through_stages(rank: int, n: int) -> dict:
    """Two ranks, two chunks each (stages 0-3): evaluation over batches of 4 and 2
    sequences, and 5 generated tokens, against the whole model in one process."""
    from scaletrain.models.decoder import sample_next
    from scaletrain.parallel.pipeline.parallel import PipelineParallel
    from scaletrain.runtime import Comm, Mesh, ParallelDims
    from scaletrain.train.layout import loss_fn

    whole, model = _gpt(), _gpt()
    mesh = Mesh.build(ParallelDims(pp=n), rank, n)
    pipeline = PipelineParallel(model, GPT_STAGES, Comm(), mesh.group("pp"), schedule="interleaved",
                                micro_batches=2, virtual_stages=2, balance_by="params",
                                boundary=lambda b, s: ((b, s, 32), torch.float32, torch.device("cpu")),
                                sample=_tokens(), world=mesh.group("world"))
    tokens = torch.randint(0, 64, (6, 16), generator=torch.Generator().manual_seed(2))
    batches = [(tokens[:4, :-1], tokens[:4, 1:]), (tokens[4:, :-1], tokens[4:, 1:])]
    with torch.no_grad():
        expected = sum(loss_fn(whole(x), y).item() for x, y in batches) / 2
    got = pipeline.evaluate(batches, loss_fn)

    def sampler(logits: torch.Tensor) -> torch.Tensor:
        return sample_next(logits, generator=torch.Generator().manual_seed(3))

    prompt = tokens[:1, :12]
    generated = pipeline.generate(prompt, 5, context=16, sample_next=sampler)
    reference = prompt
    with torch.no_grad():
        for _ in range(5):
            reference = torch.cat([reference, sampler(whole(reference[:, -16:])[:, -1, :])], dim=1)
    return {"loss": (got, expected), "same_tokens": torch.equal(generated, reference)}


def test_evaluation_and_generation_run_through_the_stages():
    """A short last validation batch included; every rank gets the loss and the tokens."""
    for result in run_distributed(_forward_through_stages, 2):
        assert result["loss"][0] == pytest.approx(result["loss"][1], rel=1e-6)
        assert result["same_tokens"]


# -- parity with one device -----------------------------------------------------------


# The portable-kernel rerun (marker numerics) takes 1F1B and ZB-H1: GPipe's and the interleaved
# schedule's stages run the same kernels on the same micro-batches, in another order.
PARITY = [
    ("gpipe", 2, {}), pytest.param("1f1b", 2, {}, marks=pytest.mark.numerics),
    pytest.param("zb-h1", 2, {}, marks=pytest.mark.numerics), ("interleaved", 2, {"n_layers": 4}),
    pytest.param("1f1b", 4, {"n_layers": 4}, marks=pytest.mark.slow),  # four stages: the README's pp4 run
    pytest.param("gpipe", 4, {"n_layers": 4}, marks=pytest.mark.slow),
    pytest.param("zb-h1", 4, {"n_layers": 4}, marks=pytest.mark.slow),
    pytest.param("interleaved", 4, {"n_layers": 8}, marks=pytest.mark.slow),
]


@pytest.mark.parametrize("schedule,n,sizes", PARITY)
def test_pipeline_reproduces_single_device_training(tiny_cfg, schedule, n, sizes):
    """scaletrain parity --nproc N --pp N --pp-schedule S: losses and weights within 1e-5
    (fp32), M = 2N micro-batches (interleaved: V = 2 chunks per rank)."""
    report = run_parity(tiny_cfg.replace(nproc=n, pp=n, pp_schedule=schedule, steps=4, **sizes),
                        tolerance=1e-5)
    assert report.passed, report.to_json()
    assert report.reference_losses[0] != report.reference_losses[-1]


@pytest.mark.parametrize("changes", [
    pytest.param(dict(nproc=4, pp=2, dp=2, pp_schedule="zb-h1", micro_batch=2),  # dp x pp: tests/test_nd.py
                 marks=pytest.mark.slow),
    dict(nproc=2, pp=2, microbatches=3, grad_accum=2, recompute="full", pp_balance="time"),
    pytest.param(dict(nproc=2, pp=2, n_layers=4, pp_schedule="interleaved", microbatches=2, offload="optimizer"),
                 marks=pytest.mark.slow),
    pytest.param(dict(nproc=2, pp=2, pp_schedule="zb-h1", compile=True), marks=pytest.mark.slow),
], ids=["dp2-pp2-zb", "accum-recompute-timed-cuts", "interleaved-offload", "zb-compile"])
def test_pipeline_composes(tiny_cfg, changes):
    report = run_parity(tiny_cfg.replace(steps=3, **changes), tolerance=1e-5)
    assert report.passed, report.to_json()


def _tied_weight_after_training(rank: int, n: int, cfg: Config, spec) -> torch.Tensor:
    trainer = build_trainer(rank, n, cfg, spec)
    for step in range(cfg.train.steps):
        trainer.train_step(step)
    return trainer.layout.model.tok_emb.weight.detach().clone()


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_tied_weight_stays_one_weight_on_both_ends(tiny_cfg, precision):
    """The first stage's embedding and the last stage's head are copies of one weight:
    after steps of ZB-H1 (bf16 too) they are still bitwise equal, and have moved."""
    cfg = tiny_cfg.replace(nproc=2, pp=2, pp_schedule="zb-h1", steps=3, precision=precision)
    spec = prepare_data(cfg, Path(cfg.data.cache_dir))
    first, last = run_distributed(_tied_weight_after_training, 2, cfg, spec, timeout_s=120)
    assert torch.equal(first, last)
    torch.manual_seed(cfg.train.seed)
    initial = GPT(GPTConfig(vocab_size=spec.vocab_size, seq_len=32, n_layers=2, n_heads=4, d_model=64))
    assert not torch.equal(first, initial.tok_emb.weight.detach())


# -- a real run: bytes, memory, timeline -------------------------------------------------


def _run(cfg: Config) -> Path:
    launch(cfg)
    return Path(cfg.run.out)


def test_each_rank_sends_its_activations_gradients_and_the_tied_weight(tiny_cfg):
    """Per step, 1F1B over 2 stages: rank 0 sends M activations [b, s, d] and its part of the
    tied weight's gradient [V, d] (then receives as much); the last stage sends the
    gradients back. Evaluation sends one activation per validation batch."""
    steps, m, b, s, d = 2, 4, tiny_cfg.train.micro_batch, tiny_cfg.data.seq_len, 64
    cfg = tiny_cfg.replace(nproc=2, pp=2, steps=steps, microbatches=m, report_comm=True)
    vocab = prepare_data(cfg, Path(cfg.data.cache_dir)).vocab_size
    ledger = json.loads((_run(cfg) / "comm.json").read_text())
    hidden, tied = b * s * d * 4, vocab * d * 4
    evals = tiny_cfg.train.eval_batches
    assert ledger["0"]["send"]["pp"] == {"calls": steps * (m + 1) + evals,
                                         "bytes": steps * (m * hidden + tied) + evals * hidden,
                                         "wire_bytes": steps * (m * hidden + tied) + evals * hidden}
    assert ledger["1"]["send"]["pp"]["bytes"] == steps * (m * hidden + tied)
    assert ledger["0"]["recv"]["pp"]["bytes"] == steps * (m * hidden + tied)


def _activation_peak(cfg: Config, schedule: str, m: int) -> int:
    run = _run(cfg.replace(out=f"{cfg.run.out}-{schedule}-{m}", nproc=2, pp=2, pp_schedule=schedule,
                           microbatches=m, steps=1, report_memory=True))
    return json.loads((run / "memory.json").read_text())["0"]["activations_peak"]


@pytest.mark.slow  # 27 s
def test_1f1b_keeps_n_micro_batches_alive_where_gpipe_keeps_m(tiny_cfg):
    """The memory ledger of the first stage, M = 8, N = 2: GPipe's peak is 8 micro-batches'
    saved activations, 1F1B's 2 (and ZB-H1's too), measured against a round of one."""
    one = _activation_peak(tiny_cfg, "1f1b", 1)
    assert _activation_peak(tiny_cfg, "gpipe", 8) == pytest.approx(8 * one, rel=0.02)
    assert _activation_peak(tiny_cfg, "1f1b", 8) == pytest.approx(2 * one, rel=0.02)
    assert _activation_peak(tiny_cfg, "zb-h1", 8) == pytest.approx(2 * one, rel=0.02)


def test_the_last_step_is_recorded_and_drawn_beside_the_plan(tiny_cfg, capsys):
    run = _run(tiny_cfg.replace(nproc=2, pp=2, pp_schedule="zb-h1", microbatches=4, steps=2))
    record = json.loads((run / "pipeline.json").read_text())
    assert (record["schedule"], record["pp"], record["microbatches"], record["step"]) == ("zb-h1", 2, 4, 2)
    for rank, spans in enumerate(record["ranks"]):
        assert sorted((e["kind"], e["micro"]) for e in spans) == sorted(
            (kind, i) for kind in ("F", "B", "W") for i in range(4))
        assert all(e["stage"] == rank and 0 <= e["start"] <= e["end"] for e in spans)
    capsys.readouterr()
    assert main(["schedule", "--measured", str(run), "--png", str(run / "timeline.png")]) == 0
    out = capsys.readouterr().out
    assert "measured at step 2" in out and "bubble: planned 0.0769" in out and ", measured 0." in out
    assert (run / "timeline.png").read_bytes()[:4] == b"\x89PNG"


# -- checkpoints across layouts -------------------------------------------------------


def test_checkpoint_saved_by_stages_resumes_in_one_process_and_back(tiny_cfg):
    """Saved by two stages (each writing its own weights, the tied one by both), the run
    continues exactly in one process with the micro-batches as accumulation steps, and
    over four stages of the same model."""
    cfg = tiny_cfg.replace(nproc=2, pp=2, microbatches=4, steps=4, n_layers=4)
    spec = prepare_data(cfg, Path(cfg.data.cache_dir))
    straight = run_distributed(train_and_save, 2, cfg, spec, 2, timeout_s=120)[0]
    for n, layout in ((1, dict(pp=1, microbatches=None, grad_accum=4)),
                      (4, dict(pp=4, microbatches=4, pp_schedule="zb-h1"))):
        resumed_cfg = cfg.replace(nproc=n, resume=True, **layout)
        resumed = run_distributed(train_and_save, n, resumed_cfg, spec, None, timeout_s=120)[0]
        assert resumed == pytest.approx(straight[2:], rel=1e-5), layout


@pytest.mark.parametrize("flags,message", [
    (["--microbatches", "4"], "--microbatches shapes a pipeline, which needs --pp 2 or more"),
    (["--pp", "2", "--nproc", "2", "--virtual-stages", "2"], "needs --pp-schedule interleaved"),
    (["--pp", "2", "--nproc", "2", "--pp-schedule", "interleaved", "--microbatches", "3", "--n-layers", "4"],
     "choose --microbatches divisible by 2"),
    (["--pp", "2", "--nproc", "2", "--pp-schedule", "interleaved", "--virtual-stages", "1"], "is 1f1b"),
    (["--pp", "2", "--nproc", "2", "--pp-schedule", "interleaved"], "cuts the model into 4 stages, but it has 2"),
])
def test_pipeline_mistakes_are_one_sentence_before_any_work(tiny_cfg, capsys, flags, message):
    out = Path(tiny_cfg.run.out)
    code = main(["train", "--model", "gpt-tiny", "--out", str(out), *flags])
    err = capsys.readouterr().err
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists()
