"""A prepared folder: token shards written once by `scaletrain prepare`, mapped by training without reading.

``DIR`` holds, for k = 0, 1, 2, ...:

* ``shard-0000k.bin``: token ids, little-endian ``uint16`` when the tokenizer has at most
  65536 ids, else ``uint32``; at most ``shard_tokens`` of them;
* ``shard-0000k.idx``: little-endian ``int64``, the offset inside the shard of every document
  that starts in it;
* ``shard-0000k.mask`` (kind "sft" only): one ``uint8`` per token, 1 where the token is trained;
* ``tokenizer.json``: the tokenizer the ids belong to;
* ``manifest.json``, written last, so that its presence means the folder is complete: the
  format version, kind, dtype, totals, tokenizer (name, vocabulary size, sha256 of its JSON),
  text field, sources (path, size, modification time, records), and every shard with its
  token and document counts and the sha256 of each of its files.

The shards concatenated in order are one stream of every document's tokens. A document may
continue from one shard into the next (a shard is cut where it is full, not where a document
ends), so shard size is a storage choice that readers never see: `TokenStream` reads across
the cut, and document d is ``tokens[starts[d]:starts[d + 1]]`` whichever shards it lies in.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from scaletrain.errors import UserError

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
TOKENIZER = "tokenizer.json"
PROGRESS = ".progress"  # prepare's work in progress (prepare.py); its presence without a manifest: interrupted
SHARD_TOKENS = 1 << 27  # 256 MiB of uint16 per shard: few files for a large corpus, each quick to hash
INDEX_DTYPE = np.dtype("<i8")
MASK_DTYPE = np.dtype("u1")
_HASH_CHUNK_BYTES = 8 << 20


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest little-endian unsigned type that holds every id."""
    return np.dtype("<u2" if vocab_size <= 1 << 16 else "<u4")


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


class TokenStream:
    """Several 1-D arrays (a prepared folder's shard memmaps) seen as one, never copied whole.

    It offers what training reads from a flat token array: ``len``, a slice (a view, lazy),
    one item, and an integer array of positions of any shape (``TokenBatches`` gathers its
    windows with a 2-D one), which returns the values in that shape; ``np.asarray`` of a
    small slice materializes it.
    """

    def __init__(self, arrays: list[np.ndarray], start: int = 0, stop: int | None = None):
        self._arrays = arrays
        self._bounds = np.cumsum([0] + [len(a) for a in arrays], dtype=np.int64)
        self._start = start
        self._stop = int(self._bounds[-1]) if stop is None else stop
        self.dtype = arrays[0].dtype  # a prepared folder has at least one shard

    def __len__(self) -> int:
        return self._stop - self._start

    def __repr__(self) -> str:
        return f"TokenStream({len(self)} tokens of {self.dtype}, {len(self._arrays)} shards)"

    def __getitem__(self, key):
        if isinstance(key, slice):
            start, stop, step = key.indices(len(self))
            if step != 1:
                raise ValueError(f"a TokenStream slice takes step 1, not {step}")
            return TokenStream(self._arrays, self._start + start, self._start + max(start, stop))
        if isinstance(key, (int, np.integer)):
            return int(self._gather(np.asarray(key, dtype=np.int64))[()])
        key = np.asarray(key)
        if key.dtype.kind not in "iu":
            raise TypeError(f"TokenStream indices must be integers or slices, not {key.dtype}")
        return self._gather(key.astype(np.int64))

    def _gather(self, positions: np.ndarray) -> np.ndarray:
        """The values at ``positions`` (negative ones count from the end), in their shape."""
        n = len(self)
        positions = np.where(positions < 0, positions + n, positions)
        if positions.size and (positions.min() < 0 or positions.max() >= n):
            raise IndexError(f"TokenStream index out of range for {n} tokens")
        flat = positions.reshape(-1) + self._start
        shard = np.searchsorted(self._bounds, flat, side="right") - 1
        out = np.empty(flat.shape, dtype=self.dtype)
        for s in np.unique(shard):
            here = shard == s
            out[here] = self._arrays[s][flat[here] - self._bounds[s]]
        return out.reshape(positions.shape)

    def __array__(self, dtype=None, copy=None):
        out = np.empty(len(self), dtype=self.dtype)
        for s, array in enumerate(self._arrays):
            lo = max(self._start, int(self._bounds[s]))
            hi = min(self._stop, int(self._bounds[s + 1]))
            if lo < hi:
                out[lo - self._start : hi - self._start] = array[lo - self._bounds[s] : hi - self._bounds[s]]
        return out if dtype is None else out.astype(dtype, copy=False)


@dataclass
class Prepared:
    """An opened prepared folder: document d is ``tokens[starts[d]:starts[d + 1]]``, trained where
    ``mask`` is 1 (kind "sft"; ``mask`` is None for kind "text", where every token is trained)."""

    folder: Path
    manifest: dict
    tokens: TokenStream
    starts: np.ndarray
    mask: TokenStream | None
    tokenizer_path: Path


def is_prepared(folder: str | Path) -> bool:
    """Whether ``folder`` holds a complete prepared folder (its manifest is written last)."""
    return os.path.isfile(Path(folder) / MANIFEST)  # False, not an error, below a folder that cannot be searched


def _corrupt(folder: Path, why: str) -> UserError:
    return UserError(f"{folder} is corrupt ({why}); run scaletrain prepare again.")


def _map(path: Path, dtype: np.dtype, count: int) -> np.ndarray:
    # An empty file cannot be memory-mapped; a shard is never empty, but its index may be.
    return np.memmap(path, dtype=dtype, mode="r", shape=(count,)) if count else np.empty(0, dtype)


