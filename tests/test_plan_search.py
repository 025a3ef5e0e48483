"""The planner's search, report and command, with a stand-in for the prediction.

The stand-in is simple but shaped like the real thing where the search relies
on it: activation memory grows with the micro-batch and shrinks with tp, cp
and recompute, ZeRO shards state over the replicas, recompute costs time.
No processes are started; everything runs in seconds.
"""

from __future__ import annotations

import json
import os
import sys
import types

import pytest

from scaletrain.commands.cli import main
from scaletrain.config import Config
from scaletrain.config_checks import check_values
from scaletrain.errors import UserError
from scaletrain.models import family_config
from scaletrain.planner.hardware import DEVICES, Cluster
from scaletrain.planner.prediction import MEMORY_ROWS, Prediction
from scaletrain.planner.report import format_table, plot, to_json
from scaletrain.planner.search import (
    LIGHTER_FITS,
    SMALLER_TOO_BIG,
    layout_text,
    layouts,
    refusal,
    search,
)

GB = 10**9
VOCAB = 50304
BASE = Config().replace(name="gpt2-124m", seq_len=1024, precision="bf16")
CLUSTER = Cluster(DEVICES["H100"], 16, 8).with_memory(3 * GB)  # small enough that some layouts do not fit
BATCH = 64
SAVING = {"none": 1, "selective": 2, "full": 8}  # activation memory divided by
COST = {"none": 1.0, "selective": 1.05, "full": 1.33}  # compute multiplied by


def _dp(cfg: Config, world: int) -> int:
    p = cfg.parallel
    return world // (p.tp * p.pp * p.cp * p.ep)


def _sequences(cfg: Config, world: int) -> int:
    """Sequences per optimizer step, as the trainer would take them."""
    t, p = cfg.train, cfg.parallel
    return t.micro_batch * t.grad_accum * (p.microbatches or 1) * _dp(cfg, world) * p.ep


