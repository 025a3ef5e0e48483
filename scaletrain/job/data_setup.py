"""From the data flags to batches: prepared once, opened by every worker.

``prepare_data`` does the slow and fallible part (finding files, training a
BPE tokenizer, checking the corpus is long enough, tokenizing into the memmap
cache) before any training starts, in the launching process. Every check
comes before the first file is written, so a refused run leaves no cache
behind. Workers then ``open_data`` the cached files, which is cheap and
cannot fail on user input.
Tokenizer and token file are cached beside the run folders (``runs/.cache``),
keyed by the corpus files and tokenizer, so the next run starts at once.

Records, ``datasets`` folders, prepared folders, several sources, ``--sft``,
``--pack`` and ``--val-data`` go through prepared folders instead
(``prepare_records``, data/sources.py, docs/data.md): each records source is
tokenized once into the cache by data/prepare.py, every folder's shards are
verified against their hashes, and the batches are opened once here, so that
long examples and short data are refused before the first step. A refused
run removes the cache entries it made.

``--tokenizer-from`` takes the tokenizer of another run (its saved
``tokenizer.json``) or of a Hugging Face model folder instead of making one:
a fine-tune sets it to its base, so that the new data becomes tokens as the
base's own data did. Every run saves the tokenizer it trained with as
``RUN/tokenizer.json`` (``save_run_tokenizer``), which is what the next
fine-tune and ``generate`` read (``run_tokenizer``).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from scaletrain.config import Config, load_run_config
from scaletrain.data import (
    ArrayBatches,
    BPETokenizer,
    ByteTokenizer,
    TokenBatches,
    build_token_cache,
    check_corpus_length,
    corpus_files,
    corpus_too_short,
    count_tokens,
    files_fingerprint,
    load_digits,
    load_tokenizer,
    load_tokens,
    split_tokens,
    token_lower_bound,
    unigram_entropy_nats,
)
from scaletrain.data.chat import ChatTemplate
from scaletrain.data.digits import NUM_CLASSES, NUM_FEATURES
from scaletrain.data.mixture import Mixture
from scaletrain.data.packing import SequenceBatches
from scaletrain.data.sft import ChatOptions
from scaletrain.data.shards import is_prepared, open_prepared
from scaletrain.data.sources import (
    cached_folder,
    check_prepared,
    example_batches,
    is_text_source,
    mixed,
    parse_sources,
    prepared_tokenizer,
    records_tokenizer,
    text_batches,
    tokenizer_identity,
)
from scaletrain.data.tokenizer import with_chat_template
from scaletrain.errors import UserError
from scaletrain.finetune.hf import is_hf_folder, load_hf_tokenizer
from scaletrain.paths import readable_dir, writable_dir

AnyTokenizer = ByteTokenizer | BPETokenizer
RUN_TOKENIZER = "tokenizer.json"  # in the run folder: the tokenizer its data was tokenized with
# What a run's tokenizer is made from: a resumed run with these unchanged keeps its saved one.
_TOKENIZER_FIELDS = ("tokenizer", "vocab_size", "tokenizer_from", "data", "text_field", "sft")


@dataclass(frozen=True)
class PreparedData:
    kind: str  # "text" or "digits"
    tokens_path: str | None = None  # the plain-text cache (corpus.py); None for prepared folders
    tokenizer_path: str | None = None
    vocab_size: int = 0
    n_tokens: int = 0
    unigram_entropy: float | None = None
    prepared: tuple[str, ...] = ()  # records and prepared sources (data/sources.py), as prepared folders
    weights: tuple[float, ...] = ()  # their mixing weights
    val_prepared: str | None = None  # --val-data, prepared
    sft: bool = False
    pack: bool = False
    chat_template: str | None = None  # with sft: the template the records were rendered in, which the run records


@dataclass
class OpenedData:
    train: TokenBatches | ArrayBatches | SequenceBatches | Mixture
    val: TokenBatches | ArrayBatches | SequenceBatches | Mixture
    tokenizer: ByteTokenizer | BPETokenizer | None
    n_features: int = 0
    n_classes: int = 0


def bpe_cache_path(cache_dir: Path, vocab_size: int, files: list[Path], legacy: bool = False) -> Path:
    """Where the BPE of ``vocab_size`` tokens trained on ``files`` is cached: keyed by the
    files' fingerprint, so an edited corpus gets a tokenizer of its own. ``legacy``: the name of
    one trained before the end-of-text token, which a new run must not pick up."""
    return cache_dir / f"bpe-{'' if legacy else 'eot-'}{vocab_size}-{files_fingerprint(files)[:16]}.json"


def _legacy_run_tokenizer(cfg: Config, run_dir: Path) -> AnyTokenizer:
    """The tokenizer of a run that saved none (older runs): bytes, or its BPE in the cache beside
    the run folders, found by its corpus's fingerprint as training found it."""
    if cfg.data.tokenizer == ByteTokenizer.name:
        return ByteTokenizer()
    try:
        files = corpus_files(_single_text_path(cfg))
    except UserError:
        raise UserError(f"the run in {run_dir} trained its BPE on {_single_text_path(cfg)}, which is no longer there, and "
                        f"its cached tokenizer is found by that corpus; restore the corpus.") from None
    cache_dir = Path(cfg.data.cache_dir) if cfg.data.cache_dir else run_dir.parent / ".cache"  # as training chose
    path = bpe_cache_path(cache_dir, cfg.data.vocab_size, files, legacy=True)
    if not path.is_file():
        raise UserError(f"the BPE tokenizer of the run in {run_dir} is not in its cache ({path}): the corpus "
                        f"changed since training or the cache was removed; restore them as they were.")
    return BPETokenizer.load(path)


