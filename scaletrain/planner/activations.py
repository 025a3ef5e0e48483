"""Saved activations of a decoder, per micro-batch, as the memory ledger's meter counts them.

Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
Transformer Models", section 4.1) count what one transformer layer keeps for
backward: ``s*b*h*(34 + 5*a*s/h)`` bytes with 16-bit activations, dropout
masks and the a*s*s attention matrix. Our blocks differ in ways that change
the count, so the planner counts them tensor by tensor from the family's
`ModelShape` (models/spec.py), every term measured with the ledger's meter
(tests/test_plan.py, tests/test_plan_families.py). ``b`` sequences of ``s``
positions (the rank's), width ``h``, ``a`` query heads of ``d`` features
(``a*d`` the attention's width), ``f`` the MLP's hidden width, ``t`` the tp
size, ``e`` bytes per activation (2 under bf16/fp16 autocast, else 4), ``c``
the block's column-parallel layers (each reads a norm's output: a fused qkv
and fc, 2; q, k, v, gate and up, 5):

    each norm (two a block), on the fp32 residual stream         /t with sp
      layer norm: its input, mean and 1/std                     4*b*s*h + 8*b*s
      RMSNorm: its input alone (1/rms and x/rms are computed    4*b*s*h
      again in backward: models/lean_saves.py)
    the column layers' inputs (the norms' outputs)               /t with sp
      without sp: one tensor per norm, which they share (fp32;  2*e*b*s*h
      autocast: one 16-bit copy, models/lean_saves.py)
      with sp each its own saved chunk (fp8: below)             c*e*b*s*h
    q, k, v as attention saves them                             3*e*b*s*a*d/t
      (grouped-query k and v are repeated to a heads first; the
      n_kv_heads-wide k and v are saved by nothing: rotary's
      products keep only cos and sin, the repeat keeps nothing)
    attention output (its transpose is proj's input: a view)    e*b*s*a*d/t
    attention log-sum-exp (fp32)                                4*b*a*s/t   (a fused kernel: no a*s*s matrix)
    rotary's cos and sin, without learned positions             2*e*s*d     (one pair for q and k)
    the MLP: its input matrices' outputs, and one more          (i+1)*e*b*s*f/t
      GELU (i = 1): fc's output and GELU's
      SwiGLU (i = 2): gate's and up's outputs and their product (proj's input; silu's output is
      computed again in backward: models/lean_saves.py)
    under autocast of fp32 weights: their e-byte copies         e*(2*a*d*h + 2*k*d*h + (i+1)*h*f)/t
      (q and proj a*d*h each, k and v k*d*h each with k the key/value heads, the MLP (i+1)*h*f;
      with sp only the projections': a column layer that gathers its input saves the weight
      itself and casts it again in backward, the head too)

A block of layer norms, a fused qkv and a 4h GELU MLP in fp32
without tp saves ``64*b*s*h + 16*b*s + 4*a*b*s`` bytes, under bf16 autocast
``36*b*s*h`` + the same small terms + the weight copies (against
Korthikanti's 34: our residual stream and norms stay fp32, there are no
dropout masks and no attention matrix). A block of RMSNorms, separate q,
k and v and a SwiGLU MLP of width f in fp32: ``32*b*s*h + 12*b*s*f + 4*a*b*s
+ 8*s*d``; under bf16 autocast ``20*b*s*h + 6*b*s*f + 4*a*b*s + 4*s*d`` + the
weight copies: the least such a block can keep with the residual stream in
fp32 (docs/techniques.md). With context parallelism ``s`` is a
rank's ``s/cp`` positions, and ring attention returns its output laid out
by heads, so proj's input is a copy: ``+e*b*s*a*d/t``.

A mixture of experts (models/moe.py) in place of the MLP: its T = b*s
positions (T/t under sp: it lies outside tp's regions) routed to k of E
experts make N = k*T rows (dropless; an upper bound under a capacity), each
expert ``f_e`` wide with ``i`` input matrices; the router's fp32 input takes
the MLP's column inputs' place (4*T*h), and it saves

    routing: logits and probabilities (fp32), the lse of the z-loss, the
      top-k ids (int64), values, their sum, the kept mask, the balance
      loss's fractions                                          8*T*E + 8*T + 13*T*k + 4*b*E
    dispatch and combine: the rows' order and token ids (int64), their
      gates, the experts' outputs, the gated outputs (fp32)     20*N + e*N*h + 4*N*h
    the experts on their rows: the rows (fp32: one gathered tensor;
      autocast: each input matrix its cast), the MLP's tensors  4*N*h or i*e*N*h, + 2*i*e*N*f_e
    under autocast of fp32 weights: every expert's copies       e*(E/ep)*(i+1)*h*f_e
    with ep: the arrived rows' order, the outputs in arrival
      order                                                     8*N + e*N*h

where with ep N is the mean over the ep ranks of the rows their experts
compute (a rank's own depend on the routing; their ledgers' mean equals
it). Recomputed, a mixture's forward peaks as it scatters its output back:
its router input, routing, order, outputs and gated outputs alive.

Outside the blocks: the token ids (int64), and the positions a learned
position embedding looks up, on the first stage, and on the tp group the
vocabulary embedding's local ids and mask; on the last stage the final norm,
the head's input, and the loss: log-softmax keeps its fp32 output ``4*b*s*V``
(vocabulary-parallel: the softmax ``4*b*s*V/t`` with local ids and mask),
plus the targets.

Recomputation (techniques/recompute.py) changes which of these are alive at the peak:

    none        everything, at the end of the forward
    selective   drops the log-sum-exp (the attention output stays: proj saves it)
    full        only each block's input (4*b*s*h, /t with sp) through the forward;
                in backward one block's tensors again while it is recomputed,
                after the loss's tensors are gone: L*input + block - input + ids
    every:K     blocks 0, K, 2K, ... as under full, the others as none
    sqrt        segments of ceil(sqrt L) blocks as units: segment inputs, plus
                one whole segment in backward

Under autocast of fp32 weights recomputation keeps more in the forward than
its inputs: autocast caches each weight's 16-bit copy until the forward
leaves autocast (before the loss), and a recomputed block's copies are held
by that cache though the block drops what it saved. At the end of such a
forward the R recomputed blocks hold their inputs and ``R`` x the block's
weight copies, the last one also what it is computing (the residual stream
and the f-wide tensors of its MLP's last product): for a large model this,
not the backward, is the peak (a block's copies are about ``e*12*h*h/t``
bytes, against its ``4*b*s*h`` input).

A pipeline rank holds several micro-batches at once: `schedule_peak` walks
its schedule's actions (schedules.py), each forward and backward peaking on
top of what the rank's other micro-batches hold at that moment.

Chunked head and loss (kernels/head_loss.py: on a GPU by default, or with
``--fused triton``): the final norm, and the gradients the kernel computes in
the forward, of its fp32 input ``4*b*s*h`` and, unless frozen, of the head's
weight ``4*V*h``; no logits, no targets.

Compressed (``--compress-activations``, techniques/compress_activations.py):
each saved tensor of at least 1024 elements that requires a gradient (not the
ids, the norms' statistics, the log-sum-exp, rotary's tables, autocast's
weight copies) is stored in bf16 (an fp32 one: 2 bytes an element) or as int8
blocks of 128 with an fp32 scale each (1 + 4/128 bytes an element); what a
recomputed block holds while it runs, and saves again in backward, is not.

FP8 (``--precision fp8``, techniques/fp8.py): a dense block's linear layers
multiply outside autocast and keep, in place of their inputs and of autocast's
weight copies, the e4m3 codes of both, a byte an element (a column layer under
sp its chunk of the input's), and the two scales: ``c*b*s*h`` (``/t`` with sp)
+ ``b*s*(a*d + f)/t`` + the block's weights' bytes ``/t``; the product
silu(gate) * up is kept only as the MLP's projection's codes. A mixture of
experts' layers are counted as under bf16.

A LoRA fine-tune (finetune/adapters.py: the base frozen, ``r`` the rank): a
frozen head keeps no input (it has no weight gradient to compute), the
embeddings no ids and the first block's first norm nothing (their inputs need
no gradient; what the attention's columns save of them stays uncompressed),
and each adapter keeps its ``x A^T``, ``e*b*s*r``. A column layer without an
adapter keeps no input, nor the MLP's output projection its own. Autocast caches no copy of a frozen weight: recomputed,
the copies go with their block. Where the attention's columns have no
adapters (``--lora-targets`` without qkv), nothing before the first block's
first adapter needs a gradient, so it saves nothing there either, which the
planner does not subtract: an overestimate of up to one block's attention.

Left out: dropout (masks and SDPA's math path; the planner assumes
``--dropout 0``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from scaletrain.models.spec import Column, ModelShape, Region, TensorPlan
from scaletrain.techniques.compress_activations import BLOCK as INT8_BLOCK
from scaletrain.techniques.compress_activations import MIN_ELEMENTS


@dataclass(frozen=True)
class Adapters:
    """A LoRA fine-tune's adapters in each block, its base frozen (none: ``rank`` 0): the block's
    adapted ``layers``, of them the attention's and the MLP's column layers, and whether the MLP's
    row layer (its output projection, whose input nothing else saves) is one."""

    rank: int = 0
    layers: int = 0
    attention_columns: int = 0
    mlp_columns: int = 0
    mlp_row: bool = False
    embedding: bool = False  # trained whole beside the adapters (--lora-modules-to-save embed, or a tied head)
    head: bool = False  # the same for the output head


@dataclass(frozen=True)
class Shape:
    """One micro-batch on one rank: ``b`` sequences of ``s`` (the rank's) positions through
    a model of ``model``'s sizes, whose attention holds ``attention_columns`` column-parallel layers."""

    b: int
    s: int
    model: ModelShape
    attention_columns: int  # a fused qkv: 1; q, k, v: 3 (the MLP's are its inputs)
    tp: int = 1
    sp: bool = False
    cp: int = 1
    ep: int = 1
    e: int = 4  # bytes of an autocast activation
    float8: bool = False  # --precision fp8: a block's linear layers keep their inputs' and weights' e4m3 codes
    cast_weights: bool = False  # autocast saves 16-bit copies of fp32 weights
    compress: str = "none"  # --compress-activations: how the forward stores what it saves
    chunked_loss: bool = False  # the head and loss run a chunk of rows at a time (kernels/head_loss.py)
    lora: Adapters = Adapters()

    @property
    def h(self) -> int:
        return self.model.d_model

    @property
    def width(self) -> int:
        """The attention's width, a*d: its q (and the repeated k and v) and its output."""
        return self.model.n_heads * self.model.head_dim

    @property
    def vocab(self) -> int:
        return self.model.vocab

    @property
    def bsh(self) -> int:
        return self.b * self.s * self.h

    @property
    def routed(self) -> int:
        """The positions a mixture of experts routes on this rank: outside tp's regions it sees
        the whole sequence, or under sp the rank's chunk of it."""
        return self.b * self.s // (self.tp if self.sp else 1)

    @property
    def assignments(self) -> int:
        """Rows the experts compute: k per routed position (dropless; an upper bound under a
        capacity), with ep the mean over the ep ranks of those that reach this rank's experts."""
        return self.routed * self.model.moe_top_k

    def stored(self, numel: int, element: int, count: int = 1) -> int:
        """Bytes of ``count`` saved activations of ``numel`` elements of ``element`` bytes each, as the
        forward stores them under ``--compress-activations`` (module docstring)."""
        if self.compress == "none" or numel < MIN_ELEMENTS or (self.compress == "bf16" and element <= 2):
            return count * numel * element
        if self.compress == "bf16":
            return count * 2 * numel
        blocks = -(-numel // INT8_BLOCK)
        return count * (blocks * INT8_BLOCK + 4 * blocks)  # int8 codes, an fp32 scale per block

    @property
    def frozen(self) -> bool:
        """A LoRA fine-tune's: its base trains nothing."""
        return self.lora.rank > 0

    @property
    def frozen_embedding(self) -> bool:
        """A fine-tune's embedding that does not train: its output, the first block's input, needs no gradient."""
        return self.frozen and not self.lora.embedding

    @property
    def frozen_head(self) -> bool:
        """A fine-tune's head that does not train: it needs no input for a weight gradient."""
        return self.frozen and not self.lora.head

    def columns(self, attention: bool) -> int:
        """The attention's or the MLP's column layers that save their input: every one, or of a
        frozen base those with adapters beside them (a frozen weight needs no input for its gradient)."""
        if self.frozen:
            return self.lora.attention_columns if attention else self.lora.mlp_columns
        return self.attention_columns if attention else self.model.ffn_inputs

    @property
    def plain(self) -> Shape:
        """The same micro-batch stored as it is: what a recomputation in backward saves."""
        return dataclasses.replace(self, compress="none")


def attention_columns(plan: TensorPlan | None) -> int:
    """The column-parallel layers of a block's attention: those under the plan's first region
    (a decoder block's attention comes before its MLP); a family without a tensor plan: one
    fused projection."""
    if plan is None:
        return 1
    regions = [pattern for pattern, style in plan if isinstance(style, Region)]
    return sum(1 for pattern, style in plan if isinstance(style, Column) and regions
               and pattern.startswith(regions[0] + "."))


def shape_of(model: ModelShape, plan: TensorPlan | None, micro_batch: int, tp: int, sp: bool, cp: int,
             precision: str, param_dtype: str, ep: int = 1, compress: str = "none", chunked_loss: bool = False,
             lora: Adapters = Adapters()) -> Shape:
    """One micro-batch of ``micro_batch`` sequences under a layout (``lora``: a fine-tune's adapters)."""
    autocast = precision in ("bf16", "fp16", "fp8")
    return Shape(b=micro_batch, s=model.seq_len // cp, model=model, attention_columns=attention_columns(plan), tp=tp,
                 sp=sp, cp=cp, ep=ep, e=2 if autocast else 4, float8=precision == "fp8",
                 cast_weights=autocast and param_dtype == "fp32",
                 compress=compress, chunked_loss=chunked_loss, lora=lora)


def block_input(x: Shape) -> int:
    """The residual stream entering a block: all full recomputation keeps of it."""
    return x.stored(x.bsh // (x.tp if x.sp else 1), 4)


def norm(x: Shape) -> int:
    """One norm's saved tensors on the fp32 residual stream (module docstring)."""
    rows = x.b * x.s // (x.tp if x.sp else 1)
    if x.model.norm_with_mean:
        return x.stored(rows * x.h, 4) + 8 * rows  # the mean and 1/std are outside the graph: kept as they are
    return x.stored(rows * x.h, 4)  # RMSNorm: its input alone, the rest computed again in backward


def column_inputs(x: Shape, columns: int, norms: int) -> int:
    """What ``columns`` column layers reading ``norms`` norms' outputs save of their inputs:
    one shared tensor per norm (under autocast one 16-bit copy), or under sp each layer its own chunk."""
    copies = columns if x.sp else min(norms, columns)
    return x.stored(x.bsh // (x.tp if x.sp else 1), x.e, count=copies)


def block(x: Shape, experts: bool = False) -> int:
    """Bytes one block saves for backward (module docstring); ``experts``: a mixture of experts
    in place of its MLP."""
    m, t, e = x.model, x.tp, x.e
    rows = x.b * x.s
    total = 2 * norm(x) + weight_copies(x, experts)
    total += x.stored(rows * x.width // t, e, count=4) + attention_stats(x)  # q, k, v and the output; lse
    if not m.learned_positions:
        total += 2 * e * x.s * m.head_dim  # rotary's cos and sin, cast once for q and k
    if x.cp > 1:
        total += x.stored(rows * x.width // t, e)  # ring attention's output, copied into proj's layout
    total += x.stored(rows * x.lora.rank, e, count=x.lora.layers)  # each adapter's x A^T, for B's gradient
    if experts:  # the router saves its fp32 input (the second norm's output) in place of the MLP's columns
        return total + column_inputs(x, x.columns(True), 1) + x.stored(x.routed * x.h, 4) + mixture(x)
    if x.float8:  # the linear layers keep their inputs' codes: no column input, no product kept otherwise
        return total + float8_codes(x) + x.stored(rows * m.ffn_hidden // t, e, count=m.ffn_inputs)
    total += column_inputs(x, x.columns(True), 1) + column_inputs(x, x.columns(False), 1)
    # the input matrices' outputs, then the output projection's input, which a frozen one without an adapter
    # keeps not (silu's output is computed again in backward)
    tensors = m.ffn_inputs + (0 if x.frozen and not x.lora.mlp_row else 1)
    return total + x.stored(rows * m.ffn_hidden // t, e, count=tensors)


def float8_codes(x: Shape) -> int:
    """What a dense block's float8 layers keep of their inputs (techniques/fp8.py): each layer its
    input's e4m3 codes, a byte an element (a column layer under sp its chunk of them, gathered again
    in backward), and the input's and the weight's scales; the weights' codes are `weight_copies`."""
    m, rows = x.model, x.b * x.s
    columns = x.attention_columns + m.ffn_inputs
    codes = columns * x.bsh // (x.tp if x.sp else 1) + rows * (x.width + m.ffn_hidden) // x.tp  # + the two projs
    return codes + 8 * (columns + 2)


def mixture(x: Shape) -> int:
    """What a mixture of experts saves beyond its input (module docstring): the routing, the rows
    each expert computes and its MLP's tensors on them, and the combine."""
    m, e = x.model, x.e
    tokens, rows, experts = x.routed, x.assignments, m.moe_experts
    routing = 8 * tokens * experts + 8 * tokens + 13 * tokens * m.moe_top_k + 4 * x.b * experts
    combine = 20 * rows + x.stored(rows * x.h, e) + x.stored(rows * x.h, 4)
    inputs = x.stored(rows * x.h, e, count=m.ffn_inputs) if e < 4 else x.stored(rows * x.h, 4)
    # with ep the arrived rows' order by expert, and the outputs put back in arrival order (parallel/experts.py)
    regrouped = 8 * rows + x.stored(rows * x.h, e) if x.ep > 1 else 0
    return routing + combine + inputs + regrouped + x.stored(rows * m.moe_hidden, e, count=2 * m.ffn_inputs)


def weight_copies(x: Shape, experts: bool = False) -> int:
    """One block's autocast copies of its fp32 weights (module docstring), none without them; under
    fp8 a dense block's float8 layers keep their weights' e4m3 codes instead, a byte an element."""
    m = x.model
    projections = x.width * x.h  # row-parallel: the attention's proj (and the MLP's, below)
    columns = x.width * x.h + 2 * m.n_kv_heads * m.head_dim * x.h
    if experts and x.cast_weights:  # every expert this rank holds, whole: they are no tp layers
        held = m.moe_experts // x.ep * (m.ffn_inputs + 1) * x.h * m.moe_hidden
        return x.e * (projections + (0 if x.sp else columns)) // x.tp + x.e * held
    projections += m.ffn_hidden * x.h
    columns += m.ffn_inputs * x.h * m.ffn_hidden
    if x.float8 and not experts:
        return (projections + columns) // x.tp
    return x.e * (projections + (0 if x.sp else columns)) // x.tp if x.cast_weights else 0


def in_flight(x: Shape, experts: bool = False) -> int:
    """The most a recomputed block's forward holds beyond its input, as the meter sees it: the
    residual stream after the attention, and the MLP's f-wide tensors its last product reads
    (GELU's output; silu's and up's), or a mixture's router input, routing and combine as its
    last product (the scatter back) runs. Everything else it saved is dropped as soon as made."""
    if experts:
        m, tokens, rows = x.model, x.routed, x.assignments
        routing = 8 * tokens * m.moe_experts + 9 * tokens * m.moe_top_k + 20 * rows  # probs, logits; ids, mask; order
        return block_input(x) + 4 * tokens * x.h + (x.e + 4) * rows * x.h + routing
    return block_input(x) + x.model.ffn_inputs * x.e * x.b * x.s * x.model.ffn_hidden // x.tp


def attention_stats(x: Shape) -> int:
    """The attention's fp32 log-sum-exp: what selective recomputation drops."""
    return 4 * x.b * x.model.n_heads * x.s // x.tp


def inputs(x: Shape) -> int:
    """The first stage's int64 token ids and the positions a learned position embedding looks
    up (and the vocabulary embedding's local ids and mask)."""
    ids = 8 * x.b * x.s + (8 * x.s if x.model.learned_positions else 0)
    if x.tp > 1:
        ids += 9 * x.b * x.s
    return ids


def head(x: Shape) -> int:
    """The last stage's final norm and head input (and the head's weight copy); a frozen head
    keeps no input, having no weight gradient to compute."""
    weight = x.e * x.vocab * x.h // x.tp if x.cast_weights and not x.sp else 0
    return norm(x) + (0 if x.frozen_head else column_inputs(x, 1, 1)) + weight


def loss_gradients(x: Shape) -> int:
    """What the chunked head and loss save: the gradients they compute in the forward, of the
    final norm's fp32 output and, unless it is frozen, of the head's weight in fp32
    (kernels/cross_entropy.py)."""
    return 4 * x.b * x.s * x.h + (0 if x.frozen_head else 4 * x.vocab * x.h)


def head_and_loss(x: Shape) -> int:
    """The last stage's `head` and loss (module docstring), targets included; chunked, the final
    norm and `loss_gradients`."""
    if x.chunked_loss:
        return norm(x) + loss_gradients(x)
    rows = x.b * x.s
    loss = x.stored(rows * math.ceil(x.vocab / x.tp), 4) + 8 * rows
    loss += 9 * rows if x.tp > 1 else 4  # local ids and mask; or nll's total weight
    return head(x) + loss


def chunk_peak(x: Shape, experts: list[bool], first: bool, last: bool, recompute: str) -> tuple[int, int, int]:
    """(bytes alive after a chunk's forward, the most alive at once during it, and while it
    goes backward) for one micro-batch through its blocks, ``experts`` saying of each in order
    whether it is a mixture of experts, under ``recompute``.

    Recomputed blocks drop what they save, but not autocast's copies of their weights:
    autocast keeps every copy it made until the forward leaves it (before the loss), so at
    the end of a recomputed forward each recomputed block holds its input and its copies.
    What a recomputed block holds while it runs, in the forward and again in backward, is
    held as it is: compression stores only what the forward saves through its hooks."""
    # A frozen embedding (a LoRA fine-tune's) keeps no ids, and the first block's first norm no input,
    # which needs no gradient.
    ids = inputs(x) if first and not x.frozen_embedding else 0
    ends = ids + (head_and_loss(x) if last else 0)
    targets = 8 * x.b * x.s if last and not x.chunked_loss else 0  # saved by the loss, alive until the end
    kept_ids = ids + targets
    full, one, blocks = [block(x, moe) for moe in experts], block_input(x), len(experts)
    rerun = [block(x.plain, moe) for moe in experts]  # a block as its recomputation in backward saves it
    if first and x.frozen_embedding and blocks:  # and what its attention's columns save of it stays uncompressed
        below = norm(x) + column_inputs(x, x.columns(True), 1) - column_inputs(x.plain, x.columns(True), 1)
        full[0], rerun[0] = full[0] - below, rerun[0] - norm(x.plain)
    if recompute == "none" or blocks == 0:
        after = sum(full) + ends
        return after, after, after
    if recompute == "selective":
        after = sum(full) - blocks * attention_stats(x) + ends
        return after, after, after
    # autocast caches the copies of trained weights only: a frozen base's go with the block
    # (a dense block's float8 weight codes are saved tensors, which recomputation drops)
    copies = [0 if x.frozen or (x.float8 and not moe) else weight_copies(x, moe) for moe in experts]
    if recompute == "sqrt":  # each segment's input kept, its blocks rerun together
        segment = math.ceil(math.sqrt(blocks))
        kept = [one] * math.ceil(blocks / segment)
        during = sum(kept) + max(sum(rerun[i:i + segment]) for i in range(0, blocks, segment)) - one + kept_ids
        forward = sum(kept) + sum(copies) + max(in_flight(x.plain, moe) for moe in experts)
    else:
        every = 1 if recompute == "full" else int(recompute.split(":")[1])
        checkpointed = [i % every == 0 for i in range(blocks)]
        kept = [one if c else size for c, size in zip(checkpointed, full)]
        # In backward, block i reruns with the blocks before it still holding their share.
        during = max(sum(kept[:i]) + rerun[i] + kept_ids for i in range(blocks) if checkpointed[i])
        # In forward, a rerun block computes on what the blocks before it hold, with the copies so far.
        forward = max(sum(kept[:i + 1]) + sum(c for c, again in zip(copies[:i + 1], checkpointed) if again)
                      + in_flight(x.plain, experts[i]) for i in range(blocks) if checkpointed[i])
        copies = [c for c, again in zip(copies, checkpointed) if again]
    after = sum(kept) + ends
    forward = ids + max(forward, sum(kept) + sum(copies) + (head(x) if last else 0))
    return after, max(after, forward), max(after, during)


def weight_grad_inputs(x: Shape, experts: list[bool], last: bool) -> int:
    """What a split backward keeps from B to W (parallel/pipeline/weight_grad.py): the inputs of
    the linear layers whose weight gradient waits, attention and MLP projections and,
    unless sp computes them at once with their re-gathered input, the column layers and
    the head (a norm's column layers share one input, autocast's copy); of a mixture of experts,
    the experts' projections' and first layers' inputs, their rows."""
    m, rows = x.model, x.e * x.b * x.s
    attention = rows * x.width // x.tp + (0 if x.sp else column_inputs(x, x.attention_columns, 1))
    mlp = rows * m.ffn_hidden // x.tp + (0 if x.sp else column_inputs(x, m.ffn_inputs, 1))
    routed = x.e * x.assignments * (m.moe_hidden + (m.ffn_inputs if x.e < 4 else 1) * x.h)
    return sum(attention + (routed if moe else mlp) for moe in experts) + (rows * x.h if last and not x.sp else 0)


def schedule_peak(order: list, stage_bytes: dict[int, tuple[int, int, int, int]]) -> int:
    """The most saved bytes a rank holds while running ``order`` (its compute
    actions, one micro-batch each), with ``stage_bytes[stage]`` = `chunk_peak`
    and `weight_grad_inputs` of each of its stages: a forward's and a backward's
    peaks sit on top of what the other micro-batches hold, a forward leaves the
    chunk's bytes, and they go when its backward is complete; a split backward
    (zero bubble) keeps the weight gradients' inputs from B until W."""
    live = peak = 0
    for action in order:
        after, forward, during, kept = stage_bytes[action.stage]
        if action.kind == "F":
            peak = max(peak, live + forward)
            live += after
        elif action.kind in ("BW", "B"):
            peak = max(peak, live - after + during)
            live -= after if action.kind == "BW" else after - kept
        elif action.kind == "W":
            live -= kept
    return peak
