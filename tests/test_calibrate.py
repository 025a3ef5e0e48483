"""scaletrain plan --calibrate (planner/calibrate.py): this CPU measured by two real gloo processes
into a machine profile at the default location, which plan, the gate and ``this_machine`` then read
(planner/profile.py), and whose figures change the predictions: faster products a faster step, a
collective's measured line its price (planner/step_time.py `collective_seconds`). The calibration
runs in quick mode, once for the module (about ten seconds); no figure it measured is asserted
beyond being positive and growing with the message."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from scaletrain.commands.cli import main
from scaletrain.config import Config
from scaletrain.errors import UserError
from scaletrain.planner import profile
from scaletrain.planner.calibrate_collectives import OPERATIONS
from scaletrain.planner.collective_fits import (
    CollectiveFit,
    CollectiveTable,
    fit_alpha_beta,
)
from scaletrain.planner.fit import machine_cluster
from scaletrain.planner.hardware import Cluster, cpu_device, shared_cpu
from scaletrain.planner.machine import this_machine
from scaletrain.planner.predict import predict
from scaletrain.planner.step_time import collective_seconds
from scaletrain.planner.traffic import Groups
from scaletrain.runtime.mesh import ParallelDims

PLAN = ["plan", "--model", "gpt-tiny", "--seq", "32", "--micro-batch", "4", "--recompute", "none", "--zero", "0",
        "--json"]


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory) -> tuple[Path, dict, str]:
    """(the cache folder, the profile, the command's output) of one quick calibration on 2 gloo processes,
    written where XDG_CACHE_HOME puts it."""
    cache = tmp_path_factory.mktemp("cache")
    env = {**os.environ, "XDG_CACHE_HOME": str(cache)}
    env.pop(profile.PROFILE_VARIABLE, None)
    done = subprocess.run([sys.executable, "-m", "scaletrain", "plan", "--calibrate", "--quick", "--nproc", "2",
                           "--backend", "gloo"], capture_output=True, text=True, env=env, timeout=240)
    assert done.returncode == 0, done.stderr
    written = cache / "scaletrain" / "machines" / profile.default_path(profile.device_name(False), "gloo").name
    return cache, json.loads(written.read_text()), done.stdout


@pytest.fixture
def here(calibrated, monkeypatch) -> dict:
    """This machine's profile found at its default location, and no other named."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(calibrated[0]))
    monkeypatch.delenv(profile.PROFILE_VARIABLE, raising=False)
    return calibrated[1]


def test_calibrating_this_cpu_measures_every_collective_on_two_gloo_processes(calibrated):
    _, measured, printed = calibrated
    machine = measured["machine"]
    assert machine["device"] == profile.device_name(False) and machine["backend"] == "gloo"
    assert machine["processes"] == 2 and machine["hostname"] and machine["torch"] and machine["date"]
    assert set(measured["collectives"]["measured"]) == set(OPERATIONS)
    for op in OPERATIONS:
        points = measured["collectives"]["measured"][op]["2"]
        assert all(seconds > 0 for seconds in points["seconds"]) and points["bytes"] == sorted(points["bytes"])
        assert points["seconds"][-1] > points["seconds"][0], op  # 4,096 times the bytes
        fit = measured["collectives"]["fits"][op]["2"]
        assert fit["alpha_s"] >= 0 and fit["bytes_per_s"] > 0
    assert all(value > 0 for row in measured["matmul"]["tflops"] for value in row)
    assert measured["attention"]["tflops"] > 0 and measured["block_overhead_s"] > 0
    assert measured["memory"]["elementwise_gbps"] > 0 and measured["memory"]["adamw_gbps"] > 0
    assert measured["step_overhead_s"] > 0  # the trainer's own steps, timed (planner/calibrate_engine.py)
    assert measured["attention"]["ring_tflops"] > 0  # context parallelism's blocks, timed as the ring runs them
    sharing = measured["sharing"]  # the two processes' turns on the cores (planner/calibrate_sharing.py)
    assert sharing["processes"] == 2 and 0 < sharing["efficiency"] <= 1 and sharing["sync_s"] >= 0
    assert "machine profile: " in printed and "all_to_all" in printed and "fixed cost of a step" in printed
    assert "ring attention" in printed and "2 processes on" in printed


def test_the_alpha_beta_fit_recovers_a_line_and_grows_with_the_message():
    fit = fit_alpha_beta([4096, 262144, 16777216], [1e-4 + s / 2e9 for s in (4096, 262144, 16777216)])
    assert fit.alpha_s == pytest.approx(1e-4) and fit.bytes_per_s == pytest.approx(2e9)
    noisy = fit_alpha_beta([4096, 262144, 16777216], [3e-4, 1e-4, 8e-3])  # a slow small call
    assert noisy.alpha_s >= 0 and noisy.seconds(1, 2**24) > noisy.seconds(1, 2**12)


def test_the_profile_lives_under_xdg_cache_home_unless_one_is_named(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv(profile.PROFILE_VARIABLE, raising=False)
    assert profile.chosen_path(None, "NVIDIA H200", "nccl") == (
        tmp_path / "scaletrain" / "machines" / "nvidia-h200-nccl.json", "the default location")
    monkeypatch.setenv(profile.PROFILE_VARIABLE, "/cluster/h200.json")
    assert profile.chosen_path(None, "NVIDIA H200", "nccl") == (Path("/cluster/h200.json"), "SCALETRAIN_PROFILE")
    assert profile.chosen_path("mine.json", "NVIDIA H200", "nccl") == (Path("mine.json"), "--profile")


def _plan(capsys, *flags: str) -> float:
    assert main([*PLAN, *flags]) == 0
    return json.loads(capsys.readouterr().out)["candidates"][0]["step_s"]


def _written(tmp_path: Path, name: str, measured: dict) -> str:
    path = tmp_path / name
    path.write_text(json.dumps(measured))
    return str(path)


def test_a_profile_with_twice_the_products_rate_predicts_a_faster_step(here, tmp_path, capsys):
    faster = copy.deepcopy(here)
    faster["matmul"]["tflops"] = [[2 * value for value in row] for row in here["matmul"]["tflops"]]
    measured = _plan(capsys, "--gpus", "1", "--profile", _written(tmp_path, "measured.json", here))
    assert _plan(capsys, "--gpus", "1", "--gpu", "here") == measured  # the default location's, the same file
    assert _plan(capsys, "--gpus", "1", "--profile", _written(tmp_path, "faster.json", faster)) < measured


def test_collectives_on_a_node_are_priced_from_the_measured_table(here, tmp_path, capsys):
    table = profile.device_of(here).collectives
    assert table.lookup("all_reduce", 2) is not None and table.lookup("send", 4) == table.lookup("send", 2)
    slow = copy.deepcopy(here)
    slow["collectives"]["fits"]["all_reduce"]["2"]["alpha_s"] = 1.0
    layout = ("--gpus", "2", "--dp", "2")
    assert _plan(capsys, *layout, "--profile", _written(tmp_path, "slow.json", slow)) > \
        _plan(capsys, *layout, "--profile", _written(tmp_path, "measured.json", here)) + 0.5

    fit = CollectiveFit(alpha_s=1e-3, bytes_per_s=1e9)
    device = cpu_device(1.0, 2**30)
    traffic = {"all_reduce": {"dp": {"calls": 3, "bytes": 6_000_000, "wire_bytes": 6_000_000}}}
    measured = Cluster(replace(device, collectives=CollectiveTable((("all_reduce", 2, fit),))), 2, 2)
    assert collective_seconds(traffic, {"dp": 2}, ParallelDims(dp=2), measured)["dp"] == pytest.approx(3e-3 + 6e-3)
    across_nodes = Cluster(measured.device, 2, 1)  # the table is this node's: a group over two takes the link
    assert collective_seconds(traffic, {"dp": 2}, ParallelDims(dp=2), across_nodes) == \
        collective_seconds(traffic, {"dp": 2}, ParallelDims(dp=2), Cluster(device, 2, 1))


def test_this_machine_is_planned_with_its_profile(here):
    cluster = this_machine(2, 2, on_gpu=False)
    calibrated = profile.device_of(here)
    assert cluster.device.matmul == calibrated.matmul and cluster.device.collectives == calibrated.collectives
    # two processes on two cores: each its own, at the share they reached together
    assert cluster.device.memory_gbps == pytest.approx(here["memory"]["elementwise_gbps"] * here["sharing"]["efficiency"])
    assert machine_cluster(2, 2**30, on_gpu=False).device.collectives == calibrated.collectives


def test_a_profile_of_another_device_is_refused_in_one_sentence(here, tmp_path, monkeypatch, capsys):
    other = copy.deepcopy(here)
    other["machine"]["device"] = "NVIDIA H200"
    monkeypatch.setenv(profile.PROFILE_VARIABLE, _written(tmp_path, "h200.json", other))
    assert main([*PLAN, "--gpus", "1", "--gpu", "here"]) == 2
    said = capsys.readouterr().err.strip()
    assert "measured NVIDIA H200, not this machine's" in said and len(said.splitlines()) == 1
    with pytest.raises(UserError, match="SCALETRAIN_PROFILE"):
        machine_cluster(2, 2**30, on_gpu=False)  # the gate's and --micro-batch auto's
    with pytest.raises(UserError, match="not this machine's"):
        this_machine(2, 2, on_gpu=False)
    assert main([*PLAN, "--gpus", "1", "--profile", os.environ[profile.PROFILE_VARIABLE]]) == 0  # plan: any machine


def test_a_damaged_profile_or_a_flag_without_calibrate_is_one_sentence(tmp_path, capsys):
    damaged = tmp_path / "damaged.json"
    damaged.write_text('{"format": 1, "machine": {}}')
    assert main([*PLAN, "--gpus", "1", "--profile", str(damaged)]) == 2
    assert "is not a machine profile this version reads" in capsys.readouterr().err
    assert main([*PLAN, "--gpus", "1", "--quick"]) == 2
    assert "add --calibrate or drop --quick" in capsys.readouterr().err


def test_an_older_profile_nobody_named_is_warned_of_and_left_unread(here, monkeypatch, capsys):
    """A run must not stop on a profile an earlier version left at the default location: the planner
    says so and uses the datasheet figures; a profile named by SCALETRAIN_PROFILE is refused."""
    saved = profile.default_path(profile.device_name(False), "gloo")
    older = saved.with_name("older.json")
    older.write_text(json.dumps({**here, "format": profile.FORMAT - 1}))
    monkeypatch.setattr(profile, "default_path", lambda device, backend: older)
    assert this_machine(2, 2, on_gpu=False).device.collectives is None
    said = capsys.readouterr().err.strip()
    assert said.startswith("warning: ") and "not a machine profile this version reads" in said
    assert len(said.splitlines()) == 1
    monkeypatch.setenv(profile.PROFILE_VARIABLE, str(older))
    with pytest.raises(UserError, match="not a machine profile this version reads"):
        this_machine(2, 2, on_gpu=False)


def test_a_cpus_processes_share_its_cores():
    """Figures one single-threaded process measured alone on two cores, as each process of a run sees them:
    one process computes with both cores' threads, two with one each, four take turns two at a time."""
    measured = replace(cpu_device(1.0, 2**30), memory_gbps=10.0, block_overhead_s=1e-3, step_overhead_s=2e-3)
    one, two, four = (shared_cpu(measured, measured_threads=1, cores=2, processes=n) for n in (1, 2, 4))
    assert (one.tflops["fp32"], two.tflops["fp32"], four.tflops["fp32"]) == (2.0, 1.0, 0.5)
    assert (one.memory_gbps, four.memory_gbps) == (20.0, 5.0)
    assert (two.block_overhead_s, four.block_overhead_s, four.step_overhead_s) == (1e-3, 2e-3, 4e-3)
    assert not two.lends_idle_cores and four.lends_idle_cores


def test_on_a_cpu_no_collective_hides_and_lent_cores_make_the_bubble_free():
    """gloo's transfers take the cores the compute uses: the step waits for every collective; a rank idle
    in a pipeline's bubble lends its core where processes outnumber cores (planner/step_time.py)."""
    dense = Config().replace(name="gpt-tiny", seq_len=32, micro_batch=4, dp=2)
    cpu = Cluster(cpu_device(0.1, 2**34), 2, 2)
    predicted = predict(dense, 2, 257, cpu)
    groups = Groups.of(dense, 2)
    every = sum(collective_seconds(predicted.comm[0], groups.sizes, dense.parallel.mesh_dims(2), cpu).values())
    assert predicted.time["comm"] == pytest.approx(every)
    assert predict(dense, 2, 257, Cluster(replace(cpu.device, hides_communication=True), 2, 2)).time["comm"] < every
    piped = dense.replace(dp=1, pp=2, microbatches=4, micro_batch=1)
    assert predict(piped, 2, 257, cpu).time["bubble"] > 0
    assert predict(piped, 2, 257, Cluster(replace(cpu.device, lends_idle_cores=True), 2, 2)).time["bubble"] == 0


def test_the_processes_rates_together_apply_at_the_calibrations_count_only(here):
    """The sharing measured with N processes is how N processes run (planner/hardware.py `contended`); a
    run of another count takes the turn-taking rates alone."""
    measured = copy.deepcopy(here)
    measured["sharing"] = {"processes": 2, "efficiency": 0.5, "sync_s": 0.01}
    plain = copy.deepcopy(here)
    plain["sharing"] = None
    for count in (2, 4):
        shared, turns = profile.device_of(measured, count), profile.device_of(plain, count)
        ratio = 0.5 if count == 2 else 1.0
        assert shared.tflops["fp32"] == pytest.approx(ratio * turns.tflops["fp32"])
        assert shared.memory_gbps == pytest.approx(ratio * turns.memory_gbps)
        assert shared.block_overhead_s == pytest.approx(turns.block_overhead_s / ratio)
        assert shared.sync_s == (0.01 if count == 2 else 0.0)


def test_each_collective_call_waits_the_measured_sync_on_a_shared_cpu():
    """planner/step_time.py: every call of the step (a tp all-reduce per block as much as a gradient's) adds
    ``sync_s`` to the exposed communication."""
    layout = Config().replace(name="gpt-tiny", seq_len=32, micro_batch=4, dp=1, tp=2)
    cpu = Cluster(cpu_device(0.1, 2**34), 2, 2)
    waiting = Cluster(replace(cpu.device, sync_s=0.01), 2, 2)
    calls = max(sum(entry["calls"] for groups in traffic.values() for entry in groups.values())
                for traffic in predict(layout, 2, 257, cpu).comm)
    assert calls > 4  # the tensor-parallel all-reduces of two blocks
    assert predict(layout, 2, 257, waiting).time["comm"] == pytest.approx(
        predict(layout, 2, 257, cpu).time["comm"] + 0.01 * calls)


@pytest.mark.slow
def test_the_first_plan_on_a_machine_without_a_profile_measures_and_saves_it(tmp_path, monkeypatch):
    """A whole calibration (about half a minute on two cores):
    ``python3 -m pytest -m slow tests/test_calibrate.py``."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv(profile.PROFILE_VARIABLE, raising=False)
    cluster = this_machine(2, 2, on_gpu=False, calibrate_if_missing=True)
    saved = profile.default_path(profile.device_name(False), "gloo")
    assert saved.is_relative_to(tmp_path) and cluster.device.collectives is not None
    assert this_machine(2, 2, on_gpu=False).device == cluster.device  # read back, not measured again
