"""The machine a run starts on, as the planner weighs it: its devices' arithmetic, memory and links.

A run that plans its own layout (``--layout auto``) or checks its memory (the
gate, ``--micro-batch auto``) is planned for the devices it will run on: a GPU
by its name's datasheet preset (planner/hardware.py) with the memory CUDA
reports, a CPU by its measured matmul peak with this machine's memory shared
by the processes started on it.
"""

from __future__ import annotations

import functools

import torch

from scaletrain.planner.fit import device_memory
from scaletrain.planner.hardware import DEVICES, Cluster, Device, cpu_device


def this_machine(world: int, processes_here: int, on_gpu: bool, local_rank: int = 0) -> Cluster:
    """``world`` ranks, ``processes_here`` of them on this machine (a node), each on a device like
    this process's: its GPU (``local_rank``'s) or its share of this CPU."""
    device = torch.device("cuda", local_rank % torch.cuda.device_count()) if on_gpu else torch.device("cpu")
    memory = device_memory(device, processes_here)
    planned = _gpu_preset(torch.cuda.get_device_name(device)) if on_gpu else _this_cpu(memory)
    return Cluster(planned, world, min(processes_here, world)).with_memory(memory)


def _gpu_preset(name: str) -> Device:
    """The datasheet preset whose name the GPU's contains (``NVIDIA H200`` is the H200), else the H100's."""
    return next((device for key, device in DEVICES.items() if key in name.upper()), DEVICES["H100"])


@functools.lru_cache(maxsize=1)
def _measured_cpu_peak() -> float:
    from scaletrain.job.metrics import measure_peak_tflops

    return measure_peak_tflops(torch.device("cpu"))


def _this_cpu(memory: int) -> Device:
    return cpu_device(_measured_cpu_peak(), memory)
