"""``scaletrain run``: a user's own script, launched as ``--nproc`` launches the trainer.

    scaletrain run --nproc 4 train.py --epochs 3
    scaletrain run --nproc 4 --max-restarts 2 train.py
    srun -n 8 scaletrain run train.py            (or torchrun, mpirun: the same script)
    scaletrain run --launcher ray --nproc 8 --gpus-per-worker 1 train.py

With ``--nproc N``, N local worker processes (torch's elastic agent, as
torchrun starts them) each run the script as ``__main__`` with ``sys.argv``
set to ``[SCRIPT, *ARGS]`` and the variables of ``init_process_group``'s
``env://`` rendezvous (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT``), so a script that calls
``dist.init_process_group()`` finds its place. Without ``--nproc`` this
process is one of a job another launcher started, or the only one: its place
is read as the trainer reads it (runtime/launch.py: torchrun's variables,
SLURM's, Open MPI's or MPICH's) and written into those same variables, so one
script runs unchanged under every launcher. With ``--launcher ray`` the N workers are Ray
Train workers on a Ray cluster (runtime/ray_launch.py), given the same variables.

Failures are reported as the trainer's are: a rank that raises is named with
its traceback, a rank that is killed with its signal, and ``--max-restarts
K`` starts every worker again, up to K times (``TORCHELASTIC_RESTART_COUNT``
tells the script which attempt it is, to resume from its last checkpoint).
A script that exits with a non-zero code fails its rank as an exception does.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import runpy
import sys
import time
from pathlib import Path

from scaletrain.config import ParallelConfig, add_field_flag
from scaletrain.errors import JobFailed, UserError
from scaletrain.paths import readable_file

SCRIPT_WANTED = "a Python script to run"
RAY_OPTIONS = ("launcher", "ray_address", "cpus_per_worker", "gpus_per_worker")  # as scaletrain train's


def add_parser(commands) -> None:
    run = commands.add_parser(
        "run", help="launch your own training script on N processes",
        description="Run SCRIPT with ARGS in --nproc local worker processes, each with the variables "
                    "init_process_group reads (RANK, WORLD_SIZE, MASTER_ADDR, ...), "
                    "failures named by rank, --max-restarts restarts. Without --nproc, under torchrun, srun "
                    "or mpirun, the launcher's variables are translated into the same ones.")
    run.add_argument("--nproc", type=int, default=1, metavar="N", help="local worker processes [1]")
    run.add_argument("--max-restarts", type=int, default=0, metavar="K",
                     help="start every worker again after a failure, up to K times [0]")
    placement = {fld.name: fld for fld in dataclasses.fields(ParallelConfig)}
    for name in RAY_OPTIONS:
        add_field_flag(run, placement[name], placement[name].default)
    run.add_argument("script", metavar="SCRIPT", help="the Python script")
    run.add_argument("args", nargs=argparse.REMAINDER, metavar="ARGS", help="the script's own arguments")
    run.set_defaults(handler=run_command)


def export_place() -> None:
    """This process's place in its job, from whichever launcher started it, as the variables
    ``init_process_group``'s default ``env://`` rendezvous reads; under torch's elastic agent, at
    an address of this launch attempt's own (runtime/launch.py: `attempt_rendezvous`)."""
    from scaletrain.runtime.launch import attempt_rendezvous, detect_environment

    env = detect_environment()
    addr, port = attempt_rendezvous(env)
    os.environ.update(RANK=str(env.rank), WORLD_SIZE=str(env.world_size), LOCAL_RANK=str(env.local_rank),
                      LOCAL_WORLD_SIZE=str(env.local_world_size), MASTER_ADDR=addr, MASTER_PORT=str(port),
                      TORCHELASTIC_USE_AGENT_STORE="False")


def run_script(script: str, args: list[str]) -> None:
    """Run ``script`` as ``__main__`` in this process, as ``python SCRIPT ARGS`` would; a non-zero
    exit fails the run."""
    export_place()
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv = [script, *args]
    sys.path.insert(0, str(Path(script).resolve().parent))  # as python puts the script's folder first
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exit_:
        if exit_.code not in (None, 0):
            raise JobFailed(f"{script} exited with code {exit_.code} on rank {os.environ['RANK']}") from None
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path


def run_command(args: argparse.Namespace) -> int:
    from scaletrain.config_checks import check_launcher
    from scaletrain.runtime.ray_launch import launch_ray, ray_cluster
    from scaletrain.runtime.spawn import WorkerFailed, spawn_local

    script = readable_file("SCRIPT", args.script, SCRIPT_WANTED)
    if script.suffix != ".py":
        raise UserError(f"SCRIPT {script} is not a .py file; give {SCRIPT_WANTED}.")
    if args.nproc < 1:
        raise UserError(f"--nproc is {args.nproc}; use 1 or more processes.")
    if args.max_restarts < 0:
        raise UserError(f"--max-restarts is {args.max_restarts}; use 0 or more.")
    parallel = ParallelConfig(nproc=args.nproc, max_restarts=args.max_restarts,
                              **{name: getattr(args, name) for name in RAY_OPTIONS})
    check_launcher(parallel)
    if parallel.launcher == "ray":
        with ray_cluster(parallel.ray_placement(), args.nproc):
            launch_ray(args.nproc, run_script, (str(script), args.args), placement=parallel.ray_placement(),
                       max_restarts=args.max_restarts, name=f"{script.stem}-{time.strftime('%Y%m%d-%H%M%S')}",
                       storage=None, timeout_s=parallel.timeout, own_group=False)
        return 0
    if args.nproc == 1 and args.max_restarts == 0:
        run_script(str(script), args.args)
        return 0
    try:
        spawn_local(args.nproc, run_script, (str(script), args.args), max_restarts=args.max_restarts)
    except WorkerFailed as failure:  # the user's script raised: its traceback is the report
        raise JobFailed(str(failure)) from None
    return 0
