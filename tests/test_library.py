"""The library (library.py): setup's refusals, one sentence each; the step protocol; save and
resume; the sampler; and check_parity, the library's parity rule, on a user's model."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import scaletrain
from scaletrain import ModelPlan, StagePlan, UserError
from scaletrain.runtime.spawn import spawn_local

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from transformer import PLAN, Transformer  # noqa: E402  (the example's own model and plan)


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    return torch.randn(16, 8, generator=generator), torch.randint(0, 4, (16,), generator=generator)


def mean_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, targets)


@pytest.mark.parametrize("options, words", [
    (dict(zeor=3), "setup() takes no option 'zeor'"),
    (dict(zero=5), "option 'zero' must be one of 0, 1, 2, 3"),
    (dict(lr="fast"), "option 'lr' must be float, not 'fast'"),
    (dict(tp=2), "needs a multiple of 2 processes, but 1 were started"),
    (dict(dp=2), "needs 2 processes, but 1 were started"),
    (dict(sync_every=4), "sync_every=4 averages data-parallel replicas"),
])
def test_setup_refuses_bad_options_before_any_work(options, words):
    with pytest.raises(UserError, match=words.replace("(", r"\(").replace(")", r"\)")):
        scaletrain.setup(mlp(), **options)


@pytest.mark.parametrize("plan, words", [
    (ModelPlan(tensor=(("layers.*.fc", scaletrain.Column()),)), "'layers.*.fc' matches no module"),
    (ModelPlan(blocks="stack"), "no nn.ModuleList of that name"),
    (ModelPlan(stages=StagePlan(stack="layers", first=("emb",), last=(), enter="embed", leave="unembed")),
     "no nn.ModuleList"),
    (ModelPlan(position_modules=("pos",)), "position module 'pos' matches no module"),
])
def test_a_plan_that_names_what_the_model_lacks_is_refused(plan, words):
    with pytest.raises(UserError, match=words.replace("*", r"\*").replace(".", r"\.")):
        scaletrain.setup(mlp(), plan=plan)


def test_splits_without_a_plan_are_refused_naming_what_to_give():
    from scaletrain.library_checks import check_plan, engine_config

    cfg = engine_config({"tp": 2})
    with pytest.raises(UserError, match=r"tp=2 needs a plan with tensor entries"):
        check_plan(mlp(), None, cfg.parallel.mesh_dims(2), cfg, None, None)
    cfg = engine_config({"cp": 2})
    with pytest.raises(UserError, match=r"cp=2 needs seq_len"):
        check_plan(mlp(), None, cfg.parallel.mesh_dims(2), cfg, None, None)
    with pytest.raises(UserError, match=r"cp=2 runs ring attention in place of scaletrain.CausalAttention"):
        check_plan(mlp(), None, cfg.parallel.mesh_dims(2), cfg, 8, None)
    cfg = engine_config({"ep": 2})
    with pytest.raises(UserError, match=r"ep=2 divides the experts of scaletrain's MoE layer"):
        check_plan(mlp(), None, cfg.parallel.mesh_dims(2), cfg, None, None)
    cfg = engine_config({"recompute": "selective"})
    with pytest.raises(UserError, match=r"recompute='selective'"):
        check_plan(mlp(), None, cfg.parallel.mesh_dims(1), cfg, None, None)


def test_step_protocol_names_each_misuse():
    with scaletrain.setup(mlp(), grad_accum=2, lr=0.1) as engine:
        x, y = global_batch(0)
        with pytest.raises(UserError, match=r"step\(\) was called after 0 of the step's 2 backward\(\) calls"):
            engine.step()
        for _ in range(2):
            engine.backward(F.cross_entropy(engine(x), y))
        assert engine.ready
        with pytest.raises(UserError, match=r"backward\(\) was called 3 times with grad_accum=2"):
            engine.backward(F.cross_entropy(engine(x), y))
        record = engine.step()
        assert record["step"] == 1 and record["grad_norm"] > 0 and not engine.ready
        with pytest.raises(UserError, match=r"train_step\(\) takes the step's 2 micro-batches"):
            engine.train_step([(x, y)], mean_cross_entropy)


def _steps(engine, first: int, last: int) -> list[float]:
    return [engine.train_step([global_batch(2 * step), global_batch(2 * step + 1)], mean_cross_entropy)["loss"]
            for step in range(first, last)]


def test_save_and_resume_continue_exactly(tmp_path):
    """Four steps at once, or two, a checkpoint, a new engine on a fresh model, two more: the same losses
    (the optimizer's state, the step and the learning rate's place came back)."""
    options = dict(grad_accum=2, lr=0.05, steps=4, warmup_steps=1, seed=3)
    torch.manual_seed(0)
    with scaletrain.setup(mlp(), **options) as engine:
        straight = _steps(engine, 0, 4)
    torch.manual_seed(0)
    with scaletrain.setup(mlp(), **options) as engine:
        assert engine.load(tmp_path) is None  # nothing to resume yet
        first = _steps(engine, 0, 2)
        engine.save(tmp_path, epoch=7)
    torch.manual_seed(99)  # another initialization: the checkpoint replaces it
    with scaletrain.setup(mlp(), **options) as engine:
        assert engine.load(tmp_path) == {"epoch": 7}
        assert engine.steps_done == 2
        assert engine.sampler(100, 4).start == 2 * 2  # the sampler reads on from the resumed step
        resumed = _steps(engine, 2, 4)
    assert first + resumed == pytest.approx(straight, rel=1e-6)


def test_the_engine_averages_what_the_ranks_compute():
    results = spawn_local(2, _rank_step, ())
    assert results[0] == results[1]  # every rank holds the global batch's loss


def _rank_step() -> float:
    torch.manual_seed(scaletrain_rank_seed())
    with scaletrain.setup(mlp(), lr=0.1) as engine:  # rank 0's weights reach rank 1
        x, y = global_batch(engine.rank)
        engine.backward(F.cross_entropy(engine(x), y))
        return engine.step()["loss"]


def scaletrain_rank_seed() -> int:
    import os

    return int(os.environ["RANK"])


@pytest.mark.parametrize("nproc, options", [
    (2, dict(zero=3, grad_accum=2)),
    pytest.param(2, dict(sync_every=1, precision="fp32", zero=1, offload="optimizer"), marks=pytest.mark.slow),
    pytest.param(4, dict(zero=2, shard_group=2), marks=pytest.mark.slow),
])
def test_check_parity_of_a_user_model(nproc, options):
    report = scaletrain.check_parity(mlp, global_batch, mean_cross_entropy, nproc=nproc, steps=3, lr=0.05,
                                     warmup_steps=1, **options)
    assert report.passed, scaletrain.format_parity(report)
    assert len(report.layout_losses) == 3 and report.layout_losses[-1] < report.layout_losses[0]


def test_check_parity_finds_a_layout_that_differs():
    """A layout whose global batch is not the reference's fails: the rule can fail."""
    report = scaletrain.check_parity(mlp, global_batch, mean_cross_entropy, nproc=2, steps=2, lr=0.05, sync_every=2,
                                     warmup_steps=1)
    assert not report.passed  # local SGD steps each replica on its own half: not one device's update


