"""``scaletrain bench tp``: our Megatron tensor parallelism against torch's DTensor tensor parallel.

Every process is one rank of a tp group (``--nproc`` ranks, no data
parallelism). Both contenders split the same model the Megatron way
(Shoeybi et al. 2019), by the plan its family's spec gives (models/spec.py):
the attention's query/key/value and the MLP's input layers by output
features (column-parallel), the two projections by input features
(row-parallel, one all-reduce each forward), the token embedding and the
output head by vocabulary, and the cross-entropy computed from the
vocabulary-split logits without gathering them. Each builds the model whole
from the same seed and keeps its slices, so both start from the same
weights; every rank feeds both the same batches; they are raced step by
step in rotating order, each step after a barrier:

    micro-batches: forward, loss / grad_accum, backward
    clip the global gradient norm; AdamW step; zero the gradients

Contenders:

  ours  parallel/tensor.py: ``parallelize_tensor(model, spec.tensor_plan(cfg), ...)`` without
        sequence parallelism, its vocabulary-parallel cross-entropy
        (``TensorParallel.loss``) and its clip, which sums the split
        gradients' squares over the group and counts replicated ones once.
  peer  torch's ``parallelize_module`` over a DeviceMesh of the tp group, the
        same plan in torch's words (`peer_plan`): ``ColwiseParallel`` on the
        column-parallel layers, ``RowwiseParallel`` on the row-parallel ones,
        ``RowwiseParallel`` on the token embedding (its rows split, the ids
        replicated), ``ColwiseParallel`` on the head with the logits left as
        a vocabulary-sharded DTensor, and the cross-entropy under
        ``loss_parallel()``. The norms and a position embedding are outside
        the plan and stay plain (replicated) tensors;
        torch's foreach kernels refuse lists that mix them with DTensors, so
        each AdamW group is cut in its DTensors and its plain tensors, and
        the clip is torch's ``clip_grad_norm_`` in its two public halves:
        ``get_total_norm`` of each kind (the DTensors' reduced over the
        mesh), combined, then ``clip_grads_with_norm_`` on each kind.

Why this is the same work:

  - A fused weight (one qkv layer) stacks q, k and v along its output
    ([3, heads, head_dim]). Ours splits each of the three blocks over the
    ranks; ``ColwiseParallel`` cuts the output in ``nproc`` contiguous
    pieces, which would give rank 0 all of q and half of k. So before the
    peer is parallelized such rows are permuted to [q, k, v of rank 0's
    heads; q, k, v of rank 1's; ...]. Every column-parallel module is told
    its local width (``out_features``), from which the attention reads its
    head count: both then hold the same heads on the same rank and compute
    the same attention.
  - A head tied to the token embedding: ``parallelize_module`` distributes
    each module's parameters anew, which unties them; the head's weight is
    set back to the embedding's DTensor (both Shard(0) on the same mesh),
    so the peer, like ours, trains one vocabulary matrix.
  - ``loss_parallel()`` is torch's vocabulary-parallel cross-entropy: like
    ours it never gathers the logits.
  - Both use the same AdamW (``build_optimizer``: torch's, foreach) with the
    same settings and weight decay on the same parameters, and clip the
    norm of the whole model's gradient (replicated ones counted once) to
    the same ``--grad-clip``.

A step's time is the slowest rank's; each contender reports the median over
the steps after ``--warmup``. Since both compute the same function of the
same weights on the same data, their losses (rank 0's; every tp rank has the
whole loss) must agree step by step up to rounding: the report gives the
largest relative difference, the check that the timing compares equal work.
Measured once, each rank's weight shards were the same in both, bit for bit,
and so was the first step's loss; the gradients agree to float32 rounding,
not bit for bit, so at the tiny preset the losses stay equal while at the small one a difference of
about 1e-7 grows at the loss spikes of the constant learning rate to some
1e-5 in 30 steps (as in bench zero). A wrong head grouping or an untied head
shows from the first steps as 1e-3. The JSON keeps both loss curves.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    loss_parallel,
    parallelize_module,
)
from torch.nn.utils import clip_grads_with_norm_, get_total_norm

from scaletrain.bench import (
    Batches,
    largest_relative_gap,
    machine,
    race,
    race_rank,
    slowest_rank_medians,
    spawn_race,
    step_batches,
)
from scaletrain.config import Config
from scaletrain.errors import UserError
from scaletrain.job.data_setup import PreparedData
from scaletrain.models import CLASSIFIER, build_model, spec_for
from scaletrain.models.spec import (
    Column,
    Row,
    TensorPlan,
    VocabEmbedding,
    VocabHead,
    tied_parameters,
)
from scaletrain.optim import build_optimizer, decay_groups
from scaletrain.parallel.tensor import parallelize_tensor
from scaletrain.runtime.comm import Comm
from scaletrain.runtime.mesh import Group
from scaletrain.train.layout import loss_fn

OURS, PEER = "scaletrain tensor parallel", "torch DTensor TP (parallelize_module)"



def peer_plan(plan: TensorPlan) -> dict:
    """The spec's plan in torch's words: Megatron's split of each block, the vocabulary-parallel
    embedding and head (regions and replicated embeddings need no entry: DTensor places them)."""
    styles = {VocabEmbedding: lambda style: RowwiseParallel(input_layouts=Replicate()),
              Column: lambda style: ColwiseParallel(), Row: lambda style: RowwiseParallel(),
              VocabHead: lambda style: ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}
    return {pattern: styles[type(style)](style) for pattern, style in plan if type(style) in styles}


@dataclass
class Contender:
    """A tensor-parallel model, its optimizer, how it takes its loss and clips; what the race records."""

    name: str
    model: nn.Module
    optimizer: torch.optim.Optimizer
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    clip: Callable[[], object]
    loss_context: Callable[[], AbstractContextManager] = nullcontext
    step_s: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)

    def train_step(self, batches: Batches) -> float:
        """One optimizer step on ``batches`` (micro-batches); the step's loss."""
        self.model.train()
        total = 0.0
        for x, y in batches:
            logits = self.model(x)
            with self.loss_context():  # loss_parallel must cover the backward too
                loss = self.loss(logits, y) / len(batches)
                loss.backward()
            total += _whole(loss).item()
        self.clip()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return total


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def run(cfg: Config, warmup: int) -> dict:
    """Spawn ``--nproc`` tp ranks, race the contenders; the result as ``bench --json`` prints it."""
    n = cfg.parallel.nproc
    if cfg.model.name == CLASSIFIER:
        raise UserError("bench tp splits attention heads; give a language model's --model, not the mlp.")
    family = spec_for(cfg.model.name)
    family_cfg = family.configure(cfg.model, 1, cfg.data.seq_len)
    family.check(family_cfg, n)
    heads = family.shape(family_cfg).n_heads
    if n > 1 and heads % n:
        raise UserError(f"bench tp splits the model's {heads} attention heads over --nproc {n} ranks; "
                        f"give an --nproc that divides {heads}.")
    return spawn_race(cfg, warmup, _worker, "tp", "tensor parallelism", dim="tp")


