"""Tensor-parallel plans as a user meets them: a Region on a block called by keyword, plans that
would train with wrong gradients refused before any work, and transformers' Llama, Qwen2 and
Mistral causal LMs split with no plan written (models/hf_plans.py), each against one process."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import scaletrain
from scaletrain import Column, ModelPlan, Region, Row, UserError, VocabEmbedding, VocabHead
from scaletrain.config import ModelConfig
from scaletrain.library_checks import check_plan, engine_config
from scaletrain.models import PRESETS, family_config, spec_for
from scaletrain.parallel.tensor_plan_checks import check_tensor_plan
from scaletrain.runtime.spawn import spawn_local

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from transformer import PLAN, Transformer  # noqa: E402  (the example's own model and plan)

# -- a block its parent calls by keyword -------------------------------------------------------

class Mixer(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return self.down(torch.tanh(self.up(x))) * scale


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.norm, self.attn = nn.LayerNorm(d), Mixer(d)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.attn(x=self.norm(h), scale=0.5)  # the input by keyword, as transformers calls its blocks


class KeywordNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.blocks = nn.ModuleList(Block(16) for _ in range(2))
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


KEYWORD_PLAN = (("blocks.*.attn", Region()), ("blocks.*.attn.up", Column()), ("blocks.*.attn.down", Row()))


def keyword_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    return torch.randn(8, 8, generator=generator), torch.randint(0, 4, (8,), generator=generator)


def mean_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, targets)


def test_a_region_on_a_block_called_by_keyword_equals_one_process():
    report = scaletrain.check_parity(KeywordNet, keyword_batch, mean_cross_entropy, nproc=2, steps=2, lr=0.05,
                                     warmup_steps=1, plan=ModelPlan(tensor=KEYWORD_PLAN), tp=2)
    assert report.passed, scaletrain.format_parity(report)


# -- plans that would give wrong gradients -------------------------------------------------------

@pytest.mark.parametrize("tensor, words", [
    (KEYWORD_PLAN + (("blocks.*.attn", Column()),),
     "entries 'blocks.*.attn' (Region) and 'blocks.*.attn' (Column) both match the module 'blocks.0.attn', "
     "overlapping or contradictory styles on one module"),
    (KEYWORD_PLAN + (("blocks.0.attn.up", Column()),), "overlapping or contradictory styles on one module"),
    (KEYWORD_PLAN[1:], "the plan's Column 'blocks.0.attn.up' is inside no Region"),
    (KEYWORD_PLAN + (("head", Row()),), "the plan's Row 'head' is inside no Region"),
    (KEYWORD_PLAN[:2], "the plan's Region 'blocks.0.attn' holds no Row, so the region is never left"),
    ((("blocks.0", Region()),) + KEYWORD_PLAN,
     "the plan's Region 'blocks.0.attn' enters a region inside the Region 'blocks.0'"),
    ((("blocks.1", Region()), ("blocks.1.attn.up", Column()), ("blocks.1.attn.down", Row()),
      ("blocks.1.norm", VocabHead())),
     "the plan's VocabHead 'blocks.1.norm' enters a region inside the Region 'blocks.1'"),
], ids=["contradictory", "overlapping", "column-outside", "row-outside", "region-without-row", "nested",
        "head-inside"])
def test_a_plan_that_would_give_wrong_gradients_is_refused_before_any_work(tensor, words):
    with pytest.raises(UserError, match=words.replace("*", r"\*").replace(".", r"\.").replace("(", r"\(")
                       .replace(")", r"\)")):
        scaletrain.setup(KeywordNet(), plan=ModelPlan(tensor=tensor))


def test_the_refusal_comes_before_the_layout_is_joined():
    cfg = engine_config({"tp": 2})
    with pytest.raises(UserError, match="holds no Row"):
        check_plan(KeywordNet(), ModelPlan(tensor=KEYWORD_PLAN[:2]), cfg.parallel.mesh_dims(2), cfg, None, None)


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_the_built_in_plans_pass_the_checks(preset):
    family = spec_for(preset)
    cfg = family_config(ModelConfig(name=preset), 512, 64)
    with torch.device("meta"):
        check_tensor_plan(family.build(cfg), family.plan(cfg).tensor)


def test_the_example_plan_passes_the_checks():
    check_tensor_plan(Transformer(layers=2, seq=16), PLAN.tensor)
    assert isinstance(dict(PLAN.tensor)["tok"], VocabEmbedding)  # embeddings and the head need no Region


# -- transformers' causal LMs with no plan written --------------------------------------------------

VOCAB = 101  # split unevenly over 2 ranks


def _sizes(**extra) -> dict:
    return dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, **extra)


def hf_llama() -> nn.Module:
    import transformers

    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**_sizes()))


def hf_qwen2_tied() -> nn.Module:
    import transformers

    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**_sizes(tie_word_embeddings=True)))


def hf_mistral() -> nn.Module:
    import transformers

    return transformers.MistralForCausalLM(transformers.MistralConfig(**_sizes()))


def token_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, VOCAB, (8, 17), generator=torch.Generator().manual_seed(step))
    return tokens[:, :-1], tokens[:, 1:]


@pytest.mark.parametrize("make_model, nproc, options", [
    pytest.param(hf_llama, 2, dict(tp=2), marks=pytest.mark.slow),  # within llama-tp2-sp
    # the tied head split once: the ready plan's check below; a split transformers model's parity: llama-tp2-sp
    pytest.param(hf_qwen2_tied, 2, dict(tp=2), marks=pytest.mark.slow),
    pytest.param(hf_mistral, 2, dict(tp=2), marks=pytest.mark.slow),  # Llama's architecture under a third name
    (hf_llama, 2, dict(tp=2, sp=True)),
    pytest.param(hf_llama, 4, dict(tp=2, zero=3), marks=pytest.mark.slow),
], ids=["llama-tp2", "qwen2-tied-tp2", "mistral-tp2", "llama-tp2-sp", "llama-tp2-dp2-zero3"])
def test_a_transformers_model_splits_with_no_plan_and_equals_one_process(make_model, nproc, options):
    pytest.importorskip("transformers")
    report = scaletrain.check_parity(make_model, token_batch, nproc=nproc, steps=2, lr=3e-3, warmup_steps=1,
                                     **options)
    assert report.passed, scaletrain.format_parity(report)


def test_the_ready_plan_covers_the_three_classes_and_nothing_else():
    pytest.importorskip("transformers")
    from scaletrain.models.hf_plans import ready_plan

    for make_model in (hf_llama, hf_qwen2_tied, hf_mistral):
        model = make_model()
        check_tensor_plan(model, ready_plan(model, 2, False).tensor)
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    tied = hf_qwen2_tied()
    assert tied.lm_head.weight is tied.model.embed_tokens.weight  # one weight, sharded once (parallel/tensor.py)
    assert ready_plan(nn.Linear(2, 2), 2, False) is None and ready_plan(Transformer(layers=1), 2, True) is None


def test_sequence_parallel_refuses_what_builds_a_mask_of_the_sequence():
    transformers = pytest.importorskip("transformers")
    from scaletrain.models.hf_plans import ready_plan

    eager = transformers.LlamaForCausalLM(transformers.LlamaConfig(**_sizes(), attn_implementation="eager"))
    with pytest.raises(UserError, match=r"sp=True needs an attention that builds no mask .* uses 'eager'"):
        ready_plan(eager, 2, True)
    model = hf_llama()
    ready_plan(model, 2, True)
    ids = token_batch(0)[0]
    with pytest.raises(UserError, match=r"sp=True splits the sequence before the decoder builds its mask"):
        model(ids, attention_mask=torch.ones_like(ids))
    model(ids)  # positions from the ids: the forward of one process
    windowed = transformers.MistralForCausalLM(transformers.MistralConfig(**_sizes(sliding_window=ids.shape[1])))
    ready_plan(windowed, 2, True)
    with pytest.raises(UserError, match=r"sp=True meets sequences of 16 positions, which the model's sliding window"):
        windowed(ids)


def _refusals() -> list[str]:
    import transformers

    said = []
    for make_model, options in ((hf_llama, dict(pp=2)),
                                (lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
                                    **{**_sizes(), "num_attention_heads": 6, "num_key_value_heads": 3,
                                       "hidden_size": 48})), dict(tp=2))):
        try:
            scaletrain.setup(make_model(), **options)
        except UserError as refusal:
            said.append(str(refusal))
    return said


def test_what_a_transformers_model_cannot_take_is_refused_in_one_sentence():
    pytest.importorskip("transformers")
    pipeline, heads = spawn_local(2, _refusals, ())[0]
    assert pipeline.startswith("pp=2 needs a plan with stages and width")
    assert heads.startswith("tp=2 must divide the LlamaForCausalLM's 6 attention heads and 3 key-value heads")
