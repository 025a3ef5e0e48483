"""Hugging Face model folders in: config.json, the weights, the tokenizer.

A folder as ``save_pretrained`` writes it, or as a user downloads it from the
Hub, holds ``config.json``, the weights and the tokenizer. The weights are
one ``model.safetensors``, or shards listed by ``model.safetensors.index.json``
(its ``weight_map``: tensor name -> file), or an old ``pytorch_model.bin``
(read with ``torch.load(weights_only=True)``, which unpickles tensors and
plain containers only, never code). The tokenizer is ``tokenizer.json``, or a
byte-level BPE's ``vocab.json`` with ``merges.txt``. Nothing is fetched: the
folder must hold everything, and transformers is not needed.

config.json's ``model_type`` picks the family (models/__init__.py, the
specs' adapters); the family turns the config into our ModelConfig values,
refusing in one sentence what it cannot compute, and maps every tensor name
to ours (models/spec.py, ``HFAdapter``). Everything is checked from the small
files and the safetensors headers before a run writes anything: the names a
config calls for, each shape against the model built on the meta device.
"""

from __future__ import annotations

import json
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from tokenizers import Tokenizer

from scaletrain.data.tokenizer import BPETokenizer, TokenizerConfig
from scaletrain.errors import UserError
from scaletrain.models import family_config, spec_of_hf
from scaletrain.models.spec import ModelSpec, tied_parameters

CONFIG = "config.json"
SINGLE, INDEX, PICKLED = "model.safetensors", "model.safetensors.index.json", "pytorch_model.bin"
READ_ERRORS = (OSError, SafetensorError, RuntimeError, EOFError, pickle.UnpicklingError)


def _reason(exc: BaseException) -> str:
    """The first line of a library's error message, to fit in one sentence."""
    return (str(exc).splitlines() or [type(exc).__name__])[0]


def is_hf_folder(path: Path) -> bool:
    """A Hugging Face model folder: it has a config.json (our run folders have config.toml)."""
    return (Path(path) / CONFIG).is_file()


def read_config_json(folder: Path) -> dict:
    return _json_object(folder / CONFIG)


@dataclass(frozen=True)
class HFModel:
    """A folder's model as scaletrain sees it: its family, ModelConfig values and the family's config."""

    folder: Path
    spec: ModelSpec
    values: dict[str, Any]  # ModelConfig fields: the architecture, every size given

    def family_cfg(self, model_cfg, seq_len: int | None = None) -> Any:
        """The family's config for a run's ModelConfig (the folder's values in it); ``seq_len``
        defaults to the folder's positions."""
        return family_config(model_cfg, self.values["n_vocab"], seq_len or self.values["n_positions"])


def read_hf_model(folder: Path) -> HFModel:
    """The family and ModelConfig values of the model in ``folder``, or one sentence on what is wrong."""
    folder = Path(folder)
    if not folder.is_dir():
        raise UserError(f"{folder} is not a folder; give the folder holding the model's config.json.")
    if not is_hf_folder(folder):
        raise UserError(f"{folder} has no config.json; give a Hugging Face model folder as save_pretrained "
                        f"writes it.")
    hf = read_config_json(folder)
    model_type = hf.get("model_type")  # the oldest files name none: their family says it reads them
    spec = spec_of_hf(model_type) if model_type is None or isinstance(model_type, str) else None
    if spec is None:
        from scaletrain.models import FAMILIES

        known = ", ".join(t for family in FAMILIES if family.hf for t in family.hf.model_types)
        raise UserError(f"{folder / CONFIG} gives model_type {model_type!r}, which scaletrain does not read; "
                        f"it reads {known}.")
    return HFModel(folder, spec, spec.hf.config_from_hf(hf, folder / CONFIG))


# -- where the tensors are -----------------------------------------------------------------


def weight_files(folder: Path) -> dict[str, Path]:
    """Every tensor name in the folder -> the file holding it (one file, or an index's shards)."""
    if (folder / SINGLE).is_file():
        return dict.fromkeys(_names_in(folder / SINGLE), folder / SINGLE)
    if (folder / INDEX).is_file():
        try:
            weight_map = json.loads((folder / INDEX).read_text(encoding="utf-8"))["weight_map"]
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as exc:
            raise UserError(f"{folder / INDEX} cannot be read as a weight index ({_reason(exc)}); download "
                            f"it again.") from None
        files = {name: folder / file for name, file in weight_map.items()}
        missing = sorted({str(path.name) for path in files.values() if not path.is_file()})
        if missing:
            raise UserError(f"{folder / INDEX} lists the shard {missing[0]}, which the folder lacks; download "
                            f"it again.")
        return files
    if (folder / PICKLED).is_file():
        return dict.fromkeys(_pickled(folder / PICKLED), folder / PICKLED)
    raise UserError(f"{folder} holds no {SINGLE} (nor {INDEX}, nor {PICKLED}); copy the model's weights into it.")


