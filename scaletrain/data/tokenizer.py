"""Tokenizers: raw UTF-8 bytes, or byte-level BPE trained locally.

The byte tokenizer needs no training and no files, so it is the default: any
text maps to ids 0..255 and back without loss. The BPE tokenizer wraps the
`tokenizers` library with a byte-level alphabet, so it also round-trips every
string, and is trained on the user's own corpus without any network access.

Both expose the same small interface (`name`, `vocab_size`, `encode`,
`decode`, `to_json`, `save`), and `load_tokenizer` reads back what `save`
wrote, so a run's checkpoint can carry its tokenizer.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from scaletrain.errors import UserError


def _id_list(ids) -> list[int]:
    # numpy arrays and torch tensors (even on a GPU) both offer tolist().
    return ids.tolist() if hasattr(ids, "tolist") else list(ids)


class ByteTokenizer:
    """One token per UTF-8 byte."""

    name = "byte"
    vocab_size = 256
    longest_token_bytes = 1

    def encode(self, text: str) -> np.ndarray:
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


class BPETokenizer:
    """Byte-level BPE from the `tokenizers` library."""

    name = "bpe"

    def __init__(self, tokenizer: Tokenizer):
        self._tokenizer = tokenizer

    @classmethod
    def train(cls, files: list[Path], vocab_size: int) -> BPETokenizer:
        alphabet = pre_tokenizers.ByteLevel.alphabet()
        if vocab_size < len(alphabet):
            raise UserError(
                f"--vocab-size {vocab_size} is below {len(alphabet)}, the byte alphabet "
                f"that BPE starts from; use {len(alphabet)} or more."
            )
        tokenizer = _byte_level(models.BPE())
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size, initial_alphabet=alphabet, show_progress=False
        )
        tokenizer.train([str(f) for f in files], trainer)
        return cls(tokenizer)

    @classmethod
    def load(cls, path: str | Path) -> BPETokenizer:
        return cls(Tokenizer.from_file(str(path)))

    @classmethod
    def from_vocab_merges(cls, vocab: str | Path, merges: str | Path) -> BPETokenizer:
        """The released byte-level BPE format: the token -> id map (vocab.json) and the merge rules in
        order (merges.txt)."""
        return cls(_byte_level(models.BPE.from_file(str(vocab), str(merges))))

    @property
    def vocab_size(self) -> int:
        # May be below the requested size when the corpus offers too few merges.
        return self._tokenizer.get_vocab_size()

    @property
    def longest_token_bytes(self) -> int:
        # The byte-level alphabet spells every byte as one character.
        return max(map(len, self._tokenizer.get_vocab()))

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tokenizer.encode(text).ids, dtype=np.int64)

    def decode(self, ids) -> str:
        return self._tokenizer.decode(_id_list(ids))

    def to_json(self) -> str:
        # The library's own format; its "model.type" of "BPE" marks the kind.
        return self._tokenizer.to_str()

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json(), encoding="utf-8")


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
