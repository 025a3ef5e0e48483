"""Records from every source format, the same records in the same order; units that cut a source
deterministically; and every malformed source refused in one sentence that names the file."""

from __future__ import annotations

import json
import math

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from scaletrain.data import records
from scaletrain.data.records import UnitReader, iter_records, source_format, source_units, text_of
from scaletrain.errors import UserError

# Text with what breaks naive readers: newlines and brackets inside strings, non-ASCII, an empty text.
RECORDS = [{"text": f"record {i}: " + ["héllo, wörld", "{[\"quoted\"]}\n", "日本語 — naïve", "", "x" * 300][i % 5],
            "n": i} for i in range(23)]


def write_jsonl(path, rows, blank_every=4):
    with open(path, "w", encoding="utf-8") as f:
        for i, row in enumerate(rows):
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
            if i % blank_every == 0:
                f.write("\n")  # blank lines are skipped
    return path


def write_parquet(path, rows, row_group_size=5):
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=row_group_size)
    return path


def to_dataset(rows):
    import datasets

    return datasets.Dataset.from_dict({key: [row[key] for row in rows] for key in rows[0]})


def make_source(kind, tmp_path):
    """RECORDS in the format ``kind``."""
    import datasets

    if kind == "jsonl":
        return write_jsonl(tmp_path / "data.jsonl", RECORDS)
    if kind == "json-array":
        path = tmp_path / "data.json"
        path.write_text(json.dumps(RECORDS, indent=2, ensure_ascii=False), encoding="utf-8")
        return path
    if kind == "json-lines":
        return write_jsonl(tmp_path / "data.json", RECORDS)
    if kind == "parquet":
        return write_parquet(tmp_path / "data.parquet", RECORDS)
    if kind == "save-to-disk":
        to_dataset(RECORDS).save_to_disk(str(tmp_path / "saved"))
        return tmp_path / "saved"
    if kind == "dataset-dict":
        datasets.DatasetDict({"train": to_dataset(RECORDS), "test": to_dataset(RECORDS[:2])}).save_to_disk(
            str(tmp_path / "dict"))
        return tmp_path / "dict"
    folder = tmp_path / "files"
    folder.mkdir()
    if kind == "folder-jsonl":  # load_dataset reads the files in name order
        write_jsonl(folder / "a.jsonl", RECORDS[:10])
        write_jsonl(folder / "b.jsonl", RECORDS[10:])
    else:
        write_parquet(folder / "a.parquet", RECORDS[:7])
        write_parquet(folder / "b.parquet", RECORDS[7:])
    return folder


FORMATS = ["jsonl", "json-array", "json-lines", "parquet", "save-to-disk", "dataset-dict", "folder-jsonl",
           "folder-parquet"]


@pytest.mark.parametrize("kind", FORMATS)
@pytest.mark.parametrize("unit_bytes", [97, 1 << 20])
def test_every_format_gives_the_same_records_in_order(kind, unit_bytes, tmp_path):
    source = make_source(kind, tmp_path)
    assert list(iter_records(source, unit_bytes, cache_dir=tmp_path / "cache")) == RECORDS


def test_formats_and_their_units(tmp_path):
    assert source_format(make_source("json-array", tmp_path)) == "json"
    assert source_format(make_source("json-lines", tmp_path)) == "jsonl"
    parquet = make_source("parquet", tmp_path)
    assert [(u.start, u.stop, u.group) for u in source_units(parquet)] == [(0, 5, 0), (5, 10, 1), (10, 15, 2),
                                                                           (15, 20, 3), (20, 23, 4)]
    saved = make_source("save-to-disk", tmp_path)
    assert source_format(saved) == "saved"
    units = source_units(saved, unit_bytes=200)
    assert len(units) > 3 and units[0].start == 0 and units[-1].stop == len(RECORDS)
    assert all(a.stop == b.start for a, b in zip(units, units[1:]))


@pytest.mark.parametrize("unit_bytes", [1, 2, 7, 50, 64, 333, 10_000])
def test_jsonl_units_cover_every_line_once_whatever_their_size(unit_bytes, tmp_path):
    source = write_jsonl(tmp_path / "data.jsonl", RECORDS, blank_every=3)
    size = source.stat().st_size
    units = source_units(source, unit_bytes)
    assert len(units) == math.ceil(size / unit_bytes)
    assert [(u.start, u.stop) for u in units] == [(s, min(s + unit_bytes, size)) for s in range(0, size, unit_bytes)]
    assert units == source_units(source, unit_bytes)  # a pure function of the file and the size
    assert [r for u in units for r in UnitReader(u)] == RECORDS


