"""What every decoder-only family shares: causal attention, the forward, sampling.

A decoder is ``embed`` (token ids -> the residual stream), a stack of
``blocks``, ``ln_f`` and ``head`` (``unembed``). `Decoder` runs that chain and
samples from it; a family (models/gpt.py, models/llama.py) builds the parts
and says how ``embed`` works. The parallel transforms find the attention core
by its type (`CausalAttention`), whatever the family.

Packed documents. A row may hold several documents one after another
(data/packing.py); ``documents`` [batch, seq] then numbers each position's
document within its row (0, 0, 0, 1, 1, 2, ...). Attention stays inside a
document, a block-diagonal causal mask,

    allowed(i, j) = j <= i  and  documents[i] == documents[j],

and positions restart at 0 with each document (`document_positions`), so a
packed row computes, position by position, what each document would alone
(Krell et al. 2021, "Efficient Sequence Packing without Cross-contamination").
``documents`` always covers the whole sequence, even where a rank holds only
some of its positions (context parallelism): the ring needs other ranks'
documents too.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class CausalAttention(nn.Module):
    """softmax(q k^T / sqrt(d) + causal mask) v for q, k, v [batch, heads, seq, head_dim].

    A module of its own, without weights, so that context parallelism can put
    ring attention in its place (parallel/context.py)."""

    def __init__(self, dropout: float):
        super().__init__()
        self.dropout = dropout

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                documents: torch.Tensor | None = None) -> torch.Tensor:
        return causal_attention(q, k, v, documents, dropout=self.dropout if self.training else 0.0)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: torch.Tensor | None = None,
                     dropout: float = 0.0) -> torch.Tensor:
    """Causal attention of a whole sequence, kept inside each document when ``documents`` is given:
    on a GPU by FlexAttention, which visits only the tiles the documents leave in
    (models/packed_attention.py), elsewhere by SDPA with the dense mask."""
    if documents is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout)
    if uses_flex(q, dropout):
        # Imported on a GPU's first packed row: FlexAttention brings the compiler stack (seconds of
        # import), which no other run needs at start.
        from scaletrain.models.packed_attention import flex_document_attention

        return flex_document_attention(q, k, v, documents)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=document_mask(documents, documents, causal=True),
                                          dropout_p=dropout)


def uses_flex(q: torch.Tensor, dropout: float) -> bool:
    """Whether packed rows go through FlexAttention (models/packed_attention.py): on a GPU, without
    attention dropout (FlexAttention has none, and no backward on a CPU)."""
    return q.is_cuda and dropout == 0.0


def document_positions(documents: torch.Tensor) -> torch.Tensor:
    """Each position's index within its document [batch, seq], from documents [batch, seq]
    (non-decreasing along a row): the distance to the first position of its document."""
    first = torch.searchsorted(documents.contiguous(), documents.contiguous())
    return torch.arange(documents.shape[-1], device=documents.device) - first


def document_mask(query_documents: torch.Tensor, key_documents: torch.Tensor, causal: bool) -> torch.Tensor:
    """Which keys each query may see [batch, 1, queries, keys]: those of its own document, and
    with ``causal`` (queries and keys at the same positions, in order) only up to itself."""
    allowed = query_documents[:, None, :, None] == key_documents[:, None, None, :]
    if causal:
        allowed &= torch.ones(allowed.shape[-2:], dtype=torch.bool, device=allowed.device).tril()
    return allowed


class PreNormBlock(nn.Module):
    """``x + attn(ln1(x))``, then ``+ mlp(ln2(x))``, or ``+ moe(ln2(x))`` in a mixture-of-experts
    block: a family hands in its norms, attention and feed-forward layer."""

    def __init__(self, ln1: nn.Module, attn: nn.Module, ln2: nn.Module, feed_forward: nn.Module, experts: bool):
        super().__init__()
        self.ln1, self.attn, self.ln2 = ln1, attn, ln2
        if experts:
            self.moe = feed_forward
        else:
            self.mlp = feed_forward

    def forward(self, x: torch.Tensor, documents: torch.Tensor | None = None, table: Any = None) -> torch.Tensor:
        """``table``: what the model computes once per forward for every block's attention to read
        (`Decoder.position_table`), passed on where there is one."""
        x = x + self.attn(self.ln1(x), *((documents,) if table is None else (documents, table)))
        feed_forward = self.moe if hasattr(self, "moe") else self.mlp
        return x + feed_forward(self.ln2(x))


class Decoder(nn.Module):
    """``head(ln_f(blocks(embed(ids))))``; a family sets ``cfg`` (with ``positions``, the longest
    sequence it reads, and ``vocab_size``), the parts, and ``embed``."""

    def embed(self, idx: torch.Tensor, documents: torch.Tensor | None = None) -> torch.Tensor:
        raise NotImplementedError

    def position_table(self, s: int, device: torch.device) -> Any:
        """What every block's attention reads of the positions, for sequences of ``s``, computed
        once and handed to each block (a family's rotary angles); None where the blocks need none."""
        return None

    def block_extras(self, s: int, device: torch.device, documents: torch.Tensor | None) -> tuple:
        """The arguments after ``x`` of every block's call for a micro-batch of ``s`` positions: its
        documents where packed, and the model's `position_table` where it has one."""
        table = self.position_table(s, device)
        return (documents, table) if table is not None else () if documents is None else (documents,)

    def init_weights(self, n_layers: int) -> None:
        """GPT-2's initialization (Radford et al. 2019): N(0, 0.02) for linear and embedding
        weights, zero biases, and the residual projections (attn.proj, mlp.proj, each expert's
        proj) at 0.02 / sqrt(2 * n_layers), so the residual stream's variance does not grow
        with depth."""
        self.apply(_normal_weights_zero_biases)  # children first: the order the draws were always made in
        for name, module in self.named_modules():
            if name.endswith("proj"):
                nn.init.normal_(module.weight, std=0.02 / math.sqrt(2 * n_layers))

    def unembed(self, x: torch.Tensor) -> torch.Tensor:
        """The residual stream after the last block -> logits [batch, seq, vocab]."""
        return self.head(self.ln_f(x))

    def forward(self, idx: torch.Tensor, *, logits: bool = True,
                documents: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids [batch, seq] -> logits [batch, seq, vocab]; with ``logits=False``
        the final norm's output [batch, seq, d_model], for a loss that applies the
        head itself (a fused head and cross-entropy never holds the logits whole);
        ``documents``: the rows are packed (module docstring)."""
        x = self.embed(idx, documents)
        extras = self.block_extras(idx.shape[1], idx.device, documents)
        for block in self.blocks:
            x = block(x, *extras)
        return self.unembed(x) if logits else self.ln_f(x)

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, new_tokens: int, temperature: float = 0.8,
                 top_k: int | None = 50, generator: torch.Generator | None = None,
                 stop_id: int | None = None) -> torch.Tensor:
        """Sample up to ``new_tokens`` continuations of ``idx`` [batch, seq]; sooner once every row
        has written ``stop_id`` (the end-of-text id), as there is nothing left to say."""
        written = torch.zeros(idx.shape[0], dtype=torch.bool, device=idx.device)  # rows that wrote stop_id
        for _ in range(new_tokens):
            logits = self(idx[:, -self.cfg.positions:])[:, -1, :self.cfg.vocab_size]
            idx = torch.cat([idx, sample_next(logits, temperature, top_k, generator)], dim=1)
            if stop_id is not None:
                written |= idx[:, -1] == stop_id
                if bool(written.all()):
                    break
        return idx


def _normal_weights_zero_biases(module: nn.Module) -> None:
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


def sample_next(logits: torch.Tensor, temperature: float = 0.8, top_k: int | None = 50,
                generator: torch.Generator | None = None) -> torch.Tensor:
    """One token id per row of last-position ``logits`` [batch, vocab]: top-k, then temperature
    sampling; temperature 0 takes the most likely token (greedy decoding)."""
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)
