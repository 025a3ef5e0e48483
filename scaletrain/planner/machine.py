"""The machine a run starts on, as the planner weighs it: its devices' arithmetic, memory and links.

A run that plans its own layout (``--layout auto``) or checks its memory (the
gate, ``--micro-batch auto``) is planned for the devices it will run on: as
this machine's profile describes them where it has one (``scaletrain plan
--calibrate``, planner/profile.py: found by ``SCALETRAIN_PROFILE`` or at its
default location, refused in one sentence where it measured another device),
else a GPU by its name's datasheet preset (planner/hardware.py) and a CPU by
its measured matmul peak; either with the memory CUDA reports, or this
machine's memory shared by the processes started on it.

``calibrate_if_missing`` measures a machine that has no profile first (about a
minute, planner/calibrate.py) and saves it at the default location, so that only
the first run on a machine pays for it. It starts its own processes: call it
from the process that launches the run's, before they start.
"""

from __future__ import annotations

import functools
import os

import torch

from scaletrain.errors import UserError
from scaletrain.planner import profile
from scaletrain.planner.fit import device_memory
from scaletrain.planner.hardware import DEVICES, Cluster, Device, cpu_device, shared_cpu


def this_machine(world: int, processes_here: int, on_gpu: bool, local_rank: int = 0, *,
                 backend: str | None = None, calibrate_if_missing: bool = False) -> Cluster:
    """``world`` ranks, ``processes_here`` of them on this machine (a node), each on a device like
    this process's: its GPU (``local_rank``'s) or its share of this CPU; ``backend`` the run's
    (nccl on a GPU, else gloo), whose profile is read."""
    device = torch.device("cuda", local_rank % torch.cuda.device_count()) if on_gpu else torch.device("cpu")
    memory = device_memory(device, processes_here)
    planned = profile.for_this_machine(on_gpu, backend, processes=processes_here)
    if planned is None and calibrate_if_missing:
        planned = _calibrated(on_gpu, backend, processes_here)
    if planned is None:
        planned = _gpu_preset(torch.cuda.get_device_name(device)) if on_gpu else this_cpu(memory, processes_here)
    return Cluster(planned, world, min(processes_here, world)).with_memory(memory)


def _calibrated(on_gpu: bool, backend: str | None, processes_here: int) -> Device:
    """This machine measured and saved (planner/calibrate.py): every GPU, or on a CPU as many
    processes as the run starts here (at least 2, so that the collectives are measured)."""
    from scaletrain.planner.calibrate import calibrate  # the launcher it needs, only on a machine's first run

    if backend == "mpi4py":  # mpirun's processes are the run's own: none to start for a calibration
        raise UserError("this machine has no profile for --backend mpi4py; measure it first with mpirun -n N "
                        "scaletrain plan --calibrate --backend mpi4py.")
    backend = backend or profile.default_backend(on_gpu)
    path, _ = profile.chosen_path(None, profile.device_name(on_gpu), backend)
    print(f"this machine has no profile yet: measuring it once (scaletrain plan --calibrate, about a minute) "
          f"into {path}")
    measured, _ = calibrate(None if on_gpu else max(processes_here, 2), backend, None, quick=False)
    return profile.device_of(measured, processes_here)


def _gpu_preset(name: str) -> Device:
    """The datasheet preset whose name the GPU's contains, else the H100's."""
    return profile.gpu_preset(name) or DEVICES["H100"]


@functools.lru_cache(maxsize=1)
def _measured_cpu_peak() -> float:
    from scaletrain.job.metrics import measure_peak_tflops

    return measure_peak_tflops(torch.device("cpu"))


def this_cpu(memory: int, processes: int) -> Device:
    """This CPU uncalibrated: its matmul peak measured by this process's threads, shared by ``processes``
    processes (planner/hardware.py `shared_cpu`)."""
    return shared_cpu(cpu_device(_measured_cpu_peak(), memory), torch.get_num_threads(), os.cpu_count() or 1,
                      processes)
