"""Ctrl-C on a run: one line saying where the run stood and how to go on, exit code 130.

A terminal's Ctrl-C sends SIGINT to every process of the foreground group: the
launching process, and with ``--nproc`` the elastic agent in it and each
worker. Each ends as ``KeyboardInterrupt`` whatever the code it stopped made of
it (runtime/interrupts.py; the agent's own ``SignalException`` turned back into
one by runtime/spawn.py), the workers quietly. The launching process then says
where the run stood, from the run folder, which is where a user goes on from:
the last step ``metrics.jsonl`` recorded and the newest complete checkpoint.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from scaletrain.runtime.interrupts import interrupts_as_keyboard_interrupt
from scaletrain.train.checkpoint import latest_checkpoint


@contextmanager
def interrupts_explained(run_dir: Path) -> Iterator[None]:
    """Within: Ctrl-C leaves as ``KeyboardInterrupt`` whose message is `interrupted_sentence`."""
    try:
        with interrupts_as_keyboard_interrupt():
            yield
    except KeyboardInterrupt:
        raise KeyboardInterrupt(interrupted_sentence(run_dir)) from None


def interrupted_sentence(run_dir: Path) -> str:
    """Where an interrupted run stood, from its folder, and the command that goes on from there."""
    step = last_recorded_step(run_dir / "metrics.jsonl")
    where = f"at step {step}" if step else "before the first step"
    latest = latest_checkpoint(run_dir) if run_dir.is_dir() else None
    if latest is not None:
        return f"interrupted {where}; the newest checkpoint is {latest}; rerun with --resume."
    if (run_dir / "config.toml").is_file():
        return (f"interrupted {where}, before the first checkpoint, so there is nothing to resume; delete "
                f"{run_dir} and run the same command again.")
    return f"interrupted {where}, before the run folder {run_dir} was written; run the same command again."


def last_recorded_step(metrics: Path) -> int | None:
    """The step of the last whole record in ``metrics.jsonl`` (the interrupt may have cut the last line)."""
    try:
        lines = metrics.read_text().splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            return int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            continue
    return None
