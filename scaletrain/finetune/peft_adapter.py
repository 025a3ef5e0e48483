"""A PEFT LoRA adapter folder, read back over its base: ``scaletrain finetune --from BASE --adapter DIR``.

The folder is what ``PeftModel.save_pretrained`` writes, and ``scaletrain export --format peft``
(job/export_peft.py) too: ``adapter_config.json`` and ``adapter_model.safetensors``, each adapted
module's ``base_model.model.<module>.lora_A.weight`` [r, d_in] and ``.lora_B.weight`` [d_out, r],
and each module trained whole beside them (``modules_to_save``) as ``base_model.model.<module>.weight``
(peft 0.21 saves its trained copy under the module's own name). PEFT's LoRA computes lora.py's
update, ``(alpha / r) x A^T B^T``, with A and B of the same shapes (a base weight stored
transposed, as by a Conv1D layer, changes neither), so the tensors cross as they are; what takes
care is which of our layers they belong to:

- The adapted modules are those PEFT adapts in the base, by PEFT's rules: ``target_modules`` as a
  list names a module by its full name or by its last parts, as a string it is a regular
  expression the full name must match; ``exclude_modules`` takes modules out the same way. A
  listed name that matches nothing adapts nothing, in PEFT as here.
- Each module is one of our layers through the family's Hugging Face names (``HFAdapter.names``,
  which export writes with), so a module the family does not name is no layer of the base.
- The run's ``--lora-targets`` are the family's Hugging Face names of those layers (its
  ``lora_hf_aliases``: ``q_proj,v_proj,o_proj``), each a kind of layer in every block. An adapter
  whose layers are no whole kinds (adapters in some blocks only) is refused, since the run could
  neither adapt that set nor save it again as it came.
- ``modules_to_save`` names modules by PEFT's rule for it (a module whose full name ends with a
  listed name): the token embedding and the output head train whole, as ``--lora-modules-to-save``
  has them, and any other module is refused. A head that the base ties to its embedding is one
  tensor here, so the adapter must have trained the two as one: the file holds it under both
  modules, equal (`_trained_whole`).
- Options that change what an adapter computes (DoRA, rsLoRA's alpha / sqrt(r), per-layer ranks
  or alphas, trained biases, adapters in some blocks only, initializations that rewrite the base)
  have no counterpart in our LoRA and are refused, as is a ``fan_in_fan_out`` that contradicts how
  the base stores the adapted layers, and any tensor whose shape is not its layer's (at rank r).

Everything is checked from the two files and the model (built on the meta device where a run is
only being set up) before anything is written, each refusal in one sentence.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import nn

from scaletrain.errors import UserError
from scaletrain.finetune.adapters import whole_parameters
from scaletrain.finetune.hf import READ_ERRORS, _json_object, _unreadable
from scaletrain.finetune.lora import ADAPTER_PARAMS, target_names
from scaletrain.models.spec import ModelSpec

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"

# The options that, set, make an adapter compute something our LoRA does not: what each does.
OTHER_THAN_LORA = {
    "use_dora": "DoRA's magnitude vectors",
    "use_rslora": "rsLoRA's scaling alpha / sqrt(r)",
    "layers_to_transform": "adapters in some blocks only",
    "layer_replication": "blocks repeated in the adapted model",
    "lora_bias": "a trained bias beside lora_B",
    "target_parameters": "adapters on parameters rather than layers",
    "trainable_token_indices": "trained rows of the embedding",
    "use_qalora": "QA-LoRA's pooled inputs",
    "alora_invocation_tokens": "adapters that act only after given tokens",
    "use_bdlora": "block-diagonal adapters",
    "arrow_config": "routing between several adapters",
    "kasa_config": "KaSA's singular values",
    "velora_config": "VeLoRA's compressed activations",
    "monteclora_config": "MonteCLoRA's sampled adapters",
}
# init_lora_weights values that start A and B as plain LoRA does, or from data, and leave the base
# as it is; the others (PiSSA, OLoRA, CorDA, LoftQ, ...) rewrite the base or the update.
PLAIN_INITS = (True, False, "gaussian", "eva", "orthogonal")


@dataclass(frozen=True)
class PeftAdapter:
    """What an adapter folder brings to a run: its settings as ours, and its tensors by our
    parameter names (``blocks.0.attn.q.lora_A``, ``tok_emb.weight``)."""

    rank: int
    alpha: float
    dropout: float
    targets: str  # the --lora-targets value whose layers the adapter adapts
    modules_to_save: str | None  # the --lora-modules-to-save value: the modules it trains whole, if any
    tensors: dict[str, torch.Tensor]


def hf_modules(family: ModelSpec, family_cfg: Any) -> dict[str, tuple[str, bool]]:
    """Each of our modules that holds a weight -> (its module in a Hugging Face folder, whether
    the folder stores its weight transposed)."""
    return {ours.removesuffix(".weight"): (name.removesuffix(".weight"), transposed)
            for name, (ours, transposed) in family.hf.names(family_cfg).items() if ours.endswith(".weight")}


def adapter_key(module: str, part: str | None) -> str:
    """The name PEFT saves ``part`` (lora_A or lora_B) of the adapter on ``module`` under, or with
    part ``None`` the weight of ``module`` trained whole."""
    return f"base_model.model.{module}.{part}.weight" if part else f"base_model.model.{module}.weight"


def whole_holders(model: nn.Module, family: ModelSpec, family_cfg: Any) -> dict[str, list[str]]:
    """Each parameter ``--lora-modules-to-save`` can train whole (by our name, a tied pair once) ->
    the modules of a Hugging Face folder that hold it: its own, and a tied head's beside an embedding's."""
    modules = hf_modules(family, family_cfg)
    copies: dict[str, list[str]] = {}
    for copy, original in family.hf.tied(family_cfg):
        copies.setdefault(original.removesuffix(".weight"), []).append(copy.removesuffix(".weight"))
    holders = {}
    for name in whole_parameters(model, family, ",".join(family.whole_modules)):
        module = modules[name.removesuffix(".weight")][0]
        holders[name] = [module, *copies.get(module, [])]
    return holders


def read_adapter(folder: Path, model: nn.Module, family: ModelSpec, family_cfg: Any) -> PeftAdapter:
    """The adapter in ``folder`` over ``model`` (the base, before any adapter is added; on the
    meta device, or with its weights), or one sentence on why it cannot continue there."""
    config_path, weights_path = _file(folder, CONFIG_FILE), _file(folder, WEIGHTS_FILE)
    config = _json_object(config_path)
    rank, alpha, dropout = _settings(config, folder)
    modules = hf_modules(family, family_cfg)
    chosen = _adapted(config, modules, folder)
    flipped = config.get("fan_in_fan_out", False)
    if {modules[layer][1] for layer in chosen} != {flipped}:
        raise UserError(f"{folder / CONFIG_FILE} sets fan_in_fan_out {str(flipped).lower()}, but the base does not "
                        f"store the adapted layers' weights {'transposed' if flipped else 'as [out, in]'}; the "
                        f"adapter was made for another model.")
    targets = _lora_targets(set(chosen), model, family, modules, folder)
    try:
        saved = load_file(weights_path)
    except READ_ERRORS as exc:
        raise _unreadable(weights_path, exc) from None
    whole = _trained_whole(config, whole_holders(model, family, family_cfg), modules, set(saved), folder)
    words = [next(word for word, module in family.whole_modules.items() if name == f"{module}.weight")
             for name in whole]
    return PeftAdapter(rank, alpha, dropout, targets, ",".join(words) or None,
                       _tensors(weights_path, saved, chosen, modules, model, rank, whole))


def _file(folder: Path, name: str) -> Path:
    if not (folder / name).is_file():
        raise UserError(f"--adapter {folder} holds no {name}; give the folder that PeftModel.save_pretrained "
                        f"(or scaletrain export --format peft) wrote, with {CONFIG_FILE} and {WEIGHTS_FILE}.")
    return folder / name


def _settings(config: dict, folder: Path) -> tuple[int, float, float]:
    """r, lora_alpha and lora_dropout, once the options that are no plain LoRA are refused."""
    where = folder / CONFIG_FILE
    if config.get("peft_type") != "LORA":
        raise UserError(f"{where} gives peft_type {config.get('peft_type')!r}; --adapter continues a LoRA "
                        f"adapter (peft_type LORA).")
    rank, alpha, dropout = config.get("r"), config.get("lora_alpha"), config.get("lora_dropout", 0.0)
    if not (isinstance(rank, int) and rank > 0 and isinstance(alpha, (int, float))
            and isinstance(dropout, (int, float)) and 0 <= dropout < 1):
        raise UserError(f"{where} gives r {rank!r}, lora_alpha {alpha!r} and lora_dropout {dropout!r}, where a "
                        f"LoRA adapter has a positive whole r, a number alpha and a dropout in [0, 1); restore "
                        f"the adapter's own file.")
    for option, what in OTHER_THAN_LORA.items():
        if config.get(option):
            raise UserError(f"{where} sets {option} ({what}), which scaletrain's LoRA does not compute; continue "
                            f"from an adapter saved without it.")
    if config.get("bias", "none") != "none":
        raise UserError(f"{where} sets bias {config['bias']!r}, training the base's biases beside the adapters, "
                        f"which scaletrain's LoRA keeps frozen; continue from an adapter saved with bias 'none'.")
    for option, value in (("rank_pattern", rank), ("alpha_pattern", alpha)):
        pattern = config.get(option) or {}
        if not isinstance(pattern, dict) or any(given != value for given in pattern.values()):
            raise UserError(f"{where} sets {option} {pattern}, a rank or alpha other than the adapter's own "
                            f"for some layers, where scaletrain's adapters share one; continue from an adapter "
                            f"without it.")
    init = config.get("init_lora_weights", True)
    if init not in PLAIN_INITS:
        raise UserError(f"{where} gives init_lora_weights {init!r}, which rewrites the base (or the update) "
                        f"when the adapter is made; continue from a plain LoRA adapter (PeftModel.save_pretrained's "
                        f"path_initial_model_for_weight_conversion turns a PiSSA, OLoRA, CorDA or LoRA-GA one "
                        f"into one).")
    return rank, float(alpha), float(dropout)


def targeted(pattern: str | list[str], module: str) -> bool:
    """PEFT's rule for ``target_modules``: a string is a regular expression of the whole name, a
    list names modules by their full name or its last dot-separated parts."""
    if isinstance(pattern, str):
        return re.fullmatch(pattern, module) is not None
    return any(module == name or module.endswith(f".{name}") for name in pattern)


def saved_whole(listed: list[str], module: str) -> bool:
    """PEFT's rule for ``modules_to_save``: the full name ends with a listed name."""
    return any(module.endswith(name) for name in listed)


