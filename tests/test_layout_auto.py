"""``--layout auto`` (planner/auto.py): the run takes the planner's first-ranked layout, keeps the
sizes the user gave, agrees on every rank, records predicted against measured, and refuses what
it cannot plan in one sentence. The four-process run against a plain run of its layout (about
60 s on two cores) and rank 0's refusal under torchrun are slow:
``python3 -m pytest -q -m slow tests/test_layout_auto.py``."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import tomllib
import torch
from torch import nn

from scaletrain.config import Config
from scaletrain.config_checks import check_here
from scaletrain.errors import UserError
from scaletrain.library_checks import engine_config
from scaletrain.planner.auto import (
    kept_axes,
    module_layout,
    plan_for_run,
    run_global_batch,
)
from scaletrain.planner.gate import Machine, module_price, module_weights, run_vocab
from scaletrain.planner.predict import predict
from scaletrain.planner.prediction import as_flags
from scaletrain.planner.search import layout_text, search
from scaletrain.runtime.launch import free_port
from scaletrain.runtime.mesh import ParallelDims
from scaletrain.runtime.spawn import spawn_local
from tests.conftest import run_cli

SIZES = ("dp", "tp", "pp", "cp", "ep", "zero", "micro_batch", "grad_accum")


def _auto_run(corpus, out, *extra: str) -> list[str]:
    return ["train", "--layout", "auto", "--model", "gpt-tiny", "--data", str(corpus), "--seq-len", "32",
            "--steps", "3", "--warmup-steps", "1", "--eval-every", "0", "--eval-batches", "1", "--sample-tokens",
            "0", "--no-progress", "--out", str(out), "--cache-dir", str(out.parent / "cache"), *extra]


def _chosen(out) -> tuple[dict, dict]:
    """(plan.json, config.toml's sizes) of a run folder."""
    plan = json.loads((out / "plan.json").read_text())
    saved = tomllib.loads((out / "config.toml").read_text())
    flat = {key: value for section in saved.values() for key, value in section.items()}
    assert flat["layout"] == "auto"
    return plan, {name: flat[name] for name in SIZES}


def _losses(out) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_the_choice_is_the_search_first_ranked_layout_at_the_plain_run_global_batch():
    cfg = Config().replace(name="gpt-tiny", seq_len=32)
    planned = plan_for_run(cfg, 4, 4, False, {"tp"})
    assert run_global_batch(cfg, 4, {"tp"}) == 16 * 4  # a plain --nproc 4 run: micro-batch 16 on 4 readers
    assert run_global_batch(cfg.replace(tp=2, grad_accum=2), 4, {"tp", "grad_accum"}) == 16 * 2 * 2
    first = search(cfg, planned.cluster, run_vocab(cfg), 64, {"tp"}, predict).ranked[0]
    assert planned.record["layout_text"] == layout_text(first)
    assert planned.record["layout"]["tp"] == 1  # kept as the command line gave it
    assert planned.sentence.startswith(f"--layout auto: {layout_text(first)}, the fastest of ")


def test_torchrun_ranks_take_rank_0s_choice_and_keep_the_given_tp(corpus, tmp_path):
    out = tmp_path / "run"
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                             "--master-port", str(free_port()), "-m", "scaletrain",
                             *_auto_run(corpus, out, "--tp", "2", "--debug-dist")],
                            capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    plan, sizes = _chosen(out)
    assert sizes["tp"] == 2 and sizes["dp"] == 1  # --debug-dist checked every rank's configuration alike
    assert result.stdout.count("--layout auto: dp1 tp2 ") == 2  # the choice, then predicted against measured
    assert {name: plan["layout"][name] for name in SIZES} == sizes
    assert plan["predicted"]["step_s"] > 0 and plan["measured"]["steps_timed"] == 1
    assert plan["measured"]["memory_bytes"]["counted"] > 0


