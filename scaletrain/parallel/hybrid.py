"""How ZeRO's shards move: over one group, or hybrid (shard groups x replica groups),
and optionally with int8 weight all-gathers.

Hybrid sharding. Zhao et al. 2023, "PyTorch FSDP: Experiences on Scaling
Fully Sharded Data Parallel" (HSDP); Wang et al. 2023, "ZeRO++: Extremely
Efficient Collective Communication for Giant Model Training" keeps its
optimizer state over all ranks and only a secondary weight shard per node
(hpZ), which saves memory but leaves its forward gathers and gradient
reduce-scatters crossing nodes; HSDP, here, keeps all of them in the node.
Plain ZeRO shards over all ``D`` data-parallel ranks, so every weight
all-gather and gradient reduce-scatter spans every node. With ``--shard-group N``
the dp group (runtime/mesh.py) is cut into ``G = D / N`` shard groups of N
neighbouring ranks (a node) and N replica groups of the G ranks at the same
place in each shard group. ZeRO runs inside the shard group, unchanged (units
padded to N, rank r of the group owns elements ``[r*S, (r+1)*S)``,
``S = ceil(numel / N)``); the G shard groups hold the same state, and the
gradients are averaged across them:

    reduce-scatter   inside the shard group: rank r gets the group's sum of its S elements
    all-reduce       across the replica group, of those S elements only: the sum over all D ranks
                     (the gradients were scaled by 1/D first: the average)

Traffic per step and rank, P the bytes of the padded model, one micro-batch,
``(n-1)/n`` of a collective's bytes leaving each rank of a group of n (2x for
an all-reduce), the ledger's wire bytes:

    intra-group   stage 1, 2: reduce-scatter P + all-gather P           2 (N-1)/N P
                  stage 3: reduce-scatter P + all-gathers 2P - P_root     (N-1)/N (3P - P_root)
    inter-group   all-reduce of the rank's shard, P/N bytes              2 (G-1)/G P/N

against plain ZeRO over D ranks, where all of ``(D-1)/D (3P - P_root)`` (stage 3)
crosses the nodes: hybrid sends ``2 (G-1)/G P/N`` across them, 1/N of DP's
all-reduce. The price is memory: the sharded state is divided by N, not by D
(ZeRO-3's ``16P/D`` bytes of fp32 AdamW become ``16P/N``), and the inter-group
all-reduce starts only when its reduce-scatter is waited for (in backward, as
later units launch; parallel/zero.py keeps at most two in flight), so it
overlaps the reduce-scatters of the next units, not the computation. The
gradient norm sums squares over the shard group only (the replicas hold the
same reduced shards); the loss is averaged over all D ranks.

Quantized weight all-gather (``--quantize-weights int8``, ZeRO++ qwZ). Each
rank sends its shard of the working weights as int8 ``q = round(x / s)``, with
one fp32 absmax scale ``s = max |x| / 127`` per block of ``BLOCK`` elements;
every rank, its own shard included, computes with ``q * s``, so all ranks use
the same weights in forward and backward (the gradient is exactly that of the
quantized weights). The fp32 masters the optimizer updates are never
quantized. Bytes per rank's shard of S elements, padded to whole words:
``4 ceil(S/BLOCK) + 4 ceil(S/4)``, about ``S (1 + 4/BLOCK)``, so the gathers
move 0.254x the bytes of fp32 weights (0.51x of bf16); the reduce-scatters are
unchanged. The error of an element is at most ``s/2``, half a step of its
block's grid: a relative 1/254 of the block's largest weight.

FP8 weight all-gather (``--quantize-weights fp8``): the same bytes, the codes
in e4m3 with a power-of-two scale per block (techniques/fp8.py). An e4m3
value rounds to the same relative grid under any power of two, so a gathered
weight is the one a float8 layer's own per-tensor cast makes of it, but for
those below the format's smallest normal: with ``--precision fp8`` the gather
costs nothing more than the casts the products make anyway, at half bf16's
bytes (torchtitan's FP8 all-gathers under FSDP2, with block scales so that no
amax crosses the group).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from scaletrain.runtime.comm import Comm, Pending
from scaletrain.runtime.mesh import Group, Mesh, hybrid_group_name
from scaletrain.techniques.fp8 import E4M3, to_float8

BLOCK = 256  # elements per absmax scale: 1.6% of the int8 bytes spent on scales
LEVELS = 127  # int8's symmetric range [-127, 127] (-128 left unused, so 0 is exact and signs symmetric)
QUANTIZED = ("none", "int8", "fp8")


def zero_groups(mesh: Mesh, dense: Group) -> tuple[Group, Group | None]:
    """The groups ZeRO shards over and replicates across: ``dense`` itself and none,
    or with ``--shard-group`` this rank's shard group and replica group of it."""
    if not mesh.dims.shard_group:
        return dense, None
    return (mesh.group(hybrid_group_name(mesh.dims, "shard")), mesh.group(hybrid_group_name(mesh.dims, "replica")))


