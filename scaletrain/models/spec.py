"""The model spec: everything the rest of scaletrain may know about a model family.

A family (models/gpt.py, models/llama.py) is a plain ``nn.Module`` plus one
`ModelSpec` that describes it from the outside, in data:

    presets         named sizes (``--model llama-tiny``), each a set of ModelConfig values
    configure       the user's ModelConfig (flags over the preset) -> the family's own config
    build           that config -> the plain model, freshly initialized
    tensor_plan     which module becomes which tensor-parallel layer (`TensorPlan`)
    stages          how a pipeline cuts it (`StagePlan`); the stack's layers are the
                    model's blocks: ZeRO-3's units, recompute's and compile's units
    shape           the sizes the planner's memory, FLOP and traffic formulas read (`ModelShape`)
    position_modules  the modules that turn positions into embeddings or angles, which
                    context parallelism hands each rank's global positions
    hf              its Hugging Face adapter (`HFAdapter`): config.json and tensor names both ways
    lora_aliases    the ``--lora-targets`` words, each -> the layers it means, as patterns
    lora_hf_aliases the same for the Hugging Face module names PEFT users write (``q_proj``)
    whole_modules   the ``--lora-modules-to-save`` words, each -> the module trained whole
    check           refusals of a layout the family cannot take (GQA's kv heads under tp)

The trainer, the planner, parity, export, generate and finetune read the spec
and never a family's name (tests/test_model_spec.py greps for them). Adding a
family is one module here with its model and its spec, and one line in
``FAMILIES`` (models/__init__.py); docs/models.md walks through it.

The plan vocabulary lives here, not in parallel/, because a model declares
it: parallel/tensor.py and parallel/pipeline/ interpret it, and this package
imports nothing from them (models know nothing of parallelism).

FLOPs per token (`matmul_flops_per_token`): 6N + 12 * L * (a * d_head) * s
(Kaplan et al. 2020; PaLM, Chowdhery et al. 2022, appendix B). N counts the
weights of linear layers, each once (a head tied to the embedding is the
head's matmul; lookups are free), an expert's at top_k / E; the second term
is attention's QK^T and AV, 2 * s * (a * d_head) each per token and layer
forward, three times that with backward. Grouped-query attention shares keys
and values between query heads but scores every query head: the term counts
query heads.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import nn

# -- the tensor-parallel plan: (module path pattern, style) pairs -------------------


@dataclass(frozen=True)
class VocabEmbedding:
    """Rows split by vocabulary; the ranks' lookups summed (sp: reduce-scattered)."""


@dataclass(frozen=True)
class PositionEmbedding:
    """Replicated; under sp each rank looks up its own positions."""


@dataclass(frozen=True)
class Region:
    """A module whose input enters a tp region: f (sp: all-gather along the sequence)."""


@dataclass(frozen=True)
class Column:
    """Output features split; ``parts`` equal blocks along the output (a fused q, k, v) each split."""

    parts: int = 1


@dataclass(frozen=True)
class Row:
    """Input features split; the partial outputs summed: g (sp: reduce-scatter)."""


@dataclass(frozen=True)
class VocabHead:
    """Its own region: input made whole, rows split by vocabulary, logits left split
    for the vocabulary-parallel loss."""


TensorPlan = tuple[tuple[str, object], ...]


# -- the pipeline's cut ----------------------------------------------------------------


@dataclass(frozen=True)
class StagePlan:
    """How to cut a model: its stack of layers, the modules the first stage
    runs before it and the last stage after it, and the model's methods that
    run those two parts."""

    stack: str
    first: tuple[str, ...]
    last: tuple[str, ...]
    enter: str
    leave: str


# -- what the engine reads of a model -------------------------------------------------


@dataclass(frozen=True)
class ModelPlan:
    """How the engine (train/stepper.py) may split one model, in the plan vocabulary above. A
    family's spec makes one from its config (`ModelSpec.plan`); a user writes one for their own
    module (docs/library.md). Every part is optional: data parallelism, ZeRO, precision,
    accumulation, offload and local SGD need none.

    ``tensor``: tp/sp. ``blocks``: the attribute holding the repeated blocks (an
    ``nn.ModuleList``), ZeRO-3's units and recompute's and compile's (default: every layer of
    every ``ModuleList`` or ``Sequential``, parallel/zero.py). ``stages``: pp (its ``stack``
    is the blocks). ``width``: the features of what crosses a pipeline cut, ``[b, s, width]``.
    ``position_modules``: cp, the modules that take positions (the attention itself is
    models/decoder.py's ``CausalAttention``, which cp swaps for ring attention)."""

    tensor: TensorPlan = ()
    blocks: str | None = None
    stages: StagePlan | None = None
    width: int | None = None
    position_modules: tuple[str, ...] = ()

    @property
    def block_stack(self) -> str | None:
        """The attribute that holds the repeated blocks, if the plan names one."""
        return self.stages.stack if self.stages else self.blocks


# -- what the planner reads -----------------------------------------------------------


