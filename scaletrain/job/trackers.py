"""Where a run's records go besides metrics.jsonl: ``--tracker tensorboard,mlflow,wandb``.

metrics.jsonl is the record of truth, written first, whatever the trackers do. Each tracker
takes the same records: the resolved configuration once, every step's record (each numeric
field a metric at that step), and at the end the run folder's files worth keeping. Only the
main rank tracks (job/loop.py). A tracker that fails, to start or later, is one warning on
stderr and then dropped: the run goes on, its metrics.jsonl whole.

TensorBoard (the default) writes events into RUN/tensorboard.

MLflow (``pip install '.[mlflow]'``) logs to ``MLFLOW_TRACKING_URI`` (a server, a database,
any store MLflow takes), or without it to a store of its own in ``./mlruns`` beside where the
run was started (MLflow's SQLite database ``mlruns/mlflow.db``, the artifacts in
``mlruns/artifacts``: MLflow 3 keeps its plain-file store only for old data). The run is
named after the run folder, in the experiment ``--experiment``; the configuration goes in as
parameters (``train.lr``, ``parallel.zero``, ...), each record as metrics with its step,
MLflow's system metrics (CPU, memory, disk, network, GPUs) every SYSTEM_EVERY_S seconds (a run
shorter than that has none), config.toml and the tokenizer as artifacts, and at the run's
last step its model, exported as by ``scaletrain export``, as the artifact ``model`` (with
``--register NAME``, a new version of the registered model NAME). The run's id is kept in
RUN/mlflow.json, so a resumed run (``--resume``) continues the same MLflow run; the steps
redone after the checkpoint are logged again at the same step numbers, and MLflow's metric
history keeps both, as it keeps every value logged.

Weights & Biases (``pip install '.[wandb]'``) logs a run named after the run folder in the
project ``--experiment``, the configuration as its config, each record's numbers at their
step; its files go under RUN/wandb. Its own settings apply: ``WANDB_MODE=offline`` logs
without a network (``wandb sync`` uploads later), and without a login online mode cannot
start (one warning, as above). A resumed run continues the same W&B run (its id in
RUN/wandb.json); W&B ignores steps lower than ones it has seen, so the steps redone after a
checkpoint keep their first values there.

Ray Tune (``tune``, which ``scaletrain sweep`` adds to each of its trials) gets every record as
the trial's result, for its scheduler to stop the trial early (scaletrain/commands/sweep.py).

How a run ends reaches each tracker as finished, failed or stopped: an MLflow run ends
FINISHED, FAILED or KILLED (a run stopped from outside: Ctrl-C, or a sweep's scheduler).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from scaletrain.config import Config

TRACKERS = ("tensorboard", "mlflow", "wandb", "tune")
# How a run ends, at its last step, by an error, or stopped from outside (an interrupt, a sweep's
# scheduler), and MLflow's word for each.
MLFLOW_STATUS = {"finished": "FINISHED", "failed": "FAILED", "stopped": "KILLED"}
SYSTEM_EVERY_S = 2.0  # MLflow's system metrics: a sample every this many seconds


class Tracker(Protocol):
    def log(self, record: dict[str, Any]) -> None: ...

    def finish(self, outcome: str, final: Path | None) -> None: ...


def _numbers(record: dict[str, Any]) -> dict[str, float]:
    """A record's metrics: its numeric fields but the step (booleans are not metrics)."""
    return {key: float(value) for key, value in record.items()
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool)}


class TensorBoard:
    def __init__(self, cfg: Config, run_dir: Path):
        from torch.utils.tensorboard import (
            SummaryWriter,  # heavy import, only where written
        )

        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))

    def log(self, record: dict[str, Any]) -> None:
        for key, value in _numbers(record).items():
            self.writer.add_scalar(key, value, record["step"])

    def finish(self, outcome: str, final: Path | None) -> None:
        self.writer.close()


