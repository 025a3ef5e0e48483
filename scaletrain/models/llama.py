"""The Llama family (Llama, Qwen2, Mistral, SmolLM; Mixtral-style experts), knowing nothing of parallelism.

LLaMA (Touvron et al. 2023) is the pre-norm decoder of GPT-2 (models/gpt.py)
with four changes, each from its own paper:

RMSNorm (Zhang & Sennrich 2019) in place of layer norm: no mean, no bias,

    y = w * x / sqrt(mean(x^2) + eps)

computed in fp32 whatever the input's dtype, its output fp32 as the residual
stream is (gpt.LayerNorm's reason).

Rotary position embeddings (RoPE, Su et al. 2021, "RoFormer") in place of
learned positions: the queries and keys of position p, each head's pairs of
features (i, i + d/2) turned by the angle p * f_i, with

    f_i = theta ^ (-2i / d),  i = 0 .. d/2 - 1  (d the head dim, theta 10000 or the model's)
    rope(x) = x * cos(p f) + rotate_half(x) * sin(p f),  rotate_half([x1, x2]) = [-x2, x1]

so a score q_m . k_n depends on the positions only through m - n. The angles'
cos and sin are one table per model and device, [P, d] over positions 0 .. P-1
(P the run's sequence length, or a longer sequence's), computed once and handed
to every block (``Llama.position_table``), whose rotary module reads its
positions' rows: a compiled block then reads cos and sin, where computing them
inside the block would let the compiler recompute them for every element of q
and k (the GPU profile's 6.8 ms of a tinyllama step, docs/performance.md).
The rows are the angles the formula gives, bit for bit. Pairing
feature i with i + d/2 (two halves, not neighbours) is the layout of the Hugging
Face checkpoints. Llama 3.1 (Meta 2024, "The Llama 3 Herd of Models") stretches
long wavelengths for long contexts: with factor s, low and high frequency
factors l and h and the pretraining context L, a wavelength w_i = 2 pi / f_i
longer than L / l is divided by s, one shorter than L / h kept, and one between
blended: f_i <- (1 - a) f_i / s + a f_i, a = (L / w_i - l) / (h - l).

Grouped-query attention (GQA, Ainslie et al. 2023): n_kv_heads key/value
heads, each shared by n_heads / n_kv_heads query heads (1: multi-query). The
keys and values are repeated to n_heads before the attention core, so ring
attention (parallel/context.py) sees as many heads on every side.

A SwiGLU MLP (Shazeer 2020, "GLU Variants Improve Transformer"):
``proj(silu(gate(x)) * up(x))``, of hidden width ffn_hidden (about 8/3 d_model
keeps the 4 d_model GELU MLP's parameter count).

The head is untied from the token embedding (``tie_embeddings`` ties them, as
SmolLM does); Qwen2 adds biases to q, k and v (``bias``); Mistral's sliding
window equals causal attention for sequences no longer than the window, the
only ones the spec lets through (models/llama_spec.py). With ``moe`` set, the
MLP of every ``moe.every``-th block is a mixture of SwiGLU experts, as in
Mixtral (models/moe.py), named ``blocks.{i}.moe``.

What a block keeps for backward is cut to its minimum (models/lean_saves.py): each
RMSNorm its input alone, SwiGLU its gate's and up's outputs (silu is computed again),
and under autocast q, k and v one 16-bit copy of their input between them, gate and up
another: the outputs are the plain formulas' bit for bit, the gradients the same to fp32's
rounding.

Initialization is GPT-2's (models/gpt.py): N(0, 0.02), residual projections
(attn.proj, mlp.proj, each expert's proj) N(0, 0.02 / sqrt(2 * n_layers)).

Parallel transforms rewrite this module by the names of its parts, as its
spec declares them: ``blocks.{i}.attn.q``, ``.k``, ``.v``, ``.proj``,
``attn.core``, ``attn.rope`` (handed each rank's global positions under
context parallelism), ``mlp.gate``, ``mlp.up``, ``mlp.proj``, ``tok_emb``,
``ln_f``, ``head``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from scaletrain.models.decoder import CausalAttention, Decoder, PreNormBlock, document_positions
from scaletrain.models.lean_saves import rms_norm, shared_cast, silu_mul
from scaletrain.models.moe import MoE, MoEConfig
from scaletrain.models.spec import matmul_flops_per_token


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    seq_len: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    d_model: int
    ffn_hidden: int
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # Llama 3.1's frequency scaling: (factor, low_freq_factor, high_freq_factor, original_max_position_embeddings)
    rope_scaling: tuple[float, float, float, int] | None = None
    tie_embeddings: bool = False
    bias: bool = False  # biases on q, k and v, as Qwen2 has
    dropout: float = 0.0
    vocab_multiple: int = 1
    moe: MoEConfig | None = None
    n_positions: int | None = None  # the longest sequence the model reads (default: seq_len)
    sliding_window: int | None = None  # Mistral's and Qwen2's window: longer sequences are refused

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def padded_vocab(self) -> int:
        """Rows of the embedding and the head, ``vocab_size`` rounded up to ``vocab_multiple``
        (GPTConfig.padded_vocab)."""
        return -(-self.vocab_size // self.vocab_multiple) * self.vocab_multiple

    @property
    def positions(self) -> int:
        return self.n_positions or self.seq_len


class RMSNorm(nn.Module):
    """w * x / sqrt(mean(x^2) + eps), in fp32 whatever the input's dtype; the output stays fp32.
    Backward keeps its input alone (models/lean_saves.py)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class RotaryEmbedding(nn.Module):
    """Positions [s] (or [b, s]) -> (cos, sin) of their angles, each [s, head_dim] (or [b, s, head_dim])
    fp32 (module docstring): the rows of a ``table`` (`angles` of positions 0 .. P-1) where one is
    given, else computed.

    No parameters and no buffers: the frequencies are computed on every call
    (d/2 numbers), so a model built on the meta device needs nothing filled in
    and the state dict holds weights only. Context parallelism hooks this
    module to replace the local positions it is given by the rank's global ones."""

    def __init__(self, head_dim: int, theta: float, scaling: tuple[float, float, float, int] | None = None):
        super().__init__()
        self.head_dim, self.theta, self.scaling = head_dim, theta, scaling

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        """f_i = theta^(-2i/d), and Llama 3.1's stretch of the long wavelengths when scaled."""
        exponents = torch.arange(0, self.head_dim, 2, device=device).float() / self.head_dim
        inv_freq = 1.0 / self.theta ** exponents
        if self.scaling is None:
            return inv_freq
        factor, low, high, original = self.scaling
        wavelength = 2 * math.pi / inv_freq
        blend = (original / wavelength - low) / (high - low)
        blended = (1 - blend) * inv_freq / factor + blend * inv_freq
        return torch.where(wavelength < original / high, inv_freq,
                           torch.where(wavelength > original / low, inv_freq / factor, blended))

    def angles(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) of ``positions``' angles, computed."""
        freqs = positions.float().unsqueeze(-1) * self.inv_freq(positions.device)
        angles = torch.cat((freqs, freqs), dim=-1)  # feature i and i + d/2 share an angle
        return angles.cos(), angles.sin()

    def forward(self, positions: torch.Tensor, table: tuple[torch.Tensor, torch.Tensor] | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        if table is None:
            return self.angles(positions)
        cos, sin = table
        return cos[positions], sin[positions]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [b, heads, s, head_dim] turned by the angles of its positions (cos, sin [s, head_dim],
    or [b, s, head_dim] when each row has positions of its own)."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)  # q and k keep their dtype (autocast's, if any)
    if cos.dim() == 3:
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + rotate_half(x) * sin


class Attention(nn.Module):
    shares_autocast_copy = True  # q, k and v read one autocast copy of x (models/lean_saves.py)

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.q = nn.Linear(cfg.d_model, cfg.n_heads * cfg.head_dim, bias=cfg.bias)
        self.k = nn.Linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim, bias=cfg.bias)
        self.v = nn.Linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim, bias=cfg.bias)
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        self.core = CausalAttention(cfg.dropout)
        self.proj = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.d_model, bias=False)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, documents: torch.Tensor | None = None,
                table: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """``table``: the model's rotary table (`Llama.position_table`), read where it covers every
        position of ``x`` (below s; under context parallelism below the run's sequence length)."""
        b, s, _ = x.shape
        # Head counts come from the weights, not the config: a tensor-parallel shard
        # holds n_heads / tp query heads and n_kv_heads / tp key/value heads.
        heads, kv_heads = self.q.out_features // self.head_dim, self.k.out_features // self.head_dim
        x_q, x_k, x_v = shared_cast(x, 3) if self.shares_autocast_copy else (x, x, x)
        q = self.q(x_q).view(b, s, heads, self.head_dim).transpose(1, 2)
        k = self.k(x_k).view(b, s, kv_heads, self.head_dim).transpose(1, 2)
        v = self.v(x_v).view(b, s, kv_heads, self.head_dim).transpose(1, 2)
        # Local positions 0..s-1, or in packed rows each document's own [b, s] (models/decoder.py);
        # under context parallelism a hook makes them the rank's.
        covered = table if table is not None and table[0].shape[0] >= s else None
        cos, sin = self.rope(torch.arange(s, device=x.device) if documents is None else document_positions(documents),
                             covered)
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)  # cast once: q's and k's products keep the same pair
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # Key/value head j serves query heads j*g .. j*g + g-1 (Hugging Face's repeat_kv).
        groups = heads // kv_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        y = self.core(q, k, v, documents)
        return self.resid_drop(self.proj(y.transpose(1, 2).reshape(b, s, -1)))