def test_a_unit_owns_the_lines_that_start_inside_it(tmp_path):
    source = tmp_path / "data.jsonl"
    lines = [json.dumps({"text": "a" * k}) + "\n" for k in (3, 0, 10)]
    source.write_text("".join(lines))
    # Units of 16 bytes: [0, 16) holds line 1, and [16, 32) starts exactly at line 2 and holds line 3,
    # which starts at byte 29 and runs on to 52; the units after it hold no line start.
    assert [len(line) for line in lines] == [16, 13, 23]
    units = source_units(source, 16)
    assert [[r["text"] for r in UnitReader(u)] for u in units] == [["aaa"], ["", "a" * 10], [], []]


def test_a_json_array_streams_through_a_buffer_smaller_than_a_record(tmp_path, monkeypatch):
    monkeypatch.setattr(records, "_CHUNK_BYTES", 5)
    path = tmp_path / "data.json"
    rows = [*RECORDS, {"text": "long " * 200, "n": 1.25e-7}, {"text": "", "n": 12345678901234567890}]
    path.write_text(" \n[ " + " ,\n".join(json.dumps(r) for r in rows) + "\n] \n", encoding="utf-8")
    reader = UnitReader(source_units(path)[0])
    assert list(reader) == rows
    assert reader.done == path.stat().st_size - len("\n] \n")  # the end of the last record


def test_text_of():
    assert text_of({"body": "x"}, "body") == "x"
    with pytest.raises(UserError, match=r"no field 'text' \(its fields: body, id\).*--text-field NAME"):
        text_of({"body": "x", "id": 1}, "text")
    with pytest.raises(UserError, match=r"field 'text' is a number, not a string.*--text-field NAME"):
        text_of({"text": 3}, "text")


def bad(name, files, phrase, target=None):
    """A malformed source: the files to write (bytes, or rows for a parquet file), the phrase its
    refusal holds, and the path to read (``target``, default the first file)."""
    return pytest.param(files, phrase, target, id=name)


BAD = [
    bad("missing", {}, "does not exist", "nothing.jsonl"),
    bad("empty-file", {"a.jsonl": b""}, "is empty; give a file that holds records"),
    bad("blank-file", {"a.json": b"\n  \n"}, "is empty; give a file that holds records"),
    bad("unknown-extension", {"a.txt": b"text"}, "has the unknown extension '.txt'"),
    bad("not-json", {"a.jsonl": b'{"text": "a"}\n\n{"text": oops}\n'}, "line 3 is not JSON"),
    bad("not-utf8", {"a.jsonl": b'{"text": "a"}\n{"text": "\xff"}\n'}, "line 2 is not UTF-8"),
    bad("not-an-object", {"a.jsonl": b'{"text": "a"}\n["text"]\n'}, "line 2 is an array, not an object"),
    bad("array-of-strings", {"a.json": b'[{"text": "a"}, "b"]'}, "record 2 is a string, not an object"),
    bad("array-bad-value", {"a.json": b'[{"text": "a"}, {"text": }]'}, "record 2 is not JSON"),
    bad("array-bad-separator", {"a.json": b'[{"text": "a"} {"text": "b"}]'}, "record 1 is followed by '{'"),
    bad("array-unclosed", {"a.json": b'[{"text": "a"},'}, "record 2 is not JSON"),
    bad("array-unclosed-after-value", {"a.json": b'[{"text": "a"}'}, "record 1 ends the file before"),
    bad("parquet-garbage", {"a.parquet": b"not parquet at all"}, "is not a readable Parquet file"),
    bad("parquet-no-rows", {"a.parquet": []}, "holds no rows"),
    bad("empty-folder", {"d": None}, "is an empty folder"),
    bad("folder-unreadable-files", {"d/a.xyz": b"?"}, "cannot be read by datasets.load_dataset", "d"),
    bad("folder-bad-json", {"d/a.jsonl": b"oops\n"}, "cannot be read by datasets.load_dataset", "d"),
    bad("dict-without-train", {"dd": "dict"}, "holds the splits test but no 'train'"),
]


@pytest.mark.parametrize("files, phrase, target", BAD)
def test_a_bad_source_is_refused_naming_it(files, phrase, target, tmp_path):
    import datasets

    for name, content in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if content is None:
            path.mkdir()
        elif content == "dict":
            datasets.DatasetDict({"test": to_dataset(RECORDS)}).save_to_disk(str(path))
        elif isinstance(content, list):
            pq.write_table(pa.table({"text": pa.array([], pa.string())}), path)
        else:
            path.write_bytes(content)
    source = tmp_path / (target or next(iter(files)))
    with pytest.raises(UserError) as refusal:
        list(iter_records(source, cache_dir=tmp_path / "cache"))
    message = str(refusal.value)
    assert phrase in message and str(source) in message and message.endswith("."), message
