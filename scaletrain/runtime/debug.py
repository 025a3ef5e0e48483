"""``--debug-dist``: what it takes to find out why a distributed job misbehaves.

Three aids, off by default (each costs time or disk), beside a fourth that every run has:

1. torch's and NCCL's own debug output (`DEBUG_ENVIRONMENT`), set by the
   launching process before any process group exists, so that workers it
   spawns inherit it, and in-process for a worker that is the launching
   process itself (torchrun, SLURM, MPI). ``TORCH_DISTRIBUTED_DEBUG=DETAIL``
   wraps every process group in a checker that compares each collective's
   op, dtypes and shapes across the ranks before running it (a mismatch is an
   error naming the ranks) and logs more; ``NCCL_DEBUG=INFO`` prints NCCL's
   version, topology, rings and trees; ``TORCH_CPP_LOG_LEVEL=INFO`` turns on
   c10d's C++ log (stores, process groups, the NCCL watchdog), which is read
   when torch loads: the ``scaletrain`` command sets it before importing
   torch when ``--debug-dist`` is on its command line, the launcher sets it
   for the workers it spawns (a ``debug_dist`` key in a TOML file reaches
   spawned workers only); ``TORCH_NCCL_DESYNC_DEBUG=1`` makes NCCL's watchdog
   report, on a timeout, which rank never joined.
2. One log file per rank, ``RUN/logs/rank{R}.log`` (`RankLog`): the process's
   stdout and stderr at the file-descriptor level, so the C++ and NCCL logs
   land there too, from the moment the run folder exists (for workers that
   ``--nproc`` spawns, from their start). The main rank still writes to the
   console as well; the others only to their files.
3. An agreement check before any training step: every rank's own
   configuration equals rank 0's (`check_same_config`, before rank 0 writes
   anything), and the ranks that hold copies of the same weights hold
   parameters of the same names, shapes and dtypes (`check_same_parameters`,
   once the model is built and split: the dense weights over dp x ep x cp,
   the experts, which ep ranks hold different ones of, over dp x cp). A digest per rank crosses the network
   (through runtime/comm.py, in the ledger); only when two differ do the full
   descriptions follow, to name the rank and the field or parameter.
4. The desync detector (runtime/desync.py), on in every run (a dictionary update
   per collective): every collective numbered per group in a record that the
   heartbeat thread publishes, read when a collective fails to say which
   rank is behind and where.
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Iterable, MutableMapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from scaletrain.errors import JobFailed, UserError
from scaletrain.runtime.comm import Comm
from scaletrain.runtime.mesh import Group

DEBUG_ENVIRONMENT = {
    "TORCH_DISTRIBUTED_DEBUG": "DETAIL",
    "NCCL_DEBUG": "INFO",
    "TORCH_CPP_LOG_LEVEL": "INFO",
    "TORCH_NCCL_DESYNC_DEBUG": "1",
}
# Fields that may differ between ranks: --out defaults to a time stamp taken by each
# process, and rank 0's is the one every rank uses.
_PER_PROCESS_FIELDS = ("out",)


def debug_environment(environ: MutableMapping[str, str] = os.environ) -> None:
    """Set `DEBUG_ENVIRONMENT` (replacing values already set), before any process group exists."""
    environ.update(DEBUG_ENVIRONMENT)
    if environ is os.environ:
        dist.set_debug_level_from_env()  # torch read it when it loaded


class RankLog:
    """This process's stdout and stderr appended to ``run_dir/logs/rank{rank}.log``; with ``echo``
    also still written to where they went before (the console)."""

    def __init__(self, run_dir: Path, rank: int, world_size: int, echo: bool):
        self.path = Path(run_dir, "logs", f"rank{rank}.log")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        settings = " ".join(f"{key}={os.environ.get(key, '')}" for key in DEBUG_ENVIRONMENT)
        os.write(self._file, (f"# rank {rank} of {world_size}, pid {os.getpid()} on {socket.gethostname()}, "
                              f"{time.strftime('%Y-%m-%d %H:%M:%S')}; {settings}\n").encode())
        _flush()
        self._saved = {fd: os.dup(fd) for fd in (1, 2)}
        self._copiers: list[threading.Thread] = []
        for fd, saved in self._saved.items():
            if echo:  # a pipe in place of the descriptor, a thread copying it to both
                read, write = os.pipe()
                os.dup2(write, fd)
                os.close(write)
                copier = threading.Thread(target=self._copy, args=(read, (self._file, saved)),
                                          name=f"scaletrain-log-{fd}", daemon=True)
                copier.start()
                self._copiers.append(copier)
            else:
                os.dup2(self._file, fd)
        # torch.distributed's Python loggers at INFO: torch's own handler writes them to stderr.
        self._logger = logging.getLogger("torch.distributed")
        self._previous_level = self._logger.level
        self._logger.setLevel(logging.INFO)

    @staticmethod
    def _copy(read: int, targets: tuple[int, ...]) -> None:
        while chunk := os.read(read, 1 << 16):
            for target in targets:
                try:
                    os.write(target, chunk)
                except OSError:
                    pass  # a console that went away must not stop the copy to the file
        os.close(read)

    def close(self) -> None:
        """Give the descriptors back and let the copies finish."""
        self._logger.setLevel(self._previous_level)
        _flush()
        for fd, saved in self._saved.items():
            os.dup2(saved, fd)  # closes the pipe's last write end: the copier reads to its end
        for copier in self._copiers:
            copier.join(timeout=5)
        for saved in self._saved.values():
            os.close(saved)
        os.close(self._file)


def _flush() -> None:
    """Python's buffers out to the descriptors, before these change hands."""
    for stream in {sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__}:
        if stream is not None:
            stream.flush()


