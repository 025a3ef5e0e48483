"""``scaletrain bench zero``: our ZeRO stage 3 against torch FSDP2 (and DeepSpeed ZeRO-3, when installed).

All three shard the parameters, the gradients and the optimizer state over
the ranks (ZeRO-3, Rajbhandari et al. 2020) and gather a layer's parameters
just before it runs. Each builds the same model from the same seed, so all
start from the same weights, and each rank feeds each the same batches;
they are raced step by step in rotating order, each step after a barrier:

    micro-batches: forward, loss / grad_accum, backward, every micro-batch's
                   gradients reduce-scattered into the rank's shard
    clip the global gradient norm; AdamW step on the shard; zero the gradients

Contenders:

  ours      parallel/zero.py, ``ZeroDataParallel(stage=3)``: one unit per
            repeated layer (a decoder's blocks, the mlp's linear layers) plus
            the root unit of the rest, with prefetch of the next unit.
  FSDP2     torch's ``fully_shard`` on the same units (each layer, then the
            root), over a DeviceMesh of the dp group: the peer the ratio is
            taken against. Our stage 3 reduce-scatters every micro-batch (it
            never holds whole gradients), so FSDP2 keeps its default of
            syncing every micro-batch too, rather than
            ``set_requires_gradient_sync(False)`` on all but the last: both
            then do the same communication.
  DeepSpeed ZeRO-3 (``deepspeed.initialize``, ``zero_optimization.stage`` 3)
            with the same torch AdamW as client optimizer, only when the
            optional ``deepspeed`` package imports (``pip install
            'scaletrain[deepspeed]'``); on CPU with ``DS_ACCELERATOR=cpu``
            over gloo. ``stage3_param_persistence_threshold`` is 0 so that,
            as in the other two, every parameter is sharded (by default
            DeepSpeed keeps tensors under 100k elements whole on every rank);
            its other settings are its defaults.

A step's time is the slowest rank's; each contender reports the median over
the steps after ``--warmup``. Since all do the same arithmetic on the same
data, their losses (rank 0's) must agree step by step up to rounding: the
report gives each peer's largest relative difference from ours, the check
that the timing compares equal work.

Memory, per rank: the sharded training state each contender keeps between
steps, counted from its tensors on the last step after the optimizer has
stepped (parameter shards, gradient shards, fp32 masters apart from the
parameters, optimizer state; storages counted once), which CPU runs can
report too; and on CUDA,
``torch.cuda.max_memory_allocated`` over each contender's step (reset before
it), as is, and less what was allocated when the step began (what the step
itself added: gathered layers, activations, gradients in flight). All
contenders live in the process at once, so the raw peak includes the
others' resident state.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import warnings
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext, redirect_stdout
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

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
from scaletrain.job.data_setup import PreparedData
from scaletrain.models import build_model
from scaletrain.optim import build_optimizer, decay_groups
from scaletrain.parallel.data import replicate
from scaletrain.parallel.zero import ZeroDataParallel, layer_modules
from scaletrain.runtime.comm import Comm
from scaletrain.runtime.mesh import Group
from scaletrain.train.layout import loss_fn
from scaletrain.train.memory import bytes_by_entry, optimizer_state

OURS, PEER, DEEPSPEED = "scaletrain ZeRO-3", "torch FSDP2 (fully_shard)", "DeepSpeed ZeRO-3"
CPU_MEMORY_NOTE = "not measurable on CPU"
INSTALL_HINT = "pip install 'scaletrain[deepspeed]'"


class Contender:
    """One ZeRO-3 implementation training its copy of the model; what the race records."""

    name: str

    def __init__(self, model: nn.Module, optimizer: Any, max_norm: float):
        self.model, self.optimizer, self.max_norm = model, optimizer, max_norm
        self.step_s: list[float] = []
        self.losses: list[float] = []
        self.state: dict | None = None  # bytes_by_entry of the sharded state, taken once
        self.cuda_peak: list[int] = []  # max_memory_allocated over each step
        self.cuda_step: list[int] = []  # the same less what was allocated as the step began

    def train_step(self, batches: Batches, measure: bool) -> float:
        """One optimizer step on ``batches`` (micro-batches); this rank's loss. With
        ``measure``, count the sharded state after the optimizer step."""
        raise NotImplementedError

    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        """This rank's training state by ledger entry (params, grads, optimizer)."""
        raise NotImplementedError

    def _measure(self) -> None:
        self.state = bytes_by_entry(self.state_tensors())


