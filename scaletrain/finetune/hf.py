"""Released GPT-2 weights: a Hugging Face model folder as one of our GPTs.

A folder as ``save_pretrained`` writes it, or as a user downloads it from the
Hub, holds ``config.json``, the weights (``model.safetensors``; or
``pytorch_model.bin``, read with ``torch.load(weights_only=True)``, which
unpickles tensors and plain containers only, never code) and the tokenizer
(``tokenizer.json``, or GPT-2's ``vocab.json`` with ``merges.txt``). Nothing
is fetched: the folder must hold everything, and transformers is not needed.

GPT-2 is our architecture with biases (``GPTConfig.bias``): pre-norm blocks,
learned positions, a head tied to the token embedding, GELU's tanh
approximation (``gelu_new``). The names map one to one::

    wte, wpe, ln_f                      tok_emb, pos_emb, ln_f
    h.{i}.ln_1, h.{i}.ln_2              blocks.{i}.ln1, blocks.{i}.ln2
    h.{i}.attn.c_attn, h.{i}.attn.c_proj    blocks.{i}.attn.qkv, blocks.{i}.attn.proj
    h.{i}.mlp.c_fc, h.{i}.mlp.c_proj    blocks.{i}.mlp.fc, blocks.{i}.mlp.proj

GPT-2's linear layers are ``Conv1D`` modules, which compute ``x @ W + b`` and
so store ``W`` as [in, out]; ``nn.Linear`` stores [out, in], hence the
transposes. ``c_attn``'s output is q, k and v one after the other, each split
into heads of head_dim: the [3, heads, head_dim] layout our attention reads,
so the fused weight maps without reordering. ``h.{i}.attn.bias`` and
``masked_bias`` in older files are the causal mask and its fill value,
buffers rather than weights, and are skipped.

``load_hf_gpt2`` gives the model for ``generate``; a fine-tune builds its
model from the run's ModelConfig (finetune/base.py sets it from config.json:
biases, norm epsilon, positions, vocabulary) and loads ``read_hf_weights``
into it. ``check_hf_weights`` checks the weights from the safetensors header
alone, so that a wrong folder is refused before a run writes anything.
"""

from __future__ import annotations

import json
import pickle
import re
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from scaletrain.data.tokenizer import BPETokenizer
from scaletrain.errors import UserError
from scaletrain.models.gpt import GPT, GPTConfig

CONFIG = "config.json"
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")  # in order of preference
# transformers' GPT2Config defaults: what transformers builds when config.json leaves a field out.
GPT2_DEFAULTS = {"n_layer": 12, "n_head": 12, "n_embd": 768, "n_positions": 1024, "vocab_size": 50257,
                 "n_inner": None, "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5,
                 "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
                 "tie_word_embeddings": True}
# Names transformers gives GELU's tanh approximation, each the function our MLP computes.
TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")
BLOCK_PARTS = {"ln_1": "ln1", "ln_2": "ln2", "attn.c_attn": "attn.qkv", "attn.c_proj": "attn.proj",
               "mlp.c_fc": "mlp.fc", "mlp.c_proj": "mlp.proj"}
CONV1D = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
BUFFERS = re.compile(r"h\.\d+\.attn\.(bias|masked_bias)")
PREFIX = "transformer."  # GPT2LMHeadModel's name for its GPT2Model; GPT2Model's own files have none
HEAD = "lm_head.weight"
READ_ERRORS = (OSError, SafetensorError, RuntimeError, EOFError, pickle.UnpicklingError)


def _reason(exc: BaseException) -> str:
    """The first line of a library's error message, to fit in one sentence."""
    return (str(exc).splitlines() or [type(exc).__name__])[0]


def is_hf_folder(path: Path) -> bool:
    """A Hugging Face model folder: it has a config.json (our run folders have config.toml)."""
    return (path / CONFIG).is_file()


