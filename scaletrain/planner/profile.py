"""Machine profiles: what ``scaletrain plan --calibrate`` measured on a machine, as a file, and
the planner's device made from it.

A profile is one JSON object (``FORMAT`` 3):

    machine      the device measured ("NVIDIA H200", or a CPU's model and core count), whether it
                 is a GPU, the backend, processes and threads per process, the dtype of the
                 products, the device's memory, hostname, CPU and GPU counts, torch's version,
                 the date, quick or full, the seconds the calibration took
    matmul       {"sides", "tflops"}: TFLOP/s of [m, k] @ [k, k], m rows and k columns over sides
    attention    {"shapes", "tflops", "ring_tflops"}: scaled_dot_product_attention, causal, forward and
                 backward, on the formula's 12·a·d·s FLOPs per token (planner/compute.py), over all
                 shapes; and context parallelism's ring blocks on the same count
    memory       {"elementwise_gbps", "adamw_gbps"}: GB/s of a large add, and of torch's AdamW
                 over a large flat tensor (28 bytes a weight: compute.py's optimizer bytes)
    block_overhead_s  a small block's forward and backward, every kernel launched, none busy
    step_overhead_s   the trainer's fixed cost of a step beyond its blocks (planner/calibrate_engine.py)
    collectives  {"measured": {op: {group size: {"bytes", "seconds"}}}, "fits": {op: {group size:
                 {"alpha_s", "bytes_per_s"}}}} (planner/collective_fits.py)
    sharing      on a CPU of more than one process, {"processes", "efficiency", "sync_s"}
                 (planner/calibrate_sharing.py); else null

and the device it makes (`device_of`): the GPU's datasheet preset (planner/hardware.py) or,
on a CPU, its largest measured product as the peak, with the measured curve, attention's
share of the peak (and the ring's), the elementwise bandwidth as ``memory_gbps`` and AdamW's share of it as
``memory_share`` (a preset's share is AdamW's too), the block overhead, the measured table
of collectives, and the links' figures from the largest group's all-reduce (the latency of
one of its ``2(g-1)`` messages, its bus bandwidth) for groups the table lacks. A CPU's device
is shared out to the run's processes (planner/hardware.py `shared_cpu`), and where they are as
many as the calibration's, taken at the rates they reached together (`contended`).

Where one is found, first match wins (`chosen_path`):

    1. ``--profile FILE``             (scaletrain plan)
    2. ``SCALETRAIN_PROFILE=FILE``    (every command, and the library)
    3. ``$XDG_CACHE_HOME/scaletrain/machines/<device>-<backend>.json`` (``~/.cache`` without it),
       where ``--calibrate`` writes unless told otherwise

A run on this machine (the gate, ``--micro-batch auto``, ``--layout auto``, ``plan --gpu
here``) refuses a profile of another device in one sentence; ``plan --profile FILE``
plans for whichever machine the file describes.
"""

from __future__ import annotations

import functools
import json
import os
import re
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import torch

from scaletrain.errors import UserError
from scaletrain.paths import readable_file
from scaletrain.planner.collective_fits import CollectiveTable
from scaletrain.planner.curves import MatmulCurve
from scaletrain.planner.hardware import DEVICES, GB, Device, contended, cpu_device, shared_cpu

# 2: a CPU's arithmetic measured by one process alone (planner/calibrate.py); 3: ring attention, and how the
# CPU's cores serve the processes together (planner/calibrate_sharing.py)
FORMAT = 3
PROFILE_VARIABLE = "SCALETRAIN_PROFILE"
PRECISIONS = ("bf16", "fp16", "fp32", "fp8")


