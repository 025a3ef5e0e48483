"""Export as a Hugging Face folder: ``scaletrain export --from RUN --to DIR --format hf``.

The folder is what ``save_pretrained`` writes and what
``transformers.AutoModelForCausalLM.from_pretrained(DIR)`` loads into the
same function as ours:

    config.json              the family's spec writes it (``HFAdapter.config_to_hf``)
    model.safetensors        every tensor under the folder's names (a tied head once:
                             transformers ties it back); past ``SHARD_BYTES``,
                             model-0000i-of-0000n.safetensors and their index
    generation_config.json   the special tokens' ids: ``generate`` stops at the EOS
    tokenizer.json, tokenizer_config.json, special_tokens_map.json
                             the run's tokenizer: a base folder's own files as they
                             were; a BPE the run trained; or, for a byte-level run,
                             a byte-level BPE without merges whose ids are the bytes,
                             the end-of-text token id 256. A tokenizer made here
                             declares its end-of-text token as BOS and EOS (as
                             released byte-level BPEs do), so the ``hf`` backend
                             of lm-evaluation-harness finds its prefix token
                             with no model args

Each tensor is read whole as one device would hold it (train/checkpoint.py
gathers any layout: ZeRO shards, tp slices, pipeline stages), a LoRA
fine-tune's adapters merged into it (an NF4 base dequantized first), and
written into the shard being filled, which goes to disk when full: the
export holds one shard and the tensor in hand, never the model (tests/test_export_streaming.py
counts its reads). Rows padded by ``--vocab-multiple`` stay:
config.json's ``vocab_size`` counts them, so the logits are ours, column for
column. Layers our model builds without a bias where the format has one
(a bias-free model exported to a format with biases) get zeros, which compute the same.

The folder is written beside its target under a temporary name and renamed
into place: a crash leaves no half-written folder under the target's name.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from scaletrain.config import load_run_config
from scaletrain.data.chat import ChatTemplate
from scaletrain.data.tokenizer import ByteTokenizer
from scaletrain.errors import UserError
from scaletrain.finetune.hf import is_hf_folder
from scaletrain.job.data_setup import run_tokenizer
from scaletrain.job.export import DTYPES, Exported, SavedModel, _prepared, find_checkpoint
from scaletrain.models import CLASSIFIER, spec_for
from scaletrain.paths import writable_dir

SHARD_BYTES = 5 * 10**9  # transformers' default max_shard_size
SPECIAL_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def check_folder_target(target: Path, force: bool, form: str = "hf") -> None:
    if target.suffix == ".safetensors":
        raise UserError(f"--to {target} names a file, but --format {form} writes a folder; give a folder name.")
    writable_dir("--to", target.parent if not target.exists() else target)
    if target.exists() and not target.is_dir():
        raise UserError(f"--to {target} is a file; give a folder name for --format {form}.")
    if target.exists() and any(target.iterdir()) and not force:
        raise UserError(f"--to {target} already holds files; add --force to replace the folder, or choose "
                        f"another name.")


def hf_tensors(ours: Mapping[str, torch.Tensor], names: dict[str, tuple[str, bool]]
               ) -> Iterator[tuple[str, torch.Tensor]]:
    """Our tensors under the folder's names and layouts, one at a time (each read from ``ours`` as it
    is asked for: a `SavedModel` reads it then); a bias we lack is zeros, shaped by its layer's weight
    as already read (a format's weight comes before its bias), so that no weight is read twice."""
    rows: dict[str, tuple[int, torch.dtype]] = {}  # our weights read so far: their rows and dtype
    for name, (our_name, transposed) in names.items():
        if our_name in ours:
            tensor = ours[our_name]
            rows[our_name] = (tensor.shape[0], tensor.dtype)
            yield name, tensor.t() if transposed else tensor
        elif our_name.endswith(".bias") and (weight_name := our_name.removesuffix(".bias") + ".weight") in ours:
            if weight_name not in rows:
                weight = ours[weight_name]
                rows[weight_name] = (weight.shape[0], weight.dtype)
            size, dtype = rows[weight_name]
            yield name, torch.zeros(size, dtype=dtype)
        else:
            raise UserError(f"the checkpoint lacks {our_name}, which the exported format needs; export a "
                            f"complete checkpoint.")


@dataclass
class Written:
    """What `write_weights` wrote: tensors, their elements, and the dtype of the first."""
    tensors: int = 0
    parameters: int = 0
    dtype: torch.dtype | None = None


def write_weights(tensors: Iterable[tuple[str, torch.Tensor]], folder: Path,
                  dtype: torch.dtype | None = None) -> Written:
    """``tensors`` (cast to ``dtype`` where given) into ``model.safetensors``, or past ``SHARD_BYTES``
    into numbered shards and their index, each shard written as soon as it is full: at most one
    shard is held, never the model."""
    metadata = {"format": "pt"}  # what transformers' loader expects in the header
    written, files, shard, size = Written(), [], {}, 0

    def flush() -> None:
        files.append((folder / f".shard-{len(files) + 1}", list(shard)))
        save_file(_prepared(shard, dtype), files[-1][0], metadata=metadata)
        shard.clear()

    for name, tensor in tensors:
        nbytes = tensor.numel() * (dtype or tensor.dtype).itemsize
        if shard and size + nbytes > SHARD_BYTES:
            flush()
            size = 0
        shard[name], size = tensor, size + nbytes
        written.tensors, written.parameters = written.tensors + 1, written.parameters + tensor.numel()
        written.dtype = written.dtype or (dtype if dtype and tensor.is_floating_point() else tensor.dtype)
    flush()
    if len(files) == 1:
        files[0][0].rename(folder / "model.safetensors")
        return written
    weight_map = {}
    for i, (path, names) in enumerate(files, start=1):
        file = f"model-{i:05d}-of-{len(files):05d}.safetensors"
        path.rename(folder / file)
        weight_map.update(dict.fromkeys(names, file))
    total = sum((folder / file).stat().st_size for file in set(weight_map.values()))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return written


def byte_tokenizer(tokenizer: ByteTokenizer) -> Tokenizer:
    """Our byte tokenizer as a tokenizers-library file: a BPE without merges over the byte-level
    alphabet, each byte's id its value, and the end-of-text token (if it has one) added as a
    special token at id 256, so transformers' tokenizer gives our ids."""
    vocab = {char: byte for byte, char in _byte_to_char().items()}
    exported = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    exported.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    exported.decoder = decoders.ByteLevel()
    if tokenizer.end_of_text is not None:
        exported.add_special_tokens([AddedToken(tokenizer.end_of_text, special=True, normalized=False)])
    return exported


def _byte_to_char() -> dict[int, str]:
    """The byte-level alphabet (Radford et al. 2019): printable bytes stand for themselves,
    the others for the characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def hf_base(run_dir: Path) -> Path | None:
    """The Hugging Face folder a run's tokenizer came from (its fine-tune's base), else None."""
    base = load_run_config(run_dir).data.tokenizer_from
    return Path(base) if base and is_hf_folder(Path(base)) else None


def _copied_tokenizer(base: Path, folder: Path) -> dict:
    """A base folder's tokenizer files as they were; the special token ids its config.json names."""
    for name in TOKENIZER_FILES:
        if (base / name).is_file():
            shutil.copyfile(base / name, folder / name)
    source_config = json.loads((base / "config.json").read_text(encoding="utf-8"))
    return {key: source_config[key] for key in SPECIAL_IDS if source_config.get(key) is not None}


