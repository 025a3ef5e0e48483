"""Tokenizers: raw UTF-8 bytes, or byte-level BPE trained locally.

The byte tokenizer needs no training and no files, so it is the default: any
text maps to ids 0..255 and back without loss. The BPE tokenizer wraps the
`tokenizers` library with a byte-level alphabet, so it also round-trips every
string, and is trained on the user's own corpus without any network access.

Both reserve one special token past their vocabulary, `END_OF_TEXT`
(``<|endoftext|>``, as the released byte-level BPEs spell it: id 256 for
bytes, the last id for a BPE): it ends every document of a text stream and
every record, so a model learns where a text stops, and generation stops
there too. The token's text,
written in a string, encodes to that one id, as `transformers` splits out
its special tokens, so our ids and an exported folder's agree. Tokenizers
saved before it existed load without it and keep their ids
(``ByteTokenizer(end_of_text=None)``, a BPE without the added token): a
run's tokenizer is part of the run.

Both expose the same small interface (`name`, `vocab_size`, `eos_id`,
`encode`, `decode`, `to_json`, `save`), and `load_tokenizer` reads back what
`save` wrote, so a run's checkpoint can carry its tokenizer.

A BPE tokenizer read from a Hugging Face folder also carries that folder's
`TokenizerConfig`: its named special tokens and its chat template, which
instruction fine-tuning renders conversations with (data/chat.py). The
tokenizers library's file format has no place for them, so `save` writes them
to a sidecar `<stem>.config.json` beside the tokenizer file, the way
transformers keeps them in tokenizer_config.json beside tokenizer.json.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from scaletrain.errors import UserError


END_OF_TEXT = "<|endoftext|>"
BLANK_LINE = "\n\n"  # between documents, for a tokenizer saved without an end-of-text token


def _id_list(ids) -> list[int]:
    # numpy arrays and torch tensors (even on a GPU) both offer tolist().
    return ids.tolist() if hasattr(ids, "tolist") else list(ids)


@dataclass
class TokenizerConfig:
    """A tokenizer's named special tokens and chat template, as tokenizer_config.json holds them."""

    bos_token: str | None = None
    eos_token: str | None = None
    pad_token: str | None = None
    chat_template: str | None = None
    # The other named special tokens (unk_token, sep_token, ...): chat templates may read them too.
    extra_tokens: dict[str, str] = field(default_factory=dict)

    def template_tokens(self) -> dict[str, str]:
        """Every named special token that is set, under its name: the variables transformers gives
        a chat template besides the messages."""
        named = {"bos_token": self.bos_token, "eos_token": self.eos_token, "pad_token": self.pad_token}
        return {**self.extra_tokens, **{key: value for key, value in named.items() if value is not None}}


def config_path(path: str | Path) -> Path:
    """Where `BPETokenizer.save(path)` keeps the tokenizer's config: `<stem>.config.json` beside it."""
    path = Path(path)
    return path.with_name(f"{path.stem}.config.json")


class ByteTokenizer:
    """One token per UTF-8 byte, and `END_OF_TEXT` as id 256 (None: a tokenizer saved before it)."""

    name = "byte"

    def __init__(self, end_of_text: str | None = END_OF_TEXT):
        self.end_of_text = end_of_text
        self.eos_id = None if end_of_text is None else 256
        self.vocab_size = 256 if end_of_text is None else 257
        # The special token's text is one token: a lower bound on a count must allow for it.
        self.longest_token_bytes = 1 if end_of_text is None else len(end_of_text.encode("utf-8"))
        self.config = None if end_of_text is None else own_config(end_of_text)

    def encode(self, text: str, special_tokens: bool = True) -> np.ndarray:
        """The UTF-8 bytes of `text`, the end-of-text token's text as its one id; `special_tokens` is
        accepted for the BPE's interface (bytes add no BOS or EOS of their own)."""
        texts = text.split(self.end_of_text) if self.end_of_text is not None else [text]
        pieces = [np.frombuffer(piece.encode("utf-8"), dtype=np.uint8) for piece in texts]
        ids = [pieces[0]]
        for piece in pieces[1:]:
            ids += [np.array([self.eos_id]), piece]
        return np.concatenate(ids).astype(np.int64)

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        """Bytes back to text; the end-of-text id left out, or with ``skip_special_tokens=False``
        written as its token's text (as transformers decodes). A model may sample bytes that are
        not valid UTF-8: they become U+FFFD."""
        text, run = [], []
        for i in _id_list(ids):
            if i != self.eos_id:
                run.append(i)
                continue
            text.append(bytes(run).decode("utf-8", errors="replace"))
            run = []
            if not skip_special_tokens:
                text.append(self.end_of_text)
        return "".join(text) + bytes(run).decode("utf-8", errors="replace")

    def to_json(self) -> str:
        saved = {"kind": self.name}
        if self.end_of_text is not None:
            saved["end_of_text"] = self.end_of_text
        return json.dumps(saved)

    def save(self, path: str | Path) -> None:
        """The tokenizer file, and beside it the chat template a run trained with, if any."""
        Path(path).write_text(self.to_json(), encoding="utf-8")
        _save_config(path, self.config if self.config is not None and self.config.chat_template else None)


