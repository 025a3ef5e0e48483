"""Records (JSON objects) read from the files and folders data sets come in, cut into units of work.

A source is one of:

* a ``.jsonl`` file: one JSON object per line, blank lines skipped;
* a ``.json`` file: a JSON array of objects, or JSON lines as in ``.jsonl``;
* a ``.parquet`` file, read a batch of rows at a time;
* a folder written by ``datasets``' ``save_to_disk``, opened with ``load_from_disk``
  (memory-mapped arrow); a ``DatasetDict``'s folder gives its ``train`` split;
* any other folder: its data files (jsonl, json, parquet, csv, ...) as
  ``datasets.load_dataset(folder, split="train")`` reads them, converted once
  into arrow files under a cache folder and memory-mapped from there.

Parallel workers need the work cut into pieces whose order does not depend on
how many workers there are. A unit is one such piece: a byte range of a JSON
lines file (a unit owns the lines that *start* inside its range, so a line cut
by a boundary is read whole by the unit where it starts, and no unit needs to
know where the others are), a row group of a Parquet file, a range of rows of
an arrow data set. A JSON array cannot be cut without parsing it all, so it is
one unit, read by a streaming decoder that holds one record at a time.
Reading the units of a source in order gives its records in file order.

Parsing is the libraries' (``json``, ``pyarrow``, ``datasets``); only the
cutting is written here. Every refusal names the file, and the line or record
where that helps, and says what to change.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from scaletrain.errors import UserError
from scaletrain.paths import readable_file_or_dir

UNIT_BYTES = 64 << 20  # a unit's share of a JSON lines file: a few seconds of work for one worker
SOURCES_WANTED = ("a .jsonl, .json or .parquet file, a folder that datasets' save_to_disk wrote, or a folder "
                  "of data files that datasets.load_dataset reads")
_BATCH_BYTES = 16 << 20  # rows read from arrow or Parquet at a time: about this much data
_BATCH_ROWS = 1024
_CHUNK_BYTES = 1 << 20
_SAVED_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")
_JSON_TYPES = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", int: "a number",
               float: "a number", type(None): "null"}


def json_type(value) -> str:
    """The JSON name of a decoded value's type, with its article ("an object", "null")."""
    return _JSON_TYPES.get(type(value), type(value).__name__)


@dataclass(frozen=True)
class Unit:
    """One piece of a source: ``start``..``stop`` are bytes of a JSON lines file, or rows of a Parquet
    file (``group`` its row group) or of an arrow data set; ``weight`` is its size in bytes, for progress."""

    source: Path
    format: str  # "jsonl", "json" (an array), "parquet", "saved" (save_to_disk) or "dataset" (load_dataset)
    start: int
    stop: int
    weight: int
    group: int = 0
    cache_dir: str | None = None
    stamp: tuple[int, int] = (0, 0)  # an arrow folder's size and modification time when the unit was cut


def _first_char(path: Path) -> str:
    """The first character of a file that is not whitespace ("" when there is none)."""
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK_BYTES):
            if stripped := chunk.lstrip():
                return chr(stripped[0])
    return ""


def _files_below(folder: Path) -> list[Path]:
    """The files under ``folder``, hidden ones (and those in hidden folders) left out, as datasets does."""
    files = []
    for parent, subfolders, names in os.walk(folder):
        subfolders[:] = [d for d in subfolders if not d.startswith(".")]
        files.extend(Path(parent) / name for name in names if not name.startswith("."))
    return sorted(files)


def is_saved_dataset(folder: Path) -> bool:
    """Whether ``folder`` is one ``datasets``' ``save_to_disk`` wrote (False, not an error, below a
    folder that cannot be searched)."""
    return any(os.path.isfile(Path(folder) / name) for name in _SAVED_MARKERS)


def source_format(path: Path, flag: str = "--data") -> str:
    """The format of a source (see `Unit.format`); refused unless it exists, is readable, holds
    something and has a known kind."""
    path = readable_file_or_dir(flag, path, SOURCES_WANTED)
    if path.is_dir():
        if is_saved_dataset(path):
            return "saved"
        if not _files_below(path):
            raise UserError(f"{flag} {path} is an empty folder; give a folder that holds data files.")
        return "dataset"
    suffix = path.suffix.lower()
    if suffix not in (".jsonl", ".json", ".parquet"):
        raise UserError(f"{flag} {path} has the unknown extension {suffix!r}; give {SOURCES_WANTED}.")
    if suffix == ".parquet":
        if path.stat().st_size == 0:
            raise UserError(f"{flag} {path} is empty; give a file that holds records.")
        return "parquet"
    first = _first_char(path)
    if not first:
        raise UserError(f"{flag} {path} is empty; give a file that holds records.")
    return "json" if suffix == ".json" and first == "[" else "jsonl"


