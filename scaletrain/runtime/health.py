"""Heartbeats: when a collective fails, say which rank failed.

A collective with a dead rank fails on the others within a moment (gloo:
"Connection reset by peer [10.0.0.7]:40312", an address, not a rank); with a
rank that is alive but stuck, it waits for the process group's timeout.
Neither says which rank, and on a thousand ranks that is the first question.

So every rank keeps a counter in the job's rendezvous store (the TCPStore the
process group met through: rank 0's, or the torchrun agent's, which outlives
its workers) and bumps it every ``interval`` seconds from a daemon thread. A
rank that fails in its own code writes why before it leaves; a rank that
leaves because another failed says so too, so as not to be taken for dead. When a collective fails, the rank
that saw it calls `diagnose`: a rank that wrote a reason is named with it,
else the ranks whose counter stood still for three intervals, and that
left no word, are the ones that died or hang.

The same thread publishes the rank's record of its collectives
(runtime/desync.py) whenever it changed, and `desync` reads every rank's to say,
when a collective failed and nobody died, which rank keeps it waiting and
where that rank is instead; `stuck` names a collective that timed out with
every member in it.

Keys live under ``scaletrain/health/<attempt>/``, the restart count of the
launch, because the agent's store keeps the keys of earlier attempts.

`stop` joins the thread rather than leaving it to die with the process. A
daemon thread that returns from a C++ call (``store.add``, which releases the
GIL) while the interpreter finalizes is ended by a forced unwind
(``pthread_exit``), and that unwind through pybind11's ``noexcept`` GIL guard
calls ``std::terminate``: the process aborts ("terminate called without an
active exception", exit code 134) after its work is done. A worker started by
torchrun exits through that finalization; under load the race is common.
"""

from __future__ import annotations

import json
import threading
import time
from datetime import timedelta

import torch.distributed as dist

from scaletrain.runtime.desync import Call, CollectiveTracker, explain_desync
from scaletrain.runtime.launch import ProcessEnv, restart_attempt

# Store operations on an unreachable store fail with one of these.
STORE_ERRORS = (RuntimeError, dist.DistError)


def heartbeat_interval(timeout_s: float) -> float:
    """A twentieth of the collective timeout, between one second and five:
    often enough to tell dead from slow well inside the timeout, rarely enough
    that thousands of ranks do not crowd the store, and not so often that a
    busy machine's scheduler delays a live rank's beat past three of them."""
    return min(5.0, max(1.0, timeout_s / 20))


class Health:
    def __init__(self, env: ProcessEnv, timeout_s: float):
        self.env, self.timeout_s = env, timeout_s
        self.interval = heartbeat_interval(timeout_s)
        self._prefix = f"scaletrain/health/{restart_attempt()}"
        self._store_timeout = max(5.0, 2 * self.interval)
        self._store = dist.TCPStore(env.master_addr, env.master_port, is_master=False,
                                    timeout=timedelta(seconds=self._store_timeout))
        self._stop = threading.Event()
        self._tracker: CollectiveTracker | None = None
        self._published = -1  # the tracker version last written
        self._thread = threading.Thread(target=self._beat, name="scaletrain-heartbeat", daemon=True)
        self._thread.start()

    def _key(self, what: str, rank: int) -> str:
        return f"{self._prefix}/{what}/{rank}"

    def _beat(self) -> None:
        beat = self._key("beat", self.env.rank)
        while not self._stop.is_set():
            try:
                self._store.add(beat, 1)
                self._publish()
            except STORE_ERRORS:
                return  # the store is gone with its host; diagnose() will say so
            self._stop.wait(self.interval)

    def track(self, tracker: CollectiveTracker) -> None:
        """Publish ``tracker``'s record of this rank's collectives with every heartbeat that finds it changed."""
        self._tracker = tracker

    def _publish(self) -> None:
        tracker = self._tracker
        if tracker is not None and tracker.version != self._published:
            version = tracker.version
            self._store.set(self._key("collectives", self.env.rank), json.dumps(tracker.record()))
            self._published = version

    def desync(self) -> str | None:
        """Which ranks keep this rank's failed collective waiting and where they are (runtime/desync.py),
        from every rank's published record; None without a record here, when this rank failed
        outside a collective (its own error is the cause), or when nobody is behind."""
        if self._tracker is None or not self._tracker.record()["waiting"]:
            return None
        try:
            self._publish()  # this rank's latest: the call that failed
            keys = {r: self._key("collectives", r) for r in range(self.env.world_size)}
            records = {r: json.loads(self._store.get(key)) if self._store.check([key]) else None
                       for r, key in keys.items()}
        except STORE_ERRORS:
            return None
        return explain_desync(records)

    def stuck(self, exc: Exception) -> str | None:
        """A collective of this rank's that timed out (``exc``) while no rank died and none is
        behind (every member in it: a transfer slower than the timeout, or a stuck link), as a
        phrase; None for any other failure."""
        waiting = self._tracker.record()["waiting"] if self._tracker else []
        if not waiting or "timed out" not in str(exc).lower():
            return None
        return (f"rank {self.env.rank} waited --timeout ({self.timeout_s:g} s) in {Call(**waiting[0])} with every "
                f"member alive and in it (a transfer slower than the timeout or a stuck link: raise --timeout if "
                f"it is only slow)")

    def failed(self, reason: str) -> None:
        """This rank fails in its own code, for ``reason``: the others will name it with that."""
        self._set("failed", reason)

    def leave(self) -> None:
        """This rank leaves because another failed: not to be taken for a dead one."""
        self._set("left", "")

    def _set(self, what: str, value: str) -> None:
        try:
            self._store.set(self._key(what, self.env.rank), value)
        except STORE_ERRORS:
            pass  # the store is gone: the others learn it from diagnose()

    def diagnose(self) -> str | None:
        """Who failed, as a phrase (``rank 3 died or hangs``), or None when every
        other rank is alive and silent: then the failure is this rank's own."""
        others = [r for r in range(self.env.world_size) if r != self.env.rank]
        try:
            before = self._beats(others)
            time.sleep(3 * self.interval)
            after = self._beats(others)
            # Read after the beats: a rank that wrote meanwhile is not taken for a dead one.
            failed, left = self._written("failed", others), self._written("left", others)
        except STORE_ERRORS:
            host = "the torchrun agent" if self.env.source == "torchrun" else "rank 0"
            return (f"the job's rendezvous store at {self.env.master_addr}:{self.env.master_port} is gone, "
                    f"and with it {host}, its host")
        if failed:
            rank = min(failed)
            return f"rank {rank} failed: {failed[rank]}"
        stalled = [r for r in others if after[r] == before[r] and r not in left]
        if not stalled:
            return None
        if len(stalled) == 1:
            return f"rank {stalled[0]} died or hangs"
        return f"ranks {', '.join(map(str, stalled))} died or hang"

    def _beats(self, ranks: list[int]) -> dict[int, int]:
        return {r: self._store.add(self._key("beat", r), 0) for r in ranks}

    def _written(self, what: str, ranks: list[int]) -> dict[int, str]:
        keys = {r: self._key(what, r) for r in ranks}
        return {r: self._store.get(key).decode() for r, key in keys.items() if self._store.check([key])}

    def stop(self) -> None:
        """End the heartbeats and wait for the thread: a store call it is in returns within the
        store's timeout, so the wait is bounded, and no thread is in C++ when the process exits."""
        self._stop.set()
        self._thread.join(timeout=self._store_timeout + self.interval)
