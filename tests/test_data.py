"""Tests for scaletrain.data: tokenizers, corpus and cache, batches, digits."""

import math

import numpy as np
import pytest
import torch

from scaletrain.data import (
    END_OF_TEXT,
    NUM_CLASSES,
    NUM_FEATURES,
    ArrayBatches,
    BPETokenizer,
    ByteTokenizer,
    TokenBatches,
    build_token_cache,
    corpus_files,
    count_tokens,
    default_corpus_files,
    document_separator,
    load_digits,
    load_tokenizer,
    load_tokens,
    make_tokenizer,
    split_tokens,
    token_lower_bound,
    unigram_entropy_nats,
)
from scaletrain.errors import UserError

TEXT = "héllo wörld, 日本語 — naïve café\n\tdef f(x):\n        return x + 1\n"


@pytest.fixture
def text_files(tmp_path):
    folder = tmp_path / "corpus"
    folder.mkdir()
    paths = []
    for i in range(3):
        path = folder / f"doc{i}.txt"
        path.write_text(f"document {i}: " + TEXT * (i + 2), encoding="utf-8")
        paths.append(path)
    return paths


# Tokenizers


def test_byte_tokenizer_round_trips_non_ascii(tmp_path):
    tok = ByteTokenizer()
    ids = tok.encode(TEXT)
    assert list(ids) == list(TEXT.encode("utf-8"))
    assert tok.decode(ids) == TEXT
    assert tok.decode(torch.tensor(ids.astype(np.int64))) == TEXT
    # A truncated multi-byte character decodes to a replacement, not an error.
    assert tok.decode(tok.encode("é")[:1]) == "\ufffd"
    tok.save(tmp_path / "tok.json")
    assert isinstance(load_tokenizer(tmp_path / "tok.json"), ByteTokenizer)


def test_every_tokenizer_made_here_ends_a_text_with_one_end_of_text_token(tmp_path, text_files):
    """Bytes: id 256, the vocabulary one larger; a BPE: its last id, within --vocab-size. The token's
    text encodes to that id alone, decodes back to it only when asked, and separates documents."""
    for tok in (ByteTokenizer(), make_tokenizer("bpe", text_files, vocab_size=300)):
        eos = tok.eos_id
        assert eos == tok.vocab_size - 1 and tok.config.eos_token == tok.config.bos_token == END_OF_TEXT
        ids = tok.encode(f"é{END_OF_TEXT}def").tolist()
        assert ids.count(eos) == 1 and ids == tok.encode("é").tolist() + [eos] + tok.encode("def").tolist()
        assert tok.decode(ids) == "édef" and tok.decode(ids, skip_special_tokens=False) == f"é{END_OF_TEXT}def"
        assert document_separator(tok).tolist() == [eos]
        tok.save(tmp_path / "saved.json")
        again = load_tokenizer(tmp_path / "saved.json")
        assert (again.vocab_size, again.eos_id, again.encode(END_OF_TEXT).tolist()) == (tok.vocab_size, eos, [eos])
    assert ByteTokenizer().vocab_size == 257


def test_tokenizers_saved_before_the_end_of_text_token_keep_their_ids(tmp_path, text_files):
    """A run's tokenizer is part of the run: one saved without the token loads without it, its
    documents separated by a blank line as they were."""
    (tmp_path / "byte.json").write_text('{"kind": "byte"}')
    old = load_tokenizer(tmp_path / "byte.json")
    assert (old.vocab_size, old.eos_id, old.config) == (256, None, None)
    assert old.encode(END_OF_TEXT).tolist() == list(END_OF_TEXT.encode()) and old.to_json() == '{"kind": "byte"}'
    assert document_separator(old).tolist() == [10, 10]
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.train([str(f) for f in text_files], trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    bpe.save(str(tmp_path / "bpe.json"))
    loaded = load_tokenizer(tmp_path / "bpe.json")
    assert (loaded.vocab_size, loaded.eos_id, loaded.config) == (bpe.get_vocab_size(), None, None)


def test_bpe_trains_round_trips_and_reloads(tmp_path, text_files):
    tok = make_tokenizer("bpe", text_files, vocab_size=300)
    assert isinstance(tok, BPETokenizer)
    assert 256 < tok.vocab_size <= 300
    sample = TEXT + "unseen wörds  and   spaces\n"
    ids = tok.encode(sample)
    assert len(ids) < len(sample.encode("utf-8"))  # merges were learned
    assert tok.decode(ids) == sample
    tok.save(tmp_path / "bpe.json")
    loaded = load_tokenizer(tmp_path / "bpe.json")
    assert isinstance(loaded, BPETokenizer)
    assert loaded.vocab_size == tok.vocab_size
    np.testing.assert_array_equal(loaded.encode(sample), ids)


def test_bpe_vocab_below_byte_alphabet_is_user_error(text_files):
    with pytest.raises(UserError, match="--vocab-size 100"):
        make_tokenizer("bpe", text_files, vocab_size=100)


def test_unknown_tokenizer_kind_is_user_error(text_files):
    with pytest.raises(UserError, match="'wordpiece'"):
        make_tokenizer("wordpiece", text_files, vocab_size=300)


def test_load_tokenizer_rejects_missing_and_foreign_files(tmp_path):
    with pytest.raises(UserError, match="nope.json"):
        load_tokenizer(tmp_path / "nope.json")
    (tmp_path / "other.json").write_text('{"kind": "sentencepiece"}')
    with pytest.raises(UserError, match="other.json"):
        load_tokenizer(tmp_path / "other.json")


# Corpus files


def test_corpus_files_in_folder_skip_binary_hidden_and_empty(tmp_path):
    (tmp_path / "b.txt").write_text("bee")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "a.md").write_text("ay")
    (tmp_path / "image.png").write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe\x00")
    (tmp_path / ".hidden.txt").write_text("secret")
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "config").write_text("x")
    (tmp_path / "empty.txt").write_text("")
    assert corpus_files(tmp_path) == [tmp_path / "b.txt", tmp_path / "sub" / "a.md"]