def _unreadable(source: Path, exc: BaseException) -> UserError:
    return UserError(f"{source} cannot be read ({_reason(exc)}); download it again.")


def _names_in(source: Path) -> list[str]:
    try:
        with safe_open(source, framework="pt") as f:
            return list(f.keys())
    except READ_ERRORS as exc:
        raise _unreadable(source, exc) from None


def _pickled(source: Path) -> dict[str, torch.Tensor]:
    try:
        tensors = torch.load(source, map_location="cpu", weights_only=True)
    except READ_ERRORS as exc:
        raise _unreadable(source, exc) from None
    if not isinstance(tensors, dict) or not all(isinstance(t, torch.Tensor) for t in tensors.values()):
        raise UserError(f"{source} holds no mapping of names to tensors; download it again.")
    return tensors


class TensorReader:
    """Reads a folder's tensors by name, whole or in slices, one file open at a time;
    pickled weights are loaded once, whole (their format has no random access).
    ``files``: our name for a tensor -> (the file, the name the file gives it)."""

    def __init__(self, files: dict[str, tuple[Path, str]]):
        self.files = files
        self._pickled: dict[Path, dict[str, torch.Tensor]] = {}
        self.bytes_read = 0  # what the reads returned: a rank's share, for a slice-by-slice load

    def _pickle(self, source: Path) -> dict[str, torch.Tensor]:
        if source not in self._pickled:
            self._pickled[source] = _pickled(source)
        return self._pickled[source]

    def shape(self, name: str) -> tuple[int, ...]:
        source, name = self.files[name]
        if source.suffix != ".safetensors":
            return tuple(self._pickle(source)[name].shape)
        try:
            with safe_open(source, framework="pt") as f:
                return tuple(f.get_slice(name).get_shape())
        except READ_ERRORS as exc:
            raise _unreadable(source, exc) from None

    def read(self, name: str, index: tuple[slice, ...] = ()) -> torch.Tensor:
        """The tensor ``name``, or its part ``index`` (slices per leading dimension), read alone."""
        source, name = self.files[name]
        if source.suffix != ".safetensors":
            tensor = self._pickle(source)[name][index]
        else:
            try:
                with safe_open(source, framework="pt") as f:
                    # A copy of its own: what safetensors returns may be a view of the file's mapping,
                    # whose pages would stay mapped (and shared with the file) while the weight lives.
                    tensor = (f.get_slice(name)[index] if index else f.get_tensor(name)).clone()
            except READ_ERRORS as exc:
                raise _unreadable(source, exc) from None
        self.bytes_read += tensor.numel() * tensor.element_size()
        return tensor


# -- the folder's names against ours --------------------------------------------------------


def _canonical(name: str, spec: ModelSpec, known: set[str]) -> str:
    """A bare base model's file names its tensors without the causal-LM prefix; add it."""
    return name if name in known else spec.hf.prefix + name


def folder_tensors(hf_model: HFModel, family_cfg: Any) -> tuple[TensorReader, dict[str, str]]:
    """A reader of the folder and, for every tensor our model needs, the folder's name of it
    -> our name; one sentence for the first tensor that is missing, unexpected, of the wrong
    shape, or a tied copy that differs from its original."""
    folder, spec = hf_model.folder, hf_model.spec
    expected = spec.hf.names(family_cfg)
    tied = dict(spec.hf.tied(family_cfg))
    known = set(expected) | set(tied)
    files = {_canonical(name, spec, known): (path, name) for name, path in weight_files(folder).items()
             if not spec.hf.skipped(name)}
    reader = TensorReader(files)
    given = set(files) - set(tied)
    missing, unexpected = sorted(expected.keys() - given), sorted(given - expected.keys())
    kind = "/".join(spec.hf.model_types)
    if missing:
        raise UserError(f"{folder} lacks the weight {missing[0]} that its config.json calls for; download the "
                        f"model again.")
    if unexpected:
        raise UserError(f"{folder} holds {files[unexpected[0]][1]}, which is no weight of a {kind} model of its "
                        f"config.json's sizes; give a folder whose config.json describes its weights.")
    with torch.device("meta"):
        ours = spec.build(family_cfg).state_dict()
    for name, (our_name, transposed) in expected.items():
        want = tuple(reversed(ours[our_name].shape) if transposed else ours[our_name].shape)
        if reader.shape(name) != want:
            raise UserError(f"{folder} holds {files[name][1]} of shape {list(reader.shape(name))}, but its "
                            f"config.json's sizes give {list(want)}; the weights and config.json are of different "
                            f"models.")
    for copy, original in tied.items():
        if copy in files and not torch.equal(reader.read(copy), reader.read(original)):
            raise UserError(f"{folder} holds a {copy} that differs from {original}; this model ties the two, "
                            f"as its config.json says.")
    return reader, {name: our_name for name, (our_name, _) in expected.items()}