@pytest.mark.slow  # a calibration and two four-process runs, about 2 minutes on two cores
def test_nproc_4_trains_the_planners_pick_as_a_plain_run_of_it_does(corpus, tmp_path, monkeypatch):
    """The first auto run on a machine without a profile measures it (4 processes, as the run starts)
    and saves it where the next run finds it."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache-home"))
    auto, plain = tmp_path / "auto", tmp_path / "plain"
    result = run_cli(*_auto_run(corpus, auto, "--nproc", "4"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "this machine has no profile yet: measuring it once" in result.stdout
    (written,) = (tmp_path / "cache-home" / "scaletrain" / "machines").glob("*-gloo.json")
    assert json.loads(written.read_text())["machine"]["processes"] == 4
    plan, sizes = _chosen(auto)
    assert result.stdout.count(plan["sentence"]) == 1
    assert plan["global_batch"] == 16 * 4 and "step_s" in plan["measured"]
    layout = {name: value for name, value in plan["layout"].items() if name not in ("precision", "offload")}
    args = _auto_run(corpus, plain, "--nproc", "4", *as_flags(layout).split())
    result = run_cli(*[arg for arg in args if arg not in ("--layout", "auto")])
    assert result.returncode == 0, result.stderr[-3000:]
    assert _losses(auto) == pytest.approx(_losses(plain), rel=1e-6)


def test_what_auto_cannot_plan_is_one_sentence_before_any_work(corpus, tmp_path):
    result = run_cli(*_auto_run(corpus, tmp_path / "run", "--model", "mlp"))
    assert result.returncode == 2 and "--layout auto plans a decoder's layout" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("changes, words", [
    ({"micro_batch": "auto"}, "drop --micro-batch auto"),
    ({"launcher": "ray"}, "does not; give the layout's sizes"),
])
def test_auto_beside_what_plans_elsewhere_is_refused(changes, words):
    with pytest.raises(UserError, match=words):
        kept_axes(Config().replace(layout="auto", **changes), ())


def test_only_auto_is_a_layout_and_parity_runs_the_one_given():
    with pytest.raises(UserError, match="'layout' must be one of auto, not 'fast'"):
        engine_config({"layout": "fast"})
    with pytest.raises(UserError, match="--layout auto is chosen by a training run"):
        check_here(Config().replace(layout="auto"), "parity")


def test_no_fitting_layout_is_the_search_sentence():
    cfg = Config().replace(name="gpt-tiny", seq_len=32, micro_batch=10**6)
    with pytest.raises(UserError, match=r"^--layout auto: no layout fits"):
        plan_for_run(cfg, 1, 1, False, {"micro_batch"})


def test_setup_auto_takes_the_lowest_zero_stage_that_fits():
    model = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 256))
    dims = ParallelDims.infer(4)
    cfg = Config()
    price = module_price(module_weights(model), cfg, dims, Machine(10**12, False, 4))
    zero_0, zero_1 = price({"zero": 0}, 1)["total"], price({"zero": 1}, 1)["total"]
    machine = Machine((zero_0 + zero_1) // 2, False, 4)  # room for ZeRO-1's sharded state, not for whole copies
    assert module_layout(model, cfg, dims, machine, (), False)[0] == 1
    assert module_layout(model, cfg.replace(zero=3), dims, machine, ("zero",), False)[0] == 3  # given: kept
    with pytest.raises(UserError, match="no ZeRO stage"):
        module_layout(model, cfg, dims, Machine(1000, False, 4), (), False)


def test_setup_layout_auto_in_two_processes_agrees():
    results = spawn_local(2, _auto_setup_step, ())
    assert results[0] == results[1] and results[0][0] == 0  # a small module fits without sharding


def _auto_setup_step() -> tuple[int, float]:
    import scaletrain

    torch.manual_seed(0)
    with scaletrain.setup(nn.Linear(8, 4), layout="auto", lr=0.1) as engine:
        x, y = torch.randn(4, 8), torch.randint(0, 4, (4,))
        engine.backward(nn.functional.cross_entropy(engine(x), y))
        return engine.stepper.parallel.zero, engine.step()["loss"]


@pytest.mark.slow  # a third torchrun job, about 12 s on two cores
def test_rank_0s_refusal_under_torchrun_reaches_every_rank(corpus, tmp_path):
    out = tmp_path / "run"
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                             "--master-port", str(free_port()), "-m", "scaletrain",
                             *_auto_run(corpus, out, "--micro-batch", "1000000")],
                            capture_output=True, text=True, timeout=240)
    assert result.returncode != 0
    assert result.stderr.count("--layout auto: no layout fits") == 2, result.stderr[-3000:]
    assert 'scaletrain/' not in "".join(l for l in result.stderr.splitlines() if l.strip().startswith("File"))
