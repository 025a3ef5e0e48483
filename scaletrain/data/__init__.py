"""Data: tokenizers, text corpora and their token cache, records and prepared shards, chat
templates and instruction examples, packing, mixtures, deterministic batches, digits (docs/data.md)."""

from scaletrain.data.batches import (
    IGNORE_INDEX,
    ArrayBatches,
    TokenBatches,
    check_corpus_length,
    corpus_too_short,
    split_tokens,
)
from scaletrain.data.chat import BUILTIN_TEMPLATE, END_OF_TURN, ChatTemplate
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
from scaletrain.data.mixture import Mixture
from scaletrain.data.packing import SequenceBatches, best_fit_decreasing
from scaletrain.data.prepare import TextEncoder, prepare
from scaletrain.data.records import iter_records
from scaletrain.data.sampler import ShardedSampler
from scaletrain.data.sft import ChatEncoder, record_messages
from scaletrain.data.shards import Prepared, TokenStream, is_prepared, open_prepared
from scaletrain.data.tokenizer import (
    END_OF_TEXT,
    BPETokenizer,
    ByteTokenizer,
    TokenizerConfig,
    document_separator,
    load_tokenizer,
    make_tokenizer,
)

__all__ = [
    "ArrayBatches",
    "BPETokenizer",
    "BUILTIN_TEMPLATE",
    "ByteTokenizer",
    "ChatEncoder",
    "ChatTemplate",
    "Digits",
    "END_OF_TEXT",
    "END_OF_TURN",
    "IGNORE_INDEX",
    "Mixture",
    "NUM_CLASSES",
    "NUM_FEATURES",
    "Prepared",
    "SequenceBatches",
    "ShardedSampler",
    "TextEncoder",
    "TokenBatches",
    "TokenStream",
    "TokenizerConfig",
    "best_fit_decreasing",
    "build_token_cache",
    "check_corpus_length",
    "corpus_files",
    "corpus_too_short",
    "count_tokens",
    "default_corpus_files",
    "document_separator",
    "files_fingerprint",
    "is_prepared",
    "iter_records",
    "load_digits",
    "load_tokenizer",
    "load_tokens",
    "make_tokenizer",
    "open_prepared",
    "prepare",
    "record_messages",
    "split_tokens",
    "token_lower_bound",
    "unigram_entropy_nats",
]