@dataclass(frozen=True)
class ModelShape:
    """A decoder's sizes as the planner's formulas read them (planner/activations.py, planner/traffic.py)."""

    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int  # = n_heads without grouped-query attention
    head_dim: int
    ffn_hidden: int  # the MLP's hidden width
    ffn_inputs: int  # matrices reading the block's input in the MLP: 1 (fc), 2 (SwiGLU's gate and up)
    vocab: int  # rows of the embedding and the head, padding included
    seq_len: int
    norm_with_mean: bool  # layer norm (mean and 1/std saved) or RMSNorm (1/rms only)
    learned_positions: bool  # a position embedding looked up on the first stage
    moe_experts: int = 0
    moe_top_k: int = 0
    moe_hidden: int = 0
    moe_every: int = 1

    def moe_in_block(self, index: int) -> bool:
        return self.moe_experts > 0 and index % self.moe_every == self.moe_every - 1


# -- Hugging Face folders ---------------------------------------------------------------


@dataclass(frozen=True)
class HFAdapter:
    """How a family reads and writes Hugging Face folders (finetune/hf.py does the files).

    ``config_from_hf(hf, where)``: a config.json (a dict, read from the file ``where``) ->
    ModelConfig values (every size given, ``name`` a preset of the family), or UserError with
    one sentence naming the field it cannot take. ``config_to_hf(cfg)``: the family's config ->
    the config.json transformers builds the same model from.
    ``names(cfg)``: every tensor of a ``*ForCausalLM`` file -> (our name, stored transposed);
    a file written by the bare base model lacks ``prefix`` on its names, and the reader adds it.
    ``tied(cfg)``: (hf copy, hf original) pairs one parameter of ours holds (a head tied to the
    embedding): a file may hold the copy, which must then equal the original.
    ``skipped(name)``: tensors some files carry that are no weights (GPT-2's causal masks)."""

    model_types: tuple[str, ...]
    prefix: str
    config_from_hf: Callable[[dict, Path], dict[str, Any]]
    config_to_hf: Callable[[Any], dict]
    names: Callable[[Any], dict[str, tuple[str, bool]]]
    tied: Callable[[Any], tuple[tuple[str, str], ...]]
    skipped: Callable[[str], bool] = lambda name: False
    reads_untyped: bool = False  # the family of the oldest folders, whose config.json names no model_type


# -- the spec -----------------------------------------------------------------------------


def _no_check(cfg: Any, tp: int) -> None:
    return None


@dataclass(frozen=True)
class ModelSpec:
    family: str
    presets: Mapping[str, Mapping[str, Any]]
    configure: Callable[..., Any]  # (ModelConfig, vocab_size, seq_len) -> the family's config
    build: Callable[[Any], nn.Module]
    tensor_plan: Callable[[Any], TensorPlan] | None
    stages: StagePlan | None
    shape: Callable[[Any], ModelShape] | None
    position_modules: tuple[str, ...] = ()  # path patterns of the modules that take positions
    hf: HFAdapter | None = None
    # A layer pattern names the linear layers whose dotted names end with it, ``*`` standing for
    # any one part: ``proj`` is every output projection, ``attn.proj`` the attention's alone.
    lora_aliases: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    lora_hf_aliases: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    whole_modules: Mapping[str, str] = field(default_factory=dict)
    check: Callable[[Any, int], None] = _no_check  # (family config, tp) -> None or UserError

    def plan(self, cfg: Any) -> ModelPlan:
        """The engine's plan for the model of family config ``cfg``."""
        return ModelPlan(tensor=self.tensor_plan(cfg) if self.tensor_plan else (), stages=self.stages,
                         width=self.shape(cfg).d_model if self.shape else None,
                         position_modules=self.position_modules)

    def lora_words(self) -> tuple[str, ...]:
        """The ``--lora-targets`` words: ours, then the Hugging Face module names."""
        return (*self.lora_aliases, *self.lora_hf_aliases)

    def lora_layers(self, targets: list[str]) -> list[str]:
        """``--lora-targets`` words -> the patterns of this family's layers they name."""
        aliases = {**self.lora_aliases, **self.lora_hf_aliases}
        return list(dict.fromkeys(pattern for word in targets for pattern in aliases[word]))


def matmul_flops_per_token(model: nn.Module, n_layers: int, attention_width: int, seq_len: int,
                           expert_share: float = 1.0) -> float:
    """Training FLOPs per token, 6N + 12 * L * (a * d_head) * s (the module docstring). N: the
    2-D parameters, each once, but for an embedding's table that no linear layer shares."""
    linear = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)}
    lookup_only = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)} - linear
    matmul = sum(p.numel() * (expert_share if ".experts." in name else 1.0)
                 for name, p in model.named_parameters() if p.dim() == 2 and id(p) not in lookup_only)
    return 6 * matmul + 12 * n_layers * attention_width * seq_len


def tied_parameters(model: nn.Module) -> tuple[tuple[str, str], ...]:
    """(copy, original) for every parameter the model holds under a second name (a head tied
    to the token embedding): ``state_dict`` gives both names, one tensor."""
    first: dict[int, str] = {}
    ties = []
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            ties.append((name, first[id(param)]))
        first.setdefault(id(param), name)
    return tuple(ties)