def _forward_backward(model: nn.Module, batches: Batches,
                      no_sync: Callable[[], AbstractContextManager] = nullcontext) -> float:
    """Every micro-batch's forward and backward (inside ``no_sync()`` but the last),
    the loss scaled by 1/grad_accum; the sum of the scaled losses (this rank's loss of the step)."""
    model.train()
    total = 0.0
    for micro, (x, y) in enumerate(batches):
        with nullcontext() if micro == len(batches) - 1 else no_sync():
            loss = loss_fn(model(x), y) / len(batches)
            loss.backward()
        total += loss.item()
    return total


class Ours(Contender):
    name = OURS

    def __init__(self, model: nn.Module, comm: Comm, group: Group, cfg: Config, max_norm: float):
        replicate([*model.parameters(), *model.buffers()], comm, group)
        self.zero = ZeroDataParallel(model, comm, group, stage=3)
        groups = self.zero.optimizer_groups(decay_groups(model, cfg.train.weight_decay))
        super().__init__(model, build_optimizer(groups, cfg.train), max_norm)

    def train_step(self, batches: Batches, measure: bool) -> float:
        # Stage 3 reduce-scatters every micro-batch all the same (it never holds whole gradients).
        loss = _forward_backward(self.model, batches, self.zero.no_sync)
        self.zero.finish_gradient_sync()
        self.zero.clip_grad_norm_(self.max_norm)
        self.optimizer.step()
        if measure:
            self._measure()
        self.zero.publish()
        self.zero.zero_grad()  # not optimizer.zero_grad(): the shard pieces' .grad are permanent views
        return loss

    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        tensors = self.zero.memory_tensors()
        tensors["optimizer"] += optimizer_state(self.optimizer)
        return tensors


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class FSDP2(Contender):
    name = PEER

    def __init__(self, model: nn.Module, group: Group, device: torch.device, cfg: Config, max_norm: float):
        mesh = DeviceMesh.from_group(group.handle, device.type)
        for layer in layer_modules(model):  # the same units as ours
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        # Built after sharding: the optimizer steps on the DTensor shards.
        super().__init__(model, build_optimizer(decay_groups(model, cfg.train.weight_decay), cfg.train),
                         max_norm)

    def train_step(self, batches: Batches, measure: bool) -> float:
        # No set_requires_gradient_sync(False): reduce-scatter every micro-batch, as ours does.
        loss = _forward_backward(self.model, batches)
        torch.nn.utils.clip_grad_norm_(list(self.model.parameters()), self.max_norm)
        self.optimizer.step()
        if measure:
            self._measure()
        self.optimizer.zero_grad(set_to_none=True)
        return loss

    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        params = list(self.model.parameters())
        return {"params": [_local(p) for p in params],
                "grads": [_local(p.grad) for p in params if p.grad is not None],
                "optimizer": [_local(t) for t in optimizer_state(self.optimizer)]}


def _import_deepspeed(device: torch.device) -> tuple[Any, str | None]:
    """The ``deepspeed`` module, or None and why not. Its log goes to stderr
    (it writes to stdout by default, which ``--json`` keeps for the result)."""
    os.environ["DS_ACCELERATOR"] = "cpu" if device.type == "cpu" else "cuda"
    try:
        with redirect_stdout(sys.stderr):  # its logger binds to the stdout of import time
            import deepspeed
    except ImportError as error:
        if error.name == "deepspeed":
            return None, f"the optional deepspeed package is not installed ({INSTALL_HINT})"
        return None, f"deepspeed does not import: {error}"
    except Exception as error:  # noqa: BLE001 - a broken install can raise anything at import
        return None, f"deepspeed does not import: {type(error).__name__}: {error}"
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    # It calls torch.distributed's collectives by their pre-2.13 names, warning at every call.
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")
    return deepspeed, None


