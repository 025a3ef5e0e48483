"""The planner as a gate: a run predicted not to fit this machine's memory stops before it starts.

``scaletrain train`` and ``finetune`` (commands/train.py) and the library's ``setup``
(library.py) ask the planner before anything is allocated. Allocating first is the
costly way to learn the same thing: 8B weights on a 24 GiB laptop fill its memory,
then its swap, for minutes, until the kernel's out-of-memory killer ends the run
without a sentence.

The prediction is planner/predict.py's for the run's own layout, on its busiest rank,
against the bytes one rank may fill (planner/fit.py `device_memory`: its GPU's, or on a
CPU this machine's memory shared by the processes started on it):

    refused  <=>  predicted_total > memory

and the refusal names the nearest change that fits: of the changes below, one at a
time, then two together, then three, ..., the first the trainer would take and the
planner predicts to fit, each graded change then at its mildest that still fits
(``--zero`` its lowest stage, ``--micro-batch`` its largest size):

    --zero 1, 2, 3                 where data-parallel copies share the weights
    --recompute full
    --micro-batch halved           --grad-accum doubled: the same global batch
    --offload optimizer            on a GPU (on a CPU the host is the device)
    pure bf16                      --precision bf16 --param-dtype bf16 --reduce-dtype bf16 --masters none
    --optimizer adamw8bit
    --lora-rank 16                 a fine-tune: its base frozen
    --quantize nf4                 a fine-tune: its base frozen in 4 bits (QLoRA)

and where none does, the same over 2, 4, ... 64 times the processes, each with as
much memory (more machines, or GPUs), ZeRO sharding the weights over them. With
``--micro-batch auto`` the run is priced at one sequence (planner/fit.py then
chooses). ``--force`` (``setup(force=True)``) skips the gate.

A library user's module is priced on what its parameters say (`check_module`):
its weights, gradients and optimizer state under the layout, ZeRO's shards
included; its activations, which an arbitrary forward decides, are not, so its
figure is a lower bound and only a module that cannot fit is refused.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from scaletrain.config import AUTO, Config
from scaletrain.config_checks import check_values
from scaletrain.data.tokenizer import ByteTokenizer
from scaletrain.errors import UserError
from scaletrain.models import CLASSIFIER
from scaletrain.parallel.zero import layer_modules
from scaletrain.planner.fit import device_memory, machine_cluster
from scaletrain.planner.inventory import RankWeights
from scaletrain.planner.memory import weight_memory
from scaletrain.planner.predict import predict
from scaletrain.planner.prediction import as_flags
from scaletrain.planner.search import refusal, size_text
from scaletrain.runtime.mesh import ParallelDims

SUGGESTED_LORA_RANK = 16
SCALES = (2, 4, 8, 16, 32, 64)  # processes as a multiple of the run's, where nothing on this many fits
PURE_BF16 = {"param_dtype": "bf16", "reduce_dtype": "bf16", "masters": "none"}
ROW_NAMES = {"params": "weights", "grads": "gradients", "optimizer": "optimizer state", "activations": "activations",
             "other": "buffers and allowance"}

Price = Callable[[dict, int], "dict | None"]  # (changes, process multiple) -> predicted bytes by row; None: refused


@dataclass(frozen=True)
class Machine:
    """What one process of the run may fill: ``memory`` bytes of its GPU, or of this machine's
    memory shared by ``processes`` processes."""

    memory: int
    on_gpu: bool
    processes: int = 1

    @classmethod
    def here(cls, on_gpu: bool, processes: int, local_rank: int = 0) -> Machine:
        """This machine, for ``processes`` processes started on it, the one of ``local_rank`` on its GPU
        (a rank past the GPUs is refused where the devices are chosen: runtime/launch.py)."""
        device = torch.device("cuda", local_rank % torch.cuda.device_count()) if on_gpu else torch.device("cpu")
        return cls(device_memory(device, processes), on_gpu, processes)

    def describe(self) -> str:
        if self.on_gpu:
            return f"{size_text(self.memory)} of its GPU"
        shared = f", shared by its {self.processes} processes" if self.processes > 1 else ""
        return f"{size_text(self.memory)} of this machine's memory{shared}"


@dataclass(frozen=True)
class Fix:
    """A change to the run, as configuration fields, over ``scale`` times its processes, and the
    bytes by row the planner predicts for it."""

    changes: dict
    scale: int
    memory: dict


def run_vocab(cfg: Config) -> int:
    """The vocabulary the run will have, before its data is read: the model's own (a base's), the
    byte tokenizer's, or the BPE's asked-for size (an upper bound of what it learns)."""
    if cfg.model.n_vocab:
        return cfg.model.n_vocab
    return ByteTokenizer().vocab_size if cfg.data.tokenizer == "byte" and not cfg.data.tokenizer_from \
        else cfg.data.vocab_size


def check_run(cfg: Config, world: int, machine: Machine) -> None:
    """scaletrain train's and finetune's gate (module docstring): one sentence where ``cfg`` on
    ``world`` ranks is predicted not to fit ``machine``; nothing with ``--force``, nor for the mlp
    classifier, whose memory the planner does not model."""
    if cfg.run.force or cfg.model.name == CLASSIFIER:
        return
    if cfg.train.micro_batch == AUTO:
        cfg = cfg.replace(micro_batch=1)
    if not cfg.finetune.base:  # adapters go beside a base (--from) only: without one every weight trains
        cfg = cfg.replace(lora_rank=0, quantize="none")
    vocab, p = run_vocab(cfg), cfg.parallel
    copies = world // (p.tp * p.pp * p.cp * p.ep)

    def price(changes: dict, scale: int) -> dict | None:
        candidate = cfg.replace(**changes, dp=copies * scale)
        if refusal(candidate, world * scale) is not None:
            return None
        return predict(candidate, world * scale, vocab, machine_cluster(world * scale, machine.memory,
                                                                           machine.on_gpu)).memory

    needed = price({}, 1)
    if needed is None or needed["total"] <= machine.memory:
        return
    moves = run_moves(cfg, machine.on_gpu, copies * p.cp * p.ep > 1)
    fix, least = nearest_fix(moves, price, machine.memory, _zero_moves(cfg))
    rows = ", ".join(f"{ROW_NAMES[row]} {size_text(needed[row])}" for row in ROW_NAMES)
    raise UserError(f"the planner predicts this run needs {size_text(needed['total'])} per process ({rows}), more "
                    f"than the {machine.describe()}; {_remedy(fix, least, world, as_flags)}, or give --force to "
                    f"start anyway.")


def run_moves(cfg: Config, on_gpu: bool, sharable: bool) -> list[list[dict]]:
    """The changes the gate tries for a run, each its options from the mildest (module docstring);
    ``sharable``: data-parallel copies share the weights, which ZeRO can shard."""
    t, f = cfg.train, cfg.finetune
    moves = _zero_moves(cfg) if sharable else []
    if t.recompute != "full":
        moves.append([{"recompute": "full"}])
    halvings = (t.micro_batch & -t.micro_batch).bit_length() - 1  # the times it halves to a whole number
    if halvings:
        moves.append([{"micro_batch": t.micro_batch >> k, "grad_accum": t.grad_accum << k}
                      for k in range(1, halvings + 1)])
    moves += _precision_moves(cfg, on_gpu)
    if f.base and not f.lora_rank:
        moves.append([{"lora_rank": SUGGESTED_LORA_RANK}])
    if f.base and f.quantize == "none":
        moves.append([{"lora_rank": f.lora_rank or SUGGESTED_LORA_RANK, "quantize": "nf4"}])
    return moves


def _zero_moves(cfg: Config) -> list[list[dict]]:
    """The ZeRO stages above the run's, as one graded move (none past stage 3)."""
    stages = [{"zero": stage} for stage in range(cfg.parallel.zero + 1, 4)]
    return [stages] if stages else []