def _max_norm(cfg: Config) -> float:
    return cfg.train.grad_clip if cfg.train.grad_clip > 0 else math.inf


def _ours(model: nn.Module, plan: TensorPlan, comm: Comm, group: Group, cfg: Config) -> Contender:
    tp = parallelize_tensor(model, plan, comm, group, sequence_parallel=False, dropout=0.0)
    params = list(model.parameters())
    optimizer = build_optimizer(decay_groups(model, cfg.train.weight_decay), cfg.train)
    return Contender(OURS, model, optimizer, tp.loss, lambda: tp.clip_grad_norm_(params, _max_norm(cfg)))


def _regroup_parts(layer: nn.Linear, parts: int, ranks: int) -> None:
    """Reorder a fused layer's rows from [q | k | v] (each [heads, head_dim]) to the
    ranks' pieces one after the other, each [q | k | v] of its own heads, so that
    an even split of the output gives each rank whole heads of all three."""
    with torch.no_grad():
        for tensor in (layer.weight, layer.bias):
            if tensor is not None:
                tensor.copy_(tensor.view(parts, ranks, -1, *tensor.shape[1:]).transpose(0, 1).reshape(tensor.shape))


def _by_kind(params: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """``params`` as [DTensors, plain tensors], leaving out an empty kind: torch's
    foreach kernels refuse a list that mixes the two."""
    kinds = ([p for p in params if isinstance(p, DTensor)], [p for p in params if not isinstance(p, DTensor)])
    return [kind for kind in kinds if kind]


def _clip_mixed(kinds: list[list[torch.Tensor]], max_norm: float) -> torch.Tensor:
    """torch's ``clip_grad_norm_``, taken in its two public halves (``get_total_norm``,
    ``clip_grads_with_norm_``) once per kind: the split weights' gradients are
    DTensors whose norm is reduced over the mesh, the replicated ones' plain and
    counted once, as in ours."""
    norms = [_whole(get_total_norm([p.grad for p in kind if p.grad is not None])) for kind in kinds]
    total = torch.linalg.vector_norm(torch.stack(norms))
    for kind in kinds:
        clip_grads_with_norm_(kind, max_norm, total)
    return total


def _peer(model: nn.Module, plan: TensorPlan, group: Group, device: torch.device, cfg: Config) -> Contender:
    ranks = group.size
    columns = [(module, style) for name, module in model.named_modules() for pattern, style in plan
               if isinstance(style, Column) and fnmatch.fnmatchcase(name, pattern)]
    for module, style in columns:
        if style.parts > 1:
            _regroup_parts(module, style.parts, ranks)
    ties = tied_parameters(model)
    parallelize_module(model, DeviceMesh.from_group(group.handle, device.type), peer_plan(plan))
    for copy, original in ties:  # re-tie: parallelize_module distributed each anew
        parent, _, attr = copy.rpartition(".")
        setattr(model.get_submodule(parent), attr, model.get_parameter(original))
    for module, _ in columns:
        module.out_features //= ranks  # the attention reads its local head count from it
    # The layer norms and the position embedding are outside the plan and stay plain
    # tensors: every optimizer group and the clip take the two kinds apart.
    groups = [{**g, "params": kind} for g in decay_groups(model, cfg.train.weight_decay)
              for kind in _by_kind(g["params"])]
    kinds = _by_kind(list(model.parameters()))
    return Contender(PEER, model, build_optimizer(groups, cfg.train), loss_fn,
                     lambda: _clip_mixed(kinds, _max_norm(cfg)), loss_parallel)


def _worker(cfg: Config, prepared: PreparedData, warmup: int) -> dict:
    with race_rank(cfg, prepared, "tp") as rank:
        mesh, comm, device, data = rank.mesh, rank.comm, rank.device, rank.data
        tp, dp = mesh.group("tp"), mesh.group("dp")

        def fresh_model() -> nn.Module:
            torch.manual_seed(cfg.train.seed)  # the same initial weights for both
            return build_model(cfg.model, vocab_size=prepared.vocab_size, seq_len=cfg.data.seq_len).to(device)

        family = spec_for(cfg.model.name)
        plan = family.tensor_plan(family.configure(cfg.model, prepared.vocab_size, cfg.data.seq_len))
        contenders = [_ours(fresh_model(), plan, comm, tp, cfg), _peer(fresh_model(), plan, tp, device, cfg)]

        def batches_at(step: int) -> Batches:  # dp has one rank: every tp rank reads the whole batch
            return [(x.to(device), y.to(device)) for x, y in step_batches(data, cfg.train, dp, step)]

        race(contenders, cfg.train.steps, batches_at, lambda c, batches, _: c.train_step(batches), comm, tp)
        medians = slowest_rank_medians(contenders, warmup, comm, tp)
        return _report(cfg, contenders, medians, tp.size, warmup, device)


def _report(cfg: Config, contenders: list[Contender], medians: dict[str, float], ranks: int, warmup: int,
            device: torch.device) -> dict:
    reference = contenders[0].losses
    ours, peer = ({"name": c.name, "median_s": medians[c.name], "final_loss": c.losses[-1],
                   "max_loss_rel_diff_to_ours": largest_relative_gap(c.losses, reference),
                   "losses": c.losses} for c in contenders)
    t = cfg.train
    return {
        "what": "tp",
        "machine": machine(),
        "nproc": ranks,
        "steps": t.steps,
        "warmup": warmup,
        "setup": {"model": cfg.model.name, "tp": ranks, "dp": 1, "seq_len": cfg.data.seq_len,
                  "micro_batch": t.micro_batch, "grad_accum": t.grad_accum, "timed_steps": t.steps - warmup,
                  "grad_clip": t.grad_clip, "device": device.type,
                  "torch_threads_per_rank": torch.get_num_threads()},
        "ours": ours,
        "peer": peer,
        "ratio": ours["median_s"] / peer["median_s"],
        "max_loss_rel_diff": peer["max_loss_rel_diff_to_ours"],
    }


def format_table(result: dict) -> str:
    s = result["setup"]
    title = (f"bench tp: {s['model']} over {result['nproc']} tp ranks ({s['device']}), seq {s['seq_len']}, "
             f"micro-batch {s['micro_batch']} x {s['grad_accum']}, {result['steps']} steps "
             f"({s['timed_steps']} timed), on {result['machine']}")
    rows = [f"{row['name']:<40}{row['median_s']:>9.4f}{row['final_loss']:>12.4f}"
            for row in (result["ours"], result["peer"])]
    return "\n".join([title, f"{'':<40}{'step s':>9}{'final loss':>12}", *rows,
                      f"ours / peer: {result['ratio']:.3f}; loss diff: {result['max_loss_rel_diff']:.1e}",
                      ("step s: median over the timed steps of the slowest rank; loss diff: largest relative "
                       "difference of a step's loss from ours (the same work was timed).")])