def stand_in(cfg: Config, world: int, vocab_size: int, cluster: Cluster) -> Prediction:
    """A crude memory and time model with the monotonic shape of the real one."""
    p, t = cfg.parallel, cfg.train
    g = family_config(cfg.model, vocab_size, cfg.data.seq_len)
    replicas = _dp(cfg, world) * p.cp
    params = 4 * (12 * g.n_layers * g.d_model**2 + vocab_size * g.d_model) // (p.tp * p.pp)
    # A pipeline's first stage holds pp micro-batches of 1/pp of the layers: the whole model's worth.
    per_sequence = 34 * g.n_layers * g.seq_len * g.d_model // (p.cp * p.tp * (2 if p.sp else 1))
    memory = {"params": params, "grads": params // replicas if p.zero >= 2 else params,
              "optimizer": 2 * params // replicas if p.zero >= 1 else 2 * params,
              "activations": t.micro_batch * per_sequence // SAVING[t.recompute], "other": GB // 2}
    memory["total"] = sum(memory.values())
    tokens = _sequences(cfg, world) * g.seq_len
    compute = 6 * params / 4 * tokens / world / 4e14 * COST[t.recompute]
    rounds = t.grad_accum * (p.microbatches or 1)
    time = {"compute": compute, "recompute": 0.0, "comm": 0.002 * p.zero + 0.004 * (p.tp - 1) + 1e-4 * rounds,
            "bubble": compute * (p.pp - 1) / (p.microbatches or 1)}
    time["step"] = sum(time.values())
    return Prediction(cfg, world, memory, [memory], {}, time, tokens, memory["total"] <= cluster.device.memory_bytes)


@pytest.fixture(scope="module")
def result():
    return search(BASE, CLUSTER, VOCAB, BATCH, set(), stand_in)


def _mesh(cfg: Config, world: int) -> tuple[int, ...]:
    p = cfg.parallel
    return p.dp, p.tp, p.pp, p.cp, p.ep


# -- layouts ---------------------------------------------------------------------
@pytest.mark.parametrize("experts", [0, 8])
def test_every_layout_fills_the_world_and_keeps_the_global_batch(experts):
    base = BASE.replace(moe_experts=experts)
    found = list(layouts(base, 16, 8, BATCH, set()))
    assert found
    for cfg in found:
        p, t = cfg.parallel, cfg.train
        assert p.dp * p.tp * p.pp * p.cp * p.ep == 16
        assert _sequences(cfg, 16) == BATCH
        assert 8 % p.tp == 0  # tp inside a node
        assert p.ep == 1 or experts
        assert p.cp == 1 or 1024 % (2 * p.cp) == 0
        assert p.zero == 0 or p.dp * p.cp * p.ep > 1  # ZeRO shards over the dense weights' copies
        assert not p.sp or p.tp > 1
        assert t.micro_batch & (t.micro_batch - 1) == 0  # a power of two
        if p.pp > 1:
            assert t.grad_accum == 1 and p.microbatches >= p.pp
            if p.pp_schedule == "interleaved":
                assert p.microbatches % p.pp == 0 and p.virtual_stages == 2
        else:
            assert p.microbatches is None and p.virtual_stages is None
    keys = [(_mesh(c, 16), c.parallel.zero, c.parallel.sp, c.train.recompute, c.train.micro_batch,
             c.parallel.pp_schedule if c.parallel.pp > 1 else None,
             c.parallel.zero3_gather if c.parallel.pp > 1 and c.parallel.zero == 3 else None) for c in found]
    assert len(set(keys)) == len(keys)  # nothing weighed twice
    meshes = {_mesh(c, 16) for c in found}
    assert {(16, 1, 1, 1, 1), (2, 8, 1, 1, 1), (1, 2, 2, 4, 1)} <= meshes
    assert not any(tp == 16 for _, tp, *_ in meshes)
    assert {ep for *_, ep in meshes} == ({1, 2, 4, 8, 16} if experts else {1})
    assert {c.parallel.pp_schedule for c in found if c.parallel.pp > 1} == {"gpipe", "1f1b", "interleaved", "zb-h1"}
    assert {c.train.recompute for c in found} == {"none", "selective", "full"}


def test_fixed_fields_keep_the_base_value_and_the_rest_is_searched():
    base = BASE.replace(tp=2, sp=True, zero=1, recompute="selective", micro_batch=4, pp_schedule="zb-h1")
    fixed = {"tp", "sp", "zero", "recompute", "micro_batch", "pp_schedule"}
    found = list(layouts(base, 16, 8, BATCH, fixed))
    assert found
    for cfg in found:
        p, t = cfg.parallel, cfg.train
        assert (p.tp, p.sp, p.zero, t.recompute, t.micro_batch) == (2, True, 1, "selective", 4)
        assert p.pp == 1 or p.pp_schedule == "zb-h1"
        assert _sequences(cfg, 16) == BATCH
    assert {c.parallel.pp for c in found} >= {1, 2, 4} and len({c.parallel.dp for c in found}) > 1

    pinned = list(layouts(BASE.replace(dp=4, microbatches=4), 16, 8, BATCH, {"dp", "microbatches"}))
    assert {c.parallel.dp for c in pinned} == {4}
    assert {c.parallel.microbatches for c in pinned if c.parallel.pp > 1} == {4}
    assert all(_sequences(c, 16) == BATCH for c in pinned if c.parallel.pp > 1)


# -- refusals --------------------------------------------------------------------
def test_refusal_is_the_trainers_own_sentence():
    two_bw_zero = BASE.replace(dp=2, pp=2, zero=1, microbatches=4, pp_schedule="pipedream-2bw")
    with pytest.raises(UserError) as trainer:
        check_values(two_bw_zero)
    assert refusal(two_bw_zero, 4) == str(trainer.value)
    assert "--pp-schedule pipedream-2bw does not combine with --zero" in str(trainer.value)
    assert "--tp 8 must divide the model's 12 attention heads" in refusal(BASE.replace(dp=1, tp=8), 8)
    interleaved = BASE.replace(dp=1, pp=8, pp_schedule="interleaved", microbatches=8, virtual_stages=2)
    assert "cuts the model into 16 stages, but it has 12 layers" in refusal(interleaved, 8)
    assert refusal(BASE.replace(dp=2, tp=4, sp=True, zero=1), 8) is None


def test_search_counts_refusals_by_reason_and_never_ranks_a_refused_layout():
    result = search(BASE.replace(sync_every=2), CLUSTER, VOCAB, BATCH, {"sync_every"}, stand_in)
    reasons = list(result.refused)
    assert any("--sync-every 2 keeps a whole model and optimizer on every rank, which --zero" in r for r in reasons)
    assert len([r for r in reasons if "which --zero" in r]) == 1  # one entry per kind, whatever the stage
    assert any("and under --tp no rank holds one" in reason for reason in reasons)
    assert result.ranked and all((p.cfg.parallel.zero, p.cfg.parallel.tp, p.cfg.parallel.pp) == (0, 1, 1)
                                 for p in result.ranked)
    assert all(refusal(p.cfg, 16) is None for p in result.ranked + result.too_big)


# -- ranking ---------------------------------------------------------------------
def _key(p: Prediction) -> tuple[float, int]:
    return -p.tokens_per_s, p.memory["total"]


def test_ranked_by_tokens_per_s_and_only_what_fits(result):
    assert result.ranked and result.too_big and result.refused
    assert set(result.skipped) == {LIGHTER_FITS, SMALLER_TOO_BIG}  # both shortcuts taken, so both tested
    assert [_key(p) for p in result.ranked] == sorted(_key(p) for p in result.ranked)
    assert all(p.fits for p in result.ranked) and not any(p.fits for p in result.too_big)
    assert all(p.memory["total"] > CLUSTER.device.memory_bytes for p in result.too_big)
    totals = [p.memory["total"] for p in result.too_big]
    assert totals == sorted(totals)
    assert result.considered == sum(1 for _ in layouts(BASE, 16, 8, BATCH, set()))
    assert result.best() is result.ranked[0]


def _but_recompute(p: Prediction) -> tuple:
    return tuple(sorted((k, v) for k, v in p.layout().items() if k != "recompute"))


def test_skipping_what_cannot_win_keeps_the_best(result):
    """Against predicting every legal layout: the same winner, and each fitting layout left out has
    a ranked twin with lighter recompute that is at least as fast."""
    everything = [stand_in(cfg, 16, VOCAB, CLUSTER) for cfg in layouts(BASE, 16, 8, BATCH, set())
                  if refusal(cfg, 16) is None]
    fitting = sorted((p for p in everything if p.fits), key=_key)
    assert _key(result.ranked[0]) == _key(fitting[0])
    assert len(everything) == len(result.ranked) + len(result.too_big) + sum(result.skipped.values())
    assert min(p.memory["total"] for p in everything if not p.fits) == result.too_big[0].memory["total"]
    twins: dict[tuple, list[Prediction]] = {}
    for q in result.ranked:
        twins.setdefault(_but_recompute(q), []).append(q)
    order = ("none", "selective", "full")
    for p in fitting:
        found = twins.get(_but_recompute(p), [])
        if any(q.cfg.train.recompute == p.cfg.train.recompute for q in found):
            continue
        assert found, layout_text(p)
        assert all(order.index(q.cfg.train.recompute) < order.index(p.cfg.train.recompute)
                   and q.tokens_per_s >= p.tokens_per_s for q in found)


def test_a_heavier_recompute_is_tried_when_the_lighter_does_not_fit():
    base = BASE.replace(dp=16, micro_batch=4, zero=0)  # one mesh: only full recompute fits in 3 GB
    result = search(base, CLUSTER, VOCAB, BATCH, {"dp", "micro_batch", "zero"}, stand_in)
    assert [p.layout()["recompute"] for p in result.ranked] == ["full"]
    assert sorted(p.layout()["recompute"] for p in result.too_big) == ["none", "selective"]


def test_a_batch_no_layout_can_split_and_a_model_that_fits_nowhere_are_user_errors():
    with pytest.raises(UserError, match="--global-batch 24 cannot be split"):
        search(BASE.replace(dp=16), CLUSTER, VOCAB, 24, {"dp"}, stand_in)
    with pytest.raises(UserError, match="--dp 3 does not divide the 16 GPUs"):
        search(BASE.replace(dp=3), CLUSTER, VOCAB, BATCH, {"dp"}, stand_in)
    tiny = search(BASE, CLUSTER.with_memory(10**6), VOCAB, BATCH, set(), stand_in)
    assert not tiny.ranked
    with pytest.raises(UserError, match=r"no layout fits in the 1\.0 MiB of one H100: the smallest needs"):
        tiny.best()


# -- report ----------------------------------------------------------------------
def test_json_has_the_shape_of_cli_md(result):
    data = to_json(result, top=3)
    assert json.loads(json.dumps(data)) == data
    assert set(data) == {"candidates", "dropped", "global_batch", "cluster"}
    candidates = data["candidates"]
    assert len(candidates) == 6
    for candidate in candidates:
        assert set(candidate) == {"layout", "memory_bytes", "step_s", "tokens_per_s", "fits"}
        assert set(candidate["memory_bytes"]) == set(MEMORY_ROWS)
        assert all(isinstance(v, int) for v in candidate["memory_bytes"].values())
        layout = candidate["layout"]
        assert layout["dp"] * layout["tp"] * layout["pp"] * layout["cp"] * layout["ep"] == 16
    assert [c["fits"] for c in candidates] == [True] * 3 + [False] * 3
    assert candidates[0]["layout"] == result.ranked[0].layout()
    assert candidates[0]["tokens_per_s"] == result.ranked[0].tokens_per_s
    assert sum(data["dropped"].values()) + len(result.ranked) == result.considered
    assert data["cluster"] == {"device": "H100", "gpus": 16, "gpus_per_node": 8, "memory_bytes": 3 * GB,
                               "peak_tflops": DEVICES["H100"].tflops}


def test_table_lists_the_best_then_why_the_rest_dropped(result):
    text = format_table(result, 3, CLUSTER)
    rows = [line for line in text.splitlines() if line.lstrip()[:2] in ("1 ", "2 ", "3 ")]
    assert len(rows) == 3
    assert all(layout_text(p) in row for p, row in zip(result.ranked[:3], rows, strict=True))
    assert layout_text(result.ranked[3]) not in text
    assert f"{result.ranked[0].tokens_per_s:,.0f}" in rows[0]
    assert "params" in text and "activ" in text and "tokens/s" in text
    assert next(iter(result.refused)) in text
    assert f"{len(result.too_big)} predicted layouts do not fit" in text
    assert "the H100 has 2.8 GiB" in text


def test_layout_text_is_compact(result):
    best = result.ranked[0]
    text = layout_text(best)
    p, t = best.cfg.parallel, best.cfg.train
    assert text.startswith(f"dp{p.dp} tp{p.tp} pp{p.pp}")
    assert f"zero{p.zero}" in text and f"recompute={t.recompute}" in text and f"mb{t.micro_batch}" in text
    assert ("sp" in text.split()) == p.sp


def test_plot_writes_a_png(result, tmp_path):
    path = tmp_path / "figures" / "plan.png"
    plot(result, path, CLUSTER)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert path.stat().st_size > 10_000


# -- command line ----------------------------------------------------------------
@pytest.fixture
def planner(monkeypatch):
    """`scaletrain plan` with the stand-in where planner/predict.py's predict goes."""
    module = types.ModuleType("scaletrain.planner.predict")
    module.predict = stand_in
    monkeypatch.setitem(sys.modules, "scaletrain.planner.predict", module)


def test_plan_prints_json_best_first(planner, capsys):
    assert main(["plan", "--gpus", "8", "--top", "3", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    first = data["candidates"][0]
    assert first["fits"]
    layout = first["layout"]
    assert layout["dp"] * layout["tp"] * layout["pp"] * layout["cp"] * layout["ep"] == 8
    assert _global_batch(layout) == 64 == data["global_batch"]  # nothing given: 8 per data-parallel rank
    assert layout["precision"] == "bf16"
    speeds = [c["tokens_per_s"] for c in data["candidates"] if c["fits"]]
    assert speeds == sorted(speeds, reverse=True) and len(speeds) == 3
    assert data["cluster"]["device"] == "H100" and data["cluster"]["memory_bytes"] == 80 * GB


def test_plan_honours_fixed_flags(planner, capsys):
    assert main(["plan", "--gpus", "8", "--tp", "2", "--zero", "1", "--recompute", "full", "--no-sp",
                 "--micro-batch", "2", "--gpu", "A100", "--gpu-memory", "40GiB", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["candidates"] and data["cluster"]["memory_bytes"] == 40 * 2**30
    for candidate in data["candidates"]:
        layout = candidate["layout"]
        assert (layout["tp"], layout["zero"], layout["recompute"], layout["sp"], layout["micro_batch"]) == \
            (2, 1, "full", False, 2)


def _global_batch(layout: dict) -> int:
    return layout["micro_batch"] * layout["grad_accum"] * (layout.get("microbatches") or 1) * layout["dp"] * \
        layout["ep"]


@pytest.mark.parametrize("args, expected", [
    (["--gpus", "1", "--micro-batch", "64"], 64),                        # one device: the micro-batch is the batch
    (["--gpus", "8", "--micro-batch", "4"], 32),                         # dp searched: 4 x the 8 ranks it can reach
    (["--gpus", "8", "--tp", "2", "--micro-batch", "4", "--grad-accum", "2"], 32),   # 4 x 2 x dp 4
    (["--gpus", "8", "--dp", "2", "--micro-batch", "3"], 6),
    (["--gpus", "4", "--pp", "2", "--micro-batch", "2", "--microbatches", "4"], 16),  # 2 x 4 micro-batches x dp 2
    (["--gpus", "4", "--tp", "4"], 8),                                   # nothing of the batch given: 8 per reader
])
def test_global_batch_follows_what_was_given(planner, capsys, args, expected):
    """Without --global-batch the planner derives it (micro-batch x accumulation x data-parallel size)
    instead of refusing with a batch the user never wrote; every layout keeps it and the fixed sizes."""
    assert main(["plan", *args, "--top", "50", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["global_batch"] == expected and data["candidates"]
    for candidate in data["candidates"]:
        layout = candidate["layout"]
        assert _global_batch(layout) == expected, layout
        if "--grad-accum" in args:
            assert layout["grad_accum"] == 2
        if "--micro-batch" in args:
            assert layout["micro_batch"] == int(args[args.index("--micro-batch") + 1])


def test_plan_table_and_png(planner, capsys, tmp_path):
    path = tmp_path / "plan.png"
    assert main(["plan", "--model", "gpt-small", "--gpus", "4", "--png", str(path)]) == 0
    out = capsys.readouterr().out
    assert "tokens/s" in out and "4 x H100" in out
    assert path.read_bytes()[:4] == b"\x89PNG"


def test_plan_on_this_cpu(planner, capsys):
    assert main(["plan", "--gpu", "cpu", "--gpus", "2", "--model", "gpt-tiny", "--seq", "64", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert data["cluster"]["device"] == "cpu" and data["cluster"]["memory_bytes"] == host // 2
    assert data["cluster"]["peak_tflops"]["fp32"] > 0
    assert data["candidates"][0]["layout"]["precision"] == "fp32"


@pytest.mark.parametrize("args, phrase", [
    (["--model", "gpt-huge"], "--model gpt-huge is not a model preset"),
    (["--model", "mlp"], "--model mlp is not a model preset"),
    (["--gpus", "0"], "--gpus must be at least 1, not 0"),
    (["--layers", "-2"], "--layers must be at least 1, not -2"),
    (["--top", "0"], "--top must be at least 1"),
    (["--gpu-memory", "lots"], "--gpu-memory 'lots' is not a size"),
    (["--gpu-memory", "80"], "--gpu-memory '80' is not a size"),
    (["--gpus-per-node", "3"], "--gpus-per-node 3 must divide --gpus 8"),
    (["--dp", "3"], "--dp 3 does not divide the 8 GPUs"),
    (["--tp", "2", "--pp", "3"], "--tp 2 x --pp 3 = 6 does not divide the 8 GPUs"),
    (["--global-batch", "3", "--dp", "2"], "--global-batch 3 cannot be split"),
    (["--global-batch", "8", "--micro-batch", "3"], "--global-batch 8 cannot be split"),
    (["--grad-accum", "0"], "--grad-accum must be at least 1, not 0"),
    (["--hidden", "100", "--heads", "3"], "--hidden 100 is not divisible by --heads 3"),
    (["--gpu-memory", "1MB"], "no layout fits in the 1.0 MiB of one H100"),
    (["--param-dtype", "bf16", "--precision", "fp32"], "--param-dtype bf16 needs --precision bf16"),
])
def test_bad_input_is_one_sentence_and_exit_2(planner, capsys, args, phrase):
    assert main(["plan", "--gpus", "8", *args]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert len(captured.err.strip().splitlines()) == 1, captured.err
    assert phrase in captured.err and captured.err.startswith("scaletrain plan: ")


def test_unknown_choice_is_one_sentence_and_exit_2(planner, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["plan", "--gpu", "B200"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "invalid choice: 'B200'" in err
