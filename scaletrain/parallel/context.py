"""Context parallelism: the sequence split across ranks, attention by a ring.

Liu, Zaharia & Abbeel 2023, "Ring Attention with Blockwise Transformers for
Near-Infinite Context".

The N ranks of the cp group each hold the whole model and 1/N of every
sequence's positions. Only attention mixes positions, so only attention
changes: the key/value blocks travel the ring, one hop per step, hidden behind
the computation, while each rank attends its queries to the block it holds. No
rank holds more than two K, V blocks, nor any s x s score matrix.

Merging blocks (online softmax: Milakov & Gimelshein 2018, "Online
normalizer calculation for softmax"; Dao et al. 2022, "FlashAttention"). A
block of keys gives, per query row, its softmax output ``o_b`` normalised over
that block alone and the log-sum-exp ``lse_b`` of its scores. Two partial
results over disjoint key sets combine exactly, in fp32 whatever the input dtype:

    lse = log(exp(lse_1) + exp(lse_2))
    o   = o_1 * exp(lse_1 - lse) + o_2 * exp(lse_2 - lse)

Backward keeps only q, k, v, the output O and lse (never the scores) and
recomputes each block's probabilities (FlashAttention's backward; S the block's
scaled scores, dO the output's gradient):

    D  = rowsum(dO * O)                    once, for every local query
    P  = exp(S - lse)                      the block's softmax probabilities
    dV += P^T dO
    dP = dO V^T
    dS = P * (dP - D)
    dQ += dS K * scale
    dK += dS^T Q * scale

dQ stays local; dK and dV belong to the block's owner, so their fp32
accumulators travel the ring with their K, V and one last hop brings them home.

Causal load balance (zigzag). With contiguous chunks, rank N-1 would attend to
everything and rank 0 to almost nothing, and the ring runs at the pace of the
busiest rank. Instead the sequence is cut into 2N chunks of c positions and
rank r holds chunks r and 2N-1-r, an early one and its mirror (cp = 4: rank 0
holds 0,7; rank 1: 1,6; rank 2: 2,5; rank 3: 3,4). Against the K, V of rank
src = (r - j) mod N, which rank r holds at step j:

    src == r   causal mask on the local 2c positions, exact since they increase   (2c x 2c)
    src <  r   every local query against src's first chunk, no mask: it precedes
               both query chunks, and src's second chunk follows both             (2c x c)
    src >  r   only the second query chunk against all of src's K, V, no mask:
               it follows both key chunks, the first query chunk precedes both    (c x 2c)

Skipped blocks are never computed: every rank computes 4c^2 scores at step 0
and 2c^2 at each later step, so nobody waits on the ring; in all
s^2 (N+1) / (2N) scores, the causal half plus the other half of the N diagonal
2c x 2c blocks, against s^2 for full attention.

Who sends what to whom (cp = 4), KVi the K, V pair of rank i's positions:

    rank 0 --> rank 1 --> rank 2 --> rank 3
      ^                                |
      +--------------------------------+

             rank 0   rank 1   rank 2   rank 3
    step 0   KV0      KV1      KV2      KV3     own block, causal
    step 1   KV3      KV0      KV1      KV2     each rank sends what it holds to r+1
    step 2   KV2      KV3      KV0      KV1
    step 3   KV1      KV2      KV3      KV0     no send after the last step

Communication per attention call, per rank, with a K, V pair of
2 * b * heads * (s/N) * head_dim elements:

    forward    N-1 sends of a K, V pair (in the input dtype)
    backward   N-1 sends of a K, V pair, plus N sends of a dK, dV pair in fp32

Packed documents (models/decoder.py): ``documents`` [b, s] covers the whole
sequence, so a block's mask is "same document" (and causal on the diagonal
block). A query that meets no key of its document in a block gets lse -inf and
output 0 there, which the merge absorbs exactly.

Inputs in bf16 or fp16 are computed in fp32; K, V travel in their own dtype.
Weights are replicated across the cp group and their gradients averaged over
it, as over a dp group; the spec's ``position_modules`` (learned position
embedding, rotary angles) are handed this rank's global positions.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.autograd import Function

from scaletrain.models.decoder import CausalAttention, causal_attention, document_mask
from scaletrain.runtime.comm import Comm
from scaletrain.runtime.mesh import Group


def zigzag_positions(seq_len: int, size: int, rank: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Rank ``rank``'s positions out of ``seq_len``: chunks r and 2*size-1-r of 2*size equal chunks."""
    if seq_len % (2 * size):
        raise ValueError(f"context parallelism over {size} ranks cuts the sequence into {2 * size} equal "
                         f"chunks, so the sequence length {seq_len} must be a multiple of {2 * size}.")
    chunk = seq_len // (2 * size)
    return torch.cat([torch.arange(rank * chunk, (rank + 1) * chunk, device=device),
                      torch.arange((2 * size - 1 - rank) * chunk, (2 * size - rank) * chunk, device=device)])


# -- one block of attention, in fp32 ---------------------------------------------


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, causal: bool,
            allowed: torch.Tensor | None) -> torch.Tensor:
    scores = (q @ k.transpose(-2, -1)) * scale
    if causal:
        future = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    return scores


