"""`scaletrain prepare`'s folders: one token stream across shards, the same bytes whatever the
worker count and however often interrupted, corruption and interruption refused when opened, and
every bad input refused in one sentence with nothing left behind."""

from __future__ import annotations

import json
import os
import signal

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from scaletrain.bench import prepare as prepare_bench
from scaletrain.data import ByteTokenizer, TokenBatches, split_tokens, unigram_entropy_nats
from scaletrain.data.prepare import TextEncoder, prepare
from scaletrain.data.shards import TokenStream, is_prepared, open_prepared
from scaletrain.errors import JobFailed, UserError

TOKENIZER = ByteTokenizer()
SEPARATOR = TOKENIZER.encode("\n\n")
TEXTS = [f"document {i}: " + "abc def " * (i % 13) + "é" * (i % 3) for i in range(120)]
# Small shards and units: documents cross shard boundaries, sources split into several units.
SMALL = {"shard_tokens": 700, "unit_bytes": 900}


def text_encoder(field="text"):
    return TextEncoder(TOKENIZER, field, SEPARATOR)


def expected_tokens(texts):
    return np.concatenate([np.concatenate([TOKENIZER.encode(t), SEPARATOR]) for t in texts]).astype(np.int64)


@pytest.fixture
def sources(tmp_path):
    """TEXTS spread over a JSON lines file, a Parquet file and a save_to_disk folder."""
    import datasets

    jsonl = tmp_path / "a.jsonl"
    jsonl.write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(TEXTS[:50])))
    parquet = tmp_path / "b.parquet"
    pq.write_table(pa.table({"text": TEXTS[50:90]}), parquet, row_group_size=8)
    datasets.Dataset.from_dict({"text": TEXTS[90:]}).save_to_disk(str(tmp_path / "c"))
    return [jsonl, parquet, tmp_path / "c"]


def run(sources, out, encoder=None, **kwargs):
    options = {"tokenizer": TOKENIZER, "kind": "text", "text_field": "text", "progress": False, **SMALL, **kwargs}
    return prepare(sources, encoder or text_encoder(), out, **options)


