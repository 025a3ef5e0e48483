"""Starting several local processes as torchrun would: ``spawn_local``.

``--nproc N`` (and ``scaletrain run --nproc N``, the benches, ``check_parity``)
starts N workers through torch's elastic agent on this machine, with a
rendezvous of its own and ``--max-restarts`` as torchrun's. Each worker finds
its place from the agent's variables (runtime/launch.py: `detect_environment`).
A worker's user mistake or job failure comes back as its one sentence, the
lowest rank's first; a bug as `WorkerFailed` with the traceback; a worker
killed by a signal as `WorkerKilled`, naming it; Ctrl-C as ``KeyboardInterrupt``, the
workers stopped.

Start-up. A fresh interpreter per worker imports torch and this package
(seconds of CPU each, most of a small run's time). So a launch starts a fork
server that imports them once, the entrypoint's module with them, and forks
every worker from it (`_fork_server`). It computes nothing and touches no
GPU, so the forked workers start clean. A later launch from the same process
(`check_parity`'s layouts, a bench's rungs, `--layout auto`'s calibration
then its run) forks from the same server while everything a worker takes
from it is as it was when it started: the modules it imported, the
environment variables, the import path and folder, and where standard input,
output and error lead. Otherwise the server is stopped and a new one started
from the caller as it is then (a server kept regardless would hand later
workers the environment and output it started with).
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import multiprocessing.forkserver
import os
import signal
import sys
import tempfile
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from scaletrain.errors import JobFailed, UserError
from scaletrain.runtime.interrupts import interrupts_as_keyboard_interrupt
from scaletrain.runtime.launch import DEFAULT_ADDR, free_port, restart_attempt


class WorkerFailed(RuntimeError):
    """A worker started by `spawn_local` failed with a bug (its traceback is in the message)."""


class WorkerKilled(JobFailed):
    """A worker started by `spawn_local` was killed by a signal (no traceback to show)."""


@record
def _worker(sentence_dir: str, entrypoint: Callable[..., Any], *args: Any) -> Any:
    """Run the entrypoint, leaving a UserError's or a JobFailed's sentence in a file for the parent.

    The error is raised on, so that the launcher stops the other ranks at
    once instead of leaving them blocked on this one until their collective
    timeout; the file survives that, and elastic keeps no return values of a
    failed run. `record` saves other errors' tracebacks for the parent.
    """
    try:
        with interrupts_as_keyboard_interrupt():  # Ctrl-C ends a worker quietly, whatever it interrupted
            return entrypoint(*args)
    except (UserError, JobFailed) as error:
        kind = "user" if isinstance(error, UserError) else "job"
        name = f"{restart_attempt():04d}.{int(os.environ['RANK']):06d}"
        Path(sentence_dir, name).write_text(json.dumps({"kind": kind, "text": str(error)}))
        raise


def _sentence(sentence_dir: Path) -> UserError | JobFailed | None:
    """The lowest rank's sentence from the last launch attempt, a user's mistake before a job's failure."""
    files = sorted(sentence_dir.iterdir())
    if not files:
        return None
    last = [json.loads(f.read_text()) for f in files if f.name.split(".")[0] == files[-1].name.split(".")[0]]
    first = min(last, key=lambda said: said["kind"] != "user")
    return (UserError if first["kind"] == "user" else JobFailed)(first["text"])


def _failure_text(failure: Any) -> tuple[str, str]:
    """First line and full traceback of an elastic ProcessFailure."""
    message = failure.message
    if isinstance(message, dict):
        return message.get("message", ""), message.get("extraInfo", {}).get("py_callstack", "")
    return str(message), ""


def _inherited(modules: list[str]) -> tuple:
    """What a worker forked from a server started now would take from this process (module
    docstring); each standard stream as the file it leads to, or None where it is closed."""
    streams = []
    for fd in (0, 1, 2):
        try:
            stat = os.fstat(fd)
            streams.append((stat.st_dev, stat.st_ino))
        except OSError:
            streams.append(None)
    return tuple(modules), tuple(sorted(os.environ.items())), tuple(sys.path), os.getcwd(), tuple(streams)