def open_prepared(folder: str | Path, verify: bool = False) -> Prepared:
    """Map the shards of a folder `scaletrain prepare` wrote. Every shard file's size is checked against
    the manifest; with ``verify`` its sha256 too (a full read of the folder)."""
    folder = Path(folder)
    manifest_path = folder / MANIFEST
    if not manifest_path.is_file():
        if (folder / PROGRESS).is_dir():
            raise UserError(f"{folder} has no {MANIFEST}: scaletrain prepare was interrupted while writing it; "
                            f"rerun the same scaletrain prepare command to resume.")
        raise UserError(f"{folder} has no {MANIFEST}, so it is not a prepared folder; write one with "
                        f"scaletrain prepare --out {folder}.")
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        dtype = np.dtype(manifest["dtype"]).newbyteorder("<")
        shards = manifest["shards"]
        masked = manifest["kind"] == "sft"
    except (ValueError, KeyError, TypeError) as exc:
        raise _corrupt(folder, f"its {MANIFEST} cannot be read: {exc}") from None
    tokens, masks, starts, offset = [], [], [], 0
    for shard in shards:
        n, d = shard["tokens"], shard["documents"]
        parts = {"bin": (dtype, n), "idx": (INDEX_DTYPE, d), **({"mask": (MASK_DTYPE, n)} if masked else {})}
        for ext, (part_dtype, count) in parts.items():
            path = folder / f"{shard['name']}.{ext}"
            if not path.is_file():
                raise _corrupt(folder, f"{path.name} is missing")
            if path.stat().st_size != part_dtype.itemsize * count:
                raise _corrupt(folder, f"{path.name} holds {path.stat().st_size} bytes where the manifest "
                                       f"says {part_dtype.itemsize * count}")
            if verify and sha256_file(path) != shard["sha256"][ext]:
                raise _corrupt(folder, f"{path.name} does not match its sha256 in the manifest")
        tokens.append(_map(folder / f"{shard['name']}.bin", dtype, n))
        if masked:
            masks.append(_map(folder / f"{shard['name']}.mask", MASK_DTYPE, n))
        starts.append(offset + np.fromfile(folder / f"{shard['name']}.idx", dtype=INDEX_DTYPE))
        offset += n
    starts.append(np.array([offset], dtype=np.int64))
    return Prepared(folder=folder, manifest=manifest, tokens=TokenStream(tokens),
                    starts=np.concatenate(starts).astype(np.int64), mask=TokenStream(masks) if masked else None,
                    tokenizer_path=folder / TOKENIZER)


class _PartFile:
    """One file of a shard being written: under a temporary name, hashed as it is written."""

    def __init__(self, path: Path):
        self.path = path
        self.tmp = path.with_name(path.name + ".tmp")
        self.file = open(self.tmp, "wb")
        self.digest = hashlib.sha256()

    def write(self, array: np.ndarray) -> None:
        data = array.tobytes()
        self.file.write(data)
        self.digest.update(data)


class ShardWriter:
    """Documents written into shards ``{stem}-000``, ``{stem}-001``, ... of at most ``shard_tokens``
    tokens, a document continuing into the next shard when one is full; `close` publishes them
    (each file renamed from its temporary name) and describes them, `discard` removes them."""

    def __init__(self, folder: Path, stem: str, dtype: np.dtype, shard_tokens: int, masked: bool):
        self._folder, self._stem, self._dtype = folder, stem, dtype
        self._shard_tokens, self._masked = shard_tokens, masked
        self._parts: list[dict] = []  # each: its files by extension, tokens, documents

    def _open_part(self) -> dict:
        name = f"{self._stem}-{len(self._parts):03d}"
        files = {ext: _PartFile(self._folder / f"{name}.{ext}") for ext in ("bin", "idx", "mask")[: 2 + self._masked]}
        self._parts.append({"files": files, "tokens": 0, "documents": 0})
        return self._parts[-1]

    def add(self, ids: np.ndarray, mask: np.ndarray | None = None) -> None:
        """One document (``ids`` non-empty); ``mask``, for a writer of masks, is its trained tokens."""
        part = self._parts[-1] if self._parts and self._parts[-1]["tokens"] < self._shard_tokens else self._open_part()
        part["files"]["idx"].write(np.array([part["tokens"]], dtype=INDEX_DTYPE))
        part["documents"] += 1
        ids = ids.astype(self._dtype)
        mask = None if mask is None else mask.astype(MASK_DTYPE)
        done = 0
        while done < len(ids):
            if part["tokens"] == self._shard_tokens:
                part = self._open_part()
            take = min(self._shard_tokens - part["tokens"], len(ids) - done)
            part["files"]["bin"].write(ids[done : done + take])
            if self._masked:
                part["files"]["mask"].write(mask[done : done + take])
            part["tokens"] += take
            done += take

    def close(self) -> list[dict]:
        """Publish every shard; per shard its token and document counts and the sha256 of each file."""
        described = []
        for part in self._parts:
            for f in part["files"].values():
                f.file.close()
                os.replace(f.tmp, f.path)
            described.append({"tokens": part["tokens"], "documents": part["documents"],
                              "sha256": {ext: f.digest.hexdigest() for ext, f in part["files"].items()}})
        return described

    def discard(self) -> None:
        for part in self._parts:
            for f in part["files"].values():
                f.file.close()
                for path in (f.tmp, f.path):
                    path.unlink(missing_ok=True)
