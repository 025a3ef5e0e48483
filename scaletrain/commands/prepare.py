"""``scaletrain prepare``: records tokenized once into a folder that training memory-maps.

    scaletrain prepare --data corpus.jsonl --tokenizer-from HF_DIR --out prepared/ --workers 8
    scaletrain train --data prepared/ ...

The work itself is data/prepare.py's (parallel workers, shards, manifest,
resume); this module turns the command line into its arguments: the sources,
the tokenizer (bytes, a BPE trained on the records, or a model's or a run's
own), and the kind (plain text, or instruction data with its loss masks).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from scaletrain.data.sources import parse_sources, record_encoder, records_tokenizer
from scaletrain.errors import UserError


def add_parser(commands) -> None:
    prepare = commands.add_parser(
        "prepare", help="tokenize records once into shards that training memory-maps",
        description="Tokenize records (.jsonl, .json, .parquet, a datasets save_to_disk folder or a folder "
                    "datasets.load_dataset reads) in parallel worker processes into fixed-size binary shards "
                    "with an index of document boundaries and a manifest of their hashes, never holding the "
                    "corpus in memory. Run it again after an interruption to resume. Train on the folder with "
                    "scaletrain train --data DIR (docs/data.md).")
    prepare.add_argument("--data", action="append", required=True, metavar="PATH",
                         help="records to prepare; repeat it for several sources, in order")
    prepare.add_argument("--out", required=True, metavar="DIR", help="the folder to write (new or empty, or an "
                                                                     "interrupted prepare of the same data)")
    prepare.add_argument("--text-field", default="text", metavar="NAME", help="the records' text field [text]")
    prepare.add_argument("--sft", action="store_true",
                         help="instruction data: chats (messages) or Alpaca records, rendered with the tokenizer's "
                              "chat template, the answers marked as the only trained tokens")
    prepare.add_argument("--tokenizer", choices=("byte", "bpe"), default="byte",
                         help="bytes, or a BPE trained on the records [byte]")
    prepare.add_argument("--vocab-size", type=int, default=4096, metavar="N", help="the BPE's vocabulary [4096]")
    prepare.add_argument("--tokenizer-from", metavar="DIR",
                         help="the tokenizer of a Hugging Face model folder or of a run folder instead")
    prepare.add_argument("--workers", type=int, default=1, metavar="N", help="tokenizing processes [1]")
    prepare.add_argument("--cache-dir", default=str(Path("runs", ".cache")), metavar="DIR",
                         help="where a trained BPE is kept [runs/.cache]")
    prepare.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    prepare.set_defaults(handler=run_prepare)


def run_prepare(args: argparse.Namespace) -> int:
    from scaletrain.data.prepare import prepare
    from scaletrain.job.data_setup import tokenizer_from

    sources = parse_sources(args.data)
    if any(source.weight != 1.0 for source in sources):
        raise UserError("prepare writes its sources one after another into one folder, without weights; prepare "
                        "each source into a folder of its own and give the weights to train --data DIR:WEIGHT.")
    if args.workers < 1:
        raise UserError(f"--workers is {args.workers}; use 1 or more worker processes.")
    paths = [Path(source.path) for source in sources]
    if args.tokenizer_from:
        tokenizer = tokenizer_from(Path(args.tokenizer_from))
    else:
        tokenizer = records_tokenizer(paths, args.tokenizer, args.vocab_size, args.sft, args.text_field,
                                      Path(args.cache_dir))
    prepared = prepare(paths, record_encoder(tokenizer, args.sft, args.text_field), Path(args.out),
                       tokenizer=tokenizer, kind="sft" if args.sft else "text", text_field=args.text_field,
                       workers=args.workers, progress=args.progress)
    manifest = prepared.manifest
    print(f"{args.out}: {manifest['n_documents']:,} documents, {manifest['n_tokens']:,} tokens in "
          f"{len(manifest['shards'])} shards ({manifest['dtype']}); train with --data {args.out}")
    return 0
