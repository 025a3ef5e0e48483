"""Checkpoints: torch.distributed.checkpoint (DCP), atomic, safe to load.

Layout of a run folder's ``checkpoints/``::

    step_000050/            a complete checkpoint: DCP files, trainer_state.json, manifest.json
    .tmp_step_000100/       one being written; never read, removed on the next save
    .old_step_000010/       one being deleted (--keep-last); never read, removed on the next save

Every rank writes its own part in parallel (DCP plans the writes, so
replicated tensors are written once and sharded ones by their owners, and
fsyncs each file) into the temporary folder. After a barrier the ranks
share out the files and hash them (SHA-256); the main rank writes
``trainer_state.json`` and then ``manifest.json`` (every file's size and
hash; train/manifest.py), fsyncs both and the folder, and renames the folder into place, an
atomic step on a POSIX file system. A crash at any moment leaves the
previous complete checkpoint and maybe the new one, never a half-written one
that looks complete: only ``step_*`` folders are read, and only those holding
a manifest. ``--keep-last K`` deletes older ones only after the rename, each
renamed away first so that a deletion cut off leaves no ``step_*`` folder
with files missing.

Before a resume the manifest is checked against the files (sizes and
hashes), and the shapes in the metadata against the model: a truncated or
altered file, another model's checkpoint or another vocabulary is one
sentence, before any work starts.

What is saved: the model's ``state_dict`` and the optimizer's per-parameter
state keyed by parameter name (not by position), so a checkpoint does not
depend on how the optimizer's groups were built. With fp32 master weights
(``--param-dtype bf16``, ``--offload optimizer``) the masters are saved as
the model's weights, so every checkpoint holds fp32 weights whatever the
working dtype and where the masters lived. Learning rate, data position
and random streams are pure functions of the step (see the trainer), so the
step is all the trainer state there is: nothing else to restore, nothing to
drift.

Loading has ``weights_only=True`` semantics. DCP reads tensors with
``torch.load(weights_only=True)`` already, but its ``.metadata`` file is a
plain pickle; ``SafeFileSystemReader`` unpickles it with an allow-list of the
DCP metadata classes and torch's size/dtype types, so a crafted checkpoint
cannot run code.
"""

from __future__ import annotations

import io
import json
import math
import os
import pickle
import shutil
import warnings
from collections.abc import Collection
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed._shard.sharded_tensor import (
    Shard,
    ShardedTensor,
    ShardedTensorMetadata,
    ShardMetadata,
)
from torch.distributed._shard.sharded_tensor.metadata import TensorProperties
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import (
    Metadata,
    StorageMeta,
    TensorStorageMetadata,
)

from scaletrain.errors import UserError
from scaletrain.optim.adamw8bit import AdamW8bit
from scaletrain.optim.masters import MasterWeights
from scaletrain.parallel.tensor import Split, TensorParallel
from scaletrain.parallel.zero import FlatShard, ZeroDataParallel
from scaletrain.parallel.zero_experts import JointZero
from scaletrain.runtime.mesh import Group
from scaletrain.train.manifest import (
    MANIFEST,
    entry,
    fsync,
    share,
    write_durably,
    write_manifest,
)

STATE_FILE = "trainer_state.json"
# What reading a damaged, truncated or foreign checkpoint raises.
READ_ERRORS = (OSError, ValueError, KeyError, RuntimeError, pickle.UnpicklingError, EOFError, CheckpointException)
_TMP_PREFIX = ".tmp_"
_OLD_PREFIX = ".old_"


@contextmanager
def _quiet():
    """DCP warns that it assumes one process when no group exists; that is exactly the intent of a
    one-process run, so the warning is noise. It also warns on every ShardedTensor that DTensor is its
    successor: a DTensor shards a tensor into even blocks per dimension and cannot describe ZeRO's flat
    ranges, which ShardedTensor's arbitrary chunks do (see `_sharded`)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        warnings.filterwarnings("ignore", message=".*deprecating ShardedTensor", category=FutureWarning)
        yield


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step:06d}"


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """The complete checkpoints, oldest first (temporary folders are never complete)."""
    root = run_dir / "checkpoints"
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.name.startswith("step_") and (p / MANIFEST).is_file())


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint."""
    complete = complete_checkpoints(run_dir)
    return complete[-1] if complete else None