def _own_tokenizer(tokenizer, folder: Path) -> dict:
    """A tokenizer made here as transformers' files; the special token ids config.json names."""
    exported = byte_tokenizer(tokenizer) if isinstance(tokenizer, ByteTokenizer) else \
        Tokenizer.from_str(tokenizer.to_json())
    exported.save(str(folder / "tokenizer.json"))
    special = tokenizer.config
    named = {} if special is None else {name: value for name, value in (("bos_token", special.bos_token),
                                                                       ("eos_token", special.eos_token),
                                                                       ("pad_token", special.pad_token))
                                        if value is not None}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False, **named}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (folder / "special_tokens_map.json").write_text(json.dumps(named, indent=2))
    return {f"{name}_id": exported.token_to_id(value) for name, value in named.items()}


def write_tokenizer(run_dir: Path, folder: Path) -> dict:
    """The run's tokenizer files into ``folder``; the special token ids config.json names. An
    ``--sft`` run's template (the one its answers were trained in, which may be another than a
    base's own) goes into tokenizer_config.json, for apply_chat_template."""
    tokenizer, base = run_tokenizer(run_dir), hf_base(run_dir)
    special = _copied_tokenizer(base, folder) if base else _own_tokenizer(tokenizer, folder)
    if load_run_config(run_dir).data.sft:
        (folder / "chat_template.jinja").unlink(missing_ok=True)  # transformers would read it first
        written = folder / "tokenizer_config.json"
        config = json.loads(written.read_text(encoding="utf-8")) if written.is_file() else {}
        config["chat_template"] = ChatTemplate.for_tokenizer(tokenizer).source
        written.write_text(json.dumps(config, indent=2))
    return special