def _precision_moves(cfg: Config, on_gpu: bool) -> list[list[dict]]:
    """Offload (on a GPU), pure bf16 and 8-bit AdamW, where the run has not taken them."""
    t = cfg.train
    moves = []
    if on_gpu and t.offload == "none" and t.masters != "none":
        moves.append([{"offload": "optimizer"}])
    if t.masters != "none":
        moves.append([{"precision": "fp8" if t.precision == "fp8" else "bf16", **PURE_BF16}])
    if t.optimizer == "adamw":
        moves.append([{"optimizer": "adamw8bit"}])
    return moves


def nearest_fix(moves: list[list[dict]], price: Price, memory: int,
                zero: list[list[dict]]) -> tuple[Fix | None, Fix | None]:
    """(the nearest fix predicted to fit in ``memory`` bytes, each graded move at its mildest option
    that still fits; the least predicted of those tried). On this many processes the first
    combination of ``moves`` that fits; failing that, on the fewest more processes (module
    docstring), with ``zero``, the ZeRO stages the run may add, among the moves, the first
    combination that fits on them."""
    least: Fix | None = None
    sharded = moves if any("zero" in options[0] for options in moves) else [*zero, *moves]
    for options, scales in ((moves, (1,)), (sharded, SCALES)):
        fitting: list[tuple[int, list[list[dict]]]] = []
        for combination in _combinations(options):
            strongest = _merged([move[-1] for move in combination])
            priced = price(strongest, scales[-1])
            if priced is None:
                continue
            fix = Fix(strongest, scales[-1], priced)
            least = fix if least is None or priced["total"] < least.memory["total"] else least
            if priced["total"] <= memory:
                fewest = next(scale for scale in scales if _fits(price(fix.changes, scale), memory))
                fitting.append((fewest, combination))
                if fewest == scales[0]:
                    break
        if fitting:
            scale, combination = min(fitting, key=lambda found: found[0])  # the first of the fewest processes
            return _relaxed(combination, scale, price, memory), least
    return None, least