def _adapted(config: dict, modules: dict[str, tuple[str, bool]], folder: Path) -> dict[str, str]:
    """Our layers that the adapter adapts -> their modules in the base, in the model's order."""
    where = folder / CONFIG_FILE
    targets, excluded = config.get("target_modules"), config.get("exclude_modules")
    for option, value in (("target_modules", targets), ("exclude_modules", excluded or [])):
        if isinstance(value, list) and all(isinstance(name, str) for name in value):
            continue
        if not isinstance(value, str):
            raise UserError(f"{where} gives {option} {value!r}, where PEFT takes a list of module names or one "
                            f"regular expression; restore the adapter's own file.")
        try:
            re.compile(value)
        except re.error as exc:
            raise UserError(f"{where} gives {option} {value!r}, which is no regular expression ({exc}); restore "
                            f"the adapter's own file.") from None
    chosen = {layer: module for layer, (module, _) in modules.items()
              if targeted(targets, module) and not (excluded and targeted(excluded, module))}
    if not chosen:
        raise UserError(f"{where} gives target_modules {targets!r}, which match no module of the base; the "
                        f"adapter was made for another model.")
    return chosen


def _lora_targets(chosen: set[str], model: nn.Module, family: ModelSpec, modules: dict[str, tuple[str, bool]],
                  folder: Path) -> str:
    """The --lora-targets value, in the folder's module names, whose layers are exactly ``chosen``,
    or one sentence on why none is."""
    kinds = {word: target_names(model, family.lora_layers([word])) for word in family.lora_hf_aliases}
    accepted = ", ".join(kinds)
    foreign = chosen - {layer for layers in kinds.values() for layer in layers}
    if foreign:
        names = dict.fromkeys(modules[layer][0].rsplit(".", 1)[-1] for layer in sorted(foreign))
        raise UserError(f"the adapter in {folder} adapts {', '.join(names)}, which is no layer scaletrain's LoRA "
                        f"adapts in this base; it adapts {accepted} (the token embedding and the head train whole "
                        f"with modules_to_save).")
    words, covered = [], set()
    for word, layers in kinds.items():  # each kind whole, in the family's order
        if set(layers) <= chosen and not set(layers) <= covered:
            words.append(word)
            covered.update(layers)
    # A layer without a Hugging Face name (a mixture's expert) is named as ours.
    missing = [modules[layer][0] if layer in modules else layer for layers in kinds.values()
               if (chosen - covered) & set(layers) for layer in layers if layer not in chosen]
    if missing:
        more = f" and {len(missing) - 2} more" if len(missing) > 2 else ""
        raise UserError(f"the adapter in {folder} adapts part of a kind of layer (it leaves out "
                        f"{', '.join(missing[:2])}{more}), where scaletrain adapts each kind in every block "
                        f"({accepted}); continue from an adapter whose target_modules hold whole kinds.")
    return ",".join(words)


