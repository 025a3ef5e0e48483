"""The device mesh: how the world's ranks split into data, expert, pipeline,
context and tensor parallel groups, and the process groups that go with it.

Ranks are laid out row-major over `ParallelDims.order`, outermost first:

    rank = sum(coord[d] * stride[d]),  stride[d] = product of the sizes of
                                       every dim after d in the order

With the default order ("dp", "ep", "pp", "cp", "tp") tensor parallelism is
innermost, so a tp group is a run of consecutive ranks: its collectives run
every layer, so its members should be neighbours on one node. Data
parallelism is outermost because it talks least often (once per step).

A group "along" some dims is the set of ranks whose coordinates agree on every
other dim; the groups along the same dims partition the world.

Hybrid sharding (``--shard-group N``, parallel/hybrid.py) splits each group
ZeRO shards over (dp, or dp x cp) further: its members, in rank order, form
shard groups of N consecutive ranks (neighbours, so on one node) and replica
groups of the ranks at the same place in every shard group:

    dp group [0 1 2 3 4 5 6 7], N = 4:  shard [0 1 2 3] [4 5 6 7]
                                        replica [0 4] [1 5] [2 6] [3 7]
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from scaletrain.errors import UserError

DIM_NAMES = ("dp", "ep", "pp", "cp", "tp")

# Groups spanning several dims, built next to the single-dim ones. Every rank
# must create every group in the same order, so groups cannot be made lazily
# when a strategy first asks; these are the ones strategies reduce over:
# parameters are replicated across dp and cp (ring attention splits the
# sequence, not the weights) and dense parameters also across ep, whose ranks
# see different tokens.
COMBINED_DIMS = (("dp", "cp"), ("dp", "ep"), ("dp", "ep", "cp"))
HYBRID_KINDS = ("shard", "replica")


def _flag_product(sizes: dict[str, int]) -> str:
    return " x ".join(f"--{name} {size}" for name, size in sizes.items())


@dataclass(frozen=True)
class ParallelDims:
    """How many ways each kind of parallelism splits the world."""

    dp: int = 1
    pp: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1
    order: tuple[str, ...] = DIM_NAMES
    shard_group: int = 0  # ranks per hybrid-sharding shard group (module docstring); 0: no split

    def __post_init__(self) -> None:
        for name in DIM_NAMES:
            size = getattr(self, name)
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise UserError(f"--{name} must be a whole number of at least 1, got {size!r}.")
        if sorted(self.order) != sorted(DIM_NAMES):
            raise UserError(
                f"--mesh-order {','.join(self.order)} must name each of "
                f"{','.join(DIM_NAMES)} exactly once, outermost first."
            )
        if self.shard_group:
            sharded = self.dp * self.cp
            if self.ep > 1:
                raise UserError(f"--shard-group {self.shard_group} cuts the one group ZeRO shards over into "
                                f"shard groups, but with --ep {self.ep} ZeRO shards the dense weights over dp x ep "
                                f"and the experts over dp, two groups that would need cutting apart; drop one of "
                                f"the two.")
            if sharded % self.shard_group:
                raise UserError(f"--shard-group {self.shard_group} must divide the {sharded} ranks ZeRO shards "
                                f"over (--dp {self.dp} x --cp {self.cp}); choose a --shard-group that divides "
                                f"{sharded}.")

    @classmethod
    def infer(
        cls,
        world_size: int,
        dp: int | None = None,
        pp: int = 1,
        cp: int = 1,
        tp: int = 1,
        ep: int = 1,
        order: tuple[str, ...] = DIM_NAMES,
        shard_group: int = 0,
    ) -> ParallelDims:
        """Fill in dp as whatever the other sizes leave of the world."""
        if dp is None:
            # Construct first so bad sizes fail with their own message, not a division.
            model_parallel = cls(pp=pp, cp=cp, tp=tp, ep=ep)
            product = model_parallel.world_size
            if world_size % product:
                sizes = {"pp": pp, "cp": cp, "tp": tp, "ep": ep}
                raise UserError(
                    f"{_flag_product(sizes)} = {product} does not divide the world of "
                    f"{world_size} processes; choose sizes whose product divides {world_size}."
                )
            dp = world_size // product
        dims = cls(dp=dp, pp=pp, cp=cp, tp=tp, ep=ep, order=tuple(order), shard_group=shard_group)
        dims.validate(world_size)
        return dims

    @property
    def sizes(self) -> dict[str, int]:
        """Size of every dim, in placement order."""
        return {name: getattr(self, name) for name in self.order}

    @property
    def world_size(self) -> int:
        return math.prod(self.sizes.values())

    def validate(self, world_size: int) -> None:
        """Check that the sizes use exactly the world's processes."""
        if self.world_size != world_size:
            sizes = {name: getattr(self, name) for name in ("dp", "pp", "cp", "tp", "ep")}
            raise UserError(
                f"{_flag_product(sizes)} = {self.world_size} ranks, but the world has "
                f"{world_size} processes; choose sizes whose product is {world_size}."
            )

    def validate_for_model(
        self,
        *,
        n_heads: int | None,
        n_layers: int | None,
        seq_len: int | None,
        n_experts: int | None = None,
    ) -> None:
        """Check that the model can be split this way.

        None means the model has no such structure (an MLP has no heads and no
        sequence), so any split of it larger than 1 is refused.
        """
        if self.tp > 1:
            if n_heads is None:
                raise UserError(f"--tp {self.tp} splits attention heads, but this model has none; use --tp 1.")
            if n_heads % self.tp:
                raise UserError(
                    f"--tp {self.tp} must divide the model's {n_heads} attention heads; "
                    f"choose a --tp that divides {n_heads}."
                )
        if self.pp > 1:
            if n_layers is None:
                raise UserError(f"--pp {self.pp} splits a stack of layers, but this model has none; use --pp 1.")
            if self.pp > n_layers:
                raise UserError(
                    f"--pp {self.pp} needs at least {self.pp} layers, but the model has "
                    f"{n_layers}; choose --pp at most {n_layers}."
                )
        if self.cp > 1:
            if seq_len is None:
                raise UserError(f"--cp {self.cp} splits the sequence, but this model has none; use --cp 1.")
            if seq_len % self.cp:
                raise UserError(
                    f"--cp {self.cp} must divide the sequence length {seq_len}; "
                    f"choose a --cp that divides {seq_len}."
                )
        if self.ep > 1:
            if n_experts is None:
                raise UserError("--ep needs a mixture-of-experts model; use --ep 1 or a model with experts.")
            if n_experts % self.ep:
                raise UserError(
                    f"--ep {self.ep} must divide the model's {n_experts} experts; "
                    f"choose an --ep that divides {n_experts}."
                )

    def _strides(self) -> dict[str, int]:
        strides, stride = {}, 1
        for name in reversed(self.order):
            strides[name] = stride
            stride *= getattr(self, name)
        return strides

    def coords(self, rank: int) -> dict[str, int]:
        """Coordinates of a rank, keyed in placement order."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a mesh of {self.world_size} ranks")
        strides = self._strides()
        return {name: rank // strides[name] % getattr(self, name) for name in self.order}

    def rank_of(self, coords: dict[str, int]) -> int:
        """The rank at the given coordinates (every dim must be given)."""
        strides = self._strides()
        for name in self.order:
            if not 0 <= coords[name] < getattr(self, name):
                raise ValueError(f"coordinate {name}={coords[name]} is outside 0..{getattr(self, name) - 1}")
        return sum(coords[name] * strides[name] for name in self.order)

    def group_ranks(self, dim: str | tuple[str, ...], rank: int) -> list[int]:
        """Ranks that differ from `rank` only along `dim` (one name or several), sorted."""
        along = _as_dims(dim)
        here = self.coords(rank)
        members = [
            self.rank_of({**here, **dict(zip(along, values, strict=True))})
            for values in itertools.product(*(range(getattr(self, name)) for name in along))
        ]
        return sorted(members)

    def all_groups(self, dim: str | tuple[str, ...]) -> list[list[int]]:
        """The partition of all ranks into groups along `dim`, ordered by first rank."""
        groups: list[list[int]] = []
        seen: set[int] = set()
        for rank in range(self.world_size):
            if rank not in seen:
                members = self.group_ranks(dim, rank)
                seen.update(members)
                groups.append(members)
        return groups

    @property
    def sharded_dims(self) -> tuple[str, ...]:
        """The dims of the group ZeRO shards over (with ep = 1): dp, and cp where it is split."""
        return ("dp", "cp") if self.cp > 1 else ("dp",)

    def hybrid_groups(self, kind: str) -> list[list[int]]:
        """With a shard group size: the partition of the ranks into "shard" or "replica"
        groups (module docstring), ordered by first rank."""
        if kind not in HYBRID_KINDS or not self.shard_group:
            raise ValueError(f"no {kind!r} groups in a mesh with shard_group={self.shard_group}")
        n, groups = self.shard_group, []
        for members in self.all_groups(self.sharded_dims):
            groups += [members[i:i + n] for i in range(0, len(members), n)] if kind == "shard" else \
                [members[i::n] for i in range(n)]
        return sorted(groups)

    def named_group_ranks(self, name: str, rank: int) -> list[int]:
        """The ranks of the group that `Mesh.group(name)` gives `rank` ("dp_cp", "dp_shard", "world")."""
        if name == "world":
            return list(range(self.world_size))
        kind = name.rpartition("_")[2]
        if kind in HYBRID_KINDS:
            return next(group for group in self.hybrid_groups(kind) if rank in group)
        return self.group_ranks(tuple(name.split("_")), rank)

    def describe(self) -> str:
        """Short name of the layout, e.g. "dp2 x tp2"; only dims larger than 1 appear."""
        parts = [f"{name}{size}" for name, size in self.sizes.items() if size > 1]
        text = " x ".join(parts) if parts else "single rank"
        return text + (f" (shard groups of {self.shard_group})" if self.shard_group else "")

    def layout_table(self) -> str:
        """One line per rank with its coordinates, for the start-of-run log."""
        header = "rank " + " ".join(f"{name:>3}" for name in self.order)
        rows = [
            f"{rank:>4} " + " ".join(f"{c:>3}" for c in self.coords(rank).values())
            for rank in range(self.world_size)
        ]
        return "\n".join([header, *rows])


def _as_dims(dim: str | tuple[str, ...]) -> tuple[str, ...]:
    dims = (dim,) if isinstance(dim, str) else tuple(dim)
    unknown = [d for d in dims if d not in DIM_NAMES]
    if unknown or not dims:
        raise ValueError(f"unknown mesh dims {dims}; dims are {DIM_NAMES}")
    return dims


def group_name(dim: str | tuple[str, ...]) -> str:
    """Canonical name of the group along `dim`: dims joined in DIM_NAMES order, e.g. "dp_cp"."""
    return "_".join(sorted(_as_dims(dim), key=DIM_NAMES.index))


def hybrid_group_name(dims: ParallelDims, kind: str) -> str:
    """The ledger's name of this rank's hybrid "shard" or "replica" group: "dp_shard", "dp_cp_replica"."""
    return f"{group_name(dims.sharded_dims)}_{kind}"


@dataclass
class Group:
    """This process's view of one process group.

    `rank` is this process's index inside the group; `ranks` are global ranks.
    `handle` is the torch ProcessGroup (or, with --backend mpi4py, the MPI
    communicator), or None for a group of one, which
    needs no communication.
    """

    name: str
    ranks: tuple[int, ...]
    rank: int
    handle: Any = None

    @property
    def size(self) -> int:
        return len(self.ranks)


class TorchGroups:
    """How `Mesh.build` makes groups by default: torch.distributed process groups.
    (runtime/mpi.py's `MpiGroups` makes MPI communicators the same way.)"""

    @property
    def world(self) -> Any:
        return dist.group.WORLD

    def new_group(self, members: tuple[int, ...], name: str) -> Any:
        return dist.new_group(list(members), group_desc=name)


class Mesh:
    """Every process group this rank belongs to, built once, up front.

    torch.distributed.new_group must be called by every rank, for every group,
    in the same order, even for groups the rank is not in; so all groups are
    made eagerly in `build`, never on demand (MPI_Comm_create, behind
    `MpiGroups`, has the same rule).
    """

    def __init__(self, dims: ParallelDims, rank: int, groups: dict[str, Group]):
        self.dims = dims
        self.rank = rank
        self.coords = dims.coords(rank)
        self._groups = groups

    @classmethod
    def build(cls, dims: ParallelDims, rank: int, world_size: int, maker: Any = None) -> Mesh:
        """The groups of ``dims`` for ``rank``, made by ``maker`` (default: `TorchGroups`)."""
        dims.validate(world_size)
        if maker is None:
            if world_size > 1 and not dist.is_initialized():
                raise RuntimeError(f"a mesh over {world_size} ranks needs init_distributed to have run first")
            maker = TorchGroups()
        everyone = tuple(range(world_size))
        # One group per distinct member set: a group along dp_cp with
        # cp == 1 is the dp group, and a group of all ranks is the world.
        handles: dict[tuple[int, ...], Any] = {everyone: maker.world if world_size > 1 else None}
        groups = {"world": Group("world", everyone, rank, handles[everyone])}
        partitions = [(group_name(along), dims.all_groups(along))
                      for along in [(name,) for name in DIM_NAMES] + list(COMBINED_DIMS)]
        if dims.shard_group:
            partitions += [(hybrid_group_name(dims, kind), dims.hybrid_groups(kind)) for kind in HYBRID_KINDS]
        for name, partition in partitions:
            mine: tuple[int, ...] = ()
            for members in map(tuple, partition):
                if len(members) > 1 and members not in handles:
                    handles[members] = maker.new_group(members, name)
                if rank in members:
                    mine = members
            groups[name] = Group(name, mine, mine.index(rank), handles.get(mine))
        return cls(dims, rank, groups)

    def group(self, dim: str | tuple[str, ...]) -> Group:
        """The group along `dim` ("tp", ("dp", "cp"), "dp_cp"), or "world"."""
        name = dim if isinstance(dim, str) and dim in self._groups else group_name(dim)
        if name not in self._groups:
            raise KeyError(f"no mesh group {dim!r}; groups are {sorted(self._groups)}")
        return self._groups[name]

    @property
    def world_size(self) -> int:
        return self.dims.world_size