def _combinations(moves: list[list[dict]]) -> list[list[list[dict]]]:
    """One move, then two, ..., in the order given; each set of changes once (LoRA and QLoRA together
    are QLoRA)."""
    seen, found = set(), []
    for size in range(1, len(moves) + 1):
        for combination in itertools.combinations(moves, size):
            key = repr(_merged([move[-1] for move in combination]))
            if key not in seen:
                seen.add(key)
                found.append(list(combination))
    return found


def _fits(priced: dict | None, memory: int) -> bool:
    return priced is not None and priced["total"] <= memory


def _relaxed(combination: list[list[dict]], scale: int, price: Price, memory: int) -> Fix:
    """A combination that fits on ``scale`` times the processes, each move at its mildest option that still fits."""
    chosen = [move[-1] for move in combination]
    priced = price(_merged(chosen), scale)
    for index, move in enumerate(combination):
        for option in move[:-1]:
            trial = _merged([*chosen[:index], option, *chosen[index + 1:]])
            milder = price(trial, scale)
            if milder is not None and milder["total"] <= memory:
                chosen[index], priced = option, milder
                break
    return Fix(_merged(chosen), scale, priced)


def _merged(options: list[dict]) -> dict:
    return {key: value for option in options for key, value in option.items()}


def _remedy(fix: Fix | None, least: Fix | None, world: int, words: Callable[[dict], str]) -> str:
    """The nearest fix as the user writes it (``words``: flags, or setup()'s keywords), or why none."""
    if fix is not None:
        return f"{_on(fix, world, words)} is predicted to fit ({size_text(fix.memory['total'])})"
    nearest = f" (the least, {_on(least, world, words).rstrip(',')}, still needs {size_text(least.memory['total'])})" \
        if least else ""
    return (f"none of the changes the planner tried fits{nearest}: take a smaller model or shorter sequences, "
            f"or a machine with more memory")


def _on(fix: Fix, world: int, words: Callable[[dict], str]) -> str:
    if fix.scale == 1:
        return words(fix.changes)
    return f"{words(fix.changes)} on {fix.scale * world} processes, each with as much memory as this one,"


def module_weights(model: nn.Module) -> RankWeights:
    """A user's module as one rank holding it whole: its trained parameters, in the order gradient
    buckets and ZeRO cut them, and its repeated layers, ZeRO-3's units (parallel/zero.py)."""
    return RankWeights(model, [q for q in model.parameters() if q.requires_grad], set(), [], [],
                       layer_modules(model), {0: []}, 1)


def module_price(weights: RankWeights, cfg: Config, dims: ParallelDims, machine: Machine) -> Price:
    """A user's module's weights, gradients and optimizer state per process under ``cfg`` with
    ``changes``, on the mesh ``dims`` over ``scale`` times its processes (None: ``check_values``
    refuses the changes). With tp, pp or ep the rank's share is taken as an even split of the
    whole (the busiest rank holds at least that); ZeRO shards over the data-parallel copies."""
    split = dims.tp * dims.pp * dims.ep

    def price(changes: dict, scale: int) -> dict | None:
        candidate = cfg.replace(**changes)
        try:
            check_values(candidate)
        except UserError:
            return None
        copies = dims.dp * dims.cp * scale
        held = weight_memory(candidate, weights, (copies, copies), host_is_device=not machine.on_gpu)
        rows = {row: held[row] // split for row in ("params", "grads", "optimizer")}
        return {**rows, "total": sum(rows.values()) + (held["buffers"] - held["host"]) // split}

    return price


def check_module(model: nn.Module, cfg: Config, dims: ParallelDims, machine: Machine) -> None:
    """setup()'s gate: one sentence where ``model``'s weights, gradients and optimizer state alone
    (module docstring) are predicted not to fit ``machine`` under ``cfg`` on the mesh ``dims``;
    ``cfg`` as the command's checks passed it, told the module's experts and dropout (library_checks.py).

    Priced by `module_price`."""
    price = module_price(module_weights(model), cfg, dims, machine)
    needed = price({}, 1)
    if needed["total"] <= machine.memory:
        return
    moves = [*(_zero_moves(cfg) if dims.dp * dims.cp > 1 else []), *_precision_moves(cfg, machine.on_gpu)]
    fix, least = nearest_fix(moves, price, machine.memory, _zero_moves(cfg))
    rows = ", ".join(f"{ROW_NAMES[row]} {size_text(needed[row])}" for row in ("params", "grads", "optimizer"))
    raise UserError(f"setup(): the module's weights, gradients and optimizer state alone are predicted to need "
                    f"{size_text(needed['total'])} per process ({rows}), more than the {machine.describe()}; "
                    f"{_remedy(fix, least, dims.world_size, as_keywords)}, or pass force=True to go on.")


def as_keywords(changes: dict) -> str:
    """Configuration fields as setup()'s keywords: ``zero=3, optimizer='adamw8bit'``."""
    return ", ".join(f"{name}={value!r}" for name, value in changes.items())
