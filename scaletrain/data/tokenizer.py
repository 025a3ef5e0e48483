"""Tokenizers: raw UTF-8 bytes, or byte-level BPE trained locally.

The byte tokenizer needs no training and no files, so it is the default: any
text maps to ids 0..255 and back without loss. The BPE tokenizer wraps the
`tokenizers` library with a byte-level alphabet, so it also round-trips every
string, and is trained on the user's own corpus without any network access.

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

import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from scaletrain.errors import UserError


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
    """One token per UTF-8 byte."""

    name = "byte"
    vocab_size = 256
    longest_token_bytes = 1
    # Every id is a byte of the text, so none is free to mark the end of a document.
    eos_id = None
    config = None

    def encode(self, text: str, special_tokens: bool = True) -> np.ndarray:
        """The UTF-8 bytes of `text`; `special_tokens` is accepted for the BPE's interface, bytes have none."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)

    def decode(self, ids) -> str:
        # A model may sample a byte sequence that is not valid UTF-8.
        return bytes(_id_list(ids)).decode("utf-8", errors="replace")

    def to_json(self) -> str:
        return json.dumps({"kind": self.name})

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json(), encoding="utf-8")


def _byte_level(model: models.BPE) -> Tokenizer:
    """A BPE over the byte-level alphabet, as Radford et al. 2019 built theirs."""
    tokenizer = Tokenizer(model)
    # No prefix space: decode(encode(text)) must give back text exactly.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _bpe_trainer(vocab_size: int) -> trainers.BpeTrainer:
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet):
        raise UserError(
            f"--vocab-size {vocab_size} is below {len(alphabet)}, the byte alphabet "
            f"that BPE starts from; use {len(alphabet)} or more."
        )
    return trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=alphabet, show_progress=False)


class BPETokenizer:
    """Byte-level BPE from the `tokenizers` library, with an optional `TokenizerConfig`."""

    name = "bpe"

    def __init__(self, tokenizer: Tokenizer, config: TokenizerConfig | None = None):
        self._tokenizer = tokenizer
        self.config = config

    @classmethod
    def train(cls, files: list[Path], vocab_size: int) -> BPETokenizer:
        trainer = _bpe_trainer(vocab_size)
        tokenizer = _byte_level(models.BPE())
        tokenizer.train([str(f) for f in files], trainer)
        return cls(tokenizer)

    @classmethod
    def train_from_texts(cls, texts: Iterable[str], vocab_size: int) -> BPETokenizer:
        """Trained on strings rather than files: records of a data set, read one at a time."""
        trainer = _bpe_trainer(vocab_size)
        tokenizer = _byte_level(models.BPE())
        tokenizer.train_from_iterator(texts, trainer)
        return cls(tokenizer)

    @classmethod
    def load(cls, path: str | Path) -> BPETokenizer:
        """The tokenizer file `save` wrote, with its sidecar config when there is one."""
        sidecar = config_path(path)
        config = None
        if sidecar.is_file():
            try:
                config = TokenizerConfig(**json.loads(sidecar.read_text(encoding="utf-8")))
            except (UnicodeDecodeError, json.JSONDecodeError, TypeError):
                raise UserError(f"{sidecar} is not a tokenizer config that scaletrain wrote; delete it, or "
                                f"restore the one saved with {Path(path).name}.") from None
        return cls(Tokenizer.from_file(str(path)), config)

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

    def decode(self, ids) -> str:
        return self._tokenizer.decode(_id_list(ids))

    def to_json(self) -> str:
        # The library's own format; its "model.type" of "BPE" marks the kind.
        return self._tokenizer.to_str()

    def save(self, path: str | Path) -> None:
        """The tokenizer file, and its config beside it; a stale config of an earlier save goes."""
        Path(path).write_text(self.to_json(), encoding="utf-8")
        sidecar = config_path(path)
        if self.config is not None:
            sidecar.write_text(json.dumps(asdict(self.config), indent=2), encoding="utf-8")
        else:
            sidecar.unlink(missing_ok=True)


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
        return ByteTokenizer()
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
