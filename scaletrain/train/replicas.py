"""Which ranks hold copies of which weights, and how their gradients are averaged.

    group      ranks                  hold                                     read
    batch      dp x ep                -                                        different sequences
    dense      dp x ep x cp           the same dense weights                   (cp: other positions)
    experts    dp x cp                the same experts (ep ranks hold others)

Dense gradients are averaged over ``dense``. An expert's gradient already sums
the ep ranks' tokens (the combine's backward), so it is summed over
``experts`` and divided by the size of ``dense``: the number of ranks whose
losses it covers (docs/nd-parallel.md). ZeRO shards each weight over the
group holding its copies, with the same divisors (parallel/zero_experts.py).
Dims of size 1 are left out of a group but dp, so without cp and ep every
group is plain dp, named so in the ledger.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from scaletrain.config import ParallelConfig
from scaletrain.optim.compression import PowerSGD, SignCompressor
from scaletrain.parallel.data import DataParallel, JointDataParallel, replicate, summer
from scaletrain.parallel.experts import ExpertParallel
from scaletrain.parallel.local_sgd import LocalSGD
from scaletrain.parallel.zero import ZeroDataParallel
from scaletrain.parallel.zero_experts import JointZero, zero_with_experts
from scaletrain.runtime.comm import Comm
from scaletrain.runtime.mesh import Group, Mesh
from scaletrain.techniques.precision import compute_dtype


def _group_along(mesh: Mesh, *dims: str) -> Group:
    return mesh.group(tuple(d for d in dims if d == "dp" or mesh.dims.sizes[d] > 1))


@dataclass(frozen=True)
class Replicas:
    batch: Group
    dense: Group
    experts: Group

    @classmethod
    def of(cls, mesh: Mesh) -> Replicas:
        return cls(batch=_group_along(mesh, "dp", "ep"), dense=_group_along(mesh, "dp", "ep", "cp"),
                   experts=_group_along(mesh, "dp", "cp"))

    def start_equal(self, model: nn.Module, comm: Comm, experts: ExpertParallel | None) -> None:
        """Broadcast every weight (and buffer) from the first rank of the group holding its copies."""
        mine = [*experts.expert_params, *experts.expert_buffers] if experts else []
        own = {id(t) for t in mine}
        replicate([t for t in (*model.parameters(), *model.buffers()) if id(t) not in own], comm, self.dense)
        replicate(mine, comm, self.experts)

    def data_parallel(self, model: nn.Module, comm: Comm, p: ParallelConfig, seed: int,
                      experts: ExpertParallel | None, stepped: list[torch.Tensor], steps: int
                      ) -> DataParallel | JointDataParallel | LocalSGD:
        """The gradient averaging: one `DataParallel` over ``dense``, or with expert
        parallelism a second one for the experts over ``experts``; with ``--sync-every``
        N > 1 none, the optimizer's tensors (``stepped``) averaged every N of the ``steps``."""
        if p.sync_every > 1:
            return LocalSGD(model, stepped, comm, self.dense, every=p.sync_every, last_step=steps,
                            bucket_mb=p.bucket_mb, allreduce=p.allreduce)
        options = dict(bucket_mb=p.bucket_mb, reduce_dtype=compute_dtype(p.reduce_dtype), allreduce=p.allreduce)
        if not experts:
            return DataParallel(model, comm, self.dense, compressor=self._compressor(comm, p, seed), **options)
        mine = experts.expert_params
        return JointDataParallel([
            DataParallel(model, comm, self.dense, **options,
                         params=[q for q in model.parameters() if q not in mine]),
            DataParallel(model, comm, self.experts, **options,
                         params=[q for q in model.parameters() if q in mine], average_over=self.dense.size)])

    def zero(self, model: nn.Module, comm: Comm, shard: Group, experts: ExpertParallel | None,
             **options) -> ZeroDataParallel | JointZero:
        """ZeRO (``options``: `ZeroDataParallel`'s) over ``shard`` (``dense``, or with --shard-group this
        rank's shard group of it); with expert parallelism the experts over ``experts`` and the rest
        over ``dense`` (mesh.py refuses --shard-group with --ep)."""
        if not experts:
            return ZeroDataParallel(model, comm, shard, **options)
        return zero_with_experts(model, comm, self.dense, self.experts, experts.expert_params, **options)

    def _compressor(self, comm: Comm, p: ParallelConfig, seed: int) -> PowerSGD | SignCompressor | None:
        if p.compress == "powersgd":
            return PowerSGD(comm, self.dense, rank=p.powersgd_rank, seed=seed,
                            all_reduce=summer(comm, self.dense, p.allreduce))
        if p.compress == "sign":
            return SignCompressor(comm, self.dense)
        return None