def _digest(value: Any) -> str:
    return hashlib.sha256(repr(value).encode()).hexdigest()


def _flat_config(config: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return {key: value for section in config.values() for key, value in section.items()
            if key not in _PER_PROCESS_FIELDS}


def check_same_config(comm: Comm, world: Group, config: dict[str, dict[str, Any]]) -> None:
    """Every rank was started with rank 0's configuration (``Config.to_dict()``), or a
    `UserError` names the first rank and field that differ."""
    mine = _flat_config(config)
    if len(set(comm.all_gather_object(_digest(sorted(mine.items())), world))) == 1:
        return
    everyone = comm.all_gather_object(mine, world)
    first = everyone[0]
    for rank, theirs in enumerate(everyone[1:], start=1):
        fields = sorted(set(first) | set(theirs), key=str)
        differing = [key for key in fields if first.get(key) != theirs.get(key)]
        if differing:
            key = differing[0]
            also = f" (and {len(differing) - 1} more field(s))" if len(differing) > 1 else ""
            raise UserError(f"rank {world.ranks[rank]} was started with another configuration than rank "
                            f"{world.ranks[0]}: --{key.replace('_', '-')} is {theirs.get(key)!r} there and "
                            f"{first.get(key)!r} on rank {world.ranks[0]}{also}; launch every rank with the "
                            f"same command and config file.")


def parameter_listing(named: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, dtype) of every named parameter, in order."""
    return [(name, tuple(p.shape), str(p.dtype).removeprefix("torch.")) for name, p in named]


def check_same_parameters(comm: Comm, world: Group, replicas: Sequence[int],
                          named: Iterable[tuple[str, torch.Tensor]]) -> None:
    """The ranks of each set of ``replicas`` (global ranks holding copies of the same weights:
    this rank's is given) hold ``named`` parameters of the same names, shapes and dtypes, or a
    `JobFailed` names a rank that differs from the first of its set and the first parameter that
    differs."""
    listing = parameter_listing(named)
    summaries = comm.all_gather_object((tuple(replicas), _digest(listing)), world)
    reference = {ranks: digest for ranks, digest in reversed(summaries)}  # each set's first rank's
    strays = [rank for rank, (ranks, digest) in enumerate(summaries) if digest != reference[ranks]]
    if not strays:
        return
    listings = comm.all_gather_object(listing, world)
    stray = world.ranks[strays[0]]
    first = summaries[strays[0]][0][0]
    difference = _first_difference(listings[world.ranks.index(first)], listings[strays[0]], first, stray)
    raise JobFailed(f"rank {stray} holds other parameters than rank {first}, which holds copies of the same "
                    f"weights: {difference}; every rank must build the same model (the same code and "
                    f"configuration).")


def _first_difference(ours: list, theirs: list, our_rank: int, their_rank: int) -> str:
    ours_by_name = {name: (shape, dtype) for name, shape, dtype in ours}
    theirs_by_name = {name: (shape, dtype) for name, shape, dtype in theirs}
    for name, shape, dtype in ours:
        if name not in theirs_by_name:
            return f"{name} exists on rank {our_rank} but not on rank {their_rank}"
        if theirs_by_name[name] != (shape, dtype):
            other_shape, other_dtype = theirs_by_name[name]
            return (f"{name} is {dtype} {list(shape)} on rank {our_rank} and {other_dtype} "
                    f"{list(other_shape)} on rank {their_rank}")
    extra = next((name for name, _, _ in theirs if name not in ours_by_name), None)
    if extra is None:
        return f"the same parameters in another order ({', '.join(name for name, _, _ in theirs[:3])}, ...)"
    return f"{extra} exists on rank {their_rank} but not on rank {our_rank}"
