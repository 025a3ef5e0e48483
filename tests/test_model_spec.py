"""The model spec is the only door to a family: no module outside models/ names one, every
family's spec is complete and self-consistent, and the GPT reads through it as it always did.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from scaletrain.config import ModelConfig
from scaletrain.finetune import peft_adapter
from scaletrain.finetune.lora import target_names
from scaletrain.models import FAMILIES, PRESETS, family_config, spec_for
from scaletrain.models.spec import StagePlan, tied_parameters

PACKAGE = Path(__file__).resolve().parents[1] / "scaletrain"
# Every family's name and its variants' (docs/models.md), as words in code, strings or prose.
FAMILY_WORDS = re.compile(r"gpt|llama|qwen|mistral|mixtral|smollm", re.IGNORECASE)


def test_no_module_outside_models_names_a_family():
    named = [f"{path.relative_to(PACKAGE.parent)}:{number}: {line.strip()}"
             for path in sorted(PACKAGE.rglob("*.py")) if "models" not in path.relative_to(PACKAGE).parts
             for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1)
             if FAMILY_WORDS.search(line)]
    assert named == [], "\n".join(named)


def test_the_grep_would_see_a_family_named_outside_models():
    assert FAMILY_WORDS.search("from scaletrain.models.gpt import GPT") and FAMILY_WORDS.search("a Llama folder")


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_every_preset_builds_on_the_meta_device_with_a_complete_spec(preset):
    family = spec_for(preset)
    cfg = family_config(ModelConfig(name=preset), 512, 64)
    with torch.device("meta"):
        model = family.build(cfg)
    names = dict(model.named_modules())
    assert isinstance(family.stages, StagePlan)
    stack = getattr(model, family.stages.stack)
    shape = family.shape(cfg)
    assert len(stack) == shape.n_layers
    assert all(name in names for name in (*family.stages.first, *family.stages.last))
    for pattern, _ in family.tensor_plan(cfg):  # every pattern of the plan finds its modules
        assert any(re.fullmatch(pattern.replace(".", r"\.").replace("*", r"[^.]+"), name) for name in names), pattern
    assert model.flops_per_token() > 6 * sum(p.numel() for n, p in model.named_parameters()
                                             if n.startswith(f"{family.stages.stack}.0.") and p.dim() == 2)
    hf_modules = {ours: hf for ours, (hf, _) in peft_adapter.hf_modules(family, cfg).items()}
    for word in family.lora_words():  # each names layers; a Hugging Face name, layers of that name
        layers = target_names(model, family.lora_layers([word]))
        assert layers, word
        if word in family.lora_hf_aliases:
            assert all(hf_modules[layer].endswith(f".{word}") for layer in layers if layer in hf_modules), word
    assert set(family.whole_modules.values()) <= set(names)


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.family)
def test_the_hugging_face_names_cover_every_weight_once(family):
    preset = next(iter(family.presets))
    # With biases: a folder's format has a place for each (a bias-free model exports zeros there).
    cfg = family_config(ModelConfig(name=preset, bias=True), 256, 32)
    with torch.device("meta"):
        model = family.build(cfg)
    ours = {our for our, _ in family.hf.names(cfg).values()}
    copies = {copy for copy, _ in tied_parameters(model)}
    assert ours == set(model.state_dict()) - copies
