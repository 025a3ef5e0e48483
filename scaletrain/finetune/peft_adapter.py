"""A PEFT LoRA adapter folder, read back over its base: ``scaletrain finetune --from BASE --adapter DIR``.

The folder is what ``PeftModel.save_pretrained`` writes, and ``scaletrain export --format peft``
(job/export_peft.py) too: ``adapter_config.json`` and ``adapter_model.safetensors``, each adapted
module's ``base_model.model.<module>.lora_A.weight`` [r, d_in] and ``.lora_B.weight`` [d_out, r].
PEFT's LoRA computes lora.py's update, ``(alpha / r) x A^T B^T``, with A and B of the same
shapes (a base weight stored transposed, as by a Conv1D layer, changes neither), so the tensors
cross as they are; what takes care is which of our layers they belong to:

- The adapted modules are those PEFT adapts in the base, by PEFT's rules: ``target_modules`` as a
  list names a module by its full name or by its last parts, as a string it is a regular
  expression the full name must match; ``exclude_modules`` takes modules out the same way. A
  listed name that matches nothing adapts nothing, in PEFT as here.
- Each module is one of our layers through the family's Hugging Face names (``HFAdapter.names``,
  which export writes with), so a module the family does not name is no layer of the base.
- A ``--lora-targets`` word stands for a kind of layer in every block: a group (the family's
  ``lora_aliases``: a fused attention input, or its three inputs apart; both of a block's output
  projections, which share one name) or one layer of a group by its own name (``q``, ``v``: PEFT's
  common q_proj, v_proj). An adapter continues where its layers are whole kinds, which give the
  run's ``--lora-targets``, groups where whole; any other set (one of the two output projections,
  some blocks only) is refused, since the run could neither adapt it nor save it again as it came.
- Options that change what an adapter computes (DoRA, rsLoRA's alpha / sqrt(r), per-layer ranks
  or alphas, trained biases, modules trained whole beside it, adapters in some blocks only,
  initializations that rewrite the base) have no counterpart in our LoRA and are refused, as is a
  ``fan_in_fan_out`` that contradicts how the base stores the adapted layers, and any tensor whose
  shape is not its layer's at rank r.

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
from scaletrain.finetune.hf import READ_ERRORS, _json_object, _unreadable
from scaletrain.finetune.lora import ADAPTER_PARAMS, target_names
from scaletrain.models.spec import ModelSpec

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"

# The options that, set, make an adapter compute something our LoRA does not: what each does.
OTHER_THAN_LORA = {
    "use_dora": "DoRA's magnitude vectors",
    "use_rslora": "rsLoRA's scaling alpha / sqrt(r)",
    "modules_to_save": "modules trained whole beside the adapters",
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
    ``state_dict`` keys (``blocks.0.attn.q.lora_A``)."""

    rank: int
    alpha: float
    dropout: float
    targets: str  # the --lora-targets value whose layers the adapter adapts
    tensors: dict[str, torch.Tensor]


def hf_modules(family: ModelSpec, family_cfg: Any) -> dict[str, tuple[str, bool]]:
    """Each of our modules that holds a weight -> (its module in a Hugging Face folder, whether
    the folder stores its weight transposed)."""
    return {ours.removesuffix(".weight"): (name.removesuffix(".weight"), transposed)
            for name, (ours, transposed) in family.hf.names(family_cfg).items() if ours.endswith(".weight")}


def adapter_key(module: str, part: str) -> str:
    """The name PEFT saves ``part`` (lora_A or lora_B) of the adapter on ``module`` under."""
    return f"base_model.model.{module}.{part}.weight"


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
    return PeftAdapter(rank, alpha, dropout, targets, _tensors(weights_path, chosen, modules, model, rank))


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