def folder_bytes(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


# TokenStream


def stream_and_array():
    pieces = [np.arange(start, start + n, dtype=np.uint16) for start, n in ((0, 5), (5, 1), (6, 7), (13, 3))]
    return TokenStream(pieces), np.concatenate(pieces)


def test_a_token_stream_reads_like_the_concatenated_array():
    stream, array = stream_and_array()
    assert len(stream) == len(array) and stream.dtype == np.uint16
    for key in (slice(None), slice(3, 9), slice(5, 6), slice(-4, None), slice(10, 2), slice(0, 100)):
        view = stream[key]
        assert isinstance(view, TokenStream) and np.array_equal(np.asarray(view), array[key]), key
    view = stream[2:15]
    assert np.array_equal(np.asarray(view[4:11][1:5]), array[2:15][4:11][1:5])
    assert [stream[i] for i in range(-16, 16)] == [int(array[i]) for i in range(-16, 16)]
    assert view[0] == 2 and view[-1] == 14
    positions = np.array([[0, 4, 5, 6], [12, 13, 15, 1]])
    assert np.array_equal(stream[positions], array[positions]) and stream[positions].shape == (2, 4)
    assert np.array_equal(view[positions % len(view)], array[2:15][positions % len(view)])
    assert np.asarray(stream, dtype=np.int64).dtype == np.int64
    for key in (16, -17, np.array([3, 16])):
        with pytest.raises(IndexError):
            stream[key]
    with pytest.raises(ValueError, match="step 1"):
        stream[::2]


def test_training_reads_a_token_stream_as_it_reads_an_array():
    stream, array = stream_and_array()
    for tokens in (stream, stream[1:]):
        reference = np.asarray(tokens)
        ours, theirs = TokenBatches(tokens, seq_len=3, seed=1), TokenBatches(reference, seq_len=3, seed=1)
        for first in range(0, 9, 3):
            for a, b in zip(ours.get(first, 3), theirs.get(first, 3)):
                assert a.equal(b)
        train, val = split_tokens(tokens, 0.25, 3)
        train_ref, val_ref = split_tokens(reference, 0.25, 3)
        assert np.array_equal(np.asarray(train), train_ref) and np.array_equal(np.asarray(val), val_ref)
        assert unigram_entropy_nats(tokens, 256) == unigram_entropy_nats(reference, 256)


# Preparing


def test_one_and_two_workers_write_the_same_bytes(sources, tmp_path):
    one = run(sources, tmp_path / "one", workers=1)
    two = run(sources, tmp_path / "two", workers=2)
    assert folder_bytes(one.folder) == folder_bytes(two.folder)
    manifest = one.manifest
    assert len(manifest["shards"]) > 3 and manifest["records"] == [50, 40, 30]
    assert manifest["n_documents"] == len(TEXTS) and manifest["dtype"] == "uint16" and manifest["kind"] == "text"
    assert [s["format"] for s in manifest["sources"]] == ["jsonl", "parquet", "saved"]
    assert np.array_equal(np.asarray(one.tokens), expected_tokens(TEXTS))
    assert all(TOKENIZER.decode(np.asarray(one.tokens[one.starts[d] : one.starts[d + 1]])) == text + "\n\n"
               for d, text in enumerate(TEXTS))
    assert one.mask is None and one.tokenizer_path.read_text() == TOKENIZER.to_json()
    assert open_prepared(one.folder, verify=True).manifest == manifest
    shards = [f"shard-{k:05d}.{ext}" for k in range(len(manifest["shards"])) for ext in ("bin", "idx")]
    assert sorted(p.name for p in one.folder.iterdir()) == sorted(["manifest.json", "tokenizer.json", *shards])


class MaskingEncoder:
    """Kind "sft" with the chat encoder's contract (data/sft.py): ids and a mask, here every other token trained."""

    def __call__(self, record):
        ids = TOKENIZER.encode(record["text"]).astype(np.int64)
        return ids, np.arange(len(ids)) % 2 == 0


def test_sft_shards_carry_their_mask(sources, tmp_path):
    prepared = run(sources[:1], tmp_path / "sft", MaskingEncoder(), kind="sft", shard_tokens=100)
    ids = [TOKENIZER.encode(t) for t in TEXTS[:50]]
    assert np.array_equal(np.asarray(prepared.tokens), np.concatenate(ids))
    assert np.array_equal(np.asarray(prepared.mask), np.concatenate([np.arange(len(i)) % 2 == 0 for i in ids]))
    assert (prepared.folder / "shard-00000.mask").is_file() and prepared.manifest["kind"] == "sft"


INTERRUPT_AFTER = []  # records the next in-process run encodes before an interrupt, when set
ENCODED = [0]  # records encoded by InterruptedEncoder in this process


class InterruptedEncoder(TextEncoder):
    """A text encoder that lets the test interrupt a run (Ctrl-C) after some records; its pickle, and so
    the plan a resumed run must match, does not depend on whether it will interrupt."""

    def __call__(self, record):
        if INTERRUPT_AFTER:
            INTERRUPT_AFTER[0] -= 1
            if INTERRUPT_AFTER[0] < 0:
                INTERRUPT_AFTER.clear()
                raise KeyboardInterrupt
        ENCODED[0] += 1
        return super().__call__(record)


def test_an_interrupted_run_resumes_to_the_same_bytes(sources, tmp_path):
    encoder = InterruptedEncoder(TOKENIZER, "text", SEPARATOR)
    reference = run(sources, tmp_path / "reference", encoder)
    out = tmp_path / "out"
    INTERRUPT_AFTER.append(70)
    with pytest.raises(KeyboardInterrupt):
        run(sources, out, encoder)
    done = sorted(p.name for p in (out / ".progress").glob("unit-??????.json"))
    assert done and not is_prepared(out)
    with pytest.raises(UserError, match="interrupted.*rerun the same scaletrain prepare command to resume"):
        open_prepared(out)
    skipped = sum(json.loads((out / ".progress" / name).read_text())["records"] for name in done)
    ENCODED[0] = 0
    resumed = run(sources, out, encoder)
    assert ENCODED[0] == len(TEXTS) - skipped  # the units done before were not encoded again
    assert folder_bytes(resumed.folder) == folder_bytes(reference.folder)
    assert not (out / ".progress").exists()
    ENCODED[0] = 0  # complete: a rerun has nothing to do
    assert folder_bytes(run(sources, out, encoder).folder) == folder_bytes(reference.folder) and ENCODED[0] == 0


class KillingEncoder(TextEncoder):
    """A text encoder whose process dies (SIGKILL, as the kernel's out-of-memory killer does) at the
    record "kill" while ``flag`` exists."""

    def __init__(self, flag):
        super().__init__(TOKENIZER, "text", SEPARATOR)
        self.flag = str(flag)

    def __call__(self, record):
        if record["text"] == "kill" and os.path.exists(self.flag):
            os.kill(os.getpid(), signal.SIGKILL)
        return super().__call__(record)


def test_a_killed_worker_fails_the_run_and_the_rerun_resumes(tmp_path):
    source = tmp_path / "a.jsonl"
    texts = [*TEXTS[:100], "kill", *TEXTS[100:]]
    source.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    encoder = KillingEncoder(tmp_path / "flag")
    reference = run([source], tmp_path / "reference", encoder)
    (tmp_path / "flag").touch()
    with pytest.raises(JobFailed, match="worker process died.*rerun the same command to resume"):
        run([source], tmp_path / "out", encoder, workers=2)
    assert not is_prepared(tmp_path / "out")
    (tmp_path / "flag").unlink()
    assert folder_bytes(run([source], tmp_path / "out", encoder, workers=2).folder) == folder_bytes(reference.folder)


def test_a_changed_shard_or_a_lost_manifest_is_refused(sources, tmp_path):
    folder = run(sources[:1], tmp_path / "out").folder
    shard = folder / "shard-00001.bin"
    data = bytearray(shard.read_bytes())
    data[10] ^= 1
    shard.write_bytes(bytes(data))
    open_prepared(folder)  # the size still matches: only the hashes tell
    with pytest.raises(UserError, match=r"is corrupt \(shard-00001.bin does not match.*run scaletrain prepare again"):
        open_prepared(folder, verify=True)
    shard.write_bytes(bytes(data[:-2]))
    with pytest.raises(UserError, match=r"is corrupt \(shard-00001.bin holds"):
        open_prepared(folder)
    shard.unlink()
    with pytest.raises(UserError, match=r"is corrupt \(shard-00001.bin is missing"):
        open_prepared(folder)
    (folder / "manifest.json").unlink()
    with pytest.raises(UserError, match="has no manifest.json, so it is not a prepared folder"):
        open_prepared(folder)


def test_a_folder_of_another_prepare_is_refused(sources, tmp_path):
    out = tmp_path / "out"
    run(sources[:1], out)
    with pytest.raises(UserError, match="holds a prepared folder of other sources.*give an empty or new folder"):
        run(sources[1:2], out)
    with pytest.raises(UserError, match="holds a prepared folder of other sources"):
        run(sources[:1], out, text_encoder("body"), text_field="body")
    INTERRUPT_AFTER.append(10)
    encoder = InterruptedEncoder(TOKENIZER, "text", SEPARATOR)
    with pytest.raises(KeyboardInterrupt):
        run(sources[:1], tmp_path / "stopped", encoder)
    with open(sources[0], "a") as f:  # edited after the interruption
        f.write(json.dumps({"text": "one more"}) + "\n")
    with pytest.raises(UserError, match="holds an interrupted prepare of .*sources changed since"):
        run(sources[:1], tmp_path / "stopped", encoder)


def case(name, records, phrase, **kwargs):
    """A bad input: the JSON lines of the source (None: no source file), the phrase its refusal holds."""
    return pytest.param(records, phrase, kwargs, id=name)


GOOD = [json.dumps({"text": t}) for t in TEXTS[:40]]
CASES = [
    case("no-text-field", [*GOOD, '{"body": "x", "id": 3}'], "a.jsonl line 41: the record has no field 'text' "
         "(its fields: body, id); name the field that holds the text with --text-field NAME."),
    case("other-text-field", GOOD, "line 1: the record has no field 'body' (its fields: text)",
         text_field="body"),
    case("text-not-string", [*GOOD, '{"text": ["a"]}'], "a.jsonl line 41: the record's field 'text' is an array"),
    case("not-json", [*GOOD[:30], "{oops", *GOOD[30:]], "a.jsonl line 31 is not JSON"),
    case("not-an-object", [*GOOD, "3"], "a.jsonl line 41 is a number, not an object"),
    case("bad-record-two-workers", [*GOOD, *GOOD, '{"txt": "x"}'], "a.jsonl line 81: the record has no field",
         workers=2),
    case("empty-source", [], "a.jsonl is empty"),
    case("missing-source", None, "a.jsonl does not exist"),
    case("no-workers", GOOD, "--workers is 0; use 1 or more", workers=0),
]


@pytest.mark.parametrize("existing", [False, True], ids=["new-out", "empty-out"])
@pytest.mark.parametrize("lines, phrase, kwargs", CASES)
def test_a_bad_input_is_refused_and_nothing_is_left_behind(lines, phrase, kwargs, existing, tmp_path):
    source = tmp_path / "a.jsonl"
    if lines is not None:
        source.write_text("".join(line + "\n" for line in lines))
    out = tmp_path / "new" / "out"
    if existing:
        out.mkdir(parents=True)
    kwargs = dict(kwargs)  # shared by both values of existing
    field = kwargs.pop("text_field", "text")
    with pytest.raises(UserError) as refusal:
        run([source], out, text_encoder(field), text_field=field, **kwargs)
    assert phrase in str(refusal.value), str(refusal.value)
    if existing:
        assert list(out.iterdir()) == []
    else:
        assert not (tmp_path / "new").exists()


def test_an_out_that_is_not_a_prepare_folder_is_refused_untouched(sources, tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(UserError, match="is a file, not a folder"):
        run(sources, tmp_path / "file")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match="holds files that scaletrain prepare did not write; give an empty or new"):
        run(sources, tmp_path / "busy")
    assert [p.name for p in (tmp_path / "busy").iterdir()] == ["notes.txt"]
    with pytest.raises(UserError, match="lies inside --data .*give a folder outside the data"):
        run(sources, sources[2] / "prepared")
    assert not (sources[2] / "prepared").exists()


def test_the_prepare_bench_reports_speed_and_peak_memory(tmp_path):
    result = prepare_bench.run((0.0005,), (1,), folder=tmp_path)
    (figures,) = result["runs"]
    # A line is {"text": "..."} and a newline around the text, 13 bytes; a document, the text and "\n\n".
    assert figures["n_tokens"] == figures["corpus_bytes"] - 11 * figures["n_documents"]
    assert figures["parent_peak_bytes"] > 0 and figures["worker_peak_bytes"] == 0
    assert "tokens/s" in prepare_bench.format_table(result) and list(tmp_path.iterdir()) == []