def saved_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """The full shape of every model tensor in a checkpoint, by ``state_dict`` key, from its metadata."""
    metadata = SafeFileSystemReader(path).read_metadata()
    return {fqn.removeprefix("model."): tuple(md.size) for fqn, md in metadata.state_dict_metadata.items()
            if fqn.startswith("model.") and isinstance(md, TensorStorageMetadata)}


def check_fits(path: Path, expected: dict[str, tuple[int, ...]]) -> None:
    """The checkpoint holds exactly the model's tensors, in its shapes: one sentence otherwise,
    the vocabulary named when it is what differs (the embedding's rows)."""
    try:
        saved = saved_shapes(path)
    except READ_ERRORS as exc:
        raise UserError(f"checkpoint {path} cannot be read ({failure_reason(exc)}); delete it to fall back "
                        f"to an earlier one.") from None
    missing, extra = sorted(expected.keys() - saved.keys()), sorted(saved.keys() - expected.keys())
    if missing or extra:
        names = ", ".join((missing or extra)[:3])
        raise UserError(f"checkpoint {path} is of another model: {'it lacks' if missing else 'this model has no'} "
                        f"{names}; resume with the model it was saved from, or start a new run.")
    rows = saved.get("tok_emb.weight"), expected.get("tok_emb.weight")  # a decoder's vocabulary x width
    if rows[0] and rows[1] and rows[0] != rows[1] and rows[0][1:] == rows[1][1:]:
        raise UserError(f"checkpoint {path} has a vocabulary of {rows[0][0]} tokens, but this run's data and "
                        f"tokenizer give {rows[1][0]}; resume with the data, --tokenizer and --vocab-size it was "
                        f"trained with.")
    for name in expected:  # in the model's order: the first that differs
        if saved[name] != expected[name]:
            raise UserError(f"checkpoint {path} holds {name} of shape {list(saved[name])}, but this model's is "
                            f"{list(expected[name])}; resume with the model sizes it was saved with.")


class _MetadataUnpickler(pickle.Unpickler):
    """Only what a DCP metadata file is made of: DCP's own dataclasses, torch
    sizes, dtypes, layouts and memory formats, and paths. Nothing callable
    that could run code."""

    _SAFE_CALLS = {("torch.serialization", "_get_layout"),  # looks a layout up by name
                   ("pathlib", "PosixPath"), ("pathlib", "WindowsPath")}

    def find_class(self, module: str, name: str) -> Any:
        if module.startswith("torch.distributed.checkpoint.") or (module, name) in self._SAFE_CALLS:
            return super().find_class(module, name)
        if module == "torch":
            value = getattr(torch, name, None)
            if value is torch.Size or isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
                return value
        raise pickle.UnpicklingError(f"checkpoint metadata refers to {module}.{name}, which is "
                                     f"not a checkpoint type")


class SafeFileSystemReader(FileSystemReader):
    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        raw = Path(self.path, ".metadata").read_bytes()
        metadata = _MetadataUnpickler(io.BytesIO(raw)).load()
        if not isinstance(metadata, Metadata):
            raise pickle.UnpicklingError("the .metadata file does not hold checkpoint metadata")
        # The bookkeeping FileSystemReader.read_metadata does after its pickle.load.
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def materialize_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create every parameter's optimizer state (lazy in torch) so a load has
    tensors to fill: one step with zero gradients at learning rate 0, which
    leaves the parameters unchanged (as torch's own DCP helpers do). The
    parameters' gradients are put back as they were (ZeRO's shards keep theirs)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if all(p in optimizer.state for p in params):
        return
    lrs = [group["lr"] for group in optimizer.param_groups]
    grads = [p.grad for p in params]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    for group, lr in zip(optimizer.param_groups, lrs):
        group["lr"] = lr
    for p, grad in zip(params, grads):
        p.grad = grad


def _unpacked(optimizer: torch.optim.Optimizer):
    """8-bit AdamW's moments as the fp32 tensors its checkpoints hold (optim/adamw8bit.py)."""
    return optimizer.unpacked() if isinstance(optimizer, AdamW8bit) else nullcontext()


