"""Text corpora on disk and their tokenized cache.

Without `--data`, the corpus is the Python standard library's own `.py` source,
without its test suites and IDLE: on CPython 3.11 that is 674 files, 11.4 MB,
11.4 M byte tokens (3.5 M with a 4096-token BPE), with a byte-level unigram
entropy of 3.24 nats. It ships with every Python, so training works offline
with nothing to download, and real code has structure a small model can learn.

A corpus is tokenized once into a flat binary file of token ids that
`np.memmap` opens without reading it all, next to a JSON sidecar that records
its dtype and length. The file name carries a hash of the tokenizer and of
each input file's path, size and modification time, so a later run with the
same inputs reuses it and any change builds a fresh one.
"""

from __future__ import annotations

import codecs
import hashlib
import json
import os
import sysconfig
import tempfile
from pathlib import Path

import numpy as np

from scaletrain.data.tokenizer import BPETokenizer, ByteTokenizer, document_separator
from scaletrain.errors import UserError
from scaletrain.paths import readable_dir, readable_file, readable_file_or_dir

DATA_WANTED = "a UTF-8 text file or a folder of them"  # what --data must be, in its refusals

_DEFAULT_CORPUS_SKIPPED_DIRS = {"site-packages", "__pycache__", "test", "tests", "idlelib"}
_READ_CHUNK_BYTES = 1 << 20
_COUNT_CHUNK_TOKENS = 1 << 24


def default_corpus_files() -> list[Path]:
    """The standard library's `.py` files, in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = [d for d in subfolders if d not in _DEFAULT_CORPUS_SKIPPED_DIRS]
        files.extend(Path(folder) / name for name in names if name.endswith(".py"))
    return sorted(files)


def _is_utf8_text(path: Path) -> bool:
    # Decoding in chunks checks a large file without holding it in memory.
    decoder = codecs.getincrementaldecoder("utf-8")()
    try:
        with open(path, "rb") as f:
            while chunk := f.read(_READ_CHUNK_BYTES):
                decoder.decode(chunk)
        decoder.decode(b"", final=True)
    except UnicodeDecodeError:
        return False
    return True


def _refuse_unreadable(error: OSError) -> None:
    """os.walk's report of a subfolder it cannot list: refused in the user's words."""
    readable_dir("--data", error.filename, DATA_WANTED)


def _files_below(folder: Path) -> list[Path]:
    """The files under ``folder``, hidden ones left out."""
    files = []
    for parent, subfolders, names in os.walk(folder, onerror=_refuse_unreadable):
        subfolders[:] = [d for d in subfolders if not d.startswith(".")]
        files.extend(Path(parent) / name for name in names if not name.startswith("."))
    return sorted(files)


def corpus_files(path: str | Path | None) -> list[Path]:
    """The text files a corpus is made of: the default corpus, one file, or a folder's files."""
    if path is None:
        files = default_corpus_files()
        if not files:
            raise UserError(
                "This Python has no standard library source to train on; give a text corpus with --data PATH."
            )
        return files
    path = readable_file_or_dir("--data", path, DATA_WANTED)
    if path.is_file():
        if not _is_utf8_text(path):
            raise UserError(f"--data {path} is not UTF-8 text; give {DATA_WANTED}.")
        if path.stat().st_size == 0:
            raise UserError(f"--data {path} is empty; give a file that holds text.")
        return [path]
    # Inside a folder, binary and empty files are expected company (images, lock files): skip them. Unreadable
    # files and subfolders are refused: skipped, they would leave part of the corpus out unnoticed.
    candidates = [readable_file("--data", f, DATA_WANTED) for f in _files_below(path) if f.is_file()]
    files = [f for f in candidates if f.stat().st_size > 0 and _is_utf8_text(f)]
    if not files:
        raise UserError(f"--data {path} holds no non-empty UTF-8 text files; put text files in it.")
    return files


def files_fingerprint(files: list[Path]) -> str:
    """sha256 over each file's absolute path, size and modification time: it
    changes whenever a file is added, removed or edited."""
    digest = hashlib.sha256()
    for f in files:
        stat = f.stat()
        digest.update(json.dumps([str(f.resolve()), stat.st_size, stat.st_mtime_ns]).encode("utf-8"))
    return digest.hexdigest()