class DeepSpeed(Contender):
    name = DEEPSPEED

    def __init__(self, deepspeed: Any, model: nn.Module, cfg: Config, max_norm: float):
        t = cfg.train
        config = {
            "train_micro_batch_size_per_gpu": t.micro_batch,
            "gradient_accumulation_steps": t.grad_accum,
            "gradient_clipping": max_norm if math.isfinite(max_norm) else 0.0,
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
            "zero_allow_untested_optimizer": True,  # a client torch AdamW, the same as the others'
            "steps_per_print": 2**31 - 1,
        }
        optimizer = build_optimizer(decay_groups(model, t.weight_decay), t)
        with redirect_stdout(sys.stderr):
            engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
        super().__init__(engine, optimizer, max_norm)

    def train_step(self, batches: Batches, measure: bool) -> float:
        engine = self.model
        engine.train()
        total = 0.0
        for x, y in batches:
            loss = loss_fn(engine(x), y)
            engine.backward(loss)  # scales by 1/gradient_accumulation_steps itself
            engine.step()  # after the last micro-batch: clip, optimizer step, zero the gradients
            total += loss.item() / len(batches)
        if measure:
            self._measure()  # its gradient partitions live in one permanent buffer
        return total

    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        zero = self.optimizer  # DeepSpeedZeroOptimizer_Stage3
        params = [p.ds_tensor for p in self.model.module.parameters()]
        params += [t for t in zero.fp16_partitioned_groups_flat if t is not None]
        owned = {t.untyped_storage().data_ptr() for t in params}
        masters = [t for t in zero.fp32_partitioned_groups_flat if t.untyped_storage().data_ptr() not in owned]
        grads = [t for t in (getattr(zero, "grad_partitions_flat_buffer", None),) if t is not None]
        return {"params": params, "grads": grads, "optimizer": masters + optimizer_state(zero.optimizer)}


def run(cfg: Config, warmup: int) -> dict:
    """Spawn ``--nproc`` workers, race the contenders; the result as ``bench --json`` prints it."""
    return spawn_race(cfg, warmup, _worker, "zero", "sharded data parallelism")


def _contenders(cfg: Config, prepared: PreparedData, data, comm: Comm, group: Group,
                device: torch.device) -> tuple[list[Contender], str | None]:
    """Ours, FSDP2 and, when it imports on every rank, DeepSpeed; and why DeepSpeed is left out, if it is."""
    max_norm = cfg.train.grad_clip if cfg.train.grad_clip > 0 else math.inf
    deepspeed, skipped = _import_deepspeed(device)
    reasons = [reason for reason in comm.all_gather_object(skipped, group) if reason]
    skipped = reasons[0] if reasons else None  # every rank must agree, or the collectives would not match

    def fresh_model() -> nn.Module:
        torch.manual_seed(cfg.train.seed)  # the same initial weights for every contender
        return build_model(cfg.model, vocab_size=prepared.vocab_size, seq_len=cfg.data.seq_len,
                           n_features=data.n_features, n_classes=data.n_classes).to(device)

    contenders: list[Contender] = [Ours(fresh_model(), comm, group, cfg, max_norm),
                                   FSDP2(fresh_model(), group, device, cfg, max_norm)]
    if skipped is None:
        contenders.append(DeepSpeed(deepspeed, fresh_model(), cfg, max_norm))
    return contenders, skipped


def _worker(cfg: Config, prepared: PreparedData, warmup: int) -> dict:
    with race_rank(cfg, prepared, "dp") as rank:
        comm, dp, device, data = rank.comm, rank.mesh.group("dp"), rank.device, rank.data
        contenders, skipped = _contenders(cfg, prepared, data, comm, dp, device)
        cuda = device.type == "cuda"
        last = cfg.train.steps - 1

        def batches_at(step: int) -> Batches:
            return [(x.to(device), y.to(device)) for x, y in step_batches(data, cfg.train, dp, step)]

        def train_step(c: Contender, batches: Batches, step: int) -> float:
            if not cuda:
                return c.train_step(batches, measure=step == last)
            torch.cuda.reset_peak_memory_stats(device)
            resident = torch.cuda.memory_allocated(device)
            loss = c.train_step(batches, measure=step == last)
            torch.cuda.synchronize(device)  # the step's kernels are part of its time
            c.cuda_peak.append(torch.cuda.max_memory_allocated(device))
            c.cuda_step.append(c.cuda_peak[-1] - resident)
            return loss

        race(contenders, cfg.train.steps, batches_at, train_step, comm, dp)
        medians = slowest_rank_medians(contenders, warmup, comm, dp)
        memory = comm.all_gather_object({c.name: (c.state, c.cuda_peak, c.cuda_step) for c in contenders}, dp)
        return _report(cfg, contenders, medians, memory, warmup, skipped, device)


