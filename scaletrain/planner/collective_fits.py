"""Collectives as measured on one node: a Hockney alpha-beta line per (operation, group size).

``scaletrain plan --calibrate`` (planner/calibrate_collectives.py) times every
collective the layouts use over a ladder of message sizes, each group size
separately, and fits each operation's times to

    t(S) = alpha + S / beta

with ``S`` the bytes the communication ledger records for one call
(runtime/comm.py: the whole buffer of an all-reduce, the gathered output of an
all-gather, the full input of a reduce-scatter or all-to-all, the tensor of a
send), ``alpha`` the seconds of an empty call and ``beta`` the ledger's bytes a
second once the call is large. The fit weighs each point by ``1 / t^2``
(least squares on relative error), so the small messages that set ``alpha``
count as much as the large ones that set ``beta``; a negative intercept,
which noise can give, is refitted through the origin.

Fitting the ledger's bytes rather than the ring algorithm's wire bytes keeps
the backend's own algorithm (tree, ring, copy-in shared memory) in the
measured figures: the planner asks the table for exactly what it would
otherwise price with planner/hardware.py's link figures
(planner/step_time.py `collective_seconds`). A point-to-point transfer is
priced once, on its send, at the group size of 2 whatever its group's size.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

POINT_TO_POINT = ("send",)  # the same two ranks at any group size
UNMEASURABLE_BYTES_PER_S = 1e15  # a ladder whose times do not grow: no bandwidth to be seen in it


@dataclass(frozen=True)
class CollectiveFit:
    """One operation on one group size: ``alpha_s`` per call, ``bytes_per_s`` of the ledger's bytes."""

    alpha_s: float
    bytes_per_s: float

    def seconds(self, calls: int, nbytes: float) -> float:
        """``calls`` calls moving ``nbytes`` ledger bytes in all."""
        return calls * self.alpha_s + nbytes / self.bytes_per_s


@dataclass(frozen=True)
class CollectiveTable:
    """Every (operation, group size) measured on one node, each fitted (module docstring)."""

    fits: tuple[tuple[str, int, CollectiveFit], ...]

    def lookup(self, op: str, group_size: int) -> CollectiveFit | None:
        """The fit of ``op`` on a group of ``group_size`` ranks, or None where it was not measured."""
        size = 2 if op in POINT_TO_POINT else group_size
        return next((fit for name, n, fit in self.fits if name == op and n == size), None)

    def to_json(self) -> dict:
        table: dict[str, dict[str, dict]] = {}
        for op, size, fit in self.fits:
            table.setdefault(op, {})[str(size)] = {"alpha_s": fit.alpha_s, "bytes_per_s": fit.bytes_per_s}
        return table

    @classmethod
    def from_json(cls, table: dict) -> CollectiveTable:
        return cls(tuple((op, int(size), CollectiveFit(float(fit["alpha_s"]), float(fit["bytes_per_s"])))
                         for op, sizes in table.items() for size, fit in sizes.items()))


def fit_alpha_beta(sizes: Sequence[float], seconds: Sequence[float]) -> CollectiveFit:
    """The line ``alpha + S / beta`` through (``sizes``, ``seconds``), weighted by ``1 / t^2``: through the
    origin where the free fit's alpha is negative, and at ``UNMEASURABLE_BYTES_PER_S`` where the
    times do not grow with the size (latency alone at every size measured)."""
    weights = [1 / t**2 for t in seconds]
    sw = sum(weights)
    sx = sum(w * s for w, s in zip(weights, sizes))
    sy = sum(w * t for w, t in zip(weights, seconds))
    sxx = sum(w * s * s for w, s in zip(weights, sizes))
    sxy = sum(w * s * t for w, s, t in zip(weights, sizes, seconds))
    determinant = sw * sxx - sx * sx
    slope = (sw * sxy - sx * sy) / determinant if determinant > 0 else 0.0
    alpha = (sy - slope * sx) / sw
    if alpha < 0:
        alpha, slope = 0.0, sxy / sxx
    if slope <= 0:
        return CollectiveFit(sy / sw, UNMEASURABLE_BYTES_PER_S)
    return CollectiveFit(alpha, 1 / slope)