RESUMING_SCRIPT = '''
import json, sys
import torch
import torch.nn.functional as F
from torch import nn
import scaletrain

out = sys.argv[1]
torch.manual_seed(0)
engine = scaletrain.setup(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)), lr=0.05, steps=6,
                          warmup_steps=1, zero=2)
engine.load(out)
while engine.steps_done < 6:
    g = torch.Generator().manual_seed(engine.steps_done)
    x, y = torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)
    mine = slice(engine.rank * 4, engine.rank * 4 + 4)
    engine.backward(F.cross_entropy(engine(x[mine]), y[mine]))
    record = engine.step()
    if engine.is_main:
        with open(f"{out}/losses.jsonl", "a") as f:
            f.write(json.dumps([record["step"], record["loss"]]) + "\\n")
    if engine.steps_done % 2 == 0:
        engine.save(out)
engine.close()
'''


@pytest.mark.slow  # 13 s; by default: the README's `scaletrain run --max-restarts`, tests/test_faults.py
def test_a_killed_worker_restarts_and_the_script_resumes_exactly(tmp_path):
    """``scaletrain run --max-restarts`` starts the job again after rank 1 is killed in step 5; the
    script's ``engine.load`` resumes from step 4 and ends with the losses of a run never stopped."""
    import json
    import os
    import subprocess
    import sys

    script = tmp_path / "train.py"
    script.write_text(RESUMING_SCRIPT)
    runs = {}
    for name, fault in (("straight", ""), ("killed", "kill rank=1 step=5")):
        out = tmp_path / name
        out.mkdir()
        result = subprocess.run([sys.executable, "-m", "scaletrain", "run", "--nproc", "2", "--max-restarts", "1",
                                 str(script), str(out)], capture_output=True, text=True, timeout=300,
                                env={**os.environ, "SCALETRAIN_FAULT": fault})
        assert result.returncode == 0, result.stderr[-3000:]
        runs[name] = dict(json.loads(line) for line in (out / "losses.jsonl").read_text().splitlines())
    assert sorted(runs["killed"]) == list(range(1, 7))
    assert [runs["killed"][s] for s in range(1, 7)] == pytest.approx([runs["straight"][s] for s in range(1, 7)],
                                                                    rel=1e-6)



