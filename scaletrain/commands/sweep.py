"""``scaletrain sweep``: a hyperparameter search on Ray Tune, each trial a scaletrain run.

    scaletrain sweep --steps 200 --grid lr=1e-4,3e-4,1e-3 --grid micro_batch=4,8 \\
        --tracker mlflow --experiment lr-sweep

Every combination of the ``--grid`` values (Tune's grid search over any field of ``scaletrain
train``) is a trial; ``--log-uniform FIELD=LOW:HIGH`` draws a value for each trial instead, and
``--samples N`` runs the grid N times, each time with new draws. A trial is ``scaletrain train``
with its fields changed, in SWEEP/TRIAL (``--out`` is the sweep's folder), in one process that
Ray places with ``--cpus-per-worker`` CPUs and ``--gpus-per-worker`` GPUs: a fraction packs
several trials on one GPU. ``--ray-address`` picks the cluster, as for ``--launcher ray``.

Each step's record goes to Tune (``--tracker tune``, added to the trial's trackers), and Tune's
scheduler reads ``--metric`` from it. ASHA, asynchronous successive halving (Li et al. 2018,
"A System for Massively Parallel Hyperparameter Tuning"), stops trials early: a trial reaching
a rung, ``--grace-steps`` x 2^k steps, goes on only if its metric is in the best half of the
metrics recorded at that rung so far (reduction factor 2), so most of the budget goes to the
promising trials, without waiting for the slow ones. A trial that is stopped ends like an
interrupted run: its folder keeps its checkpoints and metrics.jsonl, and its MLflow run (with
``--tracker mlflow``, one run per trial in ``--experiment``) ends KILLED, those that ran to the
end FINISHED. At the end the trials are printed best first, and written to SWEEP/sweep.json.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import itertools
import json
import math
import os
import time
from pathlib import Path
from typing import Any

from scaletrain.config import (
    Config,
    ParallelConfig,
    add_config_flags,
    base_type,
    coerce,
    field_of,
    resolve,
)
from scaletrain.config_checks import check_values
from scaletrain.errors import UserError
from scaletrain.job.base_model import check_adapters_have_base
from scaletrain.job.trackers import end_mlflow_run, open_experiment
from scaletrain.job.trackers import names as tracker_names

METRICS = ("loss", "val_loss")
REDUCTION = 2  # ASHA keeps the best 1/REDUCTION of the trials at each rung


def add_parser(commands) -> None:
    sweep = commands.add_parser(
        "sweep", help="search learning rate, batch size or any train field on Ray Tune",
        description="Run a trial of scaletrain train for each combination of --grid values (and --log-uniform "
                    "draws, --samples times), on a Ray cluster, stopping unpromising trials early (ASHA), each "
                    "trial tracked as its own run (--tracker mlflow). Takes every flag of train; --out is the "
                    "sweep's folder, one run folder per trial inside. Needs pip install 'scaletrain[ray]'.")
    add_config_flags(sweep)
    sweep.add_argument("--grid", action="append", default=[], metavar="FIELD=A,B",
                       help="try each of these values of a train field (repeatable: every combination)")
    sweep.add_argument("--log-uniform", action="append", default=[], metavar="FIELD=LOW:HIGH",
                       help="draw a value between LOW and HIGH, uniform in its logarithm, for each trial")
    sweep.add_argument("--samples", type=int, default=1, metavar="N", help="run the grid N times [1]")
    sweep.add_argument("--metric", choices=METRICS, default="loss",
                       help="what the scheduler and the ranking minimise (val_loss needs --eval-every) [loss]")
    sweep.add_argument("--scheduler", choices=("asha", "none"), default="asha",
                       help="stop unpromising trials early (ASHA), or run every trial to the end [asha]")
    sweep.add_argument("--grace-steps", type=int, default=None, metavar="G",
                       help="steps every trial runs before ASHA may stop it [a tenth of --steps, at least 1]")
    sweep.add_argument("--max-concurrent", type=int, default=0, metavar="K",
                       help="trials running at once [0: as many as the cluster holds]")
    sweep.set_defaults(handler=sweep_command)


def sweep_command(args: argparse.Namespace) -> int:
    cfg = resolve(args)
    if importlib.util.find_spec("ray") is None:
        raise UserError("scaletrain sweep runs its trials on Ray Tune; pip install 'scaletrain[ray]'.")
    sweep = run_sweep(cfg, args)
    print(f"\n{len(sweep['trials'])} trials, best {args.metric} first (all in {sweep['out']}/sweep.json)\n"
          f"{format_rows(sweep)}")
    return 0


def _field_values(option: str, text: str, parse) -> tuple[str, Any]:
    name, sep, values = text.partition("=")
    if not sep or not values:
        raise UserError(f"{option} {text!r} is not FIELD=VALUES; write it as lr=1e-4,3e-4.")
    fld = field_of(name.strip())
    if fld is None:
        raise UserError(f"{option} {name.strip()!r} is not a field of scaletrain train; name one as its flag "
                        f"is spelled, with _ for -, such as lr or micro_batch.")
    return fld.name, parse(fld, values)


def _typed(fld, text: str) -> Any:
    """A value of the field's type from its text, refused in its flag's words when it is not one."""
    kind = base_type(fld)
    try:
        value = {bool: lambda t: {"true": True, "false": False}[t.lower()], int: int, float: float}.get(kind, str)(text)
    except (KeyError, ValueError):
        wanted = {bool: "true or false", int: "a whole number", float: "a number"}.get(kind, "text")
        raise UserError(f"--grid {fld.name}={text!r} is not {wanted}; give values of that type.") from None
    return coerce(fld.name, fld, value, named="--grid field", fix="give values of that type")


def search_space(args: argparse.Namespace) -> dict[str, Any]:
    """Tune's parameter space: grid searches and log-uniform draws, by field name."""
    from ray import tune

    space: dict[str, Any] = {}
    for text in args.grid:
        name, values = _field_values("--grid", text, lambda fld, v: [_typed(fld, part) for part in v.split(",")])
        space[name] = tune.grid_search(values)
    for text in args.log_uniform:
        name, (low, high) = _field_values("--log-uniform", text, _bounds)
        space[name] = tune.loguniform(low, high)
    if not space:
        raise UserError("a sweep needs something to vary; add --grid FIELD=A,B or --log-uniform FIELD=LOW:HIGH.")
    return space