def run_tokenizer(run_dir: Path) -> AnyTokenizer:
    """The tokenizer a run folder's data was tokenized with."""
    saved = run_dir / RUN_TOKENIZER
    return load_tokenizer(saved) if saved.is_file() else _legacy_run_tokenizer(load_run_config(run_dir), run_dir)


def save_run_tokenizer(prepared: PreparedData, run_dir: Path) -> None:
    """``RUN/tokenizer.json``: a copy of the tokenizer the run's data was tokenized with, and with
    ``--sft`` the chat template it rendered the records in."""
    if prepared.tokenizer_path is None:
        return
    tokenizer = load_tokenizer(prepared.tokenizer_path)
    if prepared.chat_template is not None:  # generate --chat, eval and the export render as training did
        tokenizer = with_chat_template(tokenizer, prepared.chat_template)
    tokenizer.save(run_dir / RUN_TOKENIZER)


def resumed_tokenizer(cfg: Config) -> AnyTokenizer | None:
    """A resumed run's own tokenizer, saved when it began: its checkpoint's ids mean those tokens,
    whatever tokenizer a new run would make of the same flags (one saved before the end-of-text
    token keeps its ids). None for a run that is not resumed, saved none, or whose tokenizer
    flags now differ (a new tokenizer is made, and a checkpoint it does not fit is refused)."""
    saved = Path(cfg.run.out) / RUN_TOKENIZER if cfg.run.resume and cfg.run.out else None
    if saved is None or not saved.is_file():
        return None
    began = load_run_config(saved.parent).data
    same = all(getattr(began, name) == getattr(cfg.data, name) for name in _TOKENIZER_FIELDS)
    return load_tokenizer(saved) if same else None


def tokenizer_from(source: Path) -> AnyTokenizer:
    """``--tokenizer-from``: a Hugging Face folder's tokenizer, or the one a run trained with."""
    readable_dir("--tokenizer-from", source, "a run folder or a Hugging Face model folder")
    if is_hf_folder(source):
        return load_hf_tokenizer(source)
    if (source / "config.toml").is_file():
        return run_tokenizer(source)
    raise UserError(f"--tokenizer-from {source} is neither a run folder (it has no config.toml) nor a Hugging "
                    f"Face model folder (no config.json); give one of those.")


def _tokenizer(files: list[Path], vocab_size: int, bpe_path: Path | None) -> ByteTokenizer | BPETokenizer:
    """Bytes without a BPE path; else the cached BPE, or one trained here and not yet saved."""
    if bpe_path is None:
        return ByteTokenizer()
    return BPETokenizer.load(bpe_path) if bpe_path.is_file() else BPETokenizer.train(files, vocab_size)


