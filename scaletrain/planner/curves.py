"""How fast one device multiplies matrices of a given size: a measured curve, read between its points.

A matrix product ``[m, k] @ [k, n]`` fills a device only when it is large, so
the planner's clock (planner/compute.py) reads each product's rate from a
table measured on the device: TFLOP/s of ``[m, k] @ [k, k]`` for ``m`` and
``k`` over ``sides``, read bilinearly in ``log2`` of ``m`` and
``sqrt(k n)`` and held at the table's edges. A curve is either measured on
the machine at hand (``scaletrain plan --calibrate``, planner/calibrate.py)
or published for a device one does not have (planner/hardware.py's presets,
each citing its source); a device without its own curve reads another's as
a share of that one's peak.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass


@dataclass(frozen=True)
class MatmulCurve:
    """TFLOP/s of ``[m, k] @ [k, k]`` (rows: ``m`` in ``sides``; columns: ``k`` in ``sides``) on a
    device whose datasheet peak is ``peak_tflops``, and where the figures come from."""

    sides: tuple[int, ...]
    tflops: tuple[tuple[float, ...], ...]
    peak_tflops: float
    source: str

    def share(self, m: int, k: int, n: int) -> float:
        """The share of the peak a product [m, k] @ [k, n] reaches."""
        return self._bilinear(math.log2(max(m, 1)), math.log2(max(math.sqrt(k * n), 1))) / self.peak_tflops

    def _bilinear(self, row: float, column: float) -> float:
        logs = [math.log2(side) for side in self.sides]
        if len(logs) == 1:
            return self.tflops[0][0]

        def bracket(value: float) -> tuple[int, float]:
            value = min(max(value, logs[0]), logs[-1])
            upper = min(max(bisect.bisect_left(logs, value), 1), len(logs) - 1)
            return upper - 1, (value - logs[upper - 1]) / (logs[upper] - logs[upper - 1])

        (i, di), (j, dj) = bracket(row), bracket(column)
        t = self.tflops
        top = t[i][j] * (1 - dj) + t[i][j + 1] * dj
        bottom = t[i + 1][j] * (1 - dj) + t[i + 1][j + 1] * dj
        return top * (1 - di) + bottom * di


def flat(share: float, source: str) -> MatmulCurve:
    """One share of the peak for every size (a device measured at one size only)."""
    return MatmulCurve((1,), ((share,),), 1.0, source)


# bf16 [m, k] @ [k, k] on one H200, each the median of 20 products after 3, launch and
# synchronization included (cuBLAS under torch 2.11, scripts/gpu_figures.py's ``gemm`` row,
# docs/performance.md); against its 989.4 TFLOP/s datasheet peak.
H200_BF16 = MatmulCurve(
    sides=(256, 512, 1024, 2048, 4096, 8192),
    tflops=(
        (2, 6, 26, 86, 260, 543),
        (3, 11, 49, 169, 406, 652),
        (6, 25, 96, 288, 553, 730),
        (13, 50, 171, 407, 649, 777),
        (25, 93, 273, 538, 705, 791),
        (48, 165, 402, 631, 757, 780),
    ),
    peak_tflops=989.4,
    source="one H200, cuBLAS under torch 2.11 (docs/performance.md)",
)


def capped(curve: MatmulCurve, plateau_tflops: float, peak_tflops: float, source: str) -> MatmulCurve:
    """A slower device's curve from a faster one's: at every size the smaller of the faster device's
    rate and the slower one's published best. A product too small to fill the faster device (its
    launch and its tail dominate) fills the slower no better; a large one runs at the slower device's
    best."""
    tflops = tuple(tuple(min(rate, plateau_tflops) for rate in row) for row in curve.tflops)
    return MatmulCurve(curve.sides, tflops, peak_tflops, source)


# bf16 on an A100 SXM: its maximum achievable matmul rate, 271.2 TFLOP/s (1024 x 10240 x 5120, torch
# 2.6; stas00/ml-engineering, compute/accelerator's MAMF table), over the H200's measured curve.
A100_BF16 = capped(H200_BF16, 271.2, 312.0, "the H200's curve capped at an A100 SXM's published best "
                                            "(ml-engineering's MAMF table: 271.2 TFLOP/s)")