def device_name(on_gpu: bool, local_rank: int = 0) -> str:
    """This machine's device as a profile names it: the GPU's name, or the CPU's model and its core
    count (a CPU's figures are its processes' shares of all its cores)."""
    if on_gpu:
        return torch.cuda.get_device_name(local_rank % torch.cuda.device_count())
    model = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as info:
            model = next(line.split(":", 1)[1].strip() for line in info if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{model}, {os.cpu_count()} cores"


def default_backend(on_gpu: bool) -> str:
    return "nccl" if on_gpu else "gloo"


def default_path(device: str, backend: str) -> Path:
    """Where ``device``'s profile on ``backend`` lives unless one is named (module docstring)."""
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    slug = re.sub(r"[^a-z0-9]+", "-", device.lower()).strip("-")
    return Path(cache, "scaletrain", "machines", f"{slug}-{backend}.json")


def chosen_path(given: str | None, device: str, backend: str) -> tuple[Path, str]:
    """(the profile's path, what named it) by the precedence of the module docstring."""
    if given:
        return Path(given), "--profile"
    if os.environ.get(PROFILE_VARIABLE):
        return Path(os.environ[PROFILE_VARIABLE]), PROFILE_VARIABLE
    return default_path(device, backend), "the default location"


def save(profile: dict, path: Path) -> None:
    """Write ``profile`` whole or not at all: to a temporary file beside ``path``, then renamed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=f".{path.name}.", delete=False) as file:
        json.dump(profile, file, indent=1)
    os.replace(file.name, path)


def load(path: Path, named_by: str) -> dict:
    """The profile at ``path`` (named by ``named_by``: a flag, the variable or the default
    location); one sentence where it is unreadable or not a profile."""
    readable_file(named_by, path, "a machine profile written by scaletrain plan --calibrate")
    stat = path.stat()
    return _parsed(str(path), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=8)
def _parsed(path: str, _mtime_ns: int, _size: int) -> dict:
    """A profile's contents, read once per version of the file (the gate prices many candidates)."""
    try:
        profile = json.loads(Path(path).read_text())
        if isinstance(profile, dict) and profile.get("format") == FORMAT:
            device_of(profile)  # every figure the planner reads is there
            return profile
    except (ValueError, KeyError, TypeError, IndexError, ZeroDivisionError, AttributeError):
        pass
    raise UserError(f"{path} is not a machine profile this version reads; measure the machine again with "
                    f"scaletrain plan --calibrate --profile {path}.")


def check_here(profile: dict, path: Path, named_by: str, on_gpu: bool) -> None:
    """One sentence where ``profile`` measured another device than this machine's."""
    here, measured = device_name(on_gpu), profile["machine"]["device"]
    if measured != here:
        raise UserError(f"the machine profile {path} (from {named_by}) measured {measured}, not this machine's "
                        f"{here}; calibrate this machine with scaletrain plan --calibrate, or name its own profile.")


def for_this_machine(on_gpu: bool, backend: str | None = None, given: str | None = None,
                     required: bool = False, processes: int | None = None) -> Device | None:
    """This machine's calibrated device from its profile (module docstring), as each of ``processes``
    processes on it sees it (`device_of`); None where there is none and none was named, unless
    ``required`` (``plan --gpu here``): then one sentence."""
    backend = backend or default_backend(on_gpu)
    if on_gpu and not torch.cuda.device_count():  # a GPU priced where there is none: no profile of it here
        if required:
            raise UserError(f"--backend {backend} plans for this machine's GPU, but it shows none; give --backend "
                            f"gloo, or name a GPU machine's profile with --profile FILE alone.")
        return None
    device = device_name(on_gpu)
    path, named_by = chosen_path(given, device, backend)
    if named_by == "the default location" and not os.path.exists(path):  # unreadable folders too: no profile
        if required:
            raise UserError(f"no machine profile of this machine's {device} with {backend} at {path}; measure one "
                            f"with scaletrain plan --calibrate (about a minute), or name one with --profile FILE.")
        return None
    try:
        profile = load(path, named_by)
    except UserError as exc:
        if named_by != "the default location" or required:
            raise
        # a profile nobody named, of an older version: the run goes on as if there were none
        print(f"warning: {exc} Until then the planner uses the datasheet figures.", file=sys.stderr)
        return None
    check_here(profile, path, named_by, on_gpu)
    return device_of(profile, processes)


def gpu_preset(name: str) -> Device | None:
    """The datasheet preset whose name a GPU's contains (``NVIDIA H200`` is the H200), if any."""
    return next((device for key, device in DEVICES.items() if key in name.upper()), None)


def device_of(profile: dict, processes: int | None = None) -> Device:
    """The planner's device from a profile's measurements (module docstring); a CPU's as each of
    ``processes`` processes on its cores sees it (planner/hardware.py `shared_cpu`; default: as many as
    the calibration started)."""
    machine, matmul = profile["machine"], profile["matmul"]
    grid = tuple(tuple(float(value) for value in row) for row in matmul["tflops"])
    fastest = max(max(row) for row in grid)
    if machine["on_gpu"]:
        preset = gpu_preset(machine["device"])
        base = preset or replace(DEVICES["H100"], name=machine["device"], tflops=dict.fromkeys(PRECISIONS, fastest))
        base = replace(base, memory_bytes=int(machine["memory_bytes"]))
    else:
        base = cpu_device(fastest, int(machine["memory_bytes"]))
    peak = base.tflops[machine["dtype"]]
    source = f"{machine['device']}, measured by scaletrain plan --calibrate on {machine['date']}"
    memory = profile["memory"]
    table = CollectiveTable.from_json(profile["collectives"]["fits"])
    device = replace(base, matmul=MatmulCurve(tuple(matmul["sides"]), grid, peak, source),
                     attention_share=profile["attention"]["tflops"] / peak,
                     ring_attention_share=profile["attention"]["ring_tflops"] / peak,
                     memory_gbps=memory["elementwise_gbps"],
                     memory_share=memory["adamw_gbps"] / memory["elementwise_gbps"],
                     block_overhead_s=profile["block_overhead_s"], step_overhead_s=profile["step_overhead_s"],
                     collectives=table if table.fits else None)
    device = _with_links(device, table, on_gpu=machine["on_gpu"])
    if machine["on_gpu"]:
        return device
    count = processes or machine["processes"]
    shared = shared_cpu(device, machine["threads_per_process"], machine["cpus"], count)
    sharing = profile["sharing"]
    if sharing is None or sharing["processes"] != count:
        return shared
    return contended(shared, sharing["efficiency"], sharing["sync_s"])


def _with_links(device: Device, table: CollectiveTable, on_gpu: bool) -> Device:
    """The node's link as its largest group's all-reduce shows it: per message of the ring's 2(g-1),
    and the bus bandwidth; across nodes a GPU keeps its preset's network, a CPU its loopback."""
    sizes = [size for op, size, _ in table.fits if op == "all_reduce"]
    if not sizes:
        return device
    size = max(sizes)
    fit = table.lookup("all_reduce", size)
    messages = 2 * (size - 1)
    latency, gbps = fit.alpha_s / messages, fit.bytes_per_s * messages / size / GB
    linked = replace(device, intra_latency_s=latency, intra_node_gbps=gbps, link_efficiency=1.0)
    if on_gpu:  # the network's rate at the preset's efficiency, the node's link measured
        return replace(linked, inter_node_gbps=device.inter_node_gbps * device.link_efficiency)
    return replace(linked, inter_latency_s=latency, inter_node_gbps=gbps)