def _report(cfg: Config, contenders: list[Contender], medians: dict[str, float], memory: list[dict],
            warmup: int, deepspeed_skipped: str | None, device: torch.device) -> dict:
    reference = contenders[0].losses
    rows = {}
    for c in contenders:
        states = [rank[c.name][0] for rank in memory]
        peaks = [max(rank[c.name][1], default=None) for rank in memory]
        steps = [max(rank[c.name][2], default=None) for rank in memory]
        rows[c.name] = {
            "name": c.name, "median_s": medians[c.name], "final_loss": c.losses[-1],
            "max_loss_rel_diff_to_ours": largest_relative_gap(c.losses, reference),
            # The largest rank's, and every rank's: {params, grads, optimizer, by_device}.
            "state_bytes": max(s["params"] + s["grads"] + s["optimizer"] for s in states),
            "state_bytes_per_rank": states,
            "cuda_peak_bytes": None if None in peaks else max(peaks),
            "cuda_step_bytes": None if None in steps else max(steps),
        }
    t, ours, peer = cfg.train, rows[OURS], rows[PEER]
    deepspeed = rows.get(DEEPSPEED)
    result = {
        "what": "zero",
        "machine": machine(),
        "setup": {"model": cfg.model.name, "ranks": len(memory), "seq_len": cfg.data.seq_len,
                  "micro_batch": t.micro_batch, "grad_accum": t.grad_accum, "steps": t.steps,
                  "timed_steps": t.steps - warmup, "grad_clip": t.grad_clip,
                  "device": device.type,
                  "torch_threads_per_rank": torch.get_num_threads()},
        "ours": ours,
        "peer": peer,
        "peers": [peer, *([deepspeed] if deepspeed else [])],
        "ratio": ours["median_s"] / peer["median_s"],
        "deepspeed": deepspeed,
        "ratio_to_deepspeed": ours["median_s"] / deepspeed["median_s"] if deepspeed else None,
        "memory_note": CPU_MEMORY_NOTE if ours["cuda_peak_bytes"] is None else
        "cuda_peak_bytes: torch.cuda.max_memory_allocated over a step, every contender's resident state "
        "included; cuda_step_bytes: that less what was allocated as the step began",
    }
    if deepspeed_skipped:
        result["deepspeed_skipped"] = deepspeed_skipped
    return result


def _mib(nbytes: int | None) -> str:
    return "-" if nbytes is None else f"{nbytes / 2**20:.2f}"


def format_table(result: dict) -> str:
    s = result["setup"]
    lines = [(f"bench zero: {s['model']} on {s['ranks']} ranks ({s['device']}), seq {s['seq_len']}, "
              f"micro-batch {s['micro_batch']} x {s['grad_accum']}, {s['steps']} steps "
              f"({s['timed_steps']} timed), on {result['machine']}"),
             (f"{'':<28}{'step s':>9}{'ours / it':>11}{'final loss':>12}{'loss diff':>11}"
              f"{'state MiB':>11}{'peak MiB':>10}{'step MiB':>10}")]
    for row in (result["ours"], *result["peers"]):
        lines.append(f"{row['name']:<28}{row['median_s']:>9.4f}"
                     f"{result['ours']['median_s'] / row['median_s']:>11.3f}{row['final_loss']:>12.4f}"
                     f"{row['max_loss_rel_diff_to_ours']:>11.1e}{_mib(row['state_bytes']):>11}"
                     f"{_mib(row['cuda_peak_bytes']):>10}{_mib(row['cuda_step_bytes']):>10}")
    if result["deepspeed"] is None:
        lines.append(f"{DEEPSPEED}: skipped, {result['deepspeed_skipped']}.")
    lines.append("step s: median over the timed steps of the slowest rank; loss diff: largest relative "
                 "difference of a step's loss from ours (the same work was timed); state MiB: the largest "
                 "rank's parameter, gradient, master and optimizer-state shards; peak / step MiB: "
                 + ("CUDA peak over a step, all contenders' state included / less what was resident as it "
                    "began." if result["ours"]["cuda_peak_bytes"] is not None else
                    f"{CPU_MEMORY_NOTE}."))
    return "\n".join(lines)