def generation_config(run_dir: Path, special: dict) -> dict:
    """generation_config.json: a base folder's own (several EOS ids, where it names them), else the
    special ids, so that ``generate`` stops at the EOS. No ``max_length``: a caller's
    ``max_new_tokens`` is then the only limit, without transformers' warning that both are set."""
    base = hf_base(run_dir)
    source = base / "generation_config.json" if base else None
    generation = json.loads(source.read_text(encoding="utf-8")) if source and source.is_file() else {}
    generation.pop("max_length", None)
    return {**special, **{key: value for key, value in generation.items() if key != "transformers_version"}}


@contextmanager
def folder_in_place(target: Path) -> Iterator[Path]:
    """A temporary folder beside ``target`` to write into, renamed to ``target`` when the writing
    is done (replacing it), removed if it fails: nothing half-written under the target's name."""
    partial = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir()
    try:
        yield partial
        if target.exists():
            shutil.rmtree(target)
        os.replace(partial, target)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise


def export_hf(source: Path, target: Path, dtype: str | None = None, force: bool = False) -> Exported:
    """Write the model of ``source`` (a checkpoint or a run folder) as a Hugging Face folder ``target``."""
    check_folder_target(target, force)
    checkpoint = find_checkpoint(source)
    run_dir = checkpoint.parent.parent
    cfg = load_run_config(run_dir)
    if cfg.model.name == CLASSIFIER:
        raise UserError(f"--from {source} is a run of the mlp classifier, which no Hugging Face class loads; "
                        f"export it with --format safetensors.")
    family = spec_for(cfg.model.name)
    family_cfg = family.configure(cfg.model, run_tokenizer(run_dir).vocab_size, cfg.data.seq_len)
    ours = SavedModel(checkpoint)  # each tensor read, merged and written in turn: one shard held at a time
    with folder_in_place(target) as partial:
        written = write_weights(hf_tensors(ours, family.hf.names(family_cfg)), partial,
                                DTYPES[dtype] if dtype else None)
        special = write_tokenizer(run_dir, partial)
        config = {**family.hf.config_to_hf(family_cfg), **special, "torch_dtype": DTYPE_NAMES[written.dtype]}
        (partial / "config.json").write_text(json.dumps(config, indent=2))
        (partial / "generation_config.json").write_text(json.dumps(generation_config(run_dir, special), indent=2))
    return Exported(path=target, step=ours.step, tensors=written.tensors, parameters=written.parameters,
                    bytes=sum(f.stat().st_size for f in target.iterdir()))
