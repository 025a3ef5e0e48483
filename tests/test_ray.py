"""--launcher ray on a real Ray cluster, started by these tests and stopped after them
(runtime/ray_launch.py): dp2 under Ray trains as dp2 under --nproc, a killed Ray worker is
restarted by Ray and resumes exactly, `ray job submit` runs the trainer, `scaletrain run`
launches a script on Ray workers, and mistakes are one sentence."""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from scaletrain.commands.cli import main
from scaletrain.commands.parity import relative_diffs
from scaletrain.runtime import free_port
from scaletrain.train.checkpoint import read_model_tensors
from tests.readme import readme_argv

pytest.importorskip("ray.train")
RAY = str(Path(sys.executable).parent / "ray")  # the command installed beside this interpreter
TIMEOUT_S = 300
TINY = ("--model", "gpt-tiny", "--steps", "2")


@dataclass(frozen=True)
class Cluster:
    address: str  # the GCS's, for --ray-address
    dashboard: str  # the job server's, for ray job submit
    env: dict[str, str]  # token authentication, as Ray's clusters use it


@pytest.fixture(scope="module")
def cluster() -> Cluster:
    """A Ray cluster of this run's own, as ``ray start`` makes one. Its own temporary folder
    (RAY_TMPDIR: where --ray-address auto and ray.init() look for a running cluster) and its own
    process group, stopped by signalling that group: ``ray stop`` would stop every Ray process
    on the machine, a second test run's cluster too."""
    folder = tempfile.mkdtemp(prefix="ray-")  # short: Ray's socket paths must stay under 108 bytes
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32), "RAY_TMPDIR": folder}
    port, dashboard = free_port(), free_port()
    log = Path(folder, "head.log")
    with log.open("w") as out:  # the head keeps its own copy of the descriptor
        head = subprocess.Popen([RAY, "start", "--head", "--block", "--node-ip-address=127.0.0.1", f"--port={port}",
                                 "--num-cpus=4", "--include-dashboard=true", "--dashboard-host=127.0.0.1",
                                 f"--dashboard-port={dashboard}", "--disable-usage-stats"],
                                env=env, start_new_session=True, stdout=out, stderr=subprocess.STDOUT)
    try:
        _wait_for(Path(folder, "ray", "ray_current_cluster"), head, log)  # written once the head is up
        yield Cluster(f"127.0.0.1:{port}", f"http://127.0.0.1:{dashboard}", env)
    finally:
        os.killpg(head.pid, signal.SIGTERM)  # the head and every process it started, no one else's
        with contextlib.suppress(subprocess.TimeoutExpired):  # a head left alone takes half a minute to stop
            head.wait(timeout=5)
        with contextlib.suppress(ProcessLookupError):  # what of the group is still running
            os.killpg(head.pid, signal.SIGKILL)
        head.wait()
        shutil.rmtree(folder, ignore_errors=True)


