"""``--micro-batch auto``: the largest micro-batch the planner predicts to fit one device.

The planner's memory model (planner/memory.py, planner/activations.py: the bytes of
the busiest rank by category, checked against the trainer's memory ledger)
is run for the run's own layout at micro-batches 1, 2, 4, ... up to
``LARGEST``, and the largest whose predicted total fits the device is taken:

    micro_batch = max { 2^i <= LARGEST : predicted_total(2^i) <= memory }

``memory`` is the device's own (CUDA's total on a GPU; on a CPU the machine's
memory shared by the processes on it). Rank 0 chooses and every rank takes its
choice. The run's first step then confirms it: the memory ledger measures
that step (``--report-memory``, on with ``auto``: memory.json), the run sets
its figures beside the prediction when it ends (commands/train.py), and a step that
runs out of memory ends the run with the next size down to give.
"""

from __future__ import annotations

import os

import torch

from scaletrain.config import Config
from scaletrain.errors import UserError
from scaletrain.planner.hardware import DEVICES, Cluster, cpu_device
from scaletrain.planner.predict import predict
from scaletrain.planner.profile import for_this_machine

LARGEST = 1024  # sequences: past this a step is long whatever the device holds


def device_memory(device: torch.device, processes_here: int) -> int:
    """Bytes one rank may fill: its GPU's (read from its properties, which makes no CUDA context in a
    process that only launches the workers), or its share of this machine's memory."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // max(processes_here, 1)


def machine_cluster(world: int, memory: int, on_gpu: bool) -> Cluster:
    """``world`` ranks of ``memory`` bytes each, as the planner weighs their memory (a GPU's own, or on a
    CPU the host's, where offloaded state counts too): this machine's profile where it has one (a profile
    of another device refused: planner/profile.py), else a preset; its time model is not read, and
    nothing is measured."""
    device = for_this_machine(on_gpu) or (DEVICES["H100"] if on_gpu else cpu_device(1.0, memory))
    return Cluster(device, world, world).with_memory(memory)


def largest_fitting(cfg: Config, world: int, vocab_size: int, memory: int, on_gpu: bool) -> tuple[int, dict]:
    """(the micro-batch, its predicted bytes on the busiest rank by row) for ``cfg``'s layout on ``world``
    ranks of ``memory`` bytes each; one sentence where not even one sequence fits."""
    cluster = machine_cluster(world, memory, on_gpu)
    chosen = None
    size = 1
    while size <= LARGEST:
        prediction = predict(cfg.replace(micro_batch=size), world, vocab_size, cluster)
        if not prediction.fits:
            break
        chosen = (size, prediction.memory)
        size *= 2
    if chosen is None:
        needed = prediction.memory["total"] / 2**30
        raise UserError(f"--micro-batch auto: even one sequence per micro-batch is predicted to need "
                        f"{needed:.1f} GiB of this device's {memory / 2**30:.1f} GiB; shorten --seq-len, add "
                        f"recomputation or sharding (--recompute, --zero), or use more devices.")
    return chosen


def chosen_sentence(micro_batch: int, predicted: dict, memory: int) -> str:
    return (f"--micro-batch auto: {micro_batch}, the largest power of two (up to {LARGEST}) the planner predicts "
            f"to fit: {predicted['total'] / 2**30:.2f} GiB of this device's {memory / 2**30:.1f} GiB")


def measured_sentence(micro_batch: int, predicted: dict, ledger: dict) -> str:
    """The choice beside what rank 0's memory ledger measured on the first step, row for row
    (weights, gradients, optimizer state, activations), and on a GPU CUDA's peak beside the
    predicted total."""
    counted = sum(ledger[row] for row in ("params", "grads", "optimizer", "activations_peak"))
    counted_predicted = sum(predicted[row] for row in ("params", "grads", "optimizer", "activations"))
    cuda = f"; CUDA's peak {ledger['cuda_peak'] / 2**30:.2f} GiB" if ledger.get("cuda_peak") else ""
    return (f"--micro-batch auto: {micro_batch}; weights, gradients, optimizer state and activations predicted "
            f"{counted_predicted / 2**30:.2f} GiB on the busiest rank, measured {counted / 2**30:.2f} GiB on rank "
            f"0's first step; {predicted['total'] / 2**30:.2f} GiB predicted in all{cuda}")
