"""Ctrl-C as ``KeyboardInterrupt``, whatever the code it stopped made of it.

Python turns SIGINT into ``KeyboardInterrupt`` wherever the interpreter
happens to be, and what is under way may report it as something else: the
checkpoint writer (torch.distributed.checkpoint) wraps whatever stops it,
``KeyboardInterrupt`` included, in an error of its own, which would surface
as a failure with its traceback. So the signal is noted as it arrives, and any
exception after it leaves as ``KeyboardInterrupt``: the command line's one
line in the launching process (job/interrupt.py), and a quiet end in a
worker (torch's process wrapper swallows it; runtime/spawn.py).

A worker hears one Ctrl-C twice: from the terminal, and a moment later from
the elastic agent, which passes the signal it got on to every worker as it
stops them. The second would land in the worker's cleanup (often in a
weak reference's callback, where Python can only print it as "Exception
ignored" with a traceback), so a SIGINT soon after the first is let pass.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

SAME_CTRL_C_S = 2.0  # a SIGINT this soon after the last one is the same Ctrl-C, passed on by the agent


@contextmanager
def interrupts_as_keyboard_interrupt() -> Iterator[None]:
    """Within: SIGINT raises ``KeyboardInterrupt`` as Python's default handler does, and any
    exception after it leaves as ``KeyboardInterrupt`` (the module docstring). A SIGINT this
    process ignores, or a thread other than the main one (which cannot set handlers), keeps its ways."""
    noted: list[float] = []  # when each Ctrl-C arrived

    def note(signum: int, frame) -> None:
        now = time.monotonic()
        if noted and now - noted[-1] < SAME_CTRL_C_S:
            return
        noted.append(now)
        raise KeyboardInterrupt

    previous = None
    if threading.current_thread() is threading.main_thread() and \
            signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        previous = signal.signal(signal.SIGINT, note)
    try:
        yield
    except BaseException as exc:
        if noted and not isinstance(exc, KeyboardInterrupt):
            raise KeyboardInterrupt from None
        raise
    finally:
        if previous is not None:  # the elastic agent may have put its own in the meantime
            signal.signal(signal.SIGINT, previous)