def _cache_key(files: list[Path], tokenizer: ByteTokenizer | BPETokenizer) -> str:
    identity = [tokenizer.name, tokenizer.vocab_size, tokenizer.to_json(), document_separator(tokenizer).tolist(),
                files_fingerprint(files)]
    return hashlib.sha256(json.dumps(identity).encode("utf-8")).hexdigest()


def _token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def _sidecar(tokens_path: Path) -> Path:
    return tokens_path.with_suffix(".json")


def _read_text(path: Path) -> str:
    # Not read_text(): its newline translation would change the bytes being tokenized.
    return path.read_bytes().decode("utf-8")


def _separator_tokens(files: list[Path], tokenizer: ByteTokenizer | BPETokenizer) -> int:
    return len(document_separator(tokenizer)) * (len(files) - 1)


def count_tokens(files: list[Path], tokenizer: ByteTokenizer | BPETokenizer) -> int:
    """The length of the token file `build_token_cache` would write, without writing it."""
    return _separator_tokens(files, tokenizer) + sum(len(tokenizer.encode(_read_text(f))) for f in files)


def token_lower_bound(files: list[Path], tokenizer: ByteTokenizer | BPETokenizer) -> int:
    """At most `count_tokens`, from the files' sizes alone: no token spans more than
    `tokenizer.longest_token_bytes` bytes."""
    n_bytes = sum(f.stat().st_size for f in files)
    return _separator_tokens(files, tokenizer) + n_bytes // tokenizer.longest_token_bytes


def _write_tokens(files: list[Path], tokenizer: ByteTokenizer | BPETokenizer, dtype: np.dtype, out) -> int:
    # Between files, so a model sees where one document ends and the next starts.
    separator = document_separator(tokenizer).astype(dtype)
    n_tokens = 0
    for i, f in enumerate(files):
        ids = tokenizer.encode(_read_text(f)).astype(dtype)
        if i:
            separator.tofile(out)
            n_tokens += len(separator)
        ids.tofile(out)
        n_tokens += len(ids)
    return n_tokens


def _publish(cache_dir: Path, final: Path, write):
    """Create `final` with `write(out)` on a binary file; return what `write` returns."""
    # Written under a temporary name and renamed: os.replace is atomic, so a
    # reader (or another rank building the same cache) never sees a partial file.
    fd, tmp = tempfile.mkstemp(dir=cache_dir, prefix=f".{final.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as out:
            result = write(out)
        os.replace(tmp, final)
    except BaseException:
        os.unlink(tmp)
        raise
    return result


def build_token_cache(files: list[Path], tokenizer: ByteTokenizer | BPETokenizer, cache_dir: Path) -> Path:
    """Tokenize `files` once into `cache_dir`; return the token file for `load_tokens`."""
    cache_dir = Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    key = _cache_key(files, tokenizer)
    tokens_path = cache_dir / f"tokens-{key[:16]}.bin"
    sidecar = _sidecar(tokens_path)
    # The sidecar is published last, so its presence means the token file is complete.
    if sidecar.is_file() and json.loads(sidecar.read_text(encoding="utf-8")).get("key") == key:
        return tokens_path

    dtype = _token_dtype(tokenizer.vocab_size)
    n_tokens = _publish(cache_dir, tokens_path, lambda out: _write_tokens(files, tokenizer, dtype, out))
    meta = {
        "key": key,
        "dtype": dtype.name,
        "n_tokens": n_tokens,
        "tokenizer": tokenizer.name,
        "vocab_size": tokenizer.vocab_size,
        "num_files": len(files),
    }
    _publish(cache_dir, sidecar, lambda out: out.write(json.dumps(meta, indent=2).encode("utf-8")))
    return tokens_path


def load_tokens(path: str | Path) -> np.memmap:
    """The token ids of a cache file, mapped read-only."""
    path = Path(path)
    meta = json.loads(_sidecar(path).read_text(encoding="utf-8"))
    return np.memmap(path, dtype=np.dtype(meta["dtype"]), mode="r", shape=(meta["n_tokens"],))


def unigram_entropy_nats(tokens: np.ndarray, vocab_size: int) -> float:
    """Entropy of the token frequencies: the loss of a model that ignores context."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    # Counted in slices so a large memmap is never copied whole into memory.
    for start in range(0, len(tokens), _COUNT_CHUNK_TOKENS):
        counts += np.bincount(np.asarray(tokens[start : start + _COUNT_CHUNK_TOKENS]), minlength=vocab_size)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())