# multiprocessing runs one fork server per process; its pid -> what its workers inherit, as it started
_SERVED: dict[int, tuple] = {}


@contextmanager
def _fork_server(entrypoint: Callable[..., Any]) -> Iterator[None]:
    """The fork server for one launch, which has imported this module and the entrypoint's: the one
    running where it would fork the same workers a new one would (module docstring)."""
    # a script's __main__ is prepared in each worker as under spawn
    modules = [__name__] + ([entrypoint.__module__] if entrypoint.__module__ != "__main__" else [])
    server = multiprocessing.forkserver._forkserver
    if (server._forkserver_pid is None or server._preload_modules != modules
            or _SERVED.get(server._forkserver_pid) != _inherited(modules)):
        # Stopped the standard library's own way: one started earlier, by us or another caller (a
        # test's helper), would hand the workers that time's environment, folder and output.
        server._stop()
        _SERVED.clear()
        multiprocessing.set_forkserver_preload(modules)
    try:
        yield
    except BaseException:
        server._stop()  # a launch that failed leaves no server behind
        _SERVED.clear()
        raise
    if server._forkserver_pid is not None:
        # taken after the launch: the server started with its workers, once the launcher had set
        # its own variables (TORCHELASTIC_SIGNALS_TO_HANDLE), which the next launch finds set
        _SERVED[server._forkserver_pid] = _inherited(modules)


def spawn_local(nproc: int, entrypoint: Callable[..., Any], args: tuple, *, max_restarts: int = 0) -> dict[int, Any]:
    """Run `entrypoint(*args)` in `nproc` local processes, as torchrun would; return each rank's result.

    `entrypoint` must be a module-level function (it is pickled into the
    workers). The workers find their place with `detect_environment`.
    """
    # The elastic agent narrates every step at INFO and logs each worker's
    # failure and termination; failures come back as exceptions carrying the
    # traceback instead. The agent's own module sets its level itself, so the parent's does not reach it:
    # without it, Ctrl-C is preceded by its warning that it shuts the workers down.
    loggers = [logging.getLogger(name) for name in ("torch.distributed.elastic", "torch.multiprocessing.spawn",
                                                    "torch.distributed.elastic.agent.server.api")]
    previous_levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    try:
        with tempfile.TemporaryDirectory(prefix="scaletrain-spawn-") as workdir:
            sentence_dir = Path(workdir, "sentences")
            sentence_dir.mkdir()
            config = LaunchConfig(
                min_nodes=1,
                max_nodes=1,
                nproc_per_node=nproc,
                rdzv_backend="c10d",
                rdzv_endpoint=f"{DEFAULT_ADDR}:{free_port()}",
                run_id=uuid.uuid4().hex,
                max_restarts=max_restarts,
                start_method="forkserver",
                logs_specs=DefaultLogsSpecs(log_dir=str(Path(workdir, "logs"))),
            )
            failed: ChildFailedError | None = None
            try:
                with _fork_server(entrypoint):
                    results = elastic_launch(config, _worker)(str(sentence_dir), entrypoint, *args)
            except ChildFailedError as error:
                failed = error
            except SignalException as stopped:  # the agent's own word for Ctrl-C, having stopped the workers
                if stopped.sigval != signal.SIGINT:
                    raise
                raise KeyboardInterrupt from None
            sentence = _sentence(sentence_dir) if failed else None
    finally:
        for logger, level in zip(loggers, previous_levels, strict=True):
            logger.setLevel(level)
    if sentence is not None:
        raise sentence
    if failed is not None:
        first_rank, first = failed.get_first_failure()
        if first.exitcode < 0:  # killed: there is no traceback, only the signal
            raise WorkerKilled(f"rank {first_rank} was killed by {signal.Signals(-first.exitcode).name} and the "
                               f"launcher stopped the other workers")
        texts = {rank: _failure_text(failure) for rank, failure in sorted(failed.failures.items())}
        summary = "; ".join(f"rank {rank}: {line}" for rank, (line, _) in texts.items())
        raise WorkerFailed(f"{len(texts)} of {nproc} workers failed ({summary})\n{texts[first_rank][1]}".rstrip())
    return results