def small_transformer() -> nn.Module:
    return Transformer(layers=2, seq=16)


def token_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, 256, (8, 17), generator=torch.Generator().manual_seed(step))
    return tokens[:, :-1], tokens[:, 1:]


def experts_model() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), scaletrain.MoE(16, scaletrain.MoEConfig(experts=4, top_k=2, hidden=16)),
                         nn.Linear(16, 4))


def feature_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    return torch.randn(8, 4, 8, generator=generator), torch.randint(0, 4, (8, 4), generator=generator)


# Not rerun on the portable kernels: the same strategies' arithmetic is, through the command
# (tests/test_tensor.py, test_pipeline.py, test_cp_moe_training.py), and a user's plan changes
# only where it runs.
@pytest.mark.parametrize("make_model, batch, nproc, options", [
    pytest.param(small_transformer, token_batch, 2, dict(plan=PLAN, seq_len=16, cp=2), marks=pytest.mark.slow),
    # Four ranks; the README's examples/transformer.py runs tp2 x ZeRO-3 with a plan (tests/test_examples.py).
    pytest.param(small_transformer, token_batch, 4, dict(plan=PLAN, tp=2, sp=True, zero=1, grad_accum=2),
                 marks=pytest.mark.slow),
    pytest.param(small_transformer, token_batch, 2, dict(plan=PLAN, pp=2, pp_schedule="zb-h1", microbatches=4),
                 marks=pytest.mark.slow),
    (experts_model, feature_batch, 2, dict(ep=2)),
], ids=["cp2", "tp2-sp-zero1", "pp2-zb", "ep2"])
def test_check_parity_with_a_plan_and_with_experts(make_model, batch, nproc, options):
    report = scaletrain.check_parity(make_model, batch, nproc=nproc, steps=2, lr=3e-3, warmup_steps=1, **options)
    assert report.passed, scaletrain.format_parity(report)


def test_a_second_setup_in_one_process_is_refused():
    results = spawn_local(2, _setup_twice, ())
    assert "call scaletrain.setup once per process" in results[0]


def _setup_twice() -> str:
    with scaletrain.setup(mlp()):
        try:
            scaletrain.setup(mlp())
        except UserError as refusal:
            return str(refusal)
    return "no refusal"


def _generate_and_evaluate(options: dict) -> tuple[list[list[int]], float]:
    """A trained step, then ``engine.generate`` and ``engine.evaluate`` on every rank."""
    torch.manual_seed(0)
    with scaletrain.setup(small_transformer(), plan=PLAN, seq_len=16, lr=3e-3, warmup_steps=1, steps=2,
                          **options) as engine:
        engine.train_step([token_batch(0)] * engine.micro_batches_per_step, engine.cross_entropy)
        prompt = torch.tensor([[72, 101, 108, 108], [87, 111, 114, 108]])
        ids = engine.generate(prompt, 10, seed=7)
        batches = [token_batch(100 + i) for i in range(2)]
        group = engine.layout.replicas.batch
        loss = engine.evaluate(batches[group.rank::group.size], engine.cross_entropy)
        assert engine.layout.model.training  # left as it was
    return ids.tolist(), loss


@pytest.mark.parametrize("options", [
    # pp2 (slow): a pipeline's generation and evaluation by default in tests/test_evaluation.py (pp2-run)
    pytest.param(dict(zero=3), marks=pytest.mark.slow), dict(tp=2),
    pytest.param(dict(pp=2, microbatches=2), marks=pytest.mark.slow),
    pytest.param(dict(cp=2), marks=pytest.mark.slow),
], ids=["zero3", "tp2", "pp2", "cp2"])
def test_generate_and_evaluate_on_every_rank_equal_one_process(options):
    """Every rank holds a part of the model, so every rank takes part; each gets the ids and the
    loss one process gets (the same seed; the loss within parity's 1e-5)."""
    (reference_ids, reference_loss), = spawn_local(1, _generate_and_evaluate, ({},)).values()
    results = spawn_local(2, _generate_and_evaluate, (options,))
    for ids, loss in results.values():
        assert ids == reference_ids and len(ids[0]) == 14
        assert abs(loss - reference_loss) <= 1e-5 * reference_loss
