"""Gradient compression for data parallelism, as communication hooks with error feedback.

A data-parallel strategy calls ``compressor.reduce(key, flat, shapes)`` per gradient
bucket and optimizer step: ``flat``, this rank's contribution (the tensors of ``shapes``
concatenated, pre-scaled so that their sum over the n ranks is the averaged gradient),
becomes the sum over ranks of every rank's *compressed* contribution, bitwise identical
on every rank. ``key`` names the bucket, so state persists between steps.

Error feedback (Karimireddy, Rebjock, Stich & Jaggi 2019, "Error Feedback Fixes SignSGD
and other Gradient Compression Schemes"): each rank keeps, per bucket, what compression
dropped and adds it back before the next compression,

    M_r = g_r + e_r          e_r <- M_r - C_r(M_r)         result = sum_r C_r(M_r)

with C_r(M_r) rank r's share of what was transmitted. So result + sum_r e_r(new) =
sum_r M_r up to float rounding: nothing is lost, only delayed; over T steps the results
differ from the true gradients' sum by the current residuals alone, a bounded amount,
which lets biased compressors (low rank, sign) converge like plain SGD. The residual is
in the units of the contribution: a caller that rescales its gradients (dynamic loss
scaling's growth or backoff) carries the old scale in it for one step. A step whose
result is not finite (an fp16 overflow, which the loss scaler skips) leaves residuals
and warm starts as they were, so one overflow does not poison later steps.

PowerSGD (Vogels, Karimireddy & Jaggi 2019, "PowerSGD: Practical Low-Rank Gradient
Compression for Distributed Optimization"). A tensor of two or more dimensions is a
matrix M (m x k, k the product of the trailing dims); with r = min(rank, m, k):

    P_r = M_r Q                  Q: k x r, kept from the previous step
    P = sum_r P_r                all-reduce, r*m elements
    P_hat = orthonormal columns of P (reduced QR)
    Q <- sum_r M_r^T P_hat       all-reduce, r*k elements
    A = P_hat Q^T = P_hat P_hat^T (sum_r M_r)      written to flat
    e_r <- M_r - A / n                             so sum_r e_r = sum_r M_r - A

Bytes: r(m + k) elements per matrix instead of m*k, a saving independent of n as both
rounds are all-reduces; only where r(m + k) < m*k is a matrix compressed, and vectors
(biases, norm gains) and tiny matrices are summed whole, with no residual. An all-reduce
works because both rounds are linear in M, sum_r M_r Q = (sum_r M_r) Q; top-k picks
different coordinates per rank and sign is not additive, so those need an all-gather.
Every rank gets the same P_hat from the same summed P: QR is deterministic on identical
input, hardware and thread settings, which data-parallel replicas have. Warm start:
keeping Q makes each step one step of subspace (power) iteration on the slowly changing
gradient, so a rank as low as 1 to 4 tracks its dominant subspace. Trade-off: two
matmuls and a QR per matrix per step, one flat-sized residual and the Q's of memory,
and a lossy gradient, worst early in training when the gradient is far from low rank
(torch's own PowerSGD hook for DDP therefore runs uncompressed warm-up steps first).

Scaled sign (EF-SignSGD, Karimireddy et al. 2019, in the lineage of Seide, Fu, Droppo,
Li & Yu 2014, "1-Bit Stochastic Gradient Descent and its Application to Data-Parallel
Distributed Training of Speech DNNs"), per tensor of d elements:

    c = (||M||_1 / d) sign(M)        e <- M - c        sign(0) = +1: a bit has two values

A rank sends 1 bit per element and a float32 scale per tensor: ceil(N/8) + 4T bytes for
N elements in T tensors, against 4N for fp32, all-gathered since signs do not add. Per
rank on the wire, ring algorithms:

    fp32 all-reduce     2(n-1)/n x 4N          = 8N(n-1)/n bytes
    sign all-gather     (n-1)/n x n x N/8      = N(n-1)/8  bytes  (+ scales)

a saving of 64/n: 32x for n = 2, 8x for n = 8, none at n = 64, a loss beyond. The
payload is 32x smaller than fp32's for every n; the all-gather, which delivers all n
payloads to every rank, is what erodes the saving as n grows, and it also costs n
payloads of memory and n decodes per step. The ledger records the gathered output,
n(ceil(N/8) + 4T) bytes, and (n-1)(ceil(N/8) + 4T) wire bytes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from scaletrain.runtime.comm import Comm
from scaletrain.runtime.mesh import Group

AllReduce = Callable[[torch.Tensor], None]

# Mixes (seed, key, tensor index) into one generator seed.
_SEED_PRIME = 1_000_003


class GradientCompressor(Protocol):
    """What a data-parallel strategy calls once per bucket and optimizer step."""

    def reduce(self, key: int, flat: torch.Tensor, shapes: Sequence[torch.Size]) -> None: ...


def _numels(flat: torch.Tensor, shapes: Sequence[torch.Size]) -> list[int]:
    """Element count of each tensor of the bucket, after checking that `flat` is that bucket."""
    numels = [math.prod(shape) for shape in shapes]
    if flat.dim() != 1 or not flat.is_contiguous() or not flat.is_floating_point():
        raise ValueError(f"a bucket is a contiguous 1-D floating tensor, got {flat.dtype} of shape {tuple(flat.shape)}")
    if sum(numels) != flat.numel():
        raise ValueError(f"the shapes hold {sum(numels)} elements but the bucket has {flat.numel()}")
    return numels


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    # bf16 and fp16 would round the residual and the power iteration away.
    return torch.promote_types(dtype, torch.float32)


def _default_all_reduce(comm: Comm, group: Group) -> AllReduce:
    # a bucket's P's (with the tensors sent whole) or its Q's, concatenated: summed, as both rounds are linear
    return lambda tensor: comm.all_reduce(tensor, group, "sum")


@dataclass(frozen=True)
class _Matrix:
    """One compressed tensor of a bucket: where it lies in flat, its matrix view, its rank."""

    index: int
    offset: int
    rows: int
    cols: int
    rank: int

    @property
    def end(self) -> int:
        return self.offset + self.rows * self.cols


class PowerSGD:
    """Rank-`rank` PowerSGD with warm start and error feedback; see the module docstring."""

    def __init__(
        self,
        comm: Comm,
        group: Group,
        rank: int = 4,
        seed: int = 0,
        all_reduce: AllReduce | None = None,
    ):
        if rank < 1:
            raise ValueError(f"PowerSGD needs a rank of at least 1, got {rank}")
        self.comm = comm
        self.group = group
        self.rank = rank
        self.seed = seed
        self._all_reduce = all_reduce if all_reduce is not None else _default_all_reduce(comm, group)
        self._residuals: dict[int, torch.Tensor] = {}
        self._qs: dict[int, list[torch.Tensor]] = {}

    def _plan(self, shapes: Sequence[torch.Size]) -> tuple[list[_Matrix], list[tuple[int, int]]]:
        """The compressed matrices of a bucket, and the (offset, numel) of every tensor sent whole."""
        matrices: list[_Matrix] = []
        plain: list[tuple[int, int]] = []
        offset = 0
        for index, shape in enumerate(shapes):
            rows, cols = (shape[0], math.prod(shape[1:])) if len(shape) >= 2 else (1, math.prod(shape))
            rank = min(self.rank, rows, cols)
            if len(shape) >= 2 and rank * (rows + cols) < rows * cols:
                matrices.append(_Matrix(index, offset, rows, cols, rank))
            else:
                plain.append((offset, rows * cols))
            offset += rows * cols
        return matrices, plain

    def transmitted_elements(self, shapes: Sequence[torch.Size]) -> int:
        """Elements all-reduced per call: r(m + k) per compressed matrix, every element of the rest."""
        matrices, plain = self._plan(shapes)
        return sum(a.rank * (a.rows + a.cols) for a in matrices) + sum(numel for _, numel in plain)

    def payload_bytes(self, shapes: Sequence[torch.Size], dtype: torch.dtype = torch.float32) -> int:
        """Bytes this rank puts into the all-reduces per call, for a bucket of `dtype`."""
        return self.transmitted_elements(shapes) * _compute_dtype(dtype).itemsize

    def residual(self, key: int) -> torch.Tensor | None:
        """This rank's residual of bucket `key` (zero where sent whole), or None before its first call."""
        return self._residuals.get(key)

    def reduce(self, key: int, flat: torch.Tensor, shapes: Sequence[torch.Size]) -> None:
        """Replace `flat` by the sum over ranks of its rank-r approximations, keeping the residual."""
        _numels(flat, shapes)
        matrices, plain = self._plan(shapes)
        contribution = flat.to(_compute_dtype(flat.dtype), copy=True)
        if key in self._residuals:
            contribution += self._residuals[key]
        views = [contribution[a.offset:a.end].view(a.rows, a.cols) for a in matrices]
        qs = self._qs.get(key) or [self._first_q(key, a, contribution) for a in matrices]

        # Round one: every P = M Q and every uncompressed tensor, summed in one call.
        sums = self._sum([view @ q for view, q in zip(views, qs, strict=True)]
                         + [contribution[offset:offset + numel] for offset, numel in plain])
        p_hats = [torch.linalg.qr(p, mode="reduced").Q for p in sums[:len(matrices)]]
        # Round two: Q = M^T P_hat, summed; this Q is also next step's warm start.
        new_qs = self._sum([view.T @ p_hat for view, p_hat in zip(views, p_hats, strict=True)])

        for a, view, p_hat, q in zip(matrices, views, p_hats, new_qs, strict=True):
            approximation = p_hat @ q.T
            flat[a.offset:a.end].copy_(approximation.view(-1))
            view -= approximation / self.group.size  # the residual e_r = M_r - A / n, kept in contribution
        for (offset, numel), total in zip(plain, sums[len(matrices):], strict=True):
            flat[offset:offset + numel].copy_(total)
            contribution[offset:offset + numel].zero_()  # sent whole: nothing dropped, no residual

        # The result is the same on every rank, so every rank makes the same choice.
        if torch.isfinite(flat).all():
            self._residuals[key] = contribution
            self._qs[key] = new_qs

    def _first_q(self, key: int, matrix: _Matrix, like: torch.Tensor) -> torch.Tensor:
        seed = ((self.seed * _SEED_PRIME + key) * _SEED_PRIME + matrix.index) % 2**63
        generator = torch.Generator().manual_seed(seed)
        # The first Q is Gaussian, seeded by (seed, key, tensor index) alone: the same on every rank.
        q = torch.randn(matrix.cols, matrix.rank, generator=generator)
        return q.to(device=like.device, dtype=like.dtype)

    def _sum(self, parts: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each part summed over the group, through one all-reduce of their concatenation."""
        if not parts:
            return []
        buffer = torch.cat([part.reshape(-1) for part in parts])
        if buffer.numel():
            self._all_reduce(buffer)
        chunks = buffer.split([part.numel() for part in parts])
        return [chunk.view(part.shape) for chunk, part in zip(chunks, parts, strict=True)]


def _bit_shifts(device: torch.device) -> torch.Tensor:
    # The first element of each group of 8 goes to the byte's high bit.
    return torch.arange(7, -1, -1, dtype=torch.uint8, device=device)


def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """A 1-D bool tensor of L bits as ceil(L/8) bytes, zero-padded at the end."""
    padded = torch.zeros(-(-bits.numel() // 8) * 8, dtype=torch.uint8, device=bits.device)
    padded[:bits.numel()] = bits
    # The 8 shifted bits of a byte are disjoint, so their sum is their OR.
    return (padded.view(-1, 8) << _bit_shifts(bits.device)).sum(dim=1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` bits of `pack_bits`'s bytes, as a 1-D bool tensor."""
    bits = (packed.view(-1, 1) >> _bit_shifts(packed.device)) & 1
    return bits.view(-1)[:length].bool()


def _signed_scales(positive: torch.Tensor, scales: torch.Tensor, counts: torch.Tensor,
                   dtype: torch.dtype) -> torch.Tensor:
    """+scale or -scale per element, each tensor's scale over its elements."""
    per_element = scales.to(dtype).repeat_interleave(counts)
    return torch.where(positive, per_element, -per_element)


class SignCompressor:
    """Scaled sign (1 bit per element) with error feedback; see the module docstring."""

    def __init__(self, comm: Comm, group: Group):
        self.comm = comm
        self.group = group
        self._residuals: dict[int, torch.Tensor] = {}

    @staticmethod
    def payload_bytes(shapes: Sequence[torch.Size]) -> int:
        """Bytes this rank contributes to the all-gather per call: a float32 scale per tensor, then the packed bits."""
        return -(-sum(math.prod(shape) for shape in shapes) // 8) + 4 * len(shapes)

    def residual(self, key: int) -> torch.Tensor | None:
        """This rank's error-feedback residual of bucket `key`, or None before its first call."""
        return self._residuals.get(key)

    def reduce(self, key: int, flat: torch.Tensor, shapes: Sequence[torch.Size]) -> None:
        """Replace `flat` by the sum over ranks of their scaled signs, keeping the residual."""
        numels = _numels(flat, shapes)
        if not numels:
            return
        contribution = flat.to(_compute_dtype(flat.dtype), copy=True)
        if key in self._residuals:
            contribution += self._residuals[key]
        counts = torch.tensor(numels, device=flat.device)
        # The scale is sent as float32, so the residual is taken against that rounding of it.
        scales = torch.stack([part.abs().sum() / max(part.numel(), 1)
                              for part in contribution.split(numels)]).float()
        positive = contribution >= 0

        payload = torch.cat([scales.view(torch.uint8), pack_bits(positive)])
        gathered = torch.empty(self.group.size, payload.numel(), dtype=torch.uint8, device=flat.device)
        # each rank's T float32 scales and ceil(N/8) sign bytes, one row each: signs do not add, so gather
        self.comm.all_gather(gathered, payload, self.group)
        scale_bytes = 4 * len(numels)
        # Copied into a buffer of their own: in place, the rows' scales are strided
        # and may start where no float32 view can.
        all_scales = torch.empty(self.group.size, scale_bytes, dtype=torch.uint8, device=flat.device)
        all_scales = all_scales.copy_(gathered[:, :scale_bytes]).view(torch.float32)

        # Every rank decodes the n rows and sums them in rank order: bitwise the same total on every rank.
        total = torch.zeros_like(contribution)
        for row, row_scales in zip(gathered, all_scales, strict=True):
            total += _signed_scales(unpack_bits(row[scale_bytes:], flat.numel()), row_scales, counts, total.dtype)
        flat.copy_(total)

        if torch.isfinite(flat).all():
            self._residuals[key] = contribution - _signed_scales(positive, scales, counts, contribution.dtype)
