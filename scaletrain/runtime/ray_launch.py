"""Ray as a launcher: a run's workers as Ray Train workers on a Ray cluster.

    scaletrain train --launcher ray --nproc 4                       # a Ray instance of this machine
    scaletrain train --launcher ray --nproc 16 --gpus-per-worker 1 --ray-address auto
    ray job submit --address http://HEAD:8265 -- scaletrain train --launcher ray --nproc 16 ...

Ray Train's ``TorchTrainer`` asks the cluster for ``--nproc`` workers, each with
``--cpus-per-worker`` CPUs and ``--gpus-per-worker`` GPUs reserved, gives each the
variables torchrun gives (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
MASTER_PORT) and joins them into one torch process group, gloo without GPUs and nccl with
them: Ray's rendezvous replaces ours, and the worker then runs as under any launcher
(runtime/launch.py takes the group Ray made). A user's script (``scaletrain run --launcher
ray``) makes its own group, as it would under torchrun: Ray's is handed back first and the
script gets a fresh MASTER_PORT.

Failures are Ray's to handle: ``FailureConfig(max_failures=--max-restarts)``. When a
worker dies (its process killed, its node lost) Ray stops the others, starts a new group
and the new workers continue the run from its newest complete checkpoint, as after a
torchrun restart. They learn that they are a restart from TORCHELASTIC_RESTART_COUNT, set
as torchrun sets it: a small actor of this launch numbers the worker groups as their
rank 0 asks, and each rank 0 tells its group.

Every worker reads and writes the run folder itself, and works in the folder the
launching command was started in: on a cluster of several nodes that folder and the run's
(``--out``) must be on storage every node mounts at the same path. Ray's own records of
the run go in RUN/ray. The launching process's variables of the project and its services
(FORWARDED) go to the workers, which a cluster started elsewhere would not otherwise have.
"""

from __future__ import annotations

import importlib.util
import os
import socket
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from scaletrain.errors import JobFailed, UserError
from scaletrain.runtime.launch import CLUSTER_TIMEOUT_S, LAUNCHER_VARIABLE, free_port
from scaletrain.runtime.spawn import WorkerKilled

# Variables the workers need from the launching process: fault injection and the project's own,
# the trackers' (MLFLOW_TRACKING_URI, WANDB_MODE), the hub's, the kernels' and torch's settings.
FORWARDED = ("SCALETRAIN_", "MLFLOW_", "WANDB_", "HF_", "TRITON_", "ATEN_", "NCCL_", "TORCH_")
INSTALL_HINT = "pip install 'scaletrain[ray]'"
ANSWER_S = 5.0  # how long a cluster's address may take to accept a connection


@dataclass(frozen=True)
class RayPlacement:
    """Where the workers run and what each reserves."""

    address: str | None  # None: the cluster of `ray job submit` (RAY_ADDRESS), else a new local one
    cpus_per_worker: float
    gpus_per_worker: float

    @property
    def backend(self) -> str:
        return "nccl" if self.gpus_per_worker else "gloo"


def check_placement(placement: RayPlacement, nproc: int, backend: str | None) -> None:
    """Refuse what Ray could never place or run, before anything starts."""
    if importlib.util.find_spec("ray") is None:
        raise UserError(f"--launcher ray needs Ray Train; {INSTALL_HINT}, or launch without it.")
    if placement.cpus_per_worker <= 0 or placement.gpus_per_worker < 0:
        raise UserError(f"--cpus-per-worker {placement.cpus_per_worker:g} and --gpus-per-worker "
                        f"{placement.gpus_per_worker:g}: a worker needs more than 0 CPUs and 0 or more GPUs.")
    if 0 < placement.gpus_per_worker < 1 and nproc > 1:
        raise UserError(f"--gpus-per-worker {placement.gpus_per_worker:g} lets two of the {nproc} workers share a "
                        f"GPU, which NCCL refuses within one job; give each a whole GPU (a fraction suits one-worker "
                        f"runs, such as a sweep's trials).")
    if backend not in (None, placement.backend):
        raise UserError(f"--backend {backend} does not fit --gpus-per-worker {placement.gpus_per_worker:g}: Ray's "
                        f"workers join a {placement.backend} group; drop --backend.")


class _Attempts:
    """A launch's worker groups, numbered in the order their rank 0 asks: 0, then each restart."""

    def __init__(self):
        self.started = 0

    def next(self) -> int:
        self.started += 1
        return self.started - 1


@contextmanager
def ray_cluster(placement: RayPlacement, nproc: int) -> Iterator[None]:
    """Joined to the cluster (or one started here, and stopped after) for the block: entered before
    the run folder is written, so that a cluster that is not there leaves nothing behind."""
    import ray

    started_here = placement.address is None and "RAY_ADDRESS" not in os.environ
    # Ray's driver would put its own print in builtins to draw its progress bars, which it does not
    # take back at shutdown; this process's print stays Python's.
    os.environ.setdefault("RAY_TQDM_PATCH_PRINT", "0")
    if started_here:  # "local": Ray would otherwise join a cluster `ray start` left on this machine
        ray.init(address="local", logging_level="WARNING", include_dashboard=False)
    else:
        _check_answers(placement.address)
        try:
            ray.init(address=placement.address, logging_level="WARNING")
        except ConnectionError as exc:
            raise UserError(f"--ray-address {placement.address}: {exc} Start the cluster (ray start --head) or fix "
                            f"the address.") from None
    try:
        if started_here:  # nothing joins a cluster of one machine later: what it lacks it will never have
            have = ray.cluster_resources()
            for what, each in (("CPU", placement.cpus_per_worker), ("GPU", placement.gpus_per_worker)):
                if nproc * each > have.get(what, 0):
                    raise UserError(f"--nproc {nproc} workers of {each:g} {what}s each need {nproc * each:g}, but "
                                    f"this machine has {have.get(what, 0):g}; lower --nproc or "
                                    f"--{what.lower()}s-per-worker.")
        yield
    finally:
        if started_here:
            ray.shutdown()


