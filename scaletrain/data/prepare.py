"""``scaletrain prepare``: records tokenized once, by parallel workers, into a prepared folder.

The folder's layout is shards.py's: ``shard-NNNNN.bin`` (token ids), ``.idx`` (document
starts), ``.mask`` (trained tokens, kind "sft"), ``tokenizer.json``, and ``manifest.json``
written last. Training maps the shards instead of tokenizing its corpus at every start.

How the work runs. The sources are cut into units (records.py: byte ranges of JSON lines,
Parquet row groups, row ranges of arrow data sets). One worker encodes a unit into
``DIR/.progress/unit-NNNNNN-PPP.{bin,idx,mask}``, each file written under a temporary name
and renamed when complete, and then writes the unit's done marker ``unit-NNNNNN.json`` (its
record count and its shards' counts and sha256). Once every unit is done, the parent renames
the units' shards, in unit order, to ``shard-00000``, ``shard-00001``, ..., writes the
tokenizer and the manifest, and removes ``.progress``. A unit's shards depend only on the unit
and the encoder, and their names only on the order of the units, so the folder is the same,
byte for byte, whatever the number of workers and however often the run was interrupted.

Resuming. ``.progress/plan.json`` records what the output depends on: each source's path,
size and modification time, the tokenizer's sha256, the encoder's (of its pickle), the kind,
text field, shard size and unit size. Rerunning the same command on an interrupted folder
with the same plan encodes only the units without a done marker. A folder whose plan differs
(other sources, sources edited since, another tokenizer) is refused rather than mixed with
new work or deleted unasked. Rerunning on a complete folder with the same plan does nothing.

Failing. A bad record (a `UserError` from the reader or the encoder) stops every worker and
removes what prepare wrote, the folder too when prepare created it: fixing the record
changes its source, so the partial work could never be resumed anyway. A worker that dies
(killed, out of memory) or an interrupt leaves the finished units in place to resume from.

Memory. The parent holds the list of units and the done markers, never records; a worker
holds one batch of records and the shard it is writing streams to disk. Peak memory is flat
in corpus size (``scaletrain bench prepare`` measures it).
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import pickle
import re
import shutil
import signal
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from scaletrain.data.records import UNIT_BYTES, Unit, UnitReader, describe_source, source_units, text_of
from scaletrain.data.shards import (
    FORMAT_VERSION,
    MANIFEST,
    PROGRESS,
    SHARD_TOKENS,
    TOKENIZER,
    Prepared,
    ShardWriter,
    open_prepared,
    token_dtype,
)
from scaletrain.errors import JobFailed, UserError
from scaletrain.paths import writable_dir

KINDS = ("text", "sft")
PLAN = "plan.json"
_REPORT_BYTES = 1 << 20  # a worker adds to the progress bar, and looks for a stop, once per this much input
_POLL_S = 0.2
# What prepare writes in --out, and so what it removes after a bad record.
_OUTPUT = re.compile(r"(shard-\d+\.(bin|idx|mask)|tokenizer\.json|tokenizer\.config\.json|manifest\.json)(\.tmp)?")


class TextEncoder:
    """Kind "text": a record's ``text_field`` tokenized, then ``separator`` (the tokenizer's end-of-text
    id, or the ids of a blank line), so that a model sees where one document ends and the next begins."""

    def __init__(self, tokenizer, text_field: str, separator: np.ndarray):
        self.tokenizer = tokenizer
        self.text_field = text_field
        self.separator = np.asarray(separator, dtype=np.int64)

    def __call__(self, record: dict) -> tuple[np.ndarray, None]:
        ids = np.asarray(self.tokenizer.encode(text_of(record, self.text_field)), dtype=np.int64)
        return np.concatenate([ids, self.separator]), None


@dataclass
class _Job:
    """What every worker needs, sent to each once."""

    encoder: Callable[[dict], tuple[np.ndarray, np.ndarray | None]]
    folder: Path  # the .progress folder the units are written into
    dtype: str
    shard_tokens: int
    masked: bool
    vocab_size: int


class _Stopped(Exception):
    """A worker's unit abandoned because another unit failed."""


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _write_json(path: Path, data: dict) -> None:
    """Written under a temporary name and renamed: a reader never sees half of it."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1), encoding="utf-8")
    os.replace(tmp, path)


def _stem(number: int) -> str:
    return f"unit-{number:06d}"


def _checked(job: _Job, ids, mask) -> tuple[np.ndarray, np.ndarray | None]:
    """An encoder's output, refused when it breaks the encoder's contract (a bug, not the user's mistake)."""
    ids = np.asarray(ids)
    if ids.ndim != 1 or ids.dtype.kind not in "iu":
        raise ValueError(f"an encoder must return a 1-D integer array of ids, not {ids.dtype} of shape {ids.shape}")
    if len(ids) and (ids.min() < 0 or ids.max() >= job.vocab_size):
        raise ValueError(f"the encoder gave ids from {ids.min()} to {ids.max()}, outside the tokenizer's "
                         f"{job.vocab_size}")
    if job.masked != (mask is not None):
        raise ValueError(f"a kind {'sft' if job.masked else 'text'} encoder returns "
                         f"{'a mask' if job.masked else 'None'} beside the ids")
    if mask is not None and np.shape(mask) != ids.shape:
        raise ValueError(f"the encoder's mask has shape {np.shape(mask)}, its ids {ids.shape}")
    return ids, mask


def _encode_unit(job: _Job, number: int, unit: Unit, report: Callable[[int], object],
                 stopped: Callable[[], bool]) -> None:
    """Encode one unit into its shards and done marker; ``report`` takes progress in bytes."""
    reader = UnitReader(unit)
    writer = ShardWriter(job.folder, _stem(number), np.dtype(job.dtype), job.shard_tokens, job.masked)
    records = reported = 0
    try:
        for record in reader:
            try:
                ids, mask = _checked(job, *job.encoder(record))
            except UserError as exc:
                raise UserError(f"{reader.where()}: {exc}") from None
            if len(ids):  # an empty encoding is no document
                writer.add(ids, mask)
            records += 1
            if reader.done - reported >= _REPORT_BYTES:
                if stopped():
                    raise _Stopped
                done = min(reader.done, unit.weight)
                report(done - reported)
                reported = done
        shards = writer.close()
    except BaseException:
        writer.discard()
        raise
    report(unit.weight - reported)
    _write_json(job.folder / f"{_stem(number)}.json", {"records": records, "shards": shards})


_WORKER: dict = {}  # a worker process's job, progress counter and stop flag, set once when it starts


def _start_worker(job: _Job, counter, stop) -> None:
    # An interrupt reaches the whole process group: the parent alone handles it, and stops the workers.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _WORKER.update(job=job, counter=counter, stop=stop)


def _report(n: int) -> None:
    counter = _WORKER["counter"]
    with counter.get_lock():
        counter.value += n


def _worker_unit(number: int, unit: Unit) -> None:
    _encode_unit(_WORKER["job"], number, unit, _report, _WORKER["stop"].is_set)


def _run(job: _Job, todo: list[tuple[int, Unit]], workers: int, bar: tqdm) -> None:
    """Encode the units of ``todo``: in this process for one worker, else in spawned worker processes."""
    if workers == 1 or len(todo) <= 1:
        for number, unit in todo:
            _encode_unit(job, number, unit, bar.update, lambda: False)
        return
    # spawn: a fresh interpreter per worker, so nothing of the parent's state (threads, locks) is inherited;
    # its workers are the parent's own children, so RUSAGE_CHILDREN sees their peak memory.
    context = multiprocessing.get_context("spawn")
    counter, stop = context.Value("q", 0), context.Event()
    with ProcessPoolExecutor(min(workers, len(todo)), mp_context=context, initializer=_start_worker,
                             initargs=(job, counter, stop)) as pool:
        pending = {pool.submit(_worker_unit, number, unit) for number, unit in todo}
        shown = 0
        try:
            while pending:
                done, pending = wait(pending, timeout=_POLL_S, return_when=FIRST_EXCEPTION)
                bar.update(counter.value - shown)
                shown = counter.value
                for future in done:
                    future.result()  # raises a worker's exception here
        except BrokenProcessPool:
            raise JobFailed("A prepare worker process died (killed, or out of memory); rerun the same command "
                            "to resume from the units already done.") from None
        finally:
            stop.set()
            for future in pending:
                future.cancel()


def _plan(sources: list[Path], encoder, tokenizer, kind: str, text_field: str, shard_tokens: int,
          unit_bytes: int) -> dict:
    """What the output depends on (it opens the manifest, and decides whether a folder may be resumed)."""
    plan = {"format": FORMAT_VERSION, "kind": kind, "text_field": text_field,
            "dtype": token_dtype(tokenizer.vocab_size).name,
            "tokenizer": {"name": tokenizer.name, "vocab_size": tokenizer.vocab_size,
                          "sha256": _sha256(tokenizer.to_json().encode("utf-8"))},
            "encoder_sha256": _sha256(pickle.dumps(encoder)), "shard_tokens": shard_tokens,
            "unit_bytes": unit_bytes, "sources": [describe_source(path) for path in sources]}
    return json.loads(json.dumps(plan))  # as it reads back from JSON, to compare with what a folder holds


def _complete(out: Path, plan: dict) -> bool:
    """Whether ``out`` already holds this prepare, complete; False when it is new, empty, or holds this
    prepare interrupted; refused when it holds anything else."""
    if not out.exists() or not any(out.iterdir()):
        return False
    for path, complete in ((out / MANIFEST, True), (out / PROGRESS / PLAN, False)):
        if path.is_file():
            try:
                found = json.loads(path.read_text(encoding="utf-8"))
            except (UnicodeDecodeError, ValueError):
                found = None
            if isinstance(found, dict) and {key: found.get(key) for key in plan} == plan:
                return complete
            state = "a prepared folder" if complete else "an interrupted prepare"
            raise UserError(f"--out {out} holds {state} of other sources, another tokenizer or other settings "
                            f"(or its sources changed since); give an empty or new folder, or delete it to "
                            f"start over.")
    raise UserError(f"--out {out} holds files that scaletrain prepare did not write; give an empty or new folder.")


def _remove_output(out: Path, created: Path | None) -> None:
    """Remove what prepare wrote: the folder it created, else its files in ``out``."""
    if created is not None:
        shutil.rmtree(created, ignore_errors=True)
        return
    shutil.rmtree(out / PROGRESS, ignore_errors=True)
    for path in out.iterdir():
        if _OUTPUT.fullmatch(path.name):
            path.unlink()


def _publish(out: Path, plan: dict, sources: list[Path], owners: list[int], tokenizer) -> None:
    """Rename every unit's shards into place, in unit order, then write the tokenizer and, last, the manifest."""
    work = out / PROGRESS
    records = [0] * len(sources)
    shards = []
    for number, owner in enumerate(owners):
        done = json.loads((work / f"{_stem(number)}.json").read_text(encoding="utf-8"))
        records[owner] += done["records"]
        for part, shard in enumerate(done["shards"]):
            name = f"shard-{len(shards):05d}"
            for ext in shard["sha256"]:
                written, final = work / f"{_stem(number)}-{part:03d}.{ext}", out / f"{name}.{ext}"
                if written.is_file():
                    os.replace(written, final)
                elif not final.is_file():  # neither written nor renamed by an interrupted publish
                    raise UserError(f"--out {out} is corrupt ({written.name} is missing); delete it and run "
                                    f"scaletrain prepare again.")
            shards.append({"name": name, **shard})
    for source, count in zip(sources, records):
        if count == 0:
            raise UserError(f"--data {source} holds no records; give a source that holds some.")
    n_tokens = sum(shard["tokens"] for shard in shards)
    if n_tokens == 0:
        raise UserError(f"The records of {', '.join(map(str, sources))} encode to no tokens; give records "
                        f"that hold text.")
    # Saved in place (with its sidecar of special tokens and chat template): the manifest, written
    # after it, is what says the folder is complete.
    tokenizer.save(out / TOKENIZER)
    _write_json(out / MANIFEST, {**plan, "n_tokens": n_tokens, "n_documents": sum(s["documents"] for s in shards),
                                 "records": records, "shards": shards})


def prepare(sources: list[Path], encoder, out: Path, *, tokenizer, kind: str, text_field: str, workers: int = 1,
            shard_tokens: int = SHARD_TOKENS, unit_bytes: int = UNIT_BYTES, progress: bool = True) -> Prepared:
    """Encode every record of ``sources`` with ``encoder`` into the prepared folder ``out`` (see the module's
    docstring), with ``workers`` processes; resume an interrupted one; return it opened."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, not {kind!r}")
    if workers < 1:
        raise UserError(f"--workers is {workers}; use 1 or more worker processes.")
    if shard_tokens < 1:
        raise UserError(f"--shard-tokens is {shard_tokens}; use 1 or more tokens per shard.")
    if not sources:
        raise UserError("No sources to prepare; give --data PATH.")
    out = writable_dir("--out", out)
    sources = [Path(source) for source in sources]
    for source in sources:
        if source.is_dir() and out.resolve().is_relative_to(source.resolve()):
            raise UserError(f"--out {out} lies inside --data {source}, whose records it would join; give a "
                            f"folder outside the data.")
    plan = _plan(sources, encoder, tokenizer, kind, text_field, shard_tokens, unit_bytes)
    if _complete(out, plan):
        shutil.rmtree(out / PROGRESS, ignore_errors=True)  # left when the last run stopped right after its manifest
        return open_prepared(out)
    created = next((p for p in reversed([out, *out.parents]) if not p.exists()), None)
    work = out / PROGRESS
    work.mkdir(parents=True, exist_ok=True)
    try:
        _write_json(work / PLAN, plan)
        for stale in work.glob("*.tmp"):  # files an interrupted worker had not finished
            stale.unlink()
        per_source = [source_units(source, unit_bytes, cache_dir=work / "datasets") for source in sources]
        units = [unit for source in per_source for unit in source]
        owners = [owner for owner, source in enumerate(per_source) for _ in source]
        job = _Job(encoder, work, plan["dtype"], shard_tokens, kind == "sft", tokenizer.vocab_size)
        todo = [(n, unit) for n, unit in enumerate(units) if not (work / f"{_stem(n)}.json").is_file()]
        done_bytes = sum(unit.weight for unit in units) - sum(unit.weight for _, unit in todo)
        with tqdm(total=sum(unit.weight for unit in units), initial=done_bytes, unit="B", unit_scale=True,
                  unit_divisor=1024, desc="prepare", dynamic_ncols=True, disable=not progress) as bar:
            _run(job, todo, workers, bar)
        _publish(out, plan, sources, owners, tokenizer)
    except UserError:
        _remove_output(out, created)
        raise
    shutil.rmtree(work)
    return open_prepared(out)