def quantized_shard_bytes(numel: int) -> int:
    """Bytes one rank sends for its shard of ``numel`` elements in an int8 or fp8 gather: the
    fp32 scales, then the one-byte codes padded to whole 4-byte words (so that every rank's
    scales start aligned for viewing as fp32)."""
    return 4 * math.ceil(numel / BLOCK) + 4 * math.ceil(numel / 4)


def quantize_int8(values: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """``values`` flattened into int8 (same length) and one fp32 absmax scale per
    ``block`` elements (the last block shorter)."""
    flat = values.reshape(-1).float()
    blocks = F.pad(flat, (0, -flat.numel() % block)).view(-1, block)  # zeros cannot raise an absmax
    scales = blocks.abs().amax(dim=1) / LEVELS
    # An all-zero block has scale 0: dividing by 1 instead keeps its zeros exact.
    steps = torch.where(scales > 0, scales, torch.ones_like(scales))
    codes = torch.round(blocks / steps[:, None]).clamp_(-LEVELS, LEVELS).to(torch.int8)
    return codes.view(-1)[:flat.numel()], scales


def quantize_fp8(values: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """``values`` flattened into e4m3 (same length) and one fp32 inverse scale per ``block``
    elements, a power of two (techniques/fp8.py)."""
    flat = values.reshape(-1).float()
    blocks = F.pad(flat, (0, -flat.numel() % block)).view(-1, block)
    codes, inverse = to_float8(blocks, E4M3, per_row=True)  # a scale of 1 for an all-zero block
    return codes.view(-1)[:flat.numel()], inverse.view(-1)


def dequantize(codes: torch.Tensor, scales: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """fp32 values of int8 or e4m3 ``codes`` (the last dimension quantized in blocks) and their
    ``scales`` (each block's step, or its inverse scale)."""
    numel = codes.shape[-1]
    padded = F.pad(codes.float(), (0, -numel % block)).unflatten(-1, (-1, block))
    return (padded * scales[..., None]).flatten(-2)[..., :numel]


class ShardCollectives:
    """The collectives of ZeRO's units (parallel/zero.py): over ``shard`` alone, or
    hybrid with ``replica`` (module docstring), weights gathered exact, in int8 or in fp8."""

    def __init__(self, comm: Comm, shard: Group, replica: Group | None = None, quantize_weights: str = "none"):
        if quantize_weights not in QUANTIZED:
            raise ValueError(f"quantize_weights must be one of {QUANTIZED}, not {quantize_weights!r}")
        self.comm, self.shard, self.replica = comm, shard, replica
        self.quantize = {"int8": quantize_int8, "fp8": quantize_fp8}.get(quantize_weights)

    @property
    def averaged_over(self) -> int:
        """The ranks whose gradients are averaged: the shard group's, times the replicas'."""
        return self.shard.size * (self.replica.size if self.replica else 1)

    def reduce_scatter(self, out: torch.Tensor, source: torch.Tensor) -> Pending:
        """Start summing ``source`` into each rank's shard ``out``: over the shard group, then
        (when waited for) over the replica group."""
        # the unit's full padded gradient (N*S elements) in; this rank's S elements of the group's sum out
        scattered = self.comm.reduce_scatter(out, source, self.shard, async_op=True)
        if self.replica is None or self.replica.size == 1:
            return scattered
        # when waited for, only those S summed elements cross the replica group: the average over all D ranks
        return Pending([scattered], finish=lambda: self.comm.all_reduce(out, self.replica))

    def all_gather(self, full: torch.Tensor, shard: torch.Tensor) -> Pending:
        """Start gathering every rank's ``shard`` into ``full`` (in int8 or fp8 when quantized; integer
        shards, a 4-bit base's codes, always as they are)."""
        if self.quantize is None or not shard.is_floating_point():
            # each rank's S-element shard of the working weights, into the full unit every rank computes with
            return self.comm.all_gather(full, shard, self.shard, async_op=True)
        numel, n_scales = shard.numel(), math.ceil(shard.numel() / BLOCK)
        width = quantized_shard_bytes(numel)  # one byte buffer per rank: scales, then codes
        mine = torch.zeros(width, dtype=torch.uint8, device=shard.device)
        codes, scales = self.quantize(shard)
        mine[:4 * n_scales].view(torch.float32).copy_(scales)
        mine[4 * n_scales:4 * n_scales + numel].view(codes.dtype).copy_(codes)
        gathered = torch.empty(self.shard.size * width, dtype=torch.uint8, device=shard.device)
        # every rank's row of about S(1 + 4/BLOCK) bytes (scales, then one-byte codes), to rebuild the full unit
        pending = self.comm.all_gather(gathered, mine, self.shard, async_op=True)

        def unpack() -> None:
            rows = gathered.view(self.shard.size, width)
            values = dequantize(rows[:, 4 * n_scales:4 * n_scales + numel].view(codes.dtype),
                                rows[:, :4 * n_scales].view(torch.float32))
            full.view(self.shard.size, numel).copy_(values)

        return Pending([pending], finish=unpack)