def _bounds(fld, text: str) -> tuple[float, float]:
    low, sep, high = text.partition(":")
    try:
        bounds = float(low), float(high)
    except ValueError:
        bounds = (0.0, 0.0)
    if not sep or not 0 < bounds[0] < bounds[1] or base_type(fld) is not float:
        raise UserError(f"--log-uniform {fld.name}={text!r} needs a float field and 0 < LOW < HIGH, as lr=1e-4:1e-2.")
    return bounds


def check_sweep(cfg: Config, args: argparse.Namespace, space: dict[str, Any]) -> None:
    """Every trial's configuration checked before any starts: grid points as they are, draws at their bounds."""
    p = cfg.parallel
    if p.nproc > 1 or p.launcher != "local":
        raise UserError("a sweep's trials are one process each, placed by Ray Tune; drop --nproc and --launcher "
                        "(--cpus-per-worker and --gpus-per-worker size a trial).")
    if cfg.run.resume:
        raise UserError("a sweep starts a new run for each trial; drop --resume (a trial's folder resumes with "
                        "scaletrain train --resume --out SWEEP/TRIAL).")
    if args.samples < 1 or args.max_concurrent < 0 or (args.grace_steps is not None and args.grace_steps < 1):
        raise UserError("--samples and --grace-steps must be 1 or more, --max-concurrent 0 or more.")
    if args.metric == "val_loss" and not cfg.train.eval_every:
        raise UserError("--metric val_loss ranks the validation loss, which --eval-every 0 never measures; "
                        "give --eval-every N or use --metric loss.")
    points = [list(domain["grid_search"]) if isinstance(domain, dict) else [domain.lower, domain.upper]
              for domain in space.values()]
    for values in itertools.product(*points):
        trial = cfg.replace(**dict(zip(space, values)))
        check_values(trial)
        check_adapters_have_base(trial.finetune)