def _check_answers(address: str | None) -> None:
    """A HOST:PORT (or ray://HOST:PORT) that nothing answers at, refused at once: Ray itself
    would retry for minutes."""
    host, _, port = (address or "").removeprefix("ray://").rpartition(":")
    if not host or not port.isdecimal():
        return  # "auto", or RAY_ADDRESS: Ray's own lookup answers quickly
    try:
        socket.create_connection((host, int(port)), timeout=ANSWER_S).close()
    except OSError as exc:
        raise UserError(f"--ray-address {address}: nothing answers there ({exc.strerror or exc}); start the "
                        f"cluster (ray start --head) or fix the address.") from None


def forwarded_variables() -> dict[str, str]:
    return {key: value for key, value in os.environ.items() if key.startswith(FORWARDED)}


def launch_ray(nproc: int, entrypoint: Callable[..., Any], args: tuple, *, placement: RayPlacement,
               max_restarts: int, name: str, storage: Path | None, timeout_s: float | None,
               own_group: bool = True) -> Any:
    """Run ``entrypoint(*args)`` on ``nproc`` Ray Train workers of the cluster joined
    (`ray_cluster`); return rank 0's result. ``timeout_s``: how long a collective of Ray's
    group waits (None: a cluster's ten minutes).

    Ray keeps its records of the run ``name`` under ``storage`` (None: Ray's default,
    ~/ray_results). ``own_group``: the entrypoint joins Ray's process group (the trainer);
    otherwise Ray's is handed back and it makes its own (a user's script)."""
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig, TrainingFailedError
    from ray.train.torch import TorchConfig, TorchTrainer

    # The workers' lines are printed for the user as they come; Ray's patch of print would log each twice.
    os.environ.setdefault("RAY_TRAIN_ENABLE_PRINT_PATCH", "0")
    attempts = ray.remote(num_cpus=0)(_Attempts).remote()
    resources = {"CPU": placement.cpus_per_worker}
    if placement.gpus_per_worker:
        resources["GPU"] = placement.gpus_per_worker
    trainer = TorchTrainer(
        _ray_worker,
        train_loop_config={"entrypoint": entrypoint, "args": args, "attempts": attempts, "cwd": os.getcwd(),
                           "own_group": own_group, "variables": forwarded_variables()},
        scaling_config=ScalingConfig(num_workers=nproc, use_gpu=bool(placement.gpus_per_worker),
                                     resources_per_worker=resources),
        torch_config=TorchConfig(backend=placement.backend, timeout_s=int(timeout_s or CLUSTER_TIMEOUT_S)),
        run_config=RunConfig(name=name, storage_path=str(storage.resolve()) if storage else None,
                             failure_config=FailureConfig(max_failures=max_restarts)),
    )
    try:
        return trainer.fit().return_value
    except TrainingFailedError as failure:
        raise _reported(failure) from None


def _reported(failure: Exception) -> Exception:
    """What a failed Ray run is reported as: the lowest rank's sentence (a user's mistake before
    a job's failure), a worker that died, or the bug with its traceback."""
    from ray.exceptions import ActorDiedError

    raised = dict(sorted(getattr(failure, "worker_failures", {}).items()))
    for kind in (UserError, JobFailed):
        said = [error for error in raised.values() if isinstance(error, kind)]
        if said:
            return kind(str(said[0]))
    # A dead worker's process is found by Ray's health check, which reports the death as its cause.
    died = [rank for rank, error in raised.items()
            if isinstance(getattr(error, "health_check_failure", error), ActorDiedError)]
    if died:
        return WorkerKilled(f"rank {died[0]}'s Ray worker died and Ray's restarts (--max-restarts) were spent")
    return JobFailed(str(failure))


def _ray_worker(config: dict[str, Any]) -> Any:
    """One Ray Train worker: in the launching folder, with its variables and its attempt number."""
    import ray

    if Path(config["cwd"]).is_dir():  # a node without that folder works in Ray's, from absolute paths
        os.chdir(config["cwd"])
    os.environ.update(config["variables"])
    grouped = dist.is_initialized()
    attempt = [ray.get(config["attempts"].next.remote()) if not grouped or dist.get_rank() == 0 else None]
    if grouped:  # the group's rank 0 took its number; the others learn it from it
        dist.broadcast_object_list(attempt, src=0)
    os.environ["TORCHELASTIC_RESTART_COUNT"] = str(attempt[0])
    os.environ[LAUNCHER_VARIABLE] = "ray"
    if not config["own_group"] and dist.is_initialized():
        _hand_back_group()
    return config["entrypoint"](*config["args"])


def _hand_back_group() -> None:
    """Leave Ray's group for a script that makes its own, at a port rank 0 found free."""
    port = [free_port(os.environ["MASTER_ADDR"]) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(port, src=0)
    dist.barrier()
    dist.destroy_process_group()
    os.environ["MASTER_PORT"] = str(port[0])