class SwiGLU(nn.Module):
    """proj(silu(gate(x)) * up(x)); gate and up read one autocast copy of x, and silu(gate(x)) is
    computed again in backward rather than kept (models/lean_saves.py)."""

    shares_autocast_copy = True

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.gate = nn.Linear(cfg.d_model, cfg.ffn_hidden, bias=False)
        self.up = nn.Linear(cfg.d_model, cfg.ffn_hidden, bias=False)
        self.proj = nn.Linear(cfg.ffn_hidden, cfg.d_model, bias=False)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_gate, x_up = shared_cast(x, 2) if self.shares_autocast_copy else (x, x)
        return self.drop(self.proj(silu_mul(self.gate(x_gate), self.up(x_up))))


def block(cfg: LlamaConfig, experts: bool = False) -> PreNormBlock:
    """``x + attn(ln1(x))``, then ``+ mlp(ln2(x))``, or ``+ moe(ln2(x))`` in a mixture-of-experts block."""
    feed_forward = MoE(cfg.d_model, cfg.moe) if experts else SwiGLU(cfg)
    return PreNormBlock(RMSNorm(cfg.d_model, cfg.norm_eps), Attention(cfg), RMSNorm(cfg.d_model, cfg.norm_eps),
                        feed_forward, experts)


class Llama(Decoder):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.padded_vocab, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(block(cfg, experts=cfg.moe is not None and cfg.moe.in_block(i))
                                    for i in range(cfg.n_layers))
        self.ln_f = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.head = nn.Linear(cfg.d_model, cfg.padded_vocab, bias=False)
        if cfg.tie_embeddings:
            self.head.weight = self.tok_emb.weight
        self.init_weights(cfg.n_layers)
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)  # the table's (module docstring)
        self._tables: dict[tuple[int, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}

    def position_table(self, s: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of positions 0 .. P-1, each [P, head_dim] fp32, read by every block: P the run's
        sequence length, computed once per device and kept for every step, or ``s`` where longer (a
        generation past it), computed for this forward alone. Inside a graph compiled whole (not
        block by block) the graph computes it once per forward: a kept table would be state the
        graph must guard on, and its first step's would be compiled twice."""
        if s > self.cfg.seq_len or torch.compiler.is_compiling():
            return self.rope.angles(torch.arange(max(s, self.cfg.seq_len), device=device))
        key = (self.cfg.seq_len, torch.device(device))
        if key not in self._tables:
            self._tables[key] = self.rope.angles(torch.arange(self.cfg.seq_len, device=device))
        return self._tables[key]

    def embed(self, idx: torch.Tensor, documents: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids [batch, seq] -> the residual stream [batch, seq, d_model] entering block 0
        (fp32, even when the embedding is stored in bf16); positions enter in each attention."""
        return self.drop(self.tok_emb(idx)).float()

    def flops_per_token(self) -> float:
        """Training FLOPs per token, 6N + 12 * L * (a * d_head) * s (models/spec.py): N counts
        the head and the linear layers, the token embedding only when it is the head; a
        mixture of experts counts top_k / E of the experts."""
        c = self.cfg
        return matmul_flops_per_token(self, c.n_layers, c.n_heads * c.head_dim, c.seq_len,
                                      c.moe.top_k / c.moe.experts if c.moe else 1.0)
