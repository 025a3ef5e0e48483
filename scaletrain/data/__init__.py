"""Data: tokenizers, text corpora and their token cache, deterministic batches, digits."""

from scaletrain.data.batches import (
    ArrayBatches,
    TokenBatches,
    check_corpus_length,
    corpus_too_short,
    split_tokens,
)
from scaletrain.data.corpus import (
    build_token_cache,
    corpus_files,
    count_tokens,
    default_corpus_files,
    files_fingerprint,
    load_tokens,
    token_lower_bound,
    unigram_entropy_nats,
)
from scaletrain.data.digits import NUM_CLASSES, NUM_FEATURES, Digits, load_digits
from scaletrain.data.tokenizer import BPETokenizer, ByteTokenizer, load_tokenizer, make_tokenizer

__all__ = [
    "ArrayBatches",
    "BPETokenizer",
    "ByteTokenizer",
    "Digits",
    "NUM_CLASSES",
    "NUM_FEATURES",
    "TokenBatches",
    "build_token_cache",
    "check_corpus_length",
    "corpus_files",
    "corpus_too_short",
    "count_tokens",
    "default_corpus_files",
    "files_fingerprint",
    "load_digits",
    "load_tokenizer",
    "load_tokens",
    "make_tokenizer",
    "split_tokens",
    "token_lower_bound",
    "unigram_entropy_nats",
]