class MLflow:
    def __init__(self, cfg: Config, run_dir: Path):
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        logging.getLogger("mlflow").setLevel(logging.WARNING)  # its INFO lines would interleave with the run's
        self.run_dir, self.register = run_dir, cfg.run.register
        saved = run_dir / "mlflow.json"
        if cfg.run.resume and saved.exists():
            where = json.loads(saved.read_text())
            self.client, self.run_id = MlflowClient(where["tracking_uri"]), where["run_id"]
            self.client.update_run(self.run_id, status="RUNNING")
            self.system = _system_metrics(self.run_id, where["tracking_uri"], resume=True)
            return
        self.client, uri, experiment_id = open_experiment(cfg.run.experiment)
        self.run_id = self.client.create_run(experiment_id, run_name=run_dir.name,
                                             tags={"scaletrain.run_dir": str(run_dir.resolve())}).info.run_id
        saved.write_text(json.dumps({"tracking_uri": uri, "run_id": self.run_id}))
        self.system = _system_metrics(self.run_id, uri, resume=False)
        params = [Param(f"{section}.{key}", str(value)) for section, fields in cfg.to_dict().items()
                  for key, value in fields.items()]
        for start in range(0, len(params), 100):  # MLflow takes at most 100 parameters a batch
            self.client.log_batch(self.run_id, params=params[start:start + 100])

    def log(self, record: dict[str, Any]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(key, value, now, record["step"])
                                                    for key, value in _numbers(record).items()])

    def finish(self, outcome: str, final: Path | None) -> None:
        self.system.finish()
        for name in ("config.toml", "tokenizer.json"):
            if (self.run_dir / name).exists():
                self.client.log_artifact(self.run_id, str(self.run_dir / name))
        if final is not None:
            self._log_model(final)
        self.client.set_terminated(self.run_id, status=MLFLOW_STATUS[outcome])

    def _log_model(self, checkpoint: Path) -> None:
        """The final checkpoint exported (``scaletrain export``) as the artifact ``model``, and with
        ``--register NAME`` a new version of the registered model NAME made from it."""
        from scaletrain.job.export import export

        with tempfile.TemporaryDirectory() as folder:
            export(checkpoint, Path(folder) / "model.safetensors")
            self.client.log_artifact(self.run_id, str(Path(folder) / "model.safetensors"), artifact_path="model")
        if self.register:
            if not self.client.search_registered_models(filter_string=f"name = '{self.register}'"):
                self.client.create_registered_model(self.register)
            source = f"{self.client.get_run(self.run_id).info.artifact_uri}/model"
            self.client.create_model_version(self.register, source, run_id=self.run_id)


def open_experiment(name: str):
    """MLflow's client, the store's URI and the experiment's id, the experiment made if new: in
    ``MLFLOW_TRACKING_URI``, else in a store of one's own, MLflow's database in ./mlruns with the
    artifacts beside it. (A sweep opens it once before its trials, which would race to make it.)"""
    from mlflow.tracking import MlflowClient

    uri, artifacts = os.environ.get("MLFLOW_TRACKING_URI"), None
    if uri is None:
        local = Path("mlruns").resolve()
        local.mkdir(exist_ok=True)
        uri, artifacts = f"sqlite:///{local / 'mlflow.db'}", (local / "artifacts").as_uri()
    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name(name)
    return client, uri, experiment.experiment_id if experiment else client.create_experiment(
        name, artifact_location=artifacts)


def end_mlflow_run(run_dir: Path, outcome: str) -> None:
    """End the MLflow run of the run in ``run_dir`` (its RUN/mlflow.json) as ``outcome``, from outside
    it: a sweep's trial stopped early can be ended by Tune before its own end reaches MLflow."""
    from mlflow.tracking import MlflowClient

    where = json.loads((run_dir / "mlflow.json").read_text())
    MlflowClient(where["tracking_uri"]).set_terminated(where["run_id"], status=MLFLOW_STATUS[outcome])


