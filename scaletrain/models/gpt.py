"""A plain GPT (decoder-only transformer), knowing nothing of parallelism.

Pre-norm blocks (Radford et al. 2019, GPT-2): ``x + attn(ln(x))`` then
``x + mlp(ln(x))``; learned position embeddings; the output head shares the
token embedding's weight (weight tying, Press & Wolf 2017). Linear layers have
no biases by default (as in PaLM, Chowdhery et al. 2022): besides saving
parameters, it removes a degenerate direction, since a key bias adds the same
amount to every score of a row, softmax cancels it, and its exact gradient is
zero; Adam would turn the float noise in that zero into full-size random
steps. ``bias=True`` gives the four linear layers of each block (qkv, attn.proj,
mlp.fc, mlp.proj) biases, zero at initialization: GPT-2 has them, so its
released weights (models/gpt_spec.py) need them to compute the same function;
tensor parallelism splits a column-parallel layer's bias with its outputs and
adds a row-parallel layer's once, after the sum. Layer norms keep their bias; their epsilon is
``norm_eps``. Initialization follows GPT-2: N(0, 0.02), with the two residual
projections of each block scaled by 1/sqrt(2 * n_layers) so the residual
stream's variance does not grow with depth. The MLP's GELU is the tanh
approximation, GPT-2's ``gelu_new``.

With ``moe`` set, the MLP of every ``moe.every``-th block is a mixture of
experts instead (models/moe.py), named ``blocks.{i}.moe``.

Parallel transforms (tensor, pipeline, context, expert parallel) rewrite this
module from the outside by the names of its parts, as its spec
(models/gpt_spec.py) declares them: ``blocks.{i}.attn.qkv``
(fused query/key/value, laid out as [3, heads, head_dim] along its output),
``attn.core`` (causal attention of given queries, keys and values),
``attn.proj``, ``mlp.fc``, ``mlp.proj``, ``moe.router``, ``moe.experts.{e}``,
``tok_emb``, ``pos_emb``, ``ln_f``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from scaletrain.models.decoder import CausalAttention, Decoder, PreNormBlock, document_positions
from scaletrain.models.moe import MoE, MoEConfig
from scaletrain.models.spec import matmul_flops_per_token


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int
    seq_len: int
    n_layers: int
    n_heads: int
    d_model: int
    dropout: float = 0.0
    vocab_multiple: int = 1
    moe: MoEConfig | None = None
    bias: bool = False  # biases on the blocks' linear layers, as GPT-2 has
    norm_eps: float = 1e-5  # the layer norms' epsilon (GPT-2's layer_norm_epsilon)
    n_positions: int | None = None  # rows of the position embedding (default: seq_len; GPT-2's n_positions)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def padded_vocab(self) -> int:
        """Rows of the embedding and the head: the vocabulary rounded up to a multiple of
        ``vocab_multiple`` (64 keeps GPU matrix tiles full, as nanoGPT's 50257 -> 50304).
        The extra ids are never inputs or targets, and never sampled."""
        return -(-self.vocab_size // self.vocab_multiple) * self.vocab_multiple

    @property
    def positions(self) -> int:
        """The longest sequence the model reads: the position embedding's rows. Training may use
        fewer (``seq_len``), as a fine-tune of GPT-2's 1024 positions on shorter windows does."""
        return self.n_positions or self.seq_len


class LayerNorm(nn.LayerNorm):
    """Layer norm computed in fp32 whatever the dtype of its input and weights.

    Its mean and variance reduce over d_model elements, where 16-bit rounding
    accumulates. CUDA autocast upcasts layer_norm by itself, CPU autocast does
    not, and bf16 working weights (``--param-dtype bf16``) would pull it to
    bf16 on any device; the output stays fp32, which keeps the residual
    stream in fp32 too. For fp32 inputs and weights this is nn.LayerNorm.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x.float(), self.normalized_shape, self.weight.float(), self.bias.float(),
                            self.eps)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=cfg.bias)
        self.core = CausalAttention(cfg.dropout)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, documents: torch.Tensor | None = None) -> torch.Tensor:
        b, s, _ = x.shape
        # Head count is read from the weight, not the config, so that a
        # tensor-parallel shard holding heads/tp heads runs the same code.
        heads = self.qkv.out_features // 3 // (x.shape[-1] // self.n_heads)
        q, k, v = self.qkv(x).view(b, s, 3, heads, -1).permute(2, 0, 3, 1, 4)
        y = self.core(q, k, v, documents)
        return self.resid_drop(self.proj(y.transpose(1, 2).reshape(b, s, -1)))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model, bias=cfg.bias)
        self.proj = nn.Linear(4 * cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x), approximate="tanh")))


def block(cfg: GPTConfig, experts: bool = False) -> PreNormBlock:
    """``x + attn(ln1(x))``, then ``+ mlp(ln2(x))``, or ``+ moe(ln2(x))`` in a mixture-of-experts block."""
    feed_forward = MoE(cfg.d_model, cfg.moe) if experts else MLP(cfg)
    return PreNormBlock(LayerNorm(cfg.d_model, eps=cfg.norm_eps), CausalSelfAttention(cfg),
                        LayerNorm(cfg.d_model, eps=cfg.norm_eps), feed_forward, experts)


class GPT(Decoder):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.padded_vocab, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.positions, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(block(cfg, experts=cfg.moe is not None and cfg.moe.in_block(i))
                                    for i in range(cfg.n_layers))
        self.ln_f = LayerNorm(cfg.d_model, eps=cfg.norm_eps)
        self.head = nn.Linear(cfg.d_model, cfg.padded_vocab, bias=False)
        self.head.weight = self.tok_emb.weight
        self.init_weights(cfg.n_layers)

    def embed(self, idx: torch.Tensor, documents: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids [batch, seq] -> the residual stream [batch, seq, d_model] entering block 0;
        in packed rows positions restart with each document (models/decoder.py)."""
        positions = torch.arange(idx.shape[1], device=idx.device) if documents is None \
            else document_positions(documents)
        # The residual stream is fp32 even when the embeddings are stored in bf16.
        return self.drop(self.tok_emb(idx) + self.pos_emb(positions)).float()

    def flops_per_token(self) -> float:
        """Training FLOPs per token, 6N + 12 * L * d * s (models/spec.py): N leaves out the
        position embedding, whose lookup does no matmul work, and counts the tied token
        embedding once, as the head; a mixture of experts counts top_k / E of the experts."""
        c = self.cfg
        return matmul_flops_per_token(self, c.n_layers, c.d_model, c.seq_len,
                                      c.moe.top_k / c.moe.experts if c.moe else 1.0)
