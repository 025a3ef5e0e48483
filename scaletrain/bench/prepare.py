"""``scaletrain bench prepare``: how fast `scaletrain prepare` tokenizes, and that its memory is flat in corpus size.

For each corpus size, a JSON lines file of deterministic pseudo-random words is written
(documents of 1 to 30 sentences drawn from a fixed set, seeded, so every machine prepares the
same bytes); then for each worker count, prepare runs in a fresh interpreter on it, and reports:

* tokens per second and input bytes per second, timed around the ``prepare`` call alone
  (not the interpreter's start);
* the parent's peak resident set size, ``getrusage(RUSAGE_SELF).ru_maxrss``: the process that
  plans the units, shows progress and publishes the shards (and, with one worker, encodes);
* the workers' peak, ``getrusage(RUSAGE_CHILDREN).ru_maxrss``: on Linux the peak of the largest
  child that has exited, so one worker's own peak, not their sum (none with one worker, which
  runs in the parent).

Both include the interpreter and its imports (numpy, tokenizers, and torch, which the
``scaletrain.data`` package imports): that is the floor every figure stands on. Two corpus
sizes side by side show what grows with the corpus: only the document index the returned
folder loads (8 bytes per document), not the records. The tokenizer is the byte tokenizer,
or a BPE trained here on the first 16 MB of the smallest corpus's text.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from scaletrain.bench import machine
from scaletrain.data.tokenizer import make_tokenizer
from scaletrain.errors import UserError

SENTENCES = 20_000
BPE_SAMPLE_BYTES = 16 << 20
_LINES_PER_WRITE = 4096
PREPARE = """
import json, resource, sys, time
from pathlib import Path
from scaletrain.data.prepare import TextEncoder, prepare
from scaletrain.data.tokenizer import load_tokenizer
corpus, out, workers, tokenizer_path = sys.argv[1:]
tokenizer = load_tokenizer(tokenizer_path)
encoder = TextEncoder(tokenizer, "text", tokenizer.encode("\\n\\n"))
start = time.perf_counter()
prepared = prepare([Path(corpus)], encoder, Path(out), tokenizer=tokenizer, kind="text", text_field="text",
                   workers=int(workers), progress=False)