def _matches(pattern: str | list[str], module: str) -> bool:
    """PEFT's rule: a string is a regular expression of the whole name, a list names modules by
    their full name or its last dot-separated parts."""
    if isinstance(pattern, str):
        return re.fullmatch(pattern, module) is not None
    return any(module == name or module.endswith(f".{name}") for name in pattern)


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
              if _matches(targets, module) and not (excluded and _matches(excluded, module))}
    if not chosen:
        raise UserError(f"{where} gives target_modules {targets!r}, which match no module of the base; the "
                        f"adapter was made for another model.")
    return chosen


def _short(modules: dict[str, tuple[str, bool]], kinds: set[str]) -> str:
    """The last parts of the base's module names for our layers of these kinds (``q_proj``)."""
    names = (module.rsplit(".", 1)[-1] for layer, (module, _) in modules.items() if layer.rsplit(".", 1)[-1] in kinds)
    return ", ".join(dict.fromkeys(names))  # each once, in the model's order


def _lora_targets(chosen: set[str], model: nn.Module, family: ModelSpec, modules: dict[str, tuple[str, bool]],
                  folder: Path) -> str:
    """The --lora-targets value whose layers are exactly ``chosen``, or one sentence on why none is."""
    aliases = family.lora_aliases
    groups = "; ".join(f"{word}: {_short(modules, set(names))}" for word, names in aliases.items())
    foreign = chosen - set(target_names(model, family.lora_layers(list(aliases))))
    if foreign:
        names = dict.fromkeys(modules[layer][0].rsplit(".", 1)[-1] for layer in sorted(foreign))
        raise UserError(f"the adapter in {folder} adapts {', '.join(names)}, which is no layer scaletrain's LoRA "
                        f"adapts in this base; it adapts the layers of --lora-targets ({groups}).")
    kinds = {layer.rsplit(".", 1)[-1] for layer in chosen}
    groups_whole = [word for word, names in aliases.items() if set(names) <= kinds]
    grouped = {name for word in groups_whole for name in aliases[word]}
    words = groups_whole + [word for word in family.lora_words() if word in kinds - grouped]
    # A layer without a Hugging Face name (a mixture's expert) is named as ours.
    missing = [modules[layer][0] if layer in modules else layer
               for layer in target_names(model, family.lora_layers(words)) if layer not in chosen]
    if missing:
        more = f" and {len(missing) - 2} more" if len(missing) > 2 else ""
        raise UserError(f"the adapter in {folder} adapts part of a kind of layer (it leaves out "
                        f"{', '.join(missing[:2])}{more}), where scaletrain adapts each kind in every block, a "
                        f"group whole ({groups}) or a layer of one by its own name; continue from an adapter whose "
                        f"target_modules hold whole kinds.")
    return ",".join(words)


def _tensors(path: Path, chosen: dict[str, str], modules: dict[str, tuple[str, bool]], model: nn.Module,
             rank: int) -> dict[str, torch.Tensor]:
    """The adapter's A and B of every chosen layer by our state_dict keys, each shape checked."""
    try:
        saved = load_file(path)
    except READ_ERRORS as exc:
        raise _unreadable(path, exc) from None
    wanted = {adapter_key(module, part): (layer, part) for layer, module in chosen.items() for part in ADAPTER_PARAMS}
    for names, what in ((sorted(wanted.keys() - saved.keys()), "lacks"),
                        (sorted(saved.keys() - wanted.keys()), "holds tensors of no module it adapts, such as")):
        if names:
            raise UserError(f"{path} {what} {names[0]}; the adapter's two files do not belong together.")
    layers = dict(model.named_modules())
    tensors = {}
    for key, (layer, part) in wanted.items():
        linear = layers[layer]
        shape = (rank, linear.in_features) if part == "lora_A" else (linear.out_features, rank)
        if tuple(saved[key].shape) != shape:
            raise UserError(f"{path} holds {key} of shape {list(saved[key].shape)}, where the base's "
                            f"{modules[layer][0]} takes {list(shape)} at r {rank}; the adapter was made for "
                            f"another model.")
        tensors[f"{layer}.{part}"] = saved[key]
    return tensors
