"""Fault injection: fail on purpose, where and when asked, to prove a job survives it.

Large jobs fail: a node dies, a process hangs, a checkpoint write is cut
off, a gradient turns into NaN. The tests of docs/reliability.md cause each
of these on purpose, in real processes, through one environment variable
that every launcher passes on to its workers::

    SCALETRAIN_FAULT="kill rank=1 step=5 at=micro-batch; nan rank=0 step=3"

Each fault (``;`` between them) is a kind, then where it strikes:

    kill    SIGKILL this process: a crashed host, an out-of-memory kill
    hang    SIGSTOP this process: it keeps its sockets open and answers nothing
    nan     NaN into one gradient of this rank, after backward (``param=NAME``,
            default the first parameter holding a gradient)
    skip    this rank leaves out the step's average of the loss, a collective
            the other ranks then wait in: a desync (docs/debugging.md)

    rank=R      the global rank that fails (default 0)
    step=S      the optimizer step, counted from 1 as in metrics.jsonl; for a
                checkpoint point, the step the checkpoint is of
    at=POINT    for kill and hang, one of POINTS (default step)
    attempt=A   the launch attempt it strikes in (default 0): torchrun and
                ``--max-restarts`` restart a failed job, and the restarted
                workers (TORCHELASTIC_RESTART_COUNT=1, ...) must run through

A job without the variable pays one dictionary lookup per point.
"""

from __future__ import annotations

import math
import os
import signal
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from scaletrain.errors import UserError
from scaletrain.runtime.launch import restart_attempt

VARIABLE = "SCALETRAIN_FAULT"
KINDS = ("kill", "hang", "nan", "skip")
# Where kill and hang can strike, in the order a step reaches them:
POINTS = (
    "step",            # the start of the step
    "micro-batch",     # fetching the step's second micro-batch (its first, if it has one)
    "optimizer",       # gradients synchronised, before the update
    "save-begin",      # a checkpoint's temporary folder made, nothing written
    "save-written",    # this rank's tensor files written, before the others are waited for
    "save-manifest",   # every file written, before the manifest (main rank)
    "save-rename",     # the manifest written, before the folder is renamed into place (main rank)
    "save-prune",      # the new checkpoint in place, old ones being deleted (main rank)
)


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int = 0
    step: int = 1
    at: str = "step"
    attempt: int = 0
    param: str | None = None


def parse(text: str) -> list[Fault]:
    """The faults a SCALETRAIN_FAULT value describes."""
    faults = []
    for item in filter(None, (part.strip() for part in text.split(";"))):
        kind, *pairs = item.split()
        fields: dict[str, str | int] = {}
        for pair in pairs:
            key, _, value = pair.partition("=")
            if key not in ("rank", "step", "at", "attempt", "param") or not value:
                raise UserError(f"{VARIABLE}: {pair!r} in {item!r} is not one of rank=, step=, at=, attempt=, "
                                f"param=; see docs/reliability.md.")
            fields[key] = value if key in ("at", "param") else _whole(value, item)
        fault = Fault(kind, **fields)  # type: ignore[arg-type]
        if kind not in KINDS or fault.at not in POINTS or (kind in ("nan", "skip") and fault.at != "step"):
            raise UserError(f"{VARIABLE}: {item!r} needs a kind among {', '.join(KINDS)} and, for kill and "
                            f"hang, at= among {', '.join(POINTS)}.")
        faults.append(fault)
    return faults


def _whole(value: str, item: str) -> int:
    if not value.isdecimal():
        raise UserError(f"{VARIABLE}: {value!r} in {item!r} must be a whole number.")
    return int(value)


class Faults:
    """The faults meant for this rank in this launch attempt."""

    def __init__(self, faults: list[Fault], rank: int, attempt: int):
        self._mine = [f for f in faults if f.rank == rank and f.attempt == attempt]

    @classmethod
    def from_env(cls, rank: int, environ: Mapping[str, str] = os.environ) -> "Faults":
        return cls(parse(environ.get(VARIABLE, "")), rank, restart_attempt(environ))

    def strike(self, at: str, step: int) -> None:
        """Kill or stop this process if a fault is set for this point of ``step``."""
        for fault in self._mine:
            if fault.kind in ("kill", "hang") and fault.at == at and fault.step == step:
                os.kill(os.getpid(), signal.SIGKILL if fault.kind == "kill" else signal.SIGSTOP)

    def skips(self, step: int) -> bool:
        """Whether this rank leaves out the loss average of ``step``."""
        return any(f.kind == "skip" and f.step == step for f in self._mine)

    def poisoned(self, step: int) -> list[str | None]:
        """The parameters whose gradient turns NaN at ``step`` (None: the first with one)."""
        return [f.param for f in self._mine if f.kind == "nan" and f.step == step]


def poison(named_tensors: list[tuple[str, torch.Tensor]], name: str | None) -> None:
    """A NaN into the gradient of the tensor ``name`` (None: the first holding a gradient)."""
    held = [(n, t.grad) for n, t in named_tensors if t.grad is not None and t.grad.numel()]
    grad = next((g for n, g in held if name in (None, n)), None)
    if grad is None:
        raise UserError(f"{VARIABLE}: this rank holds no gradient named {name}; name one it holds.")
    grad.view(-1)[0] = math.nan