def _save_config(path: str | Path, config: TokenizerConfig | None) -> None:
    """The sidecar beside a tokenizer file: ``config``, or none (a stale one of an earlier save goes)."""
    sidecar = config_path(path)
    if config is not None:
        sidecar.write_text(json.dumps(asdict(config), indent=2), encoding="utf-8")
    else:
        sidecar.unlink(missing_ok=True)


def _load_config(path: str | Path) -> TokenizerConfig | None:
    """The sidecar `_save_config` wrote beside ``path``; None without one."""
    sidecar = config_path(path)
    if not sidecar.is_file():
        return None
    try:
        return TokenizerConfig(**json.loads(sidecar.read_text(encoding="utf-8")))
    except (UnicodeDecodeError, json.JSONDecodeError, TypeError):
        raise UserError(f"{sidecar} is not a tokenizer config that scaletrain wrote; delete it, or "
                        f"restore the one saved with {Path(path).name}.") from None


def with_chat_template(tokenizer, source: str):
    """A copy of ``tokenizer`` whose config carries the chat template ``source``: what a run that
    trained in that template saves, so that generate, eval and the export render as it did."""
    config = tokenizer.config if tokenizer.config is not None else TokenizerConfig()
    templated = copy.copy(tokenizer)
    templated.config = replace(config, chat_template=source)
    return templated


def own_config(end_of_text: str) -> TokenizerConfig:
    """The special tokens of a tokenizer made here: `END_OF_TEXT` begins and ends a text, as
    released byte-level BPEs declare theirs (BOS and EOS the same token)."""
    return TokenizerConfig(bos_token=end_of_text, eos_token=end_of_text)


def document_separator(tokenizer) -> np.ndarray:
    """What ends a document in a text stream or a record: the end-of-text id, or (a tokenizer
    saved without one) the ids of a blank line."""
    eos = tokenizer.eos_id
    return np.array([eos], dtype=np.int64) if eos is not None else tokenizer.encode(BLANK_LINE).astype(np.int64)


