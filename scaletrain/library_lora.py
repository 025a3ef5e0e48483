"""LoRA adapters for `scaletrain.setup`: ``setup(model, lora_rank=8, lora_alpha=16)`` freezes a
user's model and trains low-rank adapters beside its linear layers, as ``scaletrain finetune
--lora-rank`` does (Hu et al. 2022, "LoRA: Low-Rank Adaptation of Large Language Models"):

    y = x W^T + (alpha / r) * dropout(x) A^T B^T,     W frozen;  A: r x d_in, B: d_out x r trained

The adapters are finetune/lora.py's `LoRALinear`, put in by its `apply_lora` before any parallel
transform sees the model, as the command's (finetune/adapters.py) are: ZeRO shards the frozen base and
the adapters' optimizer state, tensor parallelism splits each adapter with its base
(`LoRALinear.split_with_base`), and the optimizer steps what requires a gradient only (train/layout.py).
``B`` starts at zero, so the adapted model starts as the model given; ``A`` is drawn for the engine's
``seed`` and each layer's name (lora.py's `initial_a`), as the command draws it, and rank 0's reaches
every rank with its weights.

Which layers: ``lora_targets`` names them as PEFT's ``target_modules`` list does (lora.py's `matches`):
a module's last name or names (``q_proj``, ``self_attn.o_proj``), ``*`` standing for any one part, in
a string separated by commas or in a list. Without it (None), the layers the model's tensor plan splits as
Column or Row: for the transformers classes with a ready plan (models/hf_plans.py), the
attention's q, k, v, o and the MLP's gate, up, down projections (PEFT's ``all-linear`` but the head);
for a model given with a plan, that plan's. A model with neither must name its layers.

Refused before any work, one sentence each: a negative rank; LoRA's other options without a rank; a
dropout outside [0, 1); a name that matches no linear layer; under tp, an adapter on a layer the
plan splits by vocabulary (an adapter splits only as a Column or a Row does); a model that holds
adapters already (an earlier setup put them in). setup's own refusals after the adapters are in (a
plan, the memory gate) take them out again, so that no refusal leaves the user's model changed.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable
from typing import Any

from torch import nn

from scaletrain.config import FinetuneConfig
from scaletrain.errors import UserError
from scaletrain.finetune.lora import adapters, apply_lora, target_names
from scaletrain.models.spec import Column, ModelPlan, Row, VocabHead

# The fields of scaletrain finetune that setup() takes; the others (--from, --quantize, --adapter,
# --lora-modules-to-save) read a base or a family's module words that a user's model does not have.
LORA_OPTIONS = ("lora_rank", "lora_alpha", "lora_dropout", "lora_targets")


def spelled_as_option(options: dict[str, Any]) -> dict[str, Any]:
    """``options`` with a list of ``lora_targets`` written as the command's flag is, one string."""
    targets = options.get("lora_targets")
    if isinstance(targets, (list, tuple)) and all(isinstance(name, str) for name in targets):
        return {**options, "lora_targets": ",".join(targets)}
    return options


def plan_targets(model: nn.Module, plan: ModelPlan | None) -> list[str]:
    """The layers ``plan`` splits as Column or Row, by name: the default targets (module docstring)."""
    patterns = [pattern for pattern, style in (plan.tensor if plan else ()) if isinstance(style, (Column, Row))]
    return [name for name, _ in model.named_modules() if any(fnmatch.fnmatchcase(name, p) for p in patterns)]


def add_library_adapters(model: nn.Module, finetune: FinetuneConfig, given: dict[str, Any],
                         plan: ModelPlan | None, tp: int, seed: int = 0) -> Callable[[], None]:
    """With ``lora_rank``: freeze ``model`` and put an adapter beside each target layer (module
    docstring; ``A`` drawn for ``seed``, the engine's); ``given``: the options as the user wrote them.
    What takes the adapters out again and lets train what trained before, so that a refusal after
    this leaves the user's model as it came."""
    trained = {param: param.requires_grad for param in model.parameters()}
    names = _adapt(model, finetune, given, plan, tp, seed)

    def take_out() -> None:
        for name in names:
            parent, _, child = name.rpartition(".")
            holder = model.get_submodule(parent)
            setattr(holder, child, getattr(holder, child).base)
        for param, flag in trained.items():
            param.requires_grad_(flag)

    return take_out


def _adapt(model: nn.Module, finetune: FinetuneConfig, given: dict[str, Any], plan: ModelPlan | None,
           tp: int, seed: int) -> list[str]:
    """The adapters put in, refused first where they cannot work (module docstring); their layers' names."""
    f = finetune
    if f.lora_rank < 0:
        raise UserError(f"lora_rank={f.lora_rank} must be a rank of at least 1 (or 0: no adapters, every weight "
                        f"trains); give lora_rank=8, say.")
    if not f.lora_rank:
        stray = [name for name in LORA_OPTIONS[1:] if given.get(name) is not None]
        if stray:
            raise UserError(f"{', '.join(stray)} set{'s' if len(stray) == 1 else ''} LoRA's adapters, which "
                            f"lora_rank=0 leaves out (every weight trains); give lora_rank=8, say, or drop "
                            f"{', '.join(stray)}.")
        return []
    if not 0 <= f.lora_dropout < 1:
        raise UserError(f"lora_dropout={f.lora_dropout} is the probability of zeroing an adapter's input, which "
                        f"must be at least 0 and below 1; give lora_dropout=0.05, say.")
    if adapters(model):
        raise UserError("the model holds LoRA adapters already (an earlier setup put them in beside its frozen "
                        "weights); build the model again for new adapters, or drop lora_rank to train those.")
    if given.get("lora_targets") is not None:
        words = [word.strip() for word in f.lora_targets.split(",")]
        targets = check_words(model, words)
    else:
        targets = plan_targets(model, plan)
        if not targets:
            raise UserError(f"lora_rank={f.lora_rank} puts adapters beside linear layers, and the model has no plan "
                            f"that names its projections (the transformers classes of models/hf_plans.py have one ready); "
                            f"name them, as model.named_modules() does: lora_targets='q_proj,v_proj', say.")
    check_splits(model, targets, plan, tp)
    return apply_lora(model, targets, f.lora_rank, f.lora_alpha, f.lora_dropout, seed)


def check_words(model: nn.Module, words: list[str]) -> list[str]:
    """``lora_targets``' names, each matching a linear layer (one sentence for the first that does not)."""
    linear = [name for name, module in model.named_modules() if hasattr(module, "in_features")]
    for word in words:
        if not word or not target_names(model, [word]):
            known = ", ".join(sorted({name.rpartition(".")[2] for name in linear})) or "none"
            named = repr(word) if word else "an empty name"
            raise UserError(f"lora_targets names {named}, which matches no linear layer of the "
                            f"model by its last names (model.named_modules()); the linear layers' last names are: "
                            f"{known}.")
    return words


def check_splits(model: nn.Module, targets: list[str], plan: ModelPlan | None, tp: int) -> None:
    """Under tp, one sentence for a target the plan splits by vocabulary: its output's rows, with no
    Column's or Row's rule for its adapter (finetune/lora.py)."""
    if tp == 1 or plan is None:
        return
    for name in target_names(model, targets):
        style = next((style for pattern, style in plan.tensor if fnmatch.fnmatchcase(name, pattern)), None)
        if isinstance(style, VocabHead):
            raise UserError(f"lora_targets adapts {name!r}, which tp={tp} splits by vocabulary, while an adapter "
                            f"splits only beside a Column or Row layer; leave it out of lora_targets, or set tp=1.")
