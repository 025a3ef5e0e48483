"""``--data`` in every form a user brings, through to a trained run: records (JSONL, JSON,
Parquet), a ``datasets`` folder, a ``scaletrain prepare`` folder, several sources mixed by
weight, a separate validation set (data/sources.py, data/mixture.py)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from scaletrain.commands.cli import main
from scaletrain.config import Config
from scaletrain.data.batches import TokenBatches
from scaletrain.data import END_OF_TEXT, ByteTokenizer
from scaletrain.data.mixture import BLOCK, Mixture, block_counts
from scaletrain.data.sources import is_text_source, parse_sources
from scaletrain.errors import UserError
from scaletrain.job.data_setup import open_data, prepare_data

BYTES = ByteTokenizer()
TEXTS = [f"record {i}: " + "the quick brown fox jumps over the lazy dog. " * (1 + i % 4) for i in range(80)]
TINY = ["--model", "gpt-tiny", "--seq-len", "32", "--micro-batch", "4", "--steps", "2", "--warmup-steps", "1",
        "--eval-every", "0", "--eval-batches", "1", "--sample-tokens", "0", "--no-progress"]


def _jsonl(path: Path, texts=TEXTS) -> Path:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


def _parquet(path: Path) -> Path:
    pq.write_table(pa.table({"text": TEXTS}), path, row_group_size=16)
    return path


def _saved(path: Path) -> Path:
    import datasets

    datasets.Dataset.from_dict({"text": TEXTS}).save_to_disk(str(path))
    return path


def _prepared(path: Path) -> Path:
    assert main(["prepare", "--data", str(_jsonl(path.parent / "for-prepare.jsonl")), "--out", str(path),
                 "--no-progress"]) == 0
    return path


@pytest.mark.parametrize("make", [_jsonl, _parquet, _saved, _prepared], ids=["jsonl", "parquet", "datasets",
                                                                             "prepared"])
def test_every_form_trains_on_the_same_tokens(tmp_path, make, capsys):
    """Each form of the same records trains, and its token stream is the same: the records'
    texts, each followed by the separator, in order."""
    name = {"_jsonl": "d.jsonl", "_parquet": "d.parquet", "_saved": "saved", "_prepared": "prepared"}[make.__name__]
    source = make(tmp_path / name)
    run = tmp_path / "run"
    assert main(["train", *TINY, "--data", str(source), "--out", str(run), "--cache-dir", str(tmp_path / "c")]) == 0
    capsys.readouterr()
    assert (run / "checkpoints" / "step_000002").is_dir()
    cfg = Config().replace(data=str(source), seq_len=32, cache_dir=str(tmp_path / "c"), val_fraction=0.5)
    data = open_data(prepare_data(cfg, Path(cfg.data.cache_dir)), cfg)
    window = data.train.get_samples(torch.tensor([0]))[0]
    assert BYTES.decode(window[0], skip_special_tokens=False) in END_OF_TEXT.join(TEXTS)


def test_sources_and_weights_are_read_from_the_flag(tmp_path):
    colon = tmp_path / "a:b.jsonl"
    colon.write_text("{}\n")
    assert parse_sources(["x.jsonl:0.7", "y.parquet:3", str(colon)]) == [
        parse_sources("x.jsonl:0.7")[0], parse_sources("y.parquet:3")[0], parse_sources(str(colon))[0]]
    assert [s.weight for s in parse_sources(["x.jsonl:0.7", "y.parquet:3", "z.jsonl"])] == [0.7, 3.0, 1.0]
    for bad, phrase in (("x.jsonl:lots", "not a number"), ("x.jsonl:0", "not positive"), ("x.jsonl:-1", "not positive")):
        with pytest.raises(UserError, match=phrase):
            parse_sources(bad)


def test_text_files_and_records_are_told_apart(tmp_path):
    (tmp_path / "texts").mkdir()
    (tmp_path / "texts" / "a.txt").write_text("hi")
    (tmp_path / "records").mkdir()
    _jsonl(tmp_path / "records" / "a.jsonl")
    assert is_text_source(tmp_path / "texts") and is_text_source(tmp_path / "notes.md")
    assert not is_text_source(tmp_path / "records") and not is_text_source(tmp_path / "x.parquet")


def test_a_mixture_holds_each_weight_exactly_per_block_and_reads_each_source_in_order():
    sizes = (500, 300, 200)
    sources = [TokenBatches(np.arange(n * 8 + 1) + 10_000 * k, 8, seed=k) for k, n in enumerate(sizes)]
    mixture = Mixture(sources, [0.5, 0.3, 0.2], seed=7)
    assert block_counts([0.5, 0.3, 0.2]) == [500, 300, 200] and sum(block_counts([1, 1, 1])) == BLOCK
    x, y = mixture.get(0, 2 * BLOCK)
    owner = x[:, 0] // 10_000
    for block in range(2):
        counts = torch.bincount(owner[block * BLOCK:(block + 1) * BLOCK], minlength=3).tolist()
        assert counts == [500, 300, 200]
    for k, source in enumerate(sources):  # the j-th sample a source gives is sample j of its own stream
        mine = x[owner == k]
        assert torch.equal(mine, source.get(0, len(mine))[0])
    again, _ = mixture.get(BLOCK - 5, 10)  # a pure function of the sample index
    assert torch.equal(again, x[BLOCK - 5:BLOCK + 5])
    assert not torch.equal(x[:BLOCK], Mixture(sources, [0.5, 0.3, 0.2], seed=8).get(0, BLOCK)[0])


def test_mixed_sources_train_and_validate_on_their_own_held_out_parts(tmp_path, capsys):
    a = _jsonl(tmp_path / "a.jsonl")
    b = _jsonl(tmp_path / "b.jsonl", [t.upper() for t in TEXTS])
    run = tmp_path / "run"
    assert main(["train", *TINY, "--data", f"{a}:0.75", "--data", f"{b}:0.25", "--out", str(run),
                 "--cache-dir", str(tmp_path / "c")]) == 0
    capsys.readouterr()
    assert (run / "checkpoints" / "step_000002").is_dir()
    cfg = Config().replace(data=[f"{a}:0.75", f"{b}:0.25"], seq_len=32, cache_dir=str(tmp_path / "c"))
    data = open_data(prepare_data(cfg, Path(cfg.data.cache_dir)), cfg)
    x, _ = data.train.get(0, BLOCK)
    from_b = sum(BYTES.decode(row).upper() == BYTES.decode(row) for row in x)  # b's windows are upper case
    assert from_b == 250  # a quarter of every block


def test_a_separate_validation_set_is_what_validation_reads(tmp_path):
    train = _jsonl(tmp_path / "train.jsonl")
    val = _jsonl(tmp_path / "val.jsonl", ["VALIDATION " * 20] * 10)
    cfg = Config().replace(data=str(train), val_data=str(val), seq_len=32, cache_dir=str(tmp_path / "c"))
    data = open_data(prepare_data(cfg, Path(cfg.data.cache_dir)), cfg)
    (inputs, _), *_ = data.val.eval_batches(4, 1)
    assert all("VALIDATION" in BYTES.decode(row) for row in inputs)
    stream = len(BYTES.encode(END_OF_TEXT.join(TEXTS))) + 1  # every record and its end-of-text token
    assert data.train.num_samples == (stream - 1) // 32  # the whole of train.jsonl