seconds = time.perf_counter() - start
print(json.dumps({"seconds": seconds, "n_tokens": prepared.manifest["n_tokens"],
                  "n_documents": prepared.manifest["n_documents"],
                  "parent_peak_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  "worker_peak_bytes": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024}))
"""


def _sentences(rng: np.random.Generator) -> list[str]:
    letters = np.array(list("etaoinshrdlucmfwypvbgkjqxz"))
    frequency = 1 / np.arange(1, len(letters) + 1)
    words = ["".join(rng.choice(letters, size=rng.integers(1, 10), p=frequency / frequency.sum()))
             for _ in range(4096)]
    # Zipf-like word frequencies, as in text: a BPE finds merges worth learning.
    weights = 1 / np.arange(1, len(words) + 1)
    picks = rng.choice(len(words), size=(SENTENCES, 20), p=weights / weights.sum())
    lengths = rng.integers(4, 21, size=SENTENCES)
    return [" ".join(words[w] for w in row[:n]).capitalize() + "." for row, n in zip(picks, lengths)]


def write_corpus(path: Path, n_bytes: int, seed: int = 0) -> Path:
    """A JSON lines file of about ``n_bytes``: {"text": ...} documents of pseudo-random sentences."""
    rng = np.random.default_rng(seed)
    sentences = _sentences(rng)
    written = 0
    with open(path, "w", encoding="ascii") as f:
        while written < n_bytes:
            counts = rng.integers(1, 31, size=_LINES_PER_WRITE)
            picks = rng.integers(0, SENTENCES, size=int(counts.sum()))
            ends = np.cumsum(counts)
            for n, end in zip(counts, ends):
                # The sentences hold no quote or backslash, so the JSON is written without an encoder.
                line = '{"text": "' + " ".join(sentences[i] for i in picks[end - n : end]) + '"}\n'
                f.write(line)
                written += len(line)
                if written >= n_bytes:
                    break
    return path


def _bpe_sample(corpus: Path, sample: Path) -> Path:
    with open(corpus, encoding="ascii") as lines, open(sample, "w", encoding="ascii") as out:
        while out.tell() < BPE_SAMPLE_BYTES and (line := lines.readline()):
            out.write(json.loads(line)["text"] + "\n\n")
    return sample


def _prepare_once(corpus: Path, out: Path, workers: int, tokenizer_path: Path) -> dict:
    done = subprocess.run([sys.executable, "-c", PREPARE, str(corpus), str(out), str(workers), str(tokenizer_path)],
                          capture_output=True, text=True)
    shutil.rmtree(out, ignore_errors=True)
    if done.returncode:
        raise UserError(f"bench prepare's run failed: {(done.stderr.strip().splitlines() or ['no output'])[-1]}")
    return json.loads(done.stdout.splitlines()[-1])


def run(gigabytes: tuple[float, ...] = (0.5, 3.0), workers: tuple[int, ...] = (1, 2), tokenizer: str = "byte",
        vocab_size: int = 4096, folder: Path | None = None) -> dict:
    """Prepare a corpus of each size in ``gigabytes`` (10**9 bytes) with each worker count, in ``folder``
    (a temporary one by default; the corpora are deleted afterwards); the result as ``bench --json`` prints it."""
    if not gigabytes or min(gigabytes) <= 0:
        raise UserError(f"bench prepare needs corpus sizes above 0 GB, not {list(gigabytes)}.")
    if not workers or min(workers) < 1:
        raise UserError(f"bench prepare needs worker counts of 1 or more, not {list(workers)}.")
    with tempfile.TemporaryDirectory(prefix="scaletrain-bench-prepare-", dir=folder) as tmp:
        work = Path(tmp)
        corpora = [write_corpus(work / f"corpus-{size:g}GB.jsonl", int(size * 1e9)) for size in sorted(gigabytes)]
        files = [] if tokenizer == "byte" else [_bpe_sample(corpora[0], work / "sample.txt")]
        tok = make_tokenizer(tokenizer, files, vocab_size)
        tok.save(work / "tokenizer.json")
        runs = []
        for size, corpus in zip(sorted(gigabytes), corpora):
            for n in workers:
                figures = _prepare_once(corpus, work / "out", n, work / "tokenizer.json")
                runs.append({"gigabytes": size, "corpus_bytes": corpus.stat().st_size, "workers": n, **figures,
                             "tokens_per_s": figures["n_tokens"] / figures["seconds"],
                             "bytes_per_s": corpus.stat().st_size / figures["seconds"]})
            corpus.unlink()
    return {"what": "prepare", "machine": machine(), "tokenizer": tok.name, "vocab_size": tok.vocab_size,
            "peak": "getrusage ru_maxrss: RUSAGE_SELF for the parent, RUSAGE_CHILDREN (the largest worker) "
                    "for the workers", "runs": runs}


def format_table(result: dict) -> str:
    mib = 2**20
    lines = [f"bench prepare: {result['tokenizer']} tokenizer ({result['vocab_size']} ids), on {result['machine']}",
             f"{'corpus':>9} {'workers':>7} {'tokens':>13} {'seconds':>8} {'tokens/s':>11} {'MB/s':>7} "
             f"{'parent peak':>12} {'worker peak':>12}"]
    for r in result["runs"]:
        worker = f"{r['worker_peak_bytes'] / mib:.0f} MiB" if r["worker_peak_bytes"] else "-"
        lines.append(f"{r['corpus_bytes'] / 1e9:>7.3f}GB {r['workers']:>7} {r['n_tokens']:>13,} {r['seconds']:>8.1f} "
                     f"{r['tokens_per_s']:>11,.0f} {r['bytes_per_s'] / 1e6:>7.1f} "
                     f"{r['parent_peak_bytes'] / mib:>8.0f} MiB {worker:>12}")
    lines.append("peak: getrusage's ru_maxrss, the interpreter and its imports included; the parent's "
                 "(RUSAGE_SELF) and the largest worker's (RUSAGE_CHILDREN); one worker runs in the parent.")
    return "\n".join(lines)