def _wait_for(address_file: Path, head: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not address_file.exists():
        if head.poll() is not None:
            raise RuntimeError(f"ray start failed: {log.read_text()[-2000:]}")
        assert time.monotonic() < deadline, f"the Ray head did not start within {TIMEOUT_S} s"
        time.sleep(0.5)


def _command(command: str, corpus: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "scaletrain", command, "--model", "gpt-tiny", "--data", str(corpus),
            "--seq-len", "32", "--micro-batch", "4", "--grad-accum", "2", "--steps", "6", "--checkpoint-every", "2",
            "--warmup-steps", "1", "--eval-every", "0", "--eval-batches", "1", "--sample-tokens", "0",
            "--no-progress", "--timeout", "30", "--cache-dir", str(out.parent / "cache"), "--out", str(out), *extra]


def _train(corpus: Path, out: Path, *extra: str) -> list[str]:
    return _command("train", corpus, out, "--nproc", "2", *extra)


def _run(args: list[str], env: dict[str, str] | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    result = subprocess.run(args, capture_output=True, text=True, timeout=TIMEOUT_S, env=env, cwd=cwd)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    return result


def _losses(run: Path) -> list[float]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    return [r["loss"] for r in records]


@pytest.fixture(scope="module")
def on_ray(cluster, corpus, tmp_path_factory) -> Path:
    """An uninterrupted dp2 run on the cluster's Ray Train workers."""
    run = tmp_path_factory.mktemp("ray") / "run"
    # the cluster found as a user's is: --ray-address auto, in the folder ``ray start`` records it in
    _run(_train(corpus, run, "--launcher", "ray", "--ray-address", "auto"), cluster.env)
    return run


def test_dp2_under_ray_trains_as_dp2_under_nproc(on_ray, corpus, tmp_path):
    """Parity: the same global batch, the same losses and weights (relative 1e-5) as the local spawner's."""
    local = tmp_path / "local"
    _run(_train(corpus, local))
    assert _losses(on_ray) == pytest.approx(_losses(local), rel=1e-5)
    final = "checkpoints/step_000006"
    assert relative_diffs(read_model_tensors(on_ray / final), read_model_tensors(local / final))[1] < 1e-5
    assert (on_ray / "ray" / "run").is_dir()  # Ray's own records of the run, in the run folder


@pytest.mark.slow  # 30 s; restarts that resume exactly run by default under our launcher (tests/test_faults.py)
def test_a_killed_ray_worker_is_restarted_and_resumes_exactly(on_ray, cluster, corpus, tmp_path):
    """Submitted as a Ray job; rank 1 is killed in step 5. Ray's FailureConfig (--max-restarts 1)
    starts a new worker group, which goes on from step_000004 and ends where the uninterrupted
    run ends, bit for bit: the same workers' arithmetic."""
    run = tmp_path / "restarted"
    fault = json.dumps({"env_vars": {"SCALETRAIN_FAULT": "kill rank=1 step=5 at=micro-batch"}})
    submitted = _run([RAY, "job", "submit", "--address", cluster.dashboard, "--runtime-env-json", fault, "--",
                      *_train(corpus, run, "--launcher", "ray", "--max-restarts", "1")], cluster.env)
    assert "ActorDiedError" in submitted.stdout + submitted.stderr  # the first worker group did lose a rank
    assert "resumed from checkpoint step_000004" in submitted.stdout
    assert _losses(run) == _losses(on_ray)
    final = "checkpoints/step_000006"
    mine, straight = read_model_tensors(run / final), read_model_tensors(on_ray / final)
    assert all(torch.equal(mine[name], straight[name]) for name in straight)


@pytest.mark.slow  # Ray's workers run by default under --launcher ray (on_ray)
def test_scaletrain_run_launches_a_script_on_ray_workers(cluster, tmp_path):
    """A torchrun-style script makes its own process group on the Ray workers."""
    script = tmp_path / "script.py"
    script.write_text(
        "import os, sys, torch, torch.distributed as dist\n"
        "dist.init_process_group('gloo')\n"
        "total = torch.tensor([dist.get_rank() + 1.0])\n"
        "dist.all_reduce(total)\n"
        "print(f'rank {dist.get_rank()} of {dist.get_world_size()}: {total.item():g} {sys.argv[1:]}', flush=True)\n"
        "dist.barrier()\n"
        "dist.destroy_process_group()\n")
    result = _run([sys.executable, "-m", "scaletrain", "run", "--launcher", "ray", "--ray-address", cluster.address,
                   "--nproc", "2", str(script), "--epochs", "3"], cluster.env)
    for rank in (0, 1):
        assert f"rank {rank} of 2: 3 ['--epochs', '3']" in result.stdout + result.stderr


@pytest.mark.slow  # --ray-address auto trains by default in on_ray, beside the local spawner's run
def test_the_readme_ray_train_command(cluster, tmp_path):
    """The README's Ray training line as a user types it on a machine where ``ray start`` runs a
    cluster (found by --ray-address auto), at tiny size, with the sample and evaluation on."""
    train = _run([sys.executable, "-m", *readme_argv("scaletrain train --launcher ray --nproc 4 --ray-address auto"),
                  *TINY], cluster.env, cwd=tmp_path)
    assert "layout dp4 on 4 process(es)" in train.stdout and "--- sample ---" in train.stdout


def test_the_readme_sweep_command(cluster, tmp_path):
    """The README's sweep line, its trials on the cluster (found through RAY_ADDRESS, as under
    ray job submit), each tracked in MLflow."""
    sweep = _run([sys.executable, "-m", *readme_argv("scaletrain sweep --grid lr=1e-4,3e-4,1e-3 --tracker mlflow"),
                  *TINY], {**cluster.env, "RAY_ADDRESS": cluster.address}, cwd=tmp_path)
    folder = re.search(r"all in (\S+)/sweep\.json", sweep.stdout).group(1)
    trials = json.loads((tmp_path / folder / "sweep.json").read_text())["trials"]
    assert sorted(t["lr"] for t in trials) == [1e-4, 3e-4, 1e-3] and (tmp_path / "mlruns").is_dir()


def _refused(capsys, args: list[str]) -> str:
    """The sentence ``scaletrain ARGS`` refuses with, run in this process (exit code 2, no traceback)."""
    assert main(args[3:]) == 2
    said = capsys.readouterr().err
    assert "Traceback" not in said and len(said.strip().splitlines()) == 1, said
    return said


def test_the_search_space_holds_each_grid_and_draw():
    """--grid values as Tune's grid search, in their field's type; --log-uniform draws within their bounds."""
    from scaletrain.commands.cli import build_parser
    from scaletrain.commands.sweep import search_space

    args = build_parser().parse_args(["sweep", "--grid", "micro_batch=4,8", "--log-uniform", "lr=1e-4:1e-2"])
    space = search_space(args)
    assert space["micro_batch"] == {"grid_search": [4, 8]}
    draws = space["lr"].sample(size=200, random_state=0)
    assert all(1e-4 <= draw <= 1e-2 for draw in draws) and min(draws) < 1e-3 < max(draws)


@pytest.mark.parametrize("flags, sentence", [
    (["--grid", "learning_rate=1e-3"], "'learning_rate' is not a field of scaletrain train"),
    (["--grid", "micro_batch=4,eight"], "--grid micro_batch='eight' is not a whole number"),
    (["--log-uniform", "lr=1e-2:1e-4"], "needs a float field and 0 < LOW < HIGH"),
    (["--log-uniform", "dropout=0.01:2"], "--dropout must be in [0, 1)"),  # a draw's bound checked as a value
    (["--grid", "lr=1e-3", "--metric", "val_loss"], "--eval-every 0 never measures"),
    (["--grid", "lr=1e-3", "--nproc", "2"], "a sweep's trials are one process each"),
    (["--grid", "lr=1e-3,-1"], "--lr must be positive"),
    (["--grid", "lora_rank=0,8"], "--lora-rank adapts a base model, and there is none without --from"),
    ([], "a sweep needs something to vary"),
])
def test_sweep_mistakes_are_one_sentence_before_any_trial(corpus, tmp_path, capsys, flags, sentence):
    sweep = tmp_path / "sweep"
    assert sentence in _refused(capsys, _command("sweep", corpus, sweep, *flags))
    assert not sweep.exists()


@pytest.mark.parametrize("flags, sentence", [
    (["--ray-address", "127.0.0.1:9"], "--ray-address places Ray workers; add --launcher ray"),
    (["--launcher", "ray", "--ray-address", f"127.0.0.1:{free_port()}"], "nothing answers there"),
    (["--launcher", "ray", "--gpus-per-worker", "0.5"], "lets two of the 2 workers share a GPU"),
])
def test_ray_mistakes_are_one_sentence_and_leave_no_run_folder(corpus, tmp_path, capsys, flags, sentence):
    run = tmp_path / "run"
    assert sentence in _refused(capsys, _train(corpus, run, *flags))
    assert not run.exists()


@pytest.mark.slow  # 19 s: it starts a local Ray instance to learn its CPUs
def test_a_local_instance_short_of_cpus_is_refused_and_leaves_no_run_folder(corpus, tmp_path):
    """A Ray instance of this machine cannot grow: workers it could never place are one sentence.
    (In a process of its own: the instance it starts and stops is none of the test process's state.)"""
    run = tmp_path / "run"
    result = subprocess.run(_train(corpus, run, "--launcher", "ray", "--cpus-per-worker", "100000"),
                            capture_output=True, text=True, timeout=TIMEOUT_S)
    assert result.returncode == 2, result.stderr[-3000:]
    said = [line for line in result.stderr.splitlines() if line.startswith("scaletrain train:")]
    assert len(said) == 1 and "need 200000, but this machine has" in said[0] and "Traceback" not in result.stderr
    assert not run.exists()


@pytest.mark.slow  # the README's sweep runs by default (test_the_readme_sweep_command)
def test_a_sweep_stops_the_worse_trial_early_and_tracks_every_trial_in_mlflow(cluster, corpus, tmp_path):
    """Two learning rates, one trial at a time: ASHA lets the first run to the end and stops the
    second at its first rung (step 4), whose loss is worse; each trial is an MLflow run (in a real
    SQLite store), FINISHED or KILLED, its logged losses those of its metrics.jsonl."""
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    sweep = tmp_path / "sweep"
    _run(_command("sweep", corpus, sweep, "--steps", "8", "--tracker", "mlflow", "--experiment", "sweep",
                  "--ray-address", cluster.address, "--grid", "lr=1e-2,1e-5", "--grace-steps", "4",
                  "--max-concurrent", "1"), {**cluster.env, "MLFLOW_TRACKING_URI": uri},
         cwd=tmp_path)  # where MLflow puts a database store's artifacts: ./mlruns
    written = json.loads((sweep / "sweep.json").read_text())
    assert (written["metric"], written["fields"]) == ("loss", ["lr"])
    trials = {t["lr"]: t for t in written["trials"]}
    assert (trials[1e-2]["status"], trials[1e-5]["status"]) == ("finished", "stopped at step 4")
    assert trials[1e-2]["best"] < trials[1e-5]["best"]

    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("sweep").experiment_id])
    assert sorted((r.data.params["train.lr"], r.info.status) for r in runs) == [("0.01", "FINISHED"),
                                                                                ("1e-05", "KILLED")]
    for mlflow_run in runs:
        logged = [m.value for m in sorted(client.get_metric_history(mlflow_run.info.run_id, "loss"),
                                          key=lambda m: m.step)]
        records = Path(trials[float(mlflow_run.data.params["train.lr"])]["run"]) / "metrics.jsonl"
        assert logged == [json.loads(line)["loss"] for line in records.read_text().splitlines()]


@pytest.mark.slow
def test_a_worker_dying_with_no_restarts_left_is_one_sentence(cluster, corpus, tmp_path):
    """Without --max-restarts Ray gives up at the first death: one sentence naming the rank and the
    checkpoint to resume from."""
    run = tmp_path / "run"
    result = subprocess.run(_train(corpus, run, "--launcher", "ray", "--ray-address", cluster.address),
                            capture_output=True, text=True, timeout=TIMEOUT_S,
                            env={**cluster.env, "SCALETRAIN_FAULT": "kill rank=1 step=3"})
    assert result.returncode == 1, result.stderr[-3000:]
    said = [line for line in result.stderr.splitlines() if line.startswith("scaletrain train:")]
    assert said == ["scaletrain train: rank 1's Ray worker died and Ray's restarts (--max-restarts) were spent; its "
                    "newest complete checkpoint is step_000002: run the same command with --resume to go on from "
                    "there (a launch with --max-restarts, ours or torchrun's, does it by itself)."]
