"""From the ``--data`` a user gives to prepared folders and the batches training reads.

A source is a text file or folder (the plain-text path of corpus.py), a file
or folder of records (records.py), or a folder ``scaletrain prepare`` wrote
(shards.py). Records are tokenized once into a prepared folder in the cache,
keyed by what the tokens depend on (the source's path, size and time, the
tokenizer, the chat template, the text field, the kind), so every later run
memory-maps them, exactly as it would the folder ``scaletrain prepare``
writes by hand. Several sources mix by weight, ``PATH:WEIGHT``
(data/mixture.py).

The kind is "text" (documents joined into one stream, cut into windows; with ``--pack``
whole documents packed into rows, each attending to itself alone) or "sft"
(instruction examples with their loss masks, packed or one per row:
data/packing.py).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path


from scaletrain.data.batches import TokenBatches, split_tokens
from scaletrain.data.mixture import Mixture
from scaletrain.data.packing import SequenceBatches
from scaletrain.data.prepare import TextEncoder, prepare
from scaletrain.data.records import describe_source, is_saved_dataset, iter_records, source_format, text_of
from scaletrain.data.sft import ChatEncoder, ChatOptions, record_messages
from scaletrain.data.shards import Prepared, is_prepared, open_prepared
from scaletrain.data.tokenizer import END_OF_TEXT, BPETokenizer, ByteTokenizer, document_separator, load_tokenizer
from scaletrain.errors import UserError

_RECORD_SUFFIXES = {".jsonl", ".json", ".parquet", ".csv", ".tsv", ".arrow"}


@dataclass(frozen=True)
class Source:
    path: str
    weight: float = 1.0


def parse_sources(values: list[str] | str | None) -> list[Source]:
    """``--data`` values as sources: ``PATH`` or ``PATH:WEIGHT`` (a path that exists as written
    keeps its colon)."""
    if values is None:
        return []
    sources = []
    for value in [values] if isinstance(values, str) else values:
        path, colon, weight = value.rpartition(":")
        if not colon or Path(value).exists():
            sources.append(Source(value))
            continue
        try:
            number = float(weight)
        except ValueError:
            raise UserError(f"--data {value}: the weight after the last colon, {weight!r}, is not a number; "
                            f"write PATH:WEIGHT with a positive number, as a.jsonl:0.7.") from None
        if not number > 0:
            raise UserError(f"--data {value}: the weight {weight} is not positive; give each source a weight "
                            f"above 0.")
        sources.append(Source(path, number))
    return sources


def is_text_source(path: str | Path) -> bool:
    """Plain text (corpus.py) rather than records or a prepared folder: a file of another
    extension than the records', a folder holding any such file (or none at all)."""
    path = Path(path)
    # os.path's tests, not Path's: they answer False where a folder on the way cannot be searched.
    if not os.path.isdir(path):  # a missing path too: it is refused in the words of the kind its name suggests
        return path.suffix.lower() not in _RECORD_SUFFIXES
    if not os.access(path, os.R_OK | os.X_OK):
        return True  # the text path refuses it, naming what is unreadable
    if is_prepared(path) or is_saved_dataset(path):
        return False
    names = [name for parent, folders, files in os.walk(path) if not _hidden(Path(parent).relative_to(path))
             for name in files if not name.startswith(".")]
    return not names or any(Path(name).suffix.lower() not in _RECORD_SUFFIXES for name in names)


def _hidden(relative: Path) -> bool:
    return any(part.startswith(".") for part in relative.parts)


def tokenizer_identity(tokenizer) -> str:
    """sha256 of everything a tokenizer turns text into ids with: its vocabulary and rules, and
    its special tokens and chat template."""
    config = getattr(tokenizer, "config", None)
    extra = json.dumps(config.__dict__ if config is not None else None, sort_keys=True)
    return hashlib.sha256((tokenizer.to_json() + extra).encode("utf-8")).hexdigest()


def record_encoder(tokenizer, sft: bool, text_field: str, chat: ChatOptions = ChatOptions()):
    """The encoder that turns a record into (ids, mask): a chat rendered as ``chat`` says (the
    tokenizer's own template, or the built-in one, by default), or a text field followed by the
    separator."""
    if sft:
        return ChatEncoder.chosen(tokenizer, chat)
    return TextEncoder(tokenizer, text_field, document_separator(tokenizer))


def _texts(paths: list[Path], sft: bool, text_field: str):
    """What a BPE trains on: the text field of every record, or every message of every chat."""
    for path in paths:
        for record in iter_records(path):
            if sft:
                yield from (message["content"] for message in record_messages(record))
            else:
                yield text_of(record, text_field)