def _trained_whole(config: dict, holders: dict[str, list[str]], modules: dict[str, tuple[str, bool]],
                   keys: set[str], folder: Path) -> dict[str, list[str]]:
    """The parameters the adapter trains whole (by our name) -> the folder's modules that hold each,
    from ``modules_to_save`` by PEFT's rule for it; one sentence for a module we do not train whole.

    A pair the base ties is one tensor to PEFT too where the file holds it under both modules (its
    ``ensure_weight_tying`` saves both; loading writes the head's into the weight the two share);
    under one alone, the other keeps the base's weight: apart, which we refuse."""
    where = folder / CONFIG_FILE
    listed = config.get("modules_to_save") or []
    if not (isinstance(listed, list) and all(isinstance(name, str) for name in listed)):
        raise UserError(f"{where} gives modules_to_save {listed!r}, where PEFT takes a list of module names; "
                        f"restore the adapter's own file.")
    held = {module for holding in holders.values() for module in holding}
    others = [module for module, _ in modules.values() if saved_whole(listed, module) and module not in held]
    if others:
        raise UserError(f"{where} sets modules_to_save {listed}, which trains {others[0]} whole, where scaletrain "
                        f"trains whole only the token embedding and the head (--lora-modules-to-save embed,head); "
                        f"continue from an adapter without it.")
    trained = {}
    for name, holding in holders.items():
        if not any(saved_whole(listed, module) for module in holding):
            continue
        present = [module for module in holding if adapter_key(module, None) in keys]
        if present and len(present) < len(holding):
            apart = next(module for module in holding if module not in present)
            raise UserError(f"the adapter in {folder} trains {present[0]} whole apart from {apart}, which the base "
                            f"ties to it, where scaletrain trains the two as one tensor; continue from an adapter "
                            f"that trained them tied (peft's ensure_weight_tying).")
        trained[name] = holding
    return trained