def describe_source(path: Path) -> dict:
    """What identifies a source's content cheaply: its path, format, size in bytes and latest modification
    time (of every file below it, for a folder)."""
    path = Path(path)
    fmt = source_format(path)
    files = _files_below(path) if path.is_dir() else [path]
    stats = [f.stat() for f in files] + [path.stat()]
    return {"path": str(path.resolve()), "format": fmt, "bytes": sum(s.st_size for s in stats[:-1]),
            "mtime_ns": max(s.st_mtime_ns for s in stats)}


@functools.lru_cache(maxsize=8)
def _open_dataset(path: Path, fmt: str, cache_dir: str | None, stamp: tuple[int, int]):
    """The arrow data set of a folder, opened once per process (workers read many units of it) and
    again when ``stamp`` says the folder changed."""
    import datasets  # imported here: it is slow to import and only folders need it

    if fmt == "saved":
        loaded = datasets.load_from_disk(str(path))
        if isinstance(loaded, datasets.DatasetDict):
            if "train" not in loaded:
                raise UserError(f"--data {path} holds the splits {', '.join(loaded)} but no 'train'; save the "
                                f"records to use as a 'train' split, or save that split alone.")
            loaded = loaded["train"]
    else:
        try:
            loaded = datasets.load_dataset(str(path), split="train", cache_dir=cache_dir)
        except (datasets.exceptions.DatasetsError, FileNotFoundError, ValueError) as exc:
            reason = exc.__cause__ or exc
            raise UserError(f"--data {path} cannot be read by datasets.load_dataset ({reason}); give "
                            f"{SOURCES_WANTED}.") from None
    return loaded.with_format(None)


def _parquet(path: Path):
    import pyarrow
    import pyarrow.parquet

    try:
        return pyarrow.parquet.ParquetFile(path)
    except pyarrow.ArrowException as exc:
        raise UserError(f"--data {path} is not a readable Parquet file ({exc}); give a Parquet file "
                        f"written by pyarrow, pandas or datasets.") from None