def read_hf_weights(hf_model: HFModel, family_cfg: Any) -> dict[str, torch.Tensor]:
    """The folder's weights under our names, as ``spec.build(family_cfg).load_state_dict`` takes
    them (a tied weight under both its names)."""
    reader, ours = folder_tensors(hf_model, family_cfg)
    transposed = {name for name, (_, t) in hf_model.spec.hf.names(family_cfg).items() if t}
    tensors = {our: reader.read(name).t() if name in transposed else reader.read(name) for name, our in ours.items()}
    with torch.device("meta"):
        ties = tied_parameters(hf_model.spec.build(family_cfg))
    for copy, original in ties:  # one parameter, loaded under each of its names
        tensors[copy] = tensors[original]
    return tensors


TOKENIZER_CONFIG, SPECIAL_TOKENS_MAP = "tokenizer_config.json", "special_tokens_map.json"
TEMPLATE_FILE, TEMPLATE_JSON = "chat_template.jinja", "chat_template.json"


def _json_object(path: Path) -> dict:
    try:
        given = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UserError(f"{path} cannot be read as JSON ({_reason(exc)}); restore the model's own "
                        f"{path.name}.") from None
    if not isinstance(given, dict):
        raise UserError(f"{path} holds no JSON object; restore the model's own {path.name}.")
    return given


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken's fields."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _default_template(value: Any, path: Path) -> str | None:
    """A ``chat_template`` entry: one template, or a list of ``{name, template}`` of which
    transformers applies the one named "default" unless told otherwise."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {entry.get("name"): entry.get("template") for entry in value if isinstance(entry, dict)}
        if isinstance(named.get("default"), str):
            return named["default"]
    raise UserError(f"the chat_template of {path} is neither a template nor a list holding one named "
                    f"\"default\"; restore the model's own {path.name}.")


def read_hf_tokenizer_config(folder: Path) -> TokenizerConfig | None:
    """The folder's special tokens and chat template, found where transformers looks; None if it
    names neither.

    Tokens come from tokenizer_config.json, overridden by an older special_tokens_map.json when
    the config has no ``added_tokens_decoder`` (transformers reads the map only then). The
    template comes from chat_template.jinja, which newer folders keep it in and which wins over
    the config's ``chat_template``; a processor's chat_template.json comes last.
    """
    config_file, tokens_file = folder / TOKENIZER_CONFIG, folder / SPECIAL_TOKENS_MAP
    template_file = folder / TEMPLATE_FILE
    given = _json_object(config_file) if config_file.is_file() else {}
    if "added_tokens_decoder" not in given and tokens_file.is_file():
        given = {**given, **_json_object(tokens_file)}
    if template_file.is_file():
        try:
            template = template_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise UserError(f"{template_file} cannot be read ({_reason(exc)}); restore the model's own "
                            f"{TEMPLATE_FILE}.") from None
    else:
        template = _default_template(given.get("chat_template"), config_file)
        if template is None and (folder / TEMPLATE_JSON).is_file():
            template = _default_template(_json_object(folder / TEMPLATE_JSON).get("chat_template"),
                                         folder / TEMPLATE_JSON)
    # Keys such as add_bos_token end in _token too, but hold no token text, so they drop out here.
    tokens = {key: text for key, value in given.items() if key.endswith("_token") and (text := _token_text(value))}
    if not tokens and template is None:
        return None
    return TokenizerConfig(bos_token=tokens.pop("bos_token", None), eos_token=tokens.pop("eos_token", None),
                           pad_token=tokens.pop("pad_token", None), chat_template=template, extra_tokens=tokens)


def load_hf_tokenizer(folder: Path) -> BPETokenizer:
    """The folder's tokenizer: tokenizer.json, or a byte-level BPE's vocab.json and merges.txt, with
    its special tokens and chat template (``read_hf_tokenizer_config``)."""
    folder = Path(folder)
    whole, vocab, merges = folder / "tokenizer.json", folder / "vocab.json", folder / "merges.txt"
    if not whole.is_file() and not (vocab.is_file() and merges.is_file()):
        raise UserError(f"{folder} holds no tokenizer (tokenizer.json, or vocab.json with merges.txt); copy "
                        f"the model's tokenizer files into it.")
    config = read_hf_tokenizer_config(folder)
    try:
        if whole.is_file():
            return BPETokenizer(Tokenizer.from_file(str(whole)), config)
        return BPETokenizer.from_vocab_merges(vocab, merges, config)
    except Exception as exc:  # noqa: BLE001 - the tokenizers library raises plain Exception for a bad file
        raise UserError(f"the tokenizer in {folder} cannot be read ({_reason(exc)}); copy the model's own "
                        f"tokenizer files into it.") from None