class WandB:
    def __init__(self, cfg: Config, run_dir: Path):
        import wandb

        saved = run_dir / "wandb.json"
        run_id = json.loads(saved.read_text())["run_id"] if cfg.run.resume and saved.exists() else None
        self.run = wandb.init(project=cfg.run.experiment, name=run_dir.name, dir=str(run_dir), id=run_id,
                              resume="allow" if run_id else None, config=cfg.to_dict(),
                              settings=wandb.Settings(console="off", silent=True))
        saved.write_text(json.dumps({"run_id": self.run.id}))

    def log(self, record: dict[str, Any]) -> None:
        self.run.log(_numbers(record), step=record["step"])

    def finish(self, outcome: str, final: Path | None) -> None:
        import wandb

        self.run.finish(exit_code=0 if outcome == "finished" else 1)
        # W&B's service writes the run's transaction log behind finish(); stopping it waits for the
        # log to be whole on disk, for whatever reads or uploads RUN/wandb next (atexit would,
        # but not under multiprocessing, and not before a caller in this process reads it).
        wandb.teardown()


class Tune:
    """Each record to the Ray Tune trial this run is (``scaletrain sweep``), whose scheduler reads it
    to stop the trial early: the stop arrives as a SystemExit out of the report, which ends the run
    as stopped."""

    def __init__(self, cfg: Config, run_dir: Path):
        from ray import tune

        with warnings.catch_warnings():  # outside a trial Ray warns, and says None
            warnings.simplefilter("ignore")
            if tune.get_context().get_trial_id() is None:
                raise RuntimeError("this run is not a Ray Tune trial; scaletrain sweep starts those")
        self.report = tune.report

    def log(self, record: dict[str, Any]) -> None:
        self.report({**_numbers(record), "step": record["step"]})

    def finish(self, outcome: str, final: Path | None) -> None:
        pass  # Tune learns of the trial's end from the trial itself


def _system_metrics(run_id: str, uri: str, resume: bool):
    """MLflow's own monitor of the machine (``system/cpu_utilization_percentage``, memory, disk,
    network, and each GPU's use and memory), sampled on a thread of its own every SYSTEM_EVERY_S."""
    from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

    monitor = SystemMetricsMonitor(run_id, sampling_interval=SYSTEM_EVERY_S, resume_logging=resume, tracking_uri=uri)
    monitor.start()
    return monitor


_CLASSES = {"tensorboard": TensorBoard, "mlflow": MLflow, "wandb": WandB, "tune": Tune}


def names(text: str) -> list[str]:
    """``--tracker``'s comma-separated names."""
    return [name.strip() for name in text.split(",") if name.strip()]


class Trackers:
    """The run's trackers, each one dropped, with one warning, at its first failure."""

    def __init__(self, cfg: Config, run_dir: Path):
        self.active: dict[str, Tracker] = {}
        for name in names(cfg.run.tracker):
            try:
                self.active[name] = _CLASSES[name](cfg, run_dir)
            except Exception as exc:  # a tracker's failure must not end the run: metrics.jsonl goes on
                _warn(name, "start", exc)

    def _each(self, what: str, call: Callable[[Tracker], None]) -> None:
        for name, tracker in list(self.active.items()):
            try:
                call(tracker)
            except Exception as exc:  # as above
                del self.active[name]
                _warn(name, what, exc)

    def log(self, record: dict[str, Any]) -> None:
        self._each("log a step", lambda tracker: tracker.log(record))

    def finish(self, outcome: str, final: Path | None) -> None:
        """The run's end (finished, failed or stopped); ``final``: its last checkpoint, when the run reached its last step."""
        self._each("finish", lambda tracker: tracker.finish(outcome, final))


def _warn(name: str, what: str, exc: Exception) -> None:
    first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    print(f"warning: --tracker {name} could not {what} ({first_line}); it is dropped for the rest of the run, "
          f"and metrics.jsonl keeps every record.", file=sys.stderr)
