"""--tracker (job/trackers.py) against a real MLflow store and a real ``mlflow server`` started
here: every record of metrics.jsonl read back through MLflow's client, the configuration and
files, a resumed run continuing its MLflow run, and a tracker that cannot be reached costing one
warning, not the run."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from scaletrain.commands.train import launch
from scaletrain.config_checks import check_values
from scaletrain.errors import UserError
from scaletrain.job.metrics import read_metrics

mlflow = pytest.importorskip("mlflow")


def _runs(folder):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{folder / 'mlruns' / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("scaletrain")
    return client, client.search_runs([experiment.experiment_id])


def test_mlflow_holds_what_metrics_jsonl_holds(tiny_cfg, tmp_path, monkeypatch):
    from scaletrain.job import trackers

    monkeypatch.chdir(tmp_path)  # the default store: ./mlruns
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setattr(trackers, "SYSTEM_EVERY_S", 0.05)  # samples within a run of a second
    summary = launch(tiny_cfg.replace(tracker="tensorboard,mlflow", eval_every=2, register="tiny-lm"))
    records = read_metrics(summary.run_dir / "metrics.jsonl")
    client, (run,) = _runs(tmp_path)
    (version,) = client.search_model_versions("name = 'tiny-lm'")  # the final model, registered
    assert version.run_id == run.info.run_id and version.source.endswith("/model")
    assert [a.path for a in client.list_artifacts(run.info.run_id, "model")] == ["model/model.safetensors"]
    assert run.info.status == "FINISHED" and run.info.run_name == summary.run_dir.name
    assert run.data.params["train.lr"] == str(tiny_cfg.train.lr) and run.data.params["model.name"] == "gpt-tiny"
    numeric = {key for record in records for key, value in record.items()
               if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool)}
    assert {"loss", "grad_norm", "lr", "tokens_per_s", "val_loss"} <= numeric
    for key in numeric:
        logged = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key))
        assert logged == [(r["step"], pytest.approx(float(r[key]))) for r in records if key in r and r[key] is not None]
    assert {a.path for a in client.list_artifacts(run.info.run_id)} >= {"config.toml"}
    assert "system/cpu_utilization_percentage" in run.data.metrics  # MLflow's own monitor of the machine
    assert run.data.metrics["system/system_memory_usage_megabytes"] > 0
    assert any((summary.run_dir / "tensorboard").iterdir())  # and TensorBoard beside it


@pytest.fixture
def mlflow_server(tmp_path):
    """``mlflow server`` on 127.0.0.1, its own database and artifact folder; stopped after the test."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
         "--backend-store-uri", f"sqlite:///{tmp_path / 'server.db'}", "--artifacts-destination",
         str(tmp_path / "server-artifacts")],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    uri = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                urllib.request.urlopen(f"{uri}/health", timeout=2)
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"mlflow server did not start (exit code {server.poll()})")
                time.sleep(0.5)
        yield uri
    finally:
        os.killpg(server.pid, signal.SIGTERM)  # the server and its workers
        server.wait(timeout=30)


def test_a_run_tracked_by_an_mlflow_server(tiny_cfg, mlflow_server, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    summary = launch(tiny_cfg.replace(tracker="mlflow", experiment="service"))
    client = MlflowClient(mlflow_server)
    (run,) = client.search_runs([client.get_experiment_by_name("service").experiment_id])
    records = read_metrics(summary.run_dir / "metrics.jsonl")
    assert run.info.status == "FINISHED"
    assert sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, "loss")) == \
        [(r["step"], pytest.approx(r["loss"])) for r in records]
    assert {a.path for a in client.list_artifacts(run.info.run_id)} >= {"config.toml"}  # uploaded to the server


def test_a_resumed_run_goes_on_in_the_same_mlflow_run(tiny_cfg, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    cfg = tiny_cfg.replace(tracker="mlflow")
    launch(cfg.replace(stop_at=2))
    launch(cfg.replace(resume=True))
    client, (run,) = _runs(tmp_path)
    assert run.info.status == "FINISHED"
    assert sorted({m.step for m in client.get_metric_history(run.info.run_id, "loss")}) == [1, 2, 3, 4]


def test_an_unreachable_tracker_is_one_warning_and_the_run_goes_on(tiny_cfg, monkeypatch, capfd):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9")  # nothing listens there
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    summary = launch(tiny_cfg.replace(tracker="tensorboard,mlflow"))
    assert [r["step"] for r in read_metrics(summary.run_dir / "metrics.jsonl")] == [1, 2, 3, 4]
    warnings = [line for line in capfd.readouterr().err.splitlines() if line.startswith("warning: --tracker")]
    assert len(warnings) == 1 and "--tracker mlflow could not start" in warnings[0]
    assert not (summary.run_dir / "mlflow.json").exists()


def test_wandb_offline_logs_every_record_without_a_network(tiny_cfg, monkeypatch):
    """W&B offline: its run in RUN/wandb, its transaction log holding each step's numbers (the
    log is W&B's own binary format, whose values are JSON strings: found as they are written)."""
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    summary = launch(tiny_cfg.replace(tracker="wandb"))
    run_id = json.loads((summary.run_dir / "wandb.json").read_text())["run_id"]
    (log,) = (summary.run_dir / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb")
    written = log.read_bytes()
    for record in read_metrics(summary.run_dir / "metrics.jsonl"):
        assert json.dumps(record["loss"]).encode() in written and json.dumps(record["grad_norm"]).encode() in written
    assert b"micro_batch" in written  # the configuration, as W&B's config


def test_an_unknown_tracker_is_refused_in_one_sentence(tiny_cfg):
    with pytest.raises(UserError, match="--tracker comet is not a tracker; choose among tensorboard, mlflow, wandb"):
        check_values(tiny_cfg.replace(tracker="tensorboard,comet"))
    with pytest.raises(UserError, match="--register lm registers the model in MLflow's registry; add mlflow"):
        check_values(tiny_cfg.replace(register="lm"))


def test_a_records_metrics_are_its_numbers_but_the_step():
    from scaletrain.job.trackers import _numbers

    assert _numbers({"step": 3, "loss": 1.5, "skipped_steps": 0, "mfu": None, "note": "x", "flag": True}) == \
        {"loss": 1.5, "skipped_steps": 0.0}
