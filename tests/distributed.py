"""Run a test function in N real processes joined by a gloo process group.

`run_distributed(fn, n, *args)` calls `fn(rank, n, *args)` in n fresh
processes and returns their results ordered by rank. `fn` must be a
module-level function of an importable module (it reaches the processes
pickled by name). If a process raises, the others are killed and the
parent raises with that rank's traceback; a run longer than `timeout_s` is
killed too.
"""

from __future__ import annotations

import multiprocessing.forkserver
import pickle
import queue
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing

from scaletrain.runtime import free_port


class DistributedTestError(AssertionError):
    """A rank of a distributed test failed, timed out or died."""


def _worker(rank: int, world_size: int, port: int, timeout_s: float, fn: Callable, args: tuple, results: Any) -> None:
    # Several processes share few cores; more threads each would only contend.
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
        )
        # Pickled here so tensors travel by value, not as shared memory
        # that vanishes when this process exits.
        results.put((rank, True, pickle.dumps(fn(rank, world_size, *args))))
    except BaseException:
        # Reported before the barrier below, which the other ranks may never reach.
        results.put((rank, False, traceback.format_exc()))
        raise
    finally:
        if dist.is_initialized():
            # torch 2.13 aborts teardown at random without a barrier first.
            dist.barrier()
            dist.destroy_process_group()


def run_distributed(fn: Callable, world_size: int, *args: Any, timeout_s: float = 60) -> list[Any]:
    """`fn(rank, world_size, *args)` in `world_size` gloo processes; their results by rank."""
    # A fork server imports torch once and forks each rank from that clean
    # process: spawning instead costs every rank its own torch import
    # (seconds on a small machine), and forking pytest itself is unsafe.
    context = torch.multiprocessing.get_context("forkserver")
    # fn's module too (the scaletrain modules a test reaches, a second or so a rank); the server is
    # started anew where a test module's run follows another's, whose modules it preloaded.
    preload = ["torch", "torch.distributed", "scaletrain.runtime", fn.__module__]
    if multiprocessing.forkserver._forkserver._preload_modules != preload:
        multiprocessing.forkserver._forkserver._stop()
        context.set_forkserver_preload(preload)
    results = context.Queue()
    port = free_port()
    processes = [
        context.Process(target=_worker, args=(rank, world_size, port, timeout_s, fn, args, results), daemon=True)
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    deadline = time.monotonic() + timeout_s
    outputs: dict[int, Any] = {}
    first_death: float | None = None
    try:
        while len(outputs) < world_size:
            try:
                rank, ok, payload = results.get(timeout=0.2)
            except queue.Empty:
                dead = [r for r, p in enumerate(processes) if r not in outputs and p.exitcode not in (None, 0)]
                # A rank that raised has queued its traceback before exiting;
                # wait a moment for it before reporting a bare death.
                if dead and first_death is None:
                    first_death = time.monotonic()
                if dead and time.monotonic() > first_death + 1:
                    code = processes[dead[0]].exitcode
                    raise DistributedTestError(f"rank {dead[0]} died with exit code {code}") from None
                if time.monotonic() > deadline:
                    missing = [r for r in range(world_size) if r not in outputs]
                    raise DistributedTestError(f"ranks {missing} did not finish within {timeout_s} s") from None
                continue
            if not ok:
                raise DistributedTestError(f"rank {rank} of {world_size} raised:\n{payload}")
            outputs[rank] = pickle.loads(payload)
        for process in processes:
            process.join(timeout=max(1.0, deadline - time.monotonic()))
        unclean = [r for r, p in enumerate(processes) if p.exitcode != 0]
        if unclean:
            raise DistributedTestError(
                f"rank {unclean[0]} returned but did not exit cleanly (exit code {processes[unclean[0]].exitcode})"
            )
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
                process.join()
    return [outputs[rank] for rank in range(world_size)]