def _byte_level(model: models.BPE) -> Tokenizer:
    """A BPE over the byte-level alphabet, as Radford et al. 2019 built theirs."""
    tokenizer = Tokenizer(model)
    # No prefix space: decode(encode(text)) must give back text exactly.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _bpe_trainer(vocab_size: int) -> trainers.BpeTrainer:
    """A trainer for ``vocab_size`` tokens in all: the byte alphabet, the merges, and `END_OF_TEXT`
    (added after training, so the merges get one id less)."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + 1:
        raise UserError(
            f"--vocab-size {vocab_size} is below {len(alphabet) + 1}, the byte alphabet that BPE "
            f"starts from and its end-of-text token; use {len(alphabet) + 1} or more."
        )
    return trainers.BpeTrainer(vocab_size=vocab_size - 1, initial_alphabet=alphabet, show_progress=False)


def _with_end_of_text(tokenizer: Tokenizer) -> Tokenizer:
    """`END_OF_TEXT` added after training, as the last id (where released byte-level BPEs have it): the merges never
    learn to build it from bytes, and the text spelling it encodes to it alone."""
    tokenizer.add_special_tokens([AddedToken(END_OF_TEXT, special=True, normalized=False)])
    return tokenizer


class BPETokenizer:
    """Byte-level BPE from the `tokenizers` library, with an optional `TokenizerConfig`. One trained
    here carries `END_OF_TEXT`, and without a config of its own declares it (`own_config`)."""

    name = "bpe"

    def __init__(self, tokenizer: Tokenizer, config: TokenizerConfig | None = None):
        self._tokenizer = tokenizer
        if config is None and END_OF_TEXT in {t.content for t in tokenizer.get_added_tokens_decoder().values()
                                              if t.special}:
            config = own_config(END_OF_TEXT)
        self.config = config

    @classmethod
    def train(cls, files: list[Path], vocab_size: int) -> BPETokenizer:
        trainer = _bpe_trainer(vocab_size)
        tokenizer = _byte_level(models.BPE())
        tokenizer.train([str(f) for f in files], trainer)
        return cls(_with_end_of_text(tokenizer))

    @classmethod
    def train_from_texts(cls, texts: Iterable[str], vocab_size: int) -> BPETokenizer:
        """Trained on strings rather than files: records of a data set, read one at a time."""
        trainer = _bpe_trainer(vocab_size)
        tokenizer = _byte_level(models.BPE())
        tokenizer.train_from_iterator(texts, trainer)
        return cls(_with_end_of_text(tokenizer))

    @classmethod
    def load(cls, path: str | Path) -> BPETokenizer:
        """The tokenizer file `save` wrote, with its sidecar config when there is one."""
        return cls(Tokenizer.from_file(str(path)), _load_config(path))

    @classmethod
    def from_vocab_merges(cls, vocab: str | Path, merges: str | Path,
                          config: TokenizerConfig | None = None) -> BPETokenizer:
        """The released byte-level BPE format: the token -> id map (vocab.json) and the merge rules in
        order (merges.txt)."""
        return cls(_byte_level(models.BPE.from_file(str(vocab), str(merges))), config)

    @property
    def vocab_size(self) -> int:
        # May be below the requested size when the corpus offers too few merges.
        return self._tokenizer.get_vocab_size()

    @property
    def longest_token_bytes(self) -> int:
        # The byte-level alphabet spells every byte as one character.
        return max(map(len, self._tokenizer.get_vocab()))

    @property
    def eos_id(self) -> int | None:
        """The id of the config's end-of-sequence token; None without one."""
        if self.config is None or self.config.eos_token is None:
            return None
        return self._tokenizer.token_to_id(self.config.eos_token)

    def encode(self, text: str, special_tokens: bool = True) -> np.ndarray:
        """Ids of `text`. Without `special_tokens` the post-processor adds no BOS/EOS: a rendered chat
        template already spells them out. Special tokens written in the text map to their single ids
        either way, since the library splits added tokens out before the model sees the text."""
        return np.asarray(self._tokenizer.encode(text, add_special_tokens=special_tokens).ids, dtype=np.int64)

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode(_id_list(ids), skip_special_tokens=skip_special_tokens)

    def to_json(self) -> str:
        # The library's own format; its "model.type" of "BPE" marks the kind.
        return self._tokenizer.to_str()

    def save(self, path: str | Path) -> None:
        """The tokenizer file, and its config beside it; a stale config of an earlier save goes."""
        Path(path).write_text(self.to_json(), encoding="utf-8")
        _save_config(path, self.config)


def until_end(tokenizer, ids: list[int]) -> list[int]:
    """``ids`` up to (without) the first end-of-text id: where a generated text ends."""
    eos = tokenizer.eos_id
    return ids[:ids.index(eos)] if eos is not None and eos in ids else ids


def load_tokenizer(path: str | Path) -> ByteTokenizer | BPETokenizer:
    """Read back a tokenizer written by `save`."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"No tokenizer file at {path}; give the tokenizer.json a training run saved.")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        data = None
    if isinstance(data, dict) and data.get("kind") == ByteTokenizer.name:
        tokenizer = ByteTokenizer(end_of_text=data.get("end_of_text"))
        saved = _load_config(path)
        return with_chat_template(tokenizer, saved.chat_template) if saved and saved.chat_template else tokenizer
    if isinstance(data, dict) and (data.get("model") or {}).get("type") == "BPE":
        return BPETokenizer.load(path)
    raise UserError(f"{path} is not a saved byte or BPE tokenizer; give the tokenizer.json a training run saved.")


def make_tokenizer(kind: str, files: list[Path], vocab_size: int) -> ByteTokenizer | BPETokenizer:
    """A new tokenizer of the named kind; BPE is trained on `files`."""
    if kind == ByteTokenizer.name:
        return ByteTokenizer()
    if kind == BPETokenizer.name:
        return BPETokenizer.train(files, vocab_size)
    raise UserError(f"Unknown tokenizer {kind!r}; use --tokenizer byte or --tokenizer bpe.")
