"""Desync detection: when a collective times out, say which rank is behind and where.

A collective completes only when every member of its group calls it, and
the members must call a group's collectives in the same order. A rank that
leaves one out (a branch taken on one rank only, a skipped step, an early
return) or calls them in another order does not fail: the others wait in the
collective until the process group's timeout, and the error they get names
the operation of the backend ("Timed out waiting 600000ms for recv"), not the
rank that went astray. With NCCL it is worse: the watchdog ends the process.

So every rank keeps a record of its collectives
(`CollectiveTracker`, filled by runtime/comm.py's `Comm`, the one door to the
network): per torch process group, how many calls it has made and the last
one, and the call it is blocked in now, if any (a call that failed stays
marked, since it never completed). runtime/health.py's heartbeat thread
publishes the record in the rendezvous store beside the heartbeat, and when
a collective fails on a rank whose peers are all alive, `explain_desync`
reads every rank's record and names, for each rank blocked in call #n of a
group, the members that have not reached call #n there (they are behind;
where they are instead), that wait in another collective as their #n (a
desync proper), or that went past #n with other calls (the backend paired
mismatched calls, which happens when two calls move the same bytes):

    collective desync: rank 0 waits in all_reduce on dp (call #3 of torch group 1 of ranks 0,1), which
    rank 1 has not reached (it made 2 calls there and waits in all_reduce on world (call #3 of torch
    group 2 of ranks 0,1))

Calls are numbered from 1 per torch group, the unit in which a backend
matches calls, counting only groups of two or more ranks (`Comm` skips the
others); the mesh name the caller used is given beside it. Point-to-point
transfers are noted while waited in (``recv from rank 3``) but not
numbered, since a group's members do not all take part. The record costs a
dictionary update per collective and one store write per heartbeat that
finds it changed.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from scaletrain.runtime.mesh import Group


def group_key(group: Group) -> str:
    """``torch group 3 of ranks 0,2``: the process group a call went to, by torch's name for it
    (given in the order groups are made, so the same on every rank) and its members. runtime/mesh.py
    makes one torch group per member set (with cp = 1 the dp_cp group is the dp group, and a
    group of all ranks the world), and calls are numbered per torch group."""
    return f"torch group {getattr(group.handle, 'group_name', '?')} of ranks {','.join(map(str, group.ranks))}"


@dataclass(frozen=True)
class Call:
    op: str
    name: str  # the mesh group it was called on
    group: str  # group_key: the process group
    seq: int  # the call's number on its process group, from 1 (0: a point-to-point transfer)

    def __str__(self) -> str:
        if not self.seq:
            return f"{self.op} on {self.name} ({self.group})"
        return f"{self.op} on {self.name} (call #{self.seq} of {self.group})"


class CollectiveTracker:
    """This rank's collectives: per group the count and the last op, and the calls it waits in."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._calls: dict[str, tuple[int, str]] = {}
        self._members: dict[str, list[int]] = {}
        self._waiting: dict[int, Call] = {}  # thread id -> the call it is blocked in
        self.version = 0  # bumped on every change, so the publisher writes only news

    def start(self, op: str, group: Group) -> Call:
        """Note the next call of ``op`` on ``group`` (issued, not yet waited for)."""
        key = group_key(group)
        with self._lock:
            seq = self._calls.get(key, (0, ""))[0] + 1
            self._calls[key] = (seq, f"{op} on {group.name}")
            self._members[key] = list(group.ranks)
            self.version += 1
        return Call(op, group.name, key, seq)

    def transfer(self, what: str, group: Group) -> Call:
        """A point-to-point transfer (``recv from rank 3``): waited in, never numbered."""
        return Call(what, group.name, group_key(group), 0)

    def waiting(self, call: Call) -> _Waiting:
        """Context: this thread is blocked in ``call`` until the block ends without an error."""
        return _Waiting(self, call)

    def _set_waiting(self, call: Call | None) -> None:
        with self._lock:
            if call is None:
                self._waiting.pop(threading.get_ident(), None)
            else:
                self._waiting[threading.get_ident()] = call
            self.version += 1

    def record(self) -> dict[str, Any]:
        """What the store holds for this rank: plain data, JSON-ready."""
        with self._lock:
            return {"calls": {key: {"n": n, "op": op} for key, (n, op) in self._calls.items()},
                    "members": dict(self._members),
                    "waiting": [vars(call) for call in self._waiting.values()]}


class _Waiting:
    def __init__(self, tracker: CollectiveTracker, call: Call):
        self.tracker, self.call = tracker, call

    def __enter__(self) -> None:
        self.tracker._set_waiting(self.call)

    def __exit__(self, exc_type, *_) -> None:
        if exc_type is None:  # a call that failed stays the one this rank is in
            self.tracker._set_waiting(None)


def _where(record: dict[str, Any]) -> str:
    waits = record["waiting"]
    if not waits:
        return "is in no collective"
    return "waits in " + " and ".join(str(Call(**call)) for call in waits)


def explain_desync(records: dict[int, dict[str, Any] | None], limit: int = 3) -> str | None:
    """A phrase naming the ranks that keep the blocked ones waiting, from every rank's
    `CollectiveTracker.record` (None: a rank that published none), or None when every
    blocked call has all its members in it."""
    findings: list[str] = []
    for rank in sorted(r for r, rec in records.items() if rec):
        for waits in sorted(records[rank]["waiting"], key=lambda c: (c["group"], c["seq"])):
            call = Call(**waits)
            if not call.seq:
                continue  # a transfer: only its two ends take part
            for member in records[rank]["members"].get(call.group, []):
                other = records.get(member)
                if member == rank:
                    continue
                if other is None:
                    findings.append(f"rank {rank} waits in {call}, and rank {member} published no record of "
                                    f"its collectives (it had not yet sent a heartbeat)")
                    continue
                count = other["calls"].get(call.group, {"n": 0, "op": ""})
                theirs = next((Call(**c) for c in other["waiting"]
                               if c["group"] == call.group and c["seq"] == call.seq), None)
                if count["n"] < call.seq:
                    findings.append(f"rank {rank} waits in {call}, which rank {member} has not reached (it made "
                                    f"{count['n']} calls there and {_where(other)})")
                elif theirs is not None and theirs.op != call.op:
                    if rank < member:  # said once per pair
                        findings.append(f"rank {rank} waits in {call} while rank {member} waits in {theirs}")
                elif count["n"] > call.seq or (theirs is None and not count["op"].startswith(f"{call.op} ")):
                    findings.append(f"rank {rank} waits in {call}, which rank {member} passed with other calls "
                                    f"(it made {count['n']} there, the last {count['op']})")
    if not findings:
        return None
    more = f"; and {len(findings) - limit} more" if len(findings) > limit else ""
    return "collective desync: " + "; ".join(findings[:limit]) + more