def test_corpus_files_single_file(tmp_path):
    path = tmp_path / "one.txt"
    path.write_text("text")
    assert corpus_files(str(path)) == [path]


def test_corpus_files_errors(tmp_path):
    with pytest.raises(UserError, match="missing-dir"):
        corpus_files(tmp_path / "missing-dir")
    binary = tmp_path / "blob.bin"
    binary.write_bytes(b"\xff\xfe\xfd")
    with pytest.raises(UserError, match="not UTF-8"):
        corpus_files(binary)
    only_binary = tmp_path / "only_binary"
    only_binary.mkdir()
    (only_binary / "x.png").write_bytes(b"\xff\x00")
    with pytest.raises(UserError, match="no non-empty UTF-8"):
        corpus_files(only_binary)


def test_default_corpus_is_stdlib_python_source():
    files = default_corpus_files()
    assert len(files) > 100
    assert files == sorted(files)
    assert all(f.suffix == ".py" for f in files)
    assert not any({"site-packages", "__pycache__", "test", "tests", "idlelib"} & set(f.parts) for f in files)
    assert corpus_files(None) == files


# Token cache


def test_token_cache_contents_dtype_and_reuse(tmp_path, text_files, monkeypatch):
    tok = ByteTokenizer()
    cache_dir = tmp_path / "cache"
    path = build_token_cache(text_files, tok, cache_dir)
    tokens = load_tokens(path)
    assert tokens.dtype == np.uint16
    assert not tokens.flags.writeable
    joined = END_OF_TEXT.join(f.read_text(encoding="utf-8") for f in text_files)  # one id between documents
    np.testing.assert_array_equal(tokens, tok.encode(joined))
    assert np.count_nonzero(np.asarray(tokens) == tok.eos_id) == len(text_files) - 1
    # Only the finished pair is visible: no temporary files remain.
    assert sorted(p.name for p in cache_dir.iterdir()) == sorted([path.name, path.with_suffix(".json").name])

    mtime = path.stat().st_mtime_ns

    def fail(text):
        raise AssertionError("a cache hit must not tokenize")

    monkeypatch.setattr(tok, "encode", fail)
    assert build_token_cache(text_files, tok, cache_dir) == path
    assert path.stat().st_mtime_ns == mtime


@pytest.mark.parametrize("kind", ["byte", "bpe"])
def test_token_counts_match_the_cache_without_writing_it(tmp_path, text_files, kind):
    tok = make_tokenizer(kind, text_files, vocab_size=300)
    n_tokens = count_tokens(text_files, tok)
    assert token_lower_bound(text_files, tok) <= n_tokens
    assert len(load_tokens(build_token_cache(text_files, tok, tmp_path / "cache"))) == n_tokens


def test_token_cache_key_follows_file_changes(tmp_path, text_files):
    tok = ByteTokenizer()
    first = build_token_cache(text_files, tok, tmp_path / "cache")
    text_files[1].write_text("changed", encoding="utf-8")
    second = build_token_cache(text_files, tok, tmp_path / "cache")
    assert second != first
    assert b"changed" in load_tokens(second).astype(np.uint8).tobytes()