def records_tokenizer(paths: list[Path], kind: str, vocab_size: int, sft: bool, text_field: str,
                      cache_dir: Path):
    """A new tokenizer for records: bytes, or a BPE trained on their text (cached by their sources)."""
    if kind == ByteTokenizer.name:
        return ByteTokenizer()
    # END_OF_TEXT in the key: a BPE cached before the token existed is not this one.
    identity = [[describe_source(p) for p in paths], vocab_size, sft, text_field, END_OF_TEXT]
    key = hashlib.sha256(json.dumps(identity).encode("utf-8")).hexdigest()[:16]
    path = cache_dir / f"bpe-records-{vocab_size}-{key}.json"
    if path.is_file():
        return BPETokenizer.load(path)
    tokenizer = BPETokenizer.train_from_texts(_texts(paths, sft, text_field), vocab_size)
    cache_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(path)
    return tokenizer


def prepared_tokenizer(folders: list[Path]):
    """The tokenizer of prepared folders, which must all share it."""
    identities = {open_prepared(folder).manifest["tokenizer"]["sha256"] for folder in folders}
    if len(identities) > 1:
        raise UserError(f"the prepared folders {', '.join(map(str, folders))} were tokenized with different "
                        f"tokenizers; prepare them all with the same one.")
    return load_tokenizer(open_prepared(folders[0]).tokenizer_path)


def cached_folder(path: Path, tokenizer, sft: bool, text_field: str, cache_dir: Path, workers: int,
                  progress: bool, chat: ChatOptions = ChatOptions()) -> Path:
    """A records source tokenized into a prepared folder in the cache (once; resumed if interrupted)."""
    source_format(path)  # refused here, in its own words, if it cannot serve
    encoder = record_encoder(tokenizer, sft, text_field, chat)
    identity = [describe_source(path), tokenizer_identity(tokenizer), sft,
                encoder.identity() if sft else text_field]
    key = hashlib.sha256(json.dumps(identity).encode("utf-8")).hexdigest()[:16]
    folder = cache_dir / f"prepared-{key}"
    prepare([path], encoder, folder, tokenizer=tokenizer,
            kind="sft" if sft else "text", text_field=text_field, workers=workers, progress=progress)
    return folder


def check_prepared(folder: Path, tokenizer, sft: bool) -> Prepared:
    """A prepared folder, its shards verified, refused unless it suits the run."""
    prepared = open_prepared(folder, verify=True)
    manifest = prepared.manifest
    if load_tokenizer(prepared.tokenizer_path).to_json() != tokenizer.to_json():
        raise UserError(f"--data {folder} was prepared with another tokenizer than this run's; prepare it again "
                        f"with this run's tokenizer (--tokenizer-from, as the model's).")
    if (manifest["kind"] == "sft") != sft:
        want = "with" if sft else "without"
        raise UserError(f"--data {folder} holds {manifest['kind']} data; run {want} --sft, or prepare it again "
                        f"{'with' if not sft else 'without'} --sft.")
    return prepared


def _held_out_examples(n: int, val_fraction: float) -> int:
    return max(1, int(n * val_fraction))


def text_batches(prepared: Prepared, val: Prepared | None, seq_len: int, val_fraction: float,
                 seed: int) -> tuple[TokenBatches, TokenBatches]:
    """Windows of a text stream: the last ``val_fraction`` held out, or a separate validation set."""
    if val is None:
        train, held_out = split_tokens(prepared.tokens, val_fraction, seq_len)
    else:
        train, held_out = prepared.tokens, val.tokens
    return TokenBatches(train, seq_len, seed=seed, shuffle=True), TokenBatches(held_out, seq_len, seed=seed,
                                                                              shuffle=False)


def example_batches(prepared: Prepared, val: Prepared | None, seq_len: int, val_fraction: float, seed: int,
                    pack: bool, too_long: str) -> tuple[SequenceBatches, SequenceBatches]:
    """Rows of examples (instruction examples with their masks, or with ``--pack`` the documents of
    text records, every target in them trained): the last ``val_fraction`` of the examples held
    out, or a separate set."""
    n = len(prepared.starts) - 1
    options = dict(pack=pack, too_long=too_long, seed=seed)
    if val is None:
        if n < 2:
            raise UserError(f"the data holds {n} example; give at least 2, one to train on and one to validate "
                            f"with, or a separate --val-data.")
        cut = n - _held_out_examples(n, val_fraction)
        return (SequenceBatches(prepared.tokens, prepared.starts, prepared.mask, seq_len, **options,
                                shuffle=True, documents=range(cut)),
                SequenceBatches(prepared.tokens, prepared.starts, prepared.mask, seq_len, **options,
                                shuffle=False, documents=range(cut, n)))
    return (SequenceBatches(prepared.tokens, prepared.starts, prepared.mask, seq_len, **options, shuffle=True),
            SequenceBatches(val.tokens, val.starts, val.mask, seq_len, **options, shuffle=False))


def mixed(pairs: list[tuple], weights: list[float], seed: int):
    """(train, val) of one source, or of several mixed by weight."""
    if len(pairs) == 1:
        return pairs[0]
    return Mixture([train for train, _ in pairs], weights, seed=seed), \
        Mixture([val for _, val in pairs], weights, seed=seed)