def source_units(path: Path, unit_bytes: int = UNIT_BYTES, cache_dir: str | Path | None = None) -> list[Unit]:
    """A source cut into units, in order; ``cache_dir`` holds what ``load_dataset`` converts."""
    path = Path(path)
    fmt = source_format(path)
    cache = None if cache_dir is None else str(cache_dir)
    if fmt == "jsonl":
        size = path.stat().st_size
        return [Unit(path, fmt, start, min(start + unit_bytes, size), min(unit_bytes, size - start))
                for start in range(0, size, unit_bytes)]
    if fmt == "json":
        return [Unit(path, fmt, 0, path.stat().st_size, path.stat().st_size)]
    if fmt == "parquet":
        metadata, units, row = _parquet(path).metadata, [], 0
        for group in range(metadata.num_row_groups):
            rows = metadata.row_group(group).num_rows
            units.append(Unit(path, fmt, row, row + rows, metadata.row_group(group).total_byte_size, group))
            row += rows
        if row == 0:
            raise UserError(f"--data {path} holds no rows; give a Parquet file that holds records.")
        return units
    described = describe_source(path)
    stamp = (described["bytes"], described["mtime_ns"])
    table = _open_dataset(path, fmt, cache, stamp)
    n, nbytes = len(table), table.data.nbytes
    if n == 0:
        raise UserError(f"--data {path} holds no records; give a data set that holds some.")
    rows = max(1, unit_bytes * n // max(nbytes, 1))
    return [Unit(path, fmt, start, min(start + rows, n), nbytes * (min(start + rows, n) - start) // n,
                 cache_dir=cache, stamp=stamp) for start in range(0, n, rows)]


def _line_number(path: Path, offset: int) -> int:
    """The 1-based number of the line that starts at byte ``offset`` (counted only for a refusal)."""
    count = 1
    with open(path, "rb") as f:
        while offset > 0 and (chunk := f.read(min(_CHUNK_BYTES, offset))):
            count += chunk.count(b"\n")
            offset -= len(chunk)
    return count


def _read_lines(unit: Unit, reader: UnitReader) -> Iterator[tuple[int, int, object]]:
    with open(unit.source, "rb") as f:
        offset = unit.start
        if offset:  # the line running across the unit's start belongs to the unit before
            f.seek(offset - 1)
            offset += len(f.readline()) - 1
        while offset < unit.stop and (line := f.readline()):
            if line.strip():
                try:
                    record = json.loads(line)
                except UnicodeDecodeError:
                    reader.at = offset
                    raise UserError(f"{reader.where()} is not UTF-8; save the file as UTF-8 text.") from None
                except ValueError as exc:
                    reader.at = offset
                    raise UserError(f"{reader.where()} is not JSON ({exc}); write one JSON object per "
                                    f"line.") from None
                yield offset, offset - unit.start, record
            offset += len(line)


def _read_array(unit: Unit, reader: UnitReader) -> Iterator[tuple[int, int, object]]:
    """The elements of a JSON array, decoded one at a time from a buffer refilled as it runs dry."""
    decoder = json.JSONDecoder()
    with open(unit.source, encoding="utf-8") as f:
        text, pos, eof, index, consumed = "", 0, False, 0, 0

        def refill() -> bool:  # more text after pos; False at the end of the file
            nonlocal text, pos, eof, consumed
            # Doubling the read keeps a record longer than a chunk from being re-decoded once per chunk.
            chunk = f.read(max(_CHUNK_BYTES, len(text) - pos))
            consumed += pos
            text, pos, eof = text[pos:] + chunk, 0, not chunk
            return bool(chunk)

        def next_char() -> str:  # the next character that is not whitespace, not consumed
            nonlocal pos
            while True:
                while pos < len(text) and text[pos].isspace():
                    pos += 1
                if pos < len(text) or not refill():
                    return text[pos] if pos < len(text) else ""

        def refuse(what: str, at: int):
            reader.at = at
            raise UserError(f"{reader.where()} {what}; give a JSON array of objects, or one object per line.")

        try:
            next_char()
            pos += 1  # the "[" that source_format saw
            expect_value = next_char() != "]"
            while expect_value:
                next_char()
                while True:
                    try:
                        value, end = decoder.raw_decode(text, pos)
                    except json.JSONDecodeError as exc:
                        if eof or not refill():
                            refuse(f"is not JSON ({exc.msg})", index)
                        continue
                    # A number may continue past the buffer: decode it again with more text.
                    if end < len(text) or eof or not refill():
                        break
                pos = end
                yield index, consumed + pos, value
                index += 1
                separator = next_char()
                if separator not in (",", "]"):
                    refuse(f"is followed by {separator!r} where ',' or ']' belongs" if separator
                           else "ends the file before the array is closed", index - 1)
                pos += 1
                expect_value = separator == ","
        except UnicodeDecodeError:
            refuse("is not UTF-8 text", index)


def _batches(unit: Unit) -> Iterator[list[dict]]:
    """The rows of an arrow or Parquet unit as lists of records, a bounded number of bytes at a time."""
    rows = max(unit.stop - unit.start, 1)
    per_batch = max(1, min(_BATCH_ROWS, _BATCH_BYTES * rows // max(unit.weight, 1)))
    if unit.format == "parquet":
        for batch in _parquet(unit.source).iter_batches(batch_size=per_batch, row_groups=[unit.group]):
            yield batch.to_pylist()
        return
    table = _open_dataset(unit.source, unit.format, unit.cache_dir, unit.stamp)
    for start in range(unit.start, unit.stop, per_batch):
        columns = table[start : min(start + per_batch, unit.stop)]
        yield [dict(zip(columns, values)) for values in zip(*columns.values())]


def _read_rows(unit: Unit, reader: UnitReader) -> Iterator[tuple[int, int, object]]:
    row = unit.start
    for batch in _batches(unit):
        for record in batch:
            yield row, unit.weight * (row + 1 - unit.start) // max(unit.stop - unit.start, 1), record
            row += 1


class UnitReader:
    """The records of one unit, in order. While iterating, ``done`` is how much of ``unit.weight`` has been
    read, and ``where()`` names the record last read ("a.jsonl line 12", "b.parquet record 7") for a refusal."""

    def __init__(self, unit: Unit):
        self.unit = unit
        self.done = 0
        self.at = 0  # the byte offset of the line last read, or the index of the record

    def __iter__(self) -> Iterator[dict]:
        read = {"jsonl": _read_lines, "json": _read_array}.get(self.unit.format, _read_rows)
        for self.at, self.done, record in read(self.unit, self):
            if not isinstance(record, dict):
                raise UserError(f"{self.where()} is {json_type(record)}, not an object; make every record a "
                                f'JSON object, such as {{"text": "..."}}.')
            yield record

    def where(self) -> str:
        if self.unit.format == "jsonl":
            return f"{self.unit.source} line {_line_number(self.unit.source, self.at)}"
        return f"{self.unit.source} record {self.at + 1}"


def iter_records(path: Path, unit_bytes: int = UNIT_BYTES, cache_dir: str | Path | None = None) -> Iterator[dict]:
    """Every record of a source, in order: its units read one after the other."""
    for unit in source_units(path, unit_bytes, cache_dir):
        yield from UnitReader(unit)


def text_of(record: dict, field: str) -> str:
    """The text a record holds in ``field``; the refusal (without the record's place, which the caller
    adds) names the fields it has."""
    if field not in record:
        fields = ", ".join(map(str, record)) or "none"
        raise UserError(f"the record has no field {field!r} (its fields: {fields}); name the field that holds "
                        f"the text with --text-field NAME.")
    text = record[field]
    if not isinstance(text, str):
        raise UserError(f"the record's field {field!r} is {json_type(text)}, not a string; name a field that "
                        f"holds text with --text-field NAME, or fix the record.")
    return text