def test_token_cache_key_follows_tokenizer(tmp_path, text_files):
    bpe = BPETokenizer.train(text_files, vocab_size=300)
    byte_path = build_token_cache(text_files, ByteTokenizer(), tmp_path / "cache")
    bpe_path = build_token_cache(text_files, bpe, tmp_path / "cache")
    assert bpe_path != byte_path
    tokens = load_tokens(bpe_path)
    assert tokens.dtype == np.uint16
    assert bpe.decode(tokens, skip_special_tokens=False) == END_OF_TEXT.join(f.read_text(encoding="utf-8")
                                                                             for f in text_files)


def test_failed_build_leaves_nothing_behind(tmp_path, text_files, monkeypatch):
    tok = ByteTokenizer()
    real_encode = tok.encode
    calls = []

    def encode_then_fail(text):
        calls.append(text)
        if len(calls) == 3:
            raise RuntimeError("disk full")
        return real_encode(text)

    monkeypatch.setattr(tok, "encode", encode_then_fail)
    cache_dir = tmp_path / "cache"
    with pytest.raises(RuntimeError, match="disk full"):
        build_token_cache(text_files, tok, cache_dir)
    assert list(cache_dir.iterdir()) == []


def test_unigram_entropy():
    uniform = np.tile(np.arange(4, dtype=np.uint16), 25)
    assert unigram_entropy_nats(uniform, vocab_size=256) == pytest.approx(math.log(4))
    assert unigram_entropy_nats(np.zeros(10, dtype=np.uint16), vocab_size=256) == 0.0
    skewed = np.array([0, 0, 0, 1], dtype=np.uint16)
    assert unigram_entropy_nats(skewed, vocab_size=2) == pytest.approx(-(0.75 * math.log(0.75) + 0.25 * math.log(0.25)))


# Batches


def _tokens(n):
    # Distinct values make each window identifiable by its first token.
    return np.arange(n, dtype=np.uint16)


def test_token_batches_targets_are_inputs_shifted():
    batches = TokenBatches(_tokens(101), seq_len=10, seed=3, shuffle=True)
    assert batches.num_samples == 10
    x, y = batches.get(0, 4)
    assert x.shape == y.shape == (4, 10)
    assert x.dtype == y.dtype == torch.long
    assert torch.equal(y[:, :-1], x[:, 1:])
    assert torch.equal(y[:, -1], x[:, -1] + 1)
    assert torch.all(x[:, 0] % 10 == 0)  # windows start on seq_len boundaries


def test_token_batches_are_deterministic_and_seeded():
    a = TokenBatches(_tokens(1001), seq_len=10, seed=7).get(0, 50)[0]
    b = TokenBatches(_tokens(1001), seq_len=10, seed=7).get(0, 50)[0]
    c = TokenBatches(_tokens(1001), seq_len=10, seed=8).get(0, 50)[0]
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_token_batch_slices_compose_into_global_batch():
    batches = TokenBatches(_tokens(1001), seq_len=10, seed=1)
    whole_x, whole_y = batches.get(37, 24)
    # Four ranks, six samples each, in a fresh object (as a resumed run would have).
    other = TokenBatches(_tokens(1001), seq_len=10, seed=1)
    parts = [other.get(37 + 6 * rank, 6) for rank in range(4)]
    assert torch.equal(torch.cat([p[0] for p in parts]), whole_x)
    assert torch.equal(torch.cat([p[1] for p in parts]), whole_y)