def flat_chunks(shape: tuple[int, ...], start: int, stop: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Rectangular chunks (offsets, sizes) that together hold exactly the elements
    [start, stop) of a row-major tensor of ``shape``: a partial first row, a
    block of whole rows, a partial last row, each split the same way one
    dimension down."""
    if start >= stop:
        return []
    if len(shape) <= 1:
        return [((start,), (stop - start,))]
    row = math.prod(shape[1:])
    first, last = start // row, stop // row  # rows holding start and stop

    def within(r: int, lo: int, hi: int) -> list:
        return [((r, *offsets), (1, *sizes)) for offsets, sizes in flat_chunks(shape[1:], lo, hi)]

    if first == last:  # inside one row
        return within(first, start - first * row, stop - first * row)
    chunks = []
    if start % row:
        chunks += within(first, start % row, row)
        first += 1
    if last > first:
        chunks.append(((first, *[0] * (len(shape) - 1)), (last - first, *shape[1:])))
    if stop % row:
        chunks += within(last, 0, stop % row)
    return chunks


# One rectangular chunk of a full tensor: the global rank holding it, its offsets
# and sizes, and, on that rank, the tensor holding its elements (None elsewhere).
Chunk = tuple[int, tuple[int, ...], tuple[int, ...], "torch.Tensor | None"]


def _sharded_tensor(shape: tuple[int, ...], like: torch.Tensor, chunks: list[Chunk]) -> Any:
    """A ShardedTensor from chunks that tile the full tensor. Every rank
    describes the whole tiling, so none has to ask the others; DCP writes and
    reads only the chunks a rank holds, the others are there for the tiling."""
    metadata, local = [], []
    for rank, offsets, sizes, tensor in chunks:
        meta = ShardMetadata(shard_offsets=list(offsets), shard_sizes=list(sizes),
                             placement=f"rank:{rank}/{like.device}")
        metadata.append(meta)
        if tensor is not None:
            local.append(Shard(tensor, meta))
    properties = TensorProperties(dtype=like.dtype)
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        local, ShardedTensorMetadata(shards_metadata=metadata, size=torch.Size(shape), tensor_properties=properties))


def _flat_chunks_of(shard: FlatShard) -> list[Chunk]:
    """A ZeRO `FlatShard`'s ranges, every rank's, as rectangles of its tensor."""
    chunks = []
    for rank, start, stop in shard.spans:
        position = 0
        for offsets, sizes in flat_chunks(tuple(shard.shape), start, stop):
            mine = shard.local[position:position + math.prod(sizes)].view(sizes) if rank == shard.rank else None
            chunks.append((rank, offsets, sizes, mine))
            position += math.prod(sizes)
    return chunks


def _placed_in_full(chunks: list[Chunk], split: Split, tp_rank: int) -> list[Chunk]:
    """Chunks of tp rank ``tp_rank``'s slice of a weight, moved to where they lie
    in the full weight: along the split dimension the slice is its part of
    each of ``split.parts`` blocks (q, k, v), so a chunk is cut where blocks
    meet and each piece shifted to its block's slice."""
    dim, length = split.dim, split.sizes[tp_rank]
    placed = []
    for rank, offsets, sizes, tensor in chunks:
        lo, hi = offsets[dim], offsets[dim] + sizes[dim]
        while lo < hi:
            block, within = divmod(lo, length)
            stop = min(hi, (block + 1) * length)
            full_offsets, full_sizes = list(offsets), list(sizes)
            full_offsets[dim] = block * split.block + split.start(tp_rank) + within
            full_sizes[dim] = stop - lo
            piece = None if tensor is None else tensor.narrow(dim, lo - offsets[dim], stop - lo)
            placed.append((rank, tuple(full_offsets), tuple(full_sizes), piece))
            lo = stop
    return placed


def _tensor_parallel_sharded(chunks: list[Chunk], split: Split, group: Group, like: torch.Tensor) -> Any:
    """A tp slice held in ``chunks`` (the whole slice, or the ZeRO shards of the
    dp group holding it), as chunks of the full weight; the other tp ranks'
    slices complete the tiling, described whole."""
    placed = _placed_in_full(chunks, split, group.rank)
    for index, global_rank in enumerate(group.ranks):
        if index != group.rank:
            shape = list(split.full_shape)
            shape[split.dim] = split.parts * split.sizes[index]
            placed += _placed_in_full([(global_rank, (0,) * len(shape), tuple(shape), None)], split, index)
    return _sharded_tensor(split.full_shape, like, placed)


def _per_rank(value: Any, group: Group) -> Any:
    """A tensor that every member of ``group`` holds its own of, as row ``group.rank`` of a
    ``(group.size, *shape)`` tensor, each member writing and reading its row."""
    if not torch.is_tensor(value):
        return value
    rows = [(rank, (index, *[0] * value.dim()), (1, *value.shape), value.unsqueeze(0) if index == group.rank
             else None) for index, rank in enumerate(group.ranks)]
    return _sharded_tensor((group.size, *value.shape), value, rows)


def _state_dict(model: nn.Module, optimizer: torch.optim.Optimizer | None, masters: MasterWeights | None,
                zero: ZeroDataParallel | JointZero | None, tensor_parallel: TensorParallel | None,
                own_optimizer: Group | None = None) -> dict[str, Any]:
    """Model weights and per-parameter optimizer state, both by parameter name.

    With master weights, the fp32 master stands in for its parameter, in both
    places: the optimizer steps on the masters, and they hold the bits a bf16
    working weight has lost (loading writes them, then re-rounds the model).
    Under ZeRO each rank gives its shards, as chunks of the full tensors: the
    files hold the same tensors, by the same names and shapes, as any other
    layout's, and a load reads whatever chunks its own layout needs. Tensor
    parallel slices are described the same way, as chunks of the full tensors,
    and so are ZeRO shards of tp slices (each chunk placed twice over: within
    the slice, then the slice within the weight). With ``own_optimizer`` (local SGD: the
    dp group, whose ranks keep their own AdamW moments) every optimizer tensor gets a
    leading dimension of one row per member.
    """
    if zero is not None:
        weights, optim = zero.flat_shards(optimizer)
    else:
        def stepped(tensor: torch.Tensor) -> torch.Tensor:
            master = masters.master_of(tensor) if masters else None
            return master if master is not None else tensor

        names = {id(stepped(p)): name for name, p in model.named_parameters()}
        optim = {names[id(p)]: dict(optimizer.state[p])
                 for group in optimizer.param_groups for p in group["params"]} if optimizer is not None else {}
        weights = {key: stepped(t).detach() for key, t in model.state_dict(keep_vars=True).items()}
    splits = {} if tensor_parallel is None else {
        name: tensor_parallel.splits[p] for name, p in model.named_parameters(remove_duplicate=False)
        if p in tensor_parallel.splits}

    def whole(name: str, value: Any) -> Any:
        """``value`` (a weight, its optimizer state, or this rank's ZeRO shard of either) as DCP sees it."""
        split = splits.get(name)
        if isinstance(value, FlatShard):
            chunks, like = _flat_chunks_of(value), value.local
            if split is None and len(value.spans) == 1:
                return value.local.view(value.shape)
        elif split is not None and torch.is_tensor(value) and value.dim() == len(split.full_shape):
            me = tensor_parallel.group.ranks[tensor_parallel.group.rank]
            chunks, like = [(me, (0,) * value.dim(), tuple(value.shape), value)], value
        else:
            return value
        if split is None:
            return _sharded_tensor(tuple(value.shape), like, chunks)
        return _tensor_parallel_sharded(chunks, split, tensor_parallel.group, like)

    def optimizer_value(name: str, value: Any) -> Any:
        return whole(name, value) if own_optimizer is None else _per_rank(value, own_optimizer)

    return {"model": {name: whole(name, v) for name, v in weights.items()},
            "optim": {name: {k: optimizer_value(name, v) for k, v in state.items()} for name, state in optim.items()}}


@dataclass(frozen=True)
class Team:
    """The ranks that save a checkpoint together: this one's index among them,
    how many they are, and how they wait for and hear from each other (one
    process: alone)."""

    rank: int = 0
    size: int = 1
    barrier: Callable[[], None] = lambda: None
    gather: Callable[[Any], list[Any]] = lambda value: [value]

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _remove_leftovers(root: Path) -> None:
    """Folders of a save or a deletion that a crash cut off."""
    for stale in root.glob(".*_step_*") if root.exists() else ():
        if stale.name.startswith((_TMP_PREFIX, _OLD_PREFIX)):
            shutil.rmtree(stale)


def prune(run_dir: Path, keep_last: int, strike: Callable[[str], None]) -> None:
    """Delete all but the newest ``keep_last`` complete checkpoints, each renamed away first."""
    for old in complete_checkpoints(run_dir)[:-keep_last]:
        doomed = old.with_name(_OLD_PREFIX + old.name)
        os.replace(old, doomed)
        strike("save-prune")
        shutil.rmtree(doomed)


def save_checkpoint(run_dir: Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                    masters: MasterWeights | None, trainer_state: dict[str, Any], team: Team = Team(), *,
                    zero: ZeroDataParallel | JointZero | None = None,
                    tensor_parallel: TensorParallel | None = None,
                    own_optimizer: Group | None = None, keep_last: int = 0,
                    strike: Callable[[str], None] = lambda point: None) -> Path:
    """Write a checkpoint atomically (module docstring); ``strike`` is fault injection's hook (runtime/faults.py)."""
    final = checkpoint_dir(run_dir, step)
    tmp = final.with_name(_TMP_PREFIX + final.name)
    if team.is_main:
        _remove_leftovers(final.parent)
        tmp.mkdir(parents=True)
    team.barrier()
    strike("save-begin")
    materialize_optimizer_state(optimizer)
    # DCP plans the ranks' writes over torch's process group. Without one (--backend
    # mpi4py, whose ranks all hold the same whole replica: config.py) the main rank
    # writes the checkpoint alone.
    if team.is_main or dist.is_initialized():
        with _quiet(), _unpacked(optimizer):
            dcp.save(_state_dict(model, optimizer, masters, zero, tensor_parallel, own_optimizer),
                     storage_writer=FileSystemWriter(tmp, sync_files=True))
    strike("save-written")
    team.barrier()
    hashed = team.gather(share(tmp, team.rank, team.size))
    if team.is_main:
        write_durably(tmp / STATE_FILE, json.dumps(trainer_state, indent=2))
        files = {name: line for part in hashed for name, line in part.items()}
        files[STATE_FILE] = entry(tmp / STATE_FILE)
        strike("save-manifest")
        write_manifest(tmp, step, files)
        fsync(tmp)
        strike("save-rename")
        replaced = final.with_name(_OLD_PREFIX + final.name)
        if final.exists():  # an earlier attempt at this very step completed: moved aside, deleted after
            os.replace(final, replaced)
        os.replace(tmp, final)
        fsync(final.parent)
        shutil.rmtree(replaced, ignore_errors=True)
        if keep_last:
            prune(run_dir, keep_last, strike)
    team.barrier()
    return final


def failure_reason(exc: BaseException) -> str:
    """The first line of what went wrong, unwrapped from DCP's per-rank report."""
    if isinstance(exc, CheckpointException) and exc.failures:
        exc = next(iter(exc.failures.values()))[0]
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def load_checkpoint(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None,
                    masters: MasterWeights | None = None, zero: ZeroDataParallel | JointZero | None = None,
                    tensor_parallel: TensorParallel | None = None, own_optimizer: Group | None = None
                    ) -> dict[str, Any]:
    """Fill model (and masters) and optimizer in place (no optimizer: the weights alone, as
    ``scaletrain eval --tp`` reads them); return the trainer state."""
    try:
        trainer_state = json.loads((path / STATE_FILE).read_text())
        if optimizer is not None:
            materialize_optimizer_state(optimizer)
        with _quiet(), _unpacked(optimizer):
            dcp.load(_state_dict(model, optimizer, masters, zero, tensor_parallel, own_optimizer),
                     storage_reader=SafeFileSystemReader(path))
        if masters:
            masters.copy_master_to_model()
        if zero:
            zero.publish()
    except READ_ERRORS as exc:
        raise UserError(f"checkpoint {path} cannot be loaded ({failure_reason(exc)}); delete it to fall back "
                        f"to an earlier one, or start a new run.") from None
    return trainer_state


def read_model_tensors(path: Path, names: Collection[str] | None = None) -> dict[str, torch.Tensor]:
    """The model's full tensors (``names``' only, where given) from a checkpoint, whatever layout
    wrote it: shapes come from the metadata, DCP assembles the shards."""
    reader = SafeFileSystemReader(path)
    metadata = reader.read_metadata()
    state = {fqn: torch.empty(md.size, dtype=md.properties.dtype)
             for fqn, md in metadata.state_dict_metadata.items()
             if fqn.startswith("model.") and isinstance(md, TensorStorageMetadata)
             and (names is None or fqn.removeprefix("model.") in names)}
    with _quiet():  # one reader, whole tensors: no collective, even inside a run's process group
        dcp.load(state, storage_reader=SafeFileSystemReader(path), no_dist=True)
    return {fqn.removeprefix("model."): tensor for fqn, tensor in state.items()}