def attention_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool,
                    allowed: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of queries on one block of keys: (output, log-sum-exp of each row's scores);
    ``allowed`` [b, 1, queries, keys]: which keys each query may see besides the causal rule
    (a row that may see none gives output 0 and lse -inf)."""
    scores = _scores(q, k, scale, causal, allowed)
    lse = torch.logsumexp(scores, dim=-1)
    # exp(-inf - 0) = 0 for a row without keys, where exp(-inf - -inf) would be NaN.
    return torch.exp(scores - lse.nan_to_num(neginf=0.0).unsqueeze(-1)) @ v, lse


def attention_block_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor,
                             lse: torch.Tensor, delta: torch.Tensor, scale: float, causal: bool,
                             allowed: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One block's share of (dq, dk, dv), its probabilities recomputed from the saved lse
    (the merged one: finite, since every query sees at least itself)."""
    p = torch.exp(_scores(q, k, scale, causal, allowed) - lse.unsqueeze(-1))
    dv = p.transpose(-2, -1) @ dout
    ds = p * (dout @ v.transpose(-2, -1) - delta.unsqueeze(-1))
    return (ds @ k) * scale, (ds.transpose(-2, -1) @ q) * scale, dv


def _block(rank: int, src: int, chunk: int) -> tuple[slice, slice, bool]:
    """Which local query rows meet which rows of src's K, V, and whether causally (module docstring)."""
    if src == rank:
        return slice(None), slice(None), True
    if src < rank:
        return slice(None), slice(0, chunk), False
    return slice(chunk, None), slice(None), False


def _allowed(documents: torch.Tensor | None, rank: int, src: int, size: int, rows: slice,
             cols: slice) -> torch.Tensor | None:
    """The document mask of one block: rank's queries ``rows`` against src's keys ``cols``
    (the causal rule of the diagonal block is `_scores`' own)."""
    if documents is None:
        return None
    seq = documents.shape[-1]
    queries = documents[:, zigzag_positions(seq, size, rank, documents.device)][:, rows]
    keys = documents[:, zigzag_positions(seq, size, src, documents.device)][:, cols]
    return document_mask(queries, keys, causal=False)


def _merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """Fold a block's (output, lse) into the running ones, in place (views of the running tensors)."""
    merged = torch.logaddexp(lse, block_lse)
    out.mul_(torch.exp(lse - merged).unsqueeze(-1)).add_(block_out * torch.exp(block_lse - merged).unsqueeze(-1))
    lse.copy_(merged)


def _pass_on(tensor: torch.Tensor, comm: Comm, group: Group) -> Callable[[], torch.Tensor]:
    """Start sending ``tensor`` to the next rank of the ring and receiving the previous rank's
    tensor of the same shape; returns a function that waits for both and gives the received one."""
    received = torch.empty_like(tensor)
    pending = comm.batch_isend_irecv([("send", tensor, (group.rank + 1) % group.size),
                                      ("recv", received, (group.rank - 1) % group.size)], group)

    def arrived() -> torch.Tensor:
        pending.wait()
        return received

    return arrived


# -- the ring ----------------------------------------------------------------------


class _RingAttention(Function):
    @staticmethod
    def forward(ctx, q, k, v, comm, group, documents):
        rank, size, chunk = group.rank, group.size, q.shape[-2] // 2
        scale = q.shape[-1] ** -0.5
        kv = torch.stack([k, v])  # one contiguous buffer per hop
        # Autocast would run the block matmuls in 16 bits; the merge needs fp32.
        with torch.autocast(q.device.type, enabled=False):
            q32 = q.float()
            for step in range(size):
                # the K, V pair [2, b, heads, s/N, head_dim], input dtype, on to rank r+1 while this block computes
                next_kv = _pass_on(kv, comm, group) if step < size - 1 else None
                src = (rank - step) % size
                rows, cols, causal = _block(rank, src, chunk)
                kv32 = kv.float()
                block_out, block_lse = attention_block(q32[:, :, rows], kv32[0][:, :, cols], kv32[1][:, :, cols],
                                                       scale, causal, _allowed(documents, rank, src, size, rows, cols))
                if step == 0:
                    out, lse = block_out, block_lse  # the causal block covers every row
                else:
                    _merge(out[:, :, rows], lse[:, :, rows], block_out, block_lse)
                if next_kv is not None:
                    kv = next_kv()
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, documents)
        ctx.comm, ctx.group, ctx.scale = comm, group, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, documents = ctx.saved_tensors
        comm, group, scale = ctx.comm, ctx.group, ctx.scale
        rank, size, chunk = group.rank, group.size, q.shape[-2] // 2
        kv = torch.stack([k, v])
        with torch.autocast(q.device.type, enabled=False):
            q32, dout32 = q.float(), dout.float()
            delta = (dout32 * out.float()).sum(dim=-1)
            dq = torch.zeros_like(q32)
            next_dkv = None  # the dK, dV accumulators in flight
            for step in range(size):
                # the K, V pair [2, b, heads, s/N, head_dim] around the ring again (forward kept only its own)
                next_kv = _pass_on(kv, comm, group) if step < size - 1 else None
                src = (rank - step) % size
                rows, cols, causal = _block(rank, src, chunk)
                kv32 = kv.float()
                dq_block, dk_block, dv_block = attention_block_backward(
                    q32[:, :, rows], kv32[0][:, :, cols], kv32[1][:, :, cols], dout32[:, :, rows],
                    lse[:, :, rows], delta[:, :, rows], scale, causal, _allowed(documents, rank, src, size, rows, cols))
                dq[:, :, rows] += dq_block
                # The accumulators of this K, V, from the ranks it visited before.
                dkv = torch.zeros_like(kv32) if next_dkv is None else next_dkv()
                dkv[0][:, :, cols] += dk_block
                dkv[1][:, :, cols] += dv_block
                # this K, V's fp32 dK, dV [2, b, heads, s/N, head_dim] follow it to r+1, during the next block
                next_dkv = _pass_on(dkv, comm, group)
                if next_kv is not None:
                    kv = next_kv()
            dkv = next_dkv()  # the last hop brings this rank's own accumulators home
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm: Comm, group: Group,
                   documents: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention over the whole sequence for this rank's zigzag positions.

    q, k, v: [batch, heads, s_local, head_dim], the rank's positions as `zigzag_positions`
    gives them; the result equals full-sequence causal attention at those positions;
    ``documents`` [batch, s] of the whole sequence keeps attention inside each packed document."""
    if group.size == 1:
        return causal_attention(q, k, v, documents)
    if q.shape[-2] % 2:
        raise ValueError(f"ring attention needs the two zigzag chunks of a rank, got {q.shape[-2]} positions")
    return _RingAttention.apply(q, k, v, comm, group, documents)


class RingAttention(nn.Module):
    """In place of `CausalAttention` (models/decoder.py): ring attention over the cp group.

    Without dropout (the command line refuses cp with dropout). With ``local_only``
    set it is plain causal attention of the sequence it is given (text sampling)."""

    def __init__(self, comm: Comm, group: Group):
        super().__init__()
        self.comm, self.group = comm, group
        self.local_only = False

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                documents: torch.Tensor | None = None) -> torch.Tensor:
        if self.local_only:
            return causal_attention(q, k, v, documents)
        return ring_attention(q, k, v, self.comm, self.group, documents)


# -- the transform ------------------------------------------------------------------


class ContextParallel:
    """A model whose sequence is split over the cp group; what the trainer needs from it."""

    def __init__(self, comm: Comm, group: Group, positions: torch.Tensor):
        self.comm, self.group = comm, group
        self.positions = positions
        self.attentions: list[RingAttention] = []
        self._generating = False

    def local(self, batch: torch.Tensor) -> torch.Tensor:
        """A batch tensor [b, s, ...] (token ids, targets) -> this rank's positions of it."""
        return batch.index_select(1, self.positions.to(batch.device))

    def _global_positions(self, module: nn.Module, args: tuple) -> tuple | None:
        # The model numbers the local positions 0..s_local-1 [s_local]; a position module needs the
        # global ones. Packed rows come with each document's positions over the whole sequence
        # [b, s] (models/decoder.py), of which this rank takes its own.
        if self._generating:
            return None
        positions = args[0]
        mine = self.positions[positions] if positions.dim() == 1 else positions[:, self.positions]
        return (mine, *args[1:])

    @contextmanager
    def generation(self) -> Iterator[None]:
        """Whole sequences on one rank alone: local causal attention, positions as given."""
        generating = self._generating
        self._generating = True
        for attention in self.attentions:
            attention.local_only = True
        try:
            yield
        finally:
            self._generating = generating
            for attention in self.attentions:
                attention.local_only = generating