def _tensors(path: Path, saved: dict[str, torch.Tensor], chosen: dict[str, str], modules: dict[str, tuple[str, bool]],
             model: nn.Module, rank: int, whole: dict[str, list[str]]) -> dict[str, torch.Tensor]:
    """The adapter's A and B of every chosen layer, and the weights it trains whole, from ``saved`` (the
    file ``path``) by our parameter names, each shape checked (and a tied pair's two copies equal)."""
    wanted = {adapter_key(module, part): (layer, part) for layer, module in chosen.items() for part in ADAPTER_PARAMS}
    held = {adapter_key(module, None): name for name, holding in whole.items() for module in holding}
    for names, what in ((sorted((wanted.keys() | held.keys()) - saved.keys()), "lacks"),
                        (sorted(saved.keys() - wanted.keys() - held.keys()),
                         "holds tensors of no module it adapts, such as")):
        if names:
            raise UserError(f"{path} {what} {names[0]}; the adapter's two files do not belong together.")
    layers, params = dict(model.named_modules()), dict(model.named_parameters())
    shapes = {key: (modules[layer][0], (rank, layers[layer].in_features) if part == "lora_A"
                    else (layers[layer].out_features, rank), f" at r {rank}") for key, (layer, part) in wanted.items()}
    shapes.update({adapter_key(module, None): (module, tuple(params[name].shape), "")
                   for name, holding in whole.items() for module in holding})
    for key, (module, shape, at_rank) in shapes.items():
        if tuple(saved[key].shape) != shape:
            raise UserError(f"{path} holds {key} of shape {list(saved[key].shape)}, where the base's {module} "
                            f"takes {list(shape)}{at_rank}; the adapter was made for another model.")
    tensors = {f"{layer}.{part}": saved[key] for key, (layer, part) in wanted.items()}
    for name, holding in whole.items():
        first, *copies = (saved[adapter_key(module, None)] for module in holding)
        if any(not torch.equal(first, copy) for copy in copies):
            raise UserError(f"{path} holds different weights for {' and '.join(holding)}, which the base ties; "
                            f"scaletrain trains them as one tensor, so continue from an adapter that trained them "
                            f"tied (ensure_weight_tying).")
        tensors[name] = first
    return tensors