def _read_config(folder: Path) -> dict:
    try:
        given = json.loads((folder / CONFIG).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UserError(f"{folder / CONFIG} cannot be read as JSON ({exc}); restore the model's own "
                        f"config.json.") from None
    if not isinstance(given, dict):
        raise UserError(f"{folder / CONFIG} holds no JSON object; restore the model's own config.json.")
    if given.get("model_type", "gpt2") != "gpt2":
        raise UserError(f"{folder} holds a {given['model_type']} model; only GPT-2 models (model_type gpt2) "
                        f"load into this GPT.")
    return {**GPT2_DEFAULTS, "n_positions": given.get("n_ctx", GPT2_DEFAULTS["n_positions"]), **given}


def _positive(hf: dict, key: str, folder: Path) -> int:
    value = hf[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UserError(f"{folder / CONFIG} gives {key} = {value!r}; it must be a positive whole number.")
    return value


def config_from_hf(hf: dict, folder: Path) -> GPTConfig:
    """Our GPTConfig for a GPT-2 config.json's fields, or one sentence on what differs from GPT-2's
    architecture. Dropout is 0: the released model is used as it is; a fine-tune sets its own."""
    sizes = {key: _positive(hf, key, folder) for key in ("n_layer", "n_head", "n_embd", "n_positions",
                                                          "vocab_size")}
    where = folder / CONFIG
    if sizes["n_embd"] % sizes["n_head"]:
        raise UserError(f"{where} gives n_embd {sizes['n_embd']}, which n_head {sizes['n_head']} does not "
                        f"divide; attention heads must split the width evenly.")
    if hf["activation_function"] not in TANH_GELUS:
        raise UserError(f"{where} names activation_function {hf['activation_function']!r}; this GPT computes "
                        f"GELU's tanh approximation ({', '.join(TANH_GELUS)}) only.")
    if hf["n_inner"] not in (None, 4 * sizes["n_embd"]):
        raise UserError(f"{where} gives n_inner {hf['n_inner']}; this GPT's MLP is 4 x n_embd = "
                        f"{4 * sizes['n_embd']} wide.")
    for key, gpt2 in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                      ("tie_word_embeddings", True)):
        if hf[key] != gpt2:
            raise UserError(f"{where} sets {key} to {hf[key]}; this GPT computes GPT-2's {key} = {gpt2} only.")
    eps = hf["layer_norm_epsilon"]
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or eps <= 0:
        raise UserError(f"{where} gives layer_norm_epsilon = {eps!r}; it must be a positive number.")
    return GPTConfig(vocab_size=sizes["vocab_size"], seq_len=sizes["n_positions"], n_layers=sizes["n_layer"],
                     n_heads=sizes["n_head"], d_model=sizes["n_embd"], dropout=0.0, bias=True,
                     norm_eps=float(eps))


def hf_names(n_layers: int) -> dict[str, tuple[str, bool]]:
    """Every weight a GPT-2 file holds: its name -> (our name, whether it is stored transposed)."""
    names = {"wte.weight": ("tok_emb.weight", False), "wpe.weight": ("pos_emb.weight", False),
             "ln_f.weight": ("ln_f.weight", False), "ln_f.bias": ("ln_f.bias", False)}
    for i in range(n_layers):
        for hf, ours in BLOCK_PARTS.items():
            for kind in ("weight", "bias"):
                names[f"h.{i}.{hf}.{kind}"] = (f"blocks.{i}.{ours}.{kind}", kind == "weight" and hf in CONV1D)
    return names


def read_hf_config(folder: Path) -> GPTConfig:
    """Our GPTConfig for the GPT-2 model in ``folder``, or one sentence on what is wrong with it."""
    folder = Path(folder)
    if not folder.is_dir():
        raise UserError(f"{folder} is not a folder; give the folder holding the model's config.json.")
    if not is_hf_folder(folder):
        raise UserError(f"{folder} has no config.json; give a Hugging Face GPT-2 folder as save_pretrained "
                        f"writes it.")
    return config_from_hf(_read_config(folder), folder)


def _weights_file(folder: Path) -> Path:
    source = next((folder / name for name in WEIGHT_FILES if (folder / name).is_file()), None)
    if source is None:
        raise UserError(f"{folder} holds no model.safetensors (nor pytorch_model.bin); copy the model's "
                        f"weights into it.")
    return source


def _unreadable(source: Path, exc: BaseException) -> UserError:
    return UserError(f"{source} cannot be read ({_reason(exc)}); download it again.")


def _read_weights(folder: Path) -> dict[str, torch.Tensor]:
    """The folder's tensors, by name, the ``transformer.`` prefix taken off."""
    source = _weights_file(folder)
    try:
        tensors = (load_file(source) if source.suffix == ".safetensors"
                   else torch.load(source, map_location="cpu", weights_only=True))
    except READ_ERRORS as exc:
        raise _unreadable(source, exc) from None
    if not isinstance(tensors, dict) or not all(isinstance(t, torch.Tensor) for t in tensors.values()):
        raise UserError(f"{source} holds no mapping of names to tensors; download it again.")
    return {name.removeprefix(PREFIX): tensor for name, tensor in tensors.items()}


def _weight_shapes(folder: Path) -> dict[str, tuple[int, ...]]:
    """The folder's tensor shapes by name; of a safetensors file from its header alone."""
    source = _weights_file(folder)
    if source.suffix != ".safetensors":
        return {name: tuple(t.shape) for name, t in _read_weights(folder).items()}
    try:
        with safe_open(source, framework="pt") as f:
            return {name.removeprefix(PREFIX): tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    except READ_ERRORS as exc:
        raise _unreadable(source, exc) from None


def _check_shapes(shapes: dict[str, tuple[int, ...]], cfg: GPTConfig, folder: Path) -> None:
    """Exactly the weights config.json's sizes call for, in their shapes: one sentence for the first that is not."""
    names = hf_names(cfg.n_layers)
    given = {name for name in shapes if not BUFFERS.fullmatch(name)} - {HEAD}
    missing, unexpected = sorted(names.keys() - given), sorted(given - names.keys())
    if missing:
        raise UserError(f"{folder} lacks the GPT-2 weight {missing[0]} that its config.json calls for; "
                        f"download the model again.")
    if unexpected:
        raise UserError(f"{folder} holds {unexpected[0]}, which is no weight of a GPT-2 model of its "
                        f"config.json's sizes; give a folder of GPT-2 (model_type gpt2) weights.")
    with torch.device("meta"):
        ours = GPT(cfg).state_dict()
    for name, (our_name, transposed) in names.items():
        expected = tuple(reversed(ours[our_name].shape) if transposed else ours[our_name].shape)
        if shapes[name] != expected:
            raise UserError(f"{folder} holds {name} of shape {list(shapes[name])}, but its config.json's "
                            f"sizes give {list(expected)}; the weights and config.json are of different models.")


def check_hf_weights(folder: Path, cfg: GPTConfig) -> None:
    """The weights file is there and holds the tensors ``cfg`` calls for (read from the header where
    it can be), so that a mistake is found before a run starts."""
    _check_shapes(_weight_shapes(Path(folder)), cfg, Path(folder))


def read_hf_weights(folder: Path, cfg: GPTConfig) -> dict[str, torch.Tensor]:
    """The folder's GPT-2 weights under our names, as ``GPT(cfg).load_state_dict`` takes them
    (the head tied to the embedding: the same tensor under both names)."""
    folder = Path(folder)
    tensors = _read_weights(folder)
    _check_shapes({name: tuple(t.shape) for name, t in tensors.items()}, cfg, folder)
    if HEAD in tensors and not torch.equal(tensors[HEAD], tensors["wte.weight"]):
        raise UserError(f"{folder} holds an {HEAD} that differs from wte.weight; this GPT ties its output head "
                        f"to the token embedding, as GPT-2 does.")
    ours = {our_name: tensors[name].t() if transposed else tensors[name]
            for name, (our_name, transposed) in hf_names(cfg.n_layers).items()}
    ours["head.weight"] = ours["tok_emb.weight"]
    return ours


def load_hf_gpt2(folder: Path) -> tuple[GPT, GPTConfig]:
    """The GPT-2 model in a Hugging Face folder as our GPT (fp32, in eval mode), and its config."""
    cfg = read_hf_config(folder)
    tensors = read_hf_weights(folder, cfg)
    model = GPT(cfg)
    model.load_state_dict(tensors)
    return model.eval(), cfg


def load_hf_tokenizer(folder: Path) -> BPETokenizer:
    """The folder's tokenizer: tokenizer.json, or GPT-2's vocab.json and merges.txt."""
    folder = Path(folder)
    whole, vocab, merges = folder / "tokenizer.json", folder / "vocab.json", folder / "merges.txt"
    if not whole.is_file() and not (vocab.is_file() and merges.is_file()):
        raise UserError(f"{folder} holds no tokenizer (tokenizer.json, or vocab.json with merges.txt); copy "
                        f"the model's tokenizer files into it.")
    try:
        return BPETokenizer.load(whole) if whole.is_file() else BPETokenizer.from_vocab_merges(vocab, merges)
    except Exception as exc:  # noqa: BLE001 - the tokenizers library raises plain Exception for a bad file
        raise UserError(f"the tokenizer in {folder} cannot be read ({_reason(exc)}); copy the model's own "
                        f"tokenizer files into it.") from None