def _save_atomically(tokenizer: BPETokenizer, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tokenizer.save(tmp)
    os.replace(tmp, path)


def _single_text_path(cfg: Config) -> str | None:
    """The one plain-text --data (None: the built-in corpus)."""
    sources = parse_sources(cfg.data.data)
    return sources[0].path if sources else None


def _reads_records(cfg: Config) -> bool:
    """Whether the data goes through prepared folders (data/sources.py) rather than the
    plain-text cache: records, prepared folders, several sources, SFT, packing, --val-data."""
    sources = parse_sources(cfg.data.data)
    plain = len(sources) <= 1 and all(is_text_source(s.path) for s in sources)
    return not plain or cfg.data.sft or bool(cfg.data.pack) or cfg.data.val_data is not None


def prepare_data(cfg: Config, cache_dir: Path) -> PreparedData:
    if cfg.model.name == "mlp":
        if cfg.data.data is not None:
            raise UserError("--data applies to the language models; the mlp trains on scikit-learn's "
                            "bundled digits, so drop --data.")
        return PreparedData(kind="digits")
    if _reads_records(cfg):
        return prepare_records(cfg, cache_dir)
    files = corpus_files(_single_text_path(cfg))
    writable_dir("--cache-dir", cache_dir)
    if cfg.data.tokenizer_from:
        bpe_path, tokenizer = None, tokenizer_from(Path(cfg.data.tokenizer_from))
    elif resumed := resumed_tokenizer(cfg):
        bpe_path, tokenizer = None, resumed
    else:
        bpe_path = bpe_cache_path(cache_dir, cfg.data.vocab_size, files) if cfg.data.tokenizer == "bpe" else None
        tokenizer = _tokenizer(files, cfg.data.vocab_size, bpe_path)
    if cfg.model.n_vocab is not None and cfg.model.n_vocab < tokenizer.vocab_size:
        raise UserError(f"--n-vocab {cfg.model.n_vocab} is below the {tokenizer.vocab_size} tokens of the "
                        f"tokenizer; give at least {tokenizer.vocab_size}, or leave --n-vocab out.")
    # File sizes settle the length of most corpora without tokenizing them; one they leave in
    # doubt is small, and tokenized once more to count.
    if corpus_too_short(token_lower_bound(files, tokenizer), cfg.data.val_fraction, cfg.data.seq_len):
        check_corpus_length(count_tokens(files, tokenizer), cfg.data.val_fraction, cfg.data.seq_len)
    cache_dir.mkdir(parents=True, exist_ok=True)  # the first write: every check has passed
    if bpe_path is not None and not bpe_path.is_file():
        _save_atomically(tokenizer, bpe_path)
    tokens_path = build_token_cache(files, tokenizer, cache_dir)
    tokenizer_path = tokens_path.with_suffix(".tokenizer.json")
    if not tokenizer_path.exists():
        tokenizer.save(tokenizer_path)
    tokens = load_tokens(tokens_path)
    train, _ = split_tokens(tokens, cfg.data.val_fraction, cfg.data.seq_len)
    return PreparedData(kind="text", tokens_path=str(tokens_path), tokenizer_path=str(tokenizer_path),
                    vocab_size=tokenizer.vocab_size, n_tokens=len(tokens),
                    unigram_entropy=unigram_entropy_nats(train, tokenizer.vocab_size))


def _run_tokenizer_choice(cfg: Config, record_paths: list[Path], folders: list[Path], cache_dir: Path):
    """The tokenizer of a run on records: --tokenizer-from's, a resumed run's own, the prepared folders' own (records mixed
    with them are tokenized by it too: their ids must mean the same tokens), or a new one."""
    if cfg.data.tokenizer_from:
        return tokenizer_from(Path(cfg.data.tokenizer_from))
    if resumed := resumed_tokenizer(cfg):
        return resumed
    if folders:
        return prepared_tokenizer(folders)
    return records_tokenizer(record_paths, cfg.data.tokenizer, cfg.data.vocab_size, cfg.data.sft,
                             cfg.data.text_field, cache_dir)


def prepare_records(cfg: Config, cache_dir: Path) -> PreparedData:
    """Records and prepared folders (data/sources.py): each source prepared once into the cache, every
    check (sizes, long examples, tokenizers, kinds) made before training."""
    d = cfg.data
    sources = parse_sources(d.data)
    if not sources:
        raise UserError("--sft, --pack and --val-data need --data: records (.jsonl, .json, .parquet), a datasets "
                        "folder, or a scaletrain prepare folder.")
    paths = [Path(s.path) for s in sources] + ([Path(d.val_data)] if d.val_data else [])
    for path in paths:
        if is_text_source(path):
            raise UserError(f"--data {path} is plain text, which trains alone; give records (.jsonl, .json, "
                            f".parquet), a datasets folder or a scaletrain prepare folder to mix sources or to use "
                            f"--sft, --pack or --val-data.")
    writable_dir("--cache-dir", cache_dir)
    created = next((p for p in reversed([cache_dir, *cache_dir.parents]) if not p.exists()), None)
    before = set(cache_dir.iterdir()) if cache_dir.is_dir() else set()
    try:
        return _prepare_records(cfg, sources, paths, cache_dir)
    except UserError:  # a refused run leaves no cache of its own behind: nothing half-done to trip over
        if created is not None:
            shutil.rmtree(created, ignore_errors=True)
        elif cache_dir.is_dir():
            for entry in set(cache_dir.iterdir()) - before:
                shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
        raise


def _prepare_records(cfg: Config, sources: list, paths: list[Path], cache_dir: Path) -> PreparedData:
    d = cfg.data
    folders = [p for p in paths if is_prepared(p)]
    record_paths = [p for p in paths if not is_prepared(p)]
    tokenizer = _run_tokenizer_choice(cfg, record_paths, folders, cache_dir)
    if cfg.model.n_vocab is not None and cfg.model.n_vocab < tokenizer.vocab_size:
        raise UserError(f"--n-vocab {cfg.model.n_vocab} is below the {tokenizer.vocab_size} tokens of the "
                        f"tokenizer; give at least {tokenizer.vocab_size}, or leave --n-vocab out.")
    chat = ChatOptions(d.chat_template, d.train_on_inputs, d.system_prompt)
    template = ChatTemplate.chosen(d.chat_template, tokenizer).source if d.sft else None  # refused before any work
    source_folders = [path if is_prepared(path) else
                      cached_folder(path, tokenizer, d.sft, d.text_field, cache_dir, d.workers, cfg.run.progress, chat)
                      for path in paths]  # every source's prepared folder, then --val-data's
    opened = [check_prepared(folder, tokenizer, d.sft) for folder in source_folders]
    tokenizer_path = cache_dir / f"tokenizer-{tokenizer_identity(tokenizer)[:16]}.json"
    if not tokenizer_path.exists():
        cache_dir.mkdir(parents=True, exist_ok=True)
        tokenizer.save(tokenizer_path)
    prepared = PreparedData(kind="text", tokenizer_path=str(tokenizer_path), vocab_size=tokenizer.vocab_size,
                            n_tokens=sum(len(p.tokens) for p in opened[:len(sources)]),
                            prepared=tuple(str(p) for p in source_folders[:len(sources)]),
                            weights=tuple(s.weight for s in sources),
                            val_prepared=str(source_folders[-1]) if d.val_data else None, sft=d.sft,
                            pack=d.sft if d.pack is None else d.pack, chat_template=template)
    data = open_data(prepared, cfg)  # every size and length refusal, before training
    for split, batches in (("train", data.train), ("validation", data.val)):
        if isinstance(batches, SequenceBatches) and batches.truncated:
            print(batches.cut_sentence(split))
    return prepared


def _open_prepared_batches(prepared: PreparedData, cfg: Config):
    d, seed = cfg.data, cfg.train.seed
    val = open_prepared(prepared.val_prepared) if prepared.val_prepared else None
    pairs = []
    for folder in prepared.prepared:
        source = open_prepared(folder)
        if prepared.sft or prepared.pack:
            pairs.append(example_batches(source, val, d.seq_len, d.val_fraction, seed, prepared.pack, d.too_long))
        else:
            pairs.append(text_batches(source, val, d.seq_len, d.val_fraction, seed))
    return mixed(pairs, list(prepared.weights), seed)


def open_data(prepared: PreparedData, cfg: Config) -> OpenedData:
    seed = cfg.train.seed
    if prepared.prepared:
        train, val = _open_prepared_batches(prepared, cfg)
        return OpenedData(train=train, val=val, tokenizer=load_tokenizer(prepared.tokenizer_path))
    if prepared.kind == "digits":
        digits = load_digits(seed=seed)
        return OpenedData(train=ArrayBatches(digits.train_x, digits.train_y, seed=seed, shuffle=True),
                          val=ArrayBatches(digits.val_x, digits.val_y, seed=seed, shuffle=False),
                          tokenizer=None, n_features=NUM_FEATURES, n_classes=NUM_CLASSES)
    train, val = split_tokens(load_tokens(prepared.tokens_path), cfg.data.val_fraction, cfg.data.seq_len)
    return OpenedData(train=TokenBatches(train, cfg.data.seq_len, seed=seed, shuffle=True),
                      val=TokenBatches(val, cfg.data.seq_len, seed=seed, shuffle=False),
                      tokenizer=load_tokenizer(prepared.tokenizer_path))