def run_sweep(cfg: Config, args: argparse.Namespace) -> dict[str, Any]:
    """Run the trials; return what SWEEP/sweep.json holds: the sweep's folder, metric and fields,
    and its trials best first (each its fields' values, status, steps and metric)."""
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler

    from scaletrain.job.data_setup import prepare_data
    from scaletrain.runtime.ray_launch import (
        check_placement,
        forwarded_variables,
        ray_cluster,
    )

    space = search_space(args)
    out = Path(cfg.run.out or Path("runs") / f"sweep-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    if out.exists() and any(out.iterdir()):
        raise UserError(f"--out {out} already holds files; choose a new folder for the sweep.")
    placement = cfg.parallel.ray_placement()  # the trials'; each trial's own run is one local process
    unplaced = ParallelConfig()
    cfg = cfg.replace(out=str(out), tracker=",".join([*tracker_names(cfg.run.tracker), "tune"]),
                      cache_dir=cfg.data.cache_dir or str(out / ".cache"), ray_address=unplaced.ray_address,
                      cpus_per_worker=unplaced.cpus_per_worker, gpus_per_worker=unplaced.gpus_per_worker)
    check_sweep(cfg, args, space)
    check_placement(placement, 1, cfg.parallel.backend)
    steps = cfg.train.steps
    scheduler = FIFOScheduler() if args.scheduler == "none" else ASHAScheduler(
        time_attr="step", max_t=steps, grace_period=min(steps, args.grace_steps or max(1, steps // 10)),
        reduction_factor=REDUCTION, stop_last_trials=False)  # a trial at its last step ends by itself
    # Records without the metric (val_loss between evaluations) are passed over by the scheduler.
    os.environ.setdefault("TUNE_DISABLE_STRICT_METRIC_CHECKING", "1")
    trial = tune.with_resources(_trial, {"cpu": placement.cpus_per_worker, "gpu": placement.gpus_per_worker})
    with ray_cluster(placement, 1):
        # The data once for every trial; a mistake in it is one sentence (before anything is written),
        # not a failed trial each.
        prepare_data(cfg, Path(cfg.data.cache_dir))
        out.mkdir(parents=True, exist_ok=True)
        if "mlflow" in tracker_names(cfg.run.tracker):
            open_experiment(cfg.run.experiment)
        tuner = tune.Tuner(
            tune.with_parameters(trial, base=cfg, cwd=os.getcwd(), variables=forwarded_variables()),
            param_space=space,
            tune_config=tune.TuneConfig(metric=args.metric, mode="min", scheduler=scheduler,
                                        num_samples=args.samples, max_concurrent_trials=args.max_concurrent or None,
                                        trial_dirname_creator=_trial_name, trial_name_creator=_trial_name),
            run_config=tune.RunConfig(name="tune", storage_path=str(out / "ray"), verbose=0))
        results = tuner.fit()
        rows = [_row(result, list(space), args.metric, steps, out) for result in results]
    if "mlflow" in tracker_names(cfg.run.tracker):
        for row in rows:  # Tune may end a stopped trial's process before the trial's own end is logged
            if row["status"].startswith("stopped") and (Path(row["run"]) / "mlflow.json").is_file():
                end_mlflow_run(Path(row["run"]), "stopped")
    rows.sort(key=lambda row: (row["best"] is None, row["best"] if row["best"] is not None else math.inf))
    sweep = {"out": str(out), "metric": args.metric, "fields": list(space), "trials": rows}
    (out / "sweep.json").write_text(json.dumps(sweep, indent=2))
    return sweep


def _trial_name(trial) -> str:
    values = ",".join(f"{key}={value:.3g}" if isinstance(value, float) else f"{key}={value}"
                      for key, value in sorted(trial.evaluated_params.items()))
    return f"trial_{trial.trial_id.split('_')[-1]}_{values}".replace(os.sep, "_")  # a path's value: one folder


def _trial(config: dict[str, Any], base: Config, cwd: str, variables: dict[str, str]) -> None:
    """One trial: a scaletrain run in the sweep's folder, from the folder the sweep was started in,
    with the sweep's variables (MLFLOW_TRACKING_URI, ...)."""
    from ray import tune

    from scaletrain.commands.train import launch

    os.environ.update(variables)
    os.chdir(cwd)  # Tune starts a trial in a folder of its own; the run's relative paths are the sweep's
    run = Path(base.run.out) / Path(tune.get_context().get_trial_dir()).name
    # What the run prints (its configuration, its summary) goes to SWEEP/TRIAL.log, not among the trials'.
    with open(run.parent / f"{run.name}.log", "w") as log, contextlib.redirect_stdout(log):
        launch(base.replace(out=str(run), **config))


def _row(result, fields: list[str], metric: str, steps: int, out: Path) -> dict[str, Any]:
    """One trial's line of the results: its values, how it ended, its metric (last and best)."""
    history = result.metrics_dataframe
    done = int(result.metrics.get("step", 0)) if result.metrics else 0
    best = None
    if history is not None and metric in history:
        best = float(history[metric].min())
    status = "failed" if result.error else "finished" if done >= steps else f"stopped at step {done}"
    return {"trial": Path(result.path).name, **{name: result.config[name] for name in fields}, "status": status,
            "steps": done, "last": result.metrics.get(metric) if result.metrics else None, "best": best,
            "run": str(out / Path(result.path).name)}


def format_rows(sweep: dict[str, Any]) -> str:
    """The trials as a table, one line each, in the order of ``run_sweep``'s result."""
    fields, rows = sweep["fields"], sweep["trials"]
    header = ["trial", *fields, "status", f"best {sweep['metric']}"]
    lines = [[row["trial"].split("_")[1], *(f"{row[f]:.4g}" if isinstance(row[f], float) else str(row[f])
                                            for f in fields), row["status"],
              "n/a" if row["best"] is None else f"{row['best']:.4f}"] for row in rows]
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *lines)]
    return "\n".join("  ".join(str(cell).ljust(width) for cell, width in zip(line, widths))
                     for line in [header, *lines])