def test_token_batches_visit_every_window_once_per_epoch_across_boundaries():
    batches = TokenBatches(_tokens(101), seq_len=10, seed=5)
    # One call spanning the end of epoch 0, all of epoch 1 and the start of epoch 2.
    starts = batches.get(6, 26)[0][:, 0] // 10
    assert sorted(starts[4:14].tolist()) == list(range(10))  # epoch 1
    assert sorted(torch.cat([batches.get(0, 6)[0][:, 0] // 10, starts[:4]]).tolist()) == list(range(10))
    assert torch.equal(starts, torch.cat([batches.get(i, 1)[0][:, 0] // 10 for i in range(6, 32)]))
    assert not torch.equal(starts[4:14], starts[14:24])  # a fresh order each epoch


def test_token_batches_without_shuffle_are_in_order():
    batches = TokenBatches(_tokens(101), seq_len=10, shuffle=False)
    assert (batches.get(8, 4)[0][:, 0] // 10).tolist() == [8, 9, 0, 1]


def test_token_batches_too_short_corpus_is_user_error():
    with pytest.raises(UserError, match="10 tokens.*--seq-len"):
        TokenBatches(_tokens(10), seq_len=10)
    assert TokenBatches(_tokens(11), seq_len=10).num_samples == 1


def test_token_batches_read_from_memmap(tmp_path, text_files):
    tokens = load_tokens(build_token_cache(text_files, ByteTokenizer(), tmp_path / "cache"))
    x, y = TokenBatches(tokens, seq_len=16, seed=0).get(0, 3)
    assert x.dtype == torch.long and x.shape == (3, 16)
    assert torch.equal(y[:, :-1], x[:, 1:])


def test_eval_batches_cover_items_in_order():
    batches = TokenBatches(_tokens(101), seq_len=10, seed=9)
    got = list(batches.eval_batches(batch_size=4, max_batches=10))
    assert [len(x) for x, _ in got] == [4, 4, 2]
    assert (torch.cat([x for x, _ in got])[:, 0] // 10).tolist() == list(range(10))
    assert len(list(batches.eval_batches(batch_size=4, max_batches=2))) == 2


def test_split_tokens_makes_views():
    tokens = _tokens(1000)
    train, val = split_tokens(tokens, val_fraction=0.1, seq_len=10)
    assert len(train) == 900 and len(val) == 100
    assert train[-1] + 1 == val[0]
    assert np.shares_memory(train, tokens) and np.shares_memory(val, tokens)
    # A small fraction still leaves validation one whole sequence.
    _, val = split_tokens(tokens, val_fraction=0.001, seq_len=10)
    assert len(val) == 11


def test_split_tokens_errors():
    with pytest.raises(UserError, match="21 tokens"):
        split_tokens(_tokens(21), val_fraction=0.5, seq_len=10)
    assert [len(p) for p in split_tokens(_tokens(22), val_fraction=0.5, seq_len=10)] == [11, 11]
    with pytest.raises(UserError, match="--val-fraction"):
        split_tokens(_tokens(1000), val_fraction=1.0, seq_len=10)


def test_array_batches_share_the_ordering_rule():
    inputs = torch.arange(13, dtype=torch.float32)[:, None].repeat(1, 3)
    targets = torch.arange(13)
    batches = ArrayBatches(inputs, targets, seed=4)
    assert batches.num_samples == 13
    x, y = batches.get(10, 20)  # crosses into epoch 1 and 2
    assert torch.equal(x[:, 0].long(), y)
    assert sorted(y[3:16].tolist()) == list(range(13))
    parts = [ArrayBatches(inputs, targets, seed=4).get(10 + 5 * r, 5)[1] for r in range(4)]
    assert torch.equal(torch.cat(parts), y)
    assert not torch.equal(y, ArrayBatches(inputs, targets, seed=5).get(10, 20)[1])
    assert ArrayBatches(inputs, targets, shuffle=False).get(11, 3)[1].tolist() == [11, 12, 0]
    evaluated = torch.cat([y for _, y in batches.eval_batches(batch_size=5, max_batches=100)])
    assert evaluated.tolist() == list(range(13))


# Digits


def test_digits_shapes_ranges_and_split():
    digits = load_digits(val_fraction=0.2, seed=0)
    n_train, n_val = len(digits.train_x), len(digits.val_x)
    assert n_train + n_val == 1797 and n_val == round(1797 * 0.2)
    assert digits.train_x.shape == (n_train, NUM_FEATURES) and digits.train_x.dtype == torch.float32
    assert digits.val_y.shape == (n_val,) and digits.val_y.dtype == torch.int64
    assert float(digits.train_x.min()) == 0.0 and float(digits.train_x.max()) == 1.0
    assert set(digits.train_y.tolist()) == set(range(NUM_CLASSES))
    assert digits.NUM_FEATURES == NUM_FEATURES and digits.NUM_CLASSES == NUM_CLASSES

    again = load_digits(val_fraction=0.2, seed=0)
    assert torch.equal(again.val_x, digits.val_x) and torch.equal(again.train_y, digits.train_y)
    assert not torch.equal(load_digits(val_fraction=0.2, seed=1).val_y, digits.val_y)

    # Train and validation partition the data set: every image lands in exactly one of them.
    from sklearn.datasets import load_digits as sklearn_digits

    original = torch.tensor(sklearn_digits().data / 16, dtype=torch.float32)
    split = torch.cat([digits.train_x, digits.val_x])
    assert sorted(r.numpy().tobytes() for r in split) == sorted(r.numpy().tobytes() for r in original)


def test_digits_bad_val_fraction_is_user_error():
    with pytest.raises(UserError, match="--val-fraction"):
        load_digits(val_fraction=0.0)