def parallelize_context(model: nn.Module, comm: Comm, group: Group, *, seq_len: int,
                        position_modules: tuple[str, ...], device: torch.device | None = None) -> ContextParallel:
    """Split a decoder's sequence of ``seq_len`` over ``group``, in place (after tensor parallelism,
    if any); ``position_modules`` are the path patterns of the modules that take positions;
    ``device`` that of the batches (by default the model's)."""
    device = device or next(model.parameters()).device
    cp = ContextParallel(comm, group, zigzag_positions(seq_len, group.size, group.rank, device))
    # Found by type, so the empty placeholders of pruned pipeline stages are passed over.
    for name, module in list(model.named_modules()):
        if isinstance(module, CausalAttention):
            if module.dropout > 0:
                raise ValueError(f"ring attention has no attention dropout, but {name} has {module.dropout}; "
                                 "build the model with dropout 0 for context parallelism.")
            parent, _, attr = name.rpartition(".")
            attention = RingAttention(comm, group)
            setattr(model.get_submodule(parent), attr, attention)
            cp.attentions.append(attention)
    # A pre-hook rather than a replacement: tensor parallelism's embedding may
    # itself take its sequence-parallel chunk of the positions it is given.
    for name, module in model.named_modules():
        if any(fnmatch.fnmatchcase(name, pattern) for pattern in position_modules):
            module.register_forward_pre_hook(cp._global_positions)
    return cp
