"""The layout of a resumed run on the world it resumes on.

A run's saved sizes are its defaults, not a constraint: ``--resume`` on another
number of processes keeps the saved tp, pp, cp and ep (each replaced where the
command line gives it) and derives dp from the world, as a new run does. The
global batch stays the run's, ``micro_batch x grad_accum x microbatches x dp x
ep`` sequences, so that the losses go on as the uninterrupted run's would: the
readers (dp x ep, each reading ``microbatches`` per round) change, and the
per-rank share (``micro_batch x grad_accum``) changes inversely, by the knobs
the command line left free. Nothing else needs to follow: a checkpoint holds
whole tensors, or chunks of them that any layout reads (train/checkpoint.py);
only local SGD's optimizer states, one per rank, keep to their dp (refused in
commands/train.py).
"""

from __future__ import annotations

import math

from scaletrain.config import AUTO, Config, ParallelConfig
from scaletrain.errors import UserError
from scaletrain.run_length import batch_readers

MODEL_PARALLEL = ("tp", "pp", "cp", "ep")


def resumed_layout(saved: Config, cfg: Config, given: set[str], world: int) -> tuple[Config, str | None]:
    """``cfg`` (the saved run's settings under the command line's, whose fields are ``given``)
    on ``world`` processes: dp derived unless given, the global batch kept unless both
    --micro-batch and --grad-accum are given; with the line that says what changed (None: nothing)."""
    processes = f"{world} process" + ("" if world == 1 else "es")
    cfg = cfg.replace(dp=_fitted_dp(cfg.parallel, given, world, processes))
    if saved.parallel.dp is None:  # a folder written by hand, its old layout unknown: nothing to keep
        return cfg, None
    kept = _kept_batch(saved, cfg, given)
    old_dp, new_dp = saved.parallel.dp, cfg.parallel.dp
    if kept is None:
        knobs = "--micro-batch and --grad-accum" + (
            "" if batch_readers(cfg.parallel) == new_dp else " (or --microbatches)")
        raise UserError(f"resuming on {processes} with dp {new_dp}, the run's global batch of "
                        f"{global_batch(saved)} does not split into equal whole micro-batches over "
                        f"{_readers_text(cfg.parallel)}{_fixed_batch_knobs(cfg, given)}; give {knobs} for a "
                        f"new global batch, or resume on another number of processes.")
    before, cfg = cfg, cfg.replace(micro_batch=kept[0], grad_accum=kept[1])
    batch = batch_change(before, cfg)
    if old_dp == new_dp and not batch:
        return cfg, None
    if batch:
        told = f"the global batch kept by {', '.join(batch)}"
    elif global_batch(saved) == global_batch(cfg):
        told = "the global batch as it was"
    else:
        told = f"the global batch {global_batch(saved)} -> {global_batch(cfg)}, as given"
    return cfg, f"resuming on {processes}: dp {old_dp} -> {new_dp} ({_sources(cfg, given)}); {told}"


def _fitted_dp(p: ParallelConfig, given: set[str], world: int, processes: str) -> int:
    """dp on ``world`` processes: the given one, else what the other sizes leave; refused in one
    sentence, naming where each size came from, where the sizes do not fit the world."""
    sizes = {name: getattr(p, name) for name in (("dp",) if "dp" in given else ()) + MODEL_PARALLEL}
    product = math.prod(sizes.values())
    if (product != world) if "dp" in given else (world % product != 0):
        named = " x ".join(f"--{name} {size} ({'given' if name in given else 'saved with the run'})"
                           for name, size in sizes.items() if size > 1 or name in given)
        relation, fit, instead = ("is not", "is", f"{product}") if "dp" in given else \
            ("does not divide", "divides", f"a multiple of {product}")
        raise UserError(f"resuming on {processes}, {named} = {product} {relation} {world}; give sizes whose "
                        f"product {fit} {world} on the command line (they replace the saved ones), or resume "
                        f"on {instead} processes.")
    return p.dp if "dp" in given else world // product


def _kept_batch(saved: Config, cfg: Config, given: set[str]) -> tuple[int | str, int] | None:
    """(micro-batch, accumulation) that give each reader of ``cfg``'s layout its share of the
    saved run's global batch, the given ones as given (None: no whole pair does). With
    ``auto`` on either side the planner sizes the micro-batch, so micro-batches are counted."""
    t = cfg.train
    fixed_micro = "micro_batch" in given or t.micro_batch == AUTO
    if fixed_micro and "grad_accum" in given:
        return t.micro_batch, t.grad_accum
    counted = AUTO in (saved.train.micro_batch, t.micro_batch)
    old_micro = 1 if counted else saved.train.micro_batch
    per_reader, rest = divmod(old_micro * saved.train.grad_accum * batch_readers(saved.parallel),
                              batch_readers(cfg.parallel))
    if rest:
        return None
    if "grad_accum" in given:
        return (per_reader // t.grad_accum, t.grad_accum) if per_reader % t.grad_accum == 0 else None
    if fixed_micro:
        unit = 1 if counted else t.micro_batch
        return (t.micro_batch, per_reader // unit) if per_reader % unit == 0 else None
    # Free to choose both: the largest micro-batch up to the run's (no more memory per rank), then accumulate.
    micro = max(d for d in range(1, min(per_reader, t.micro_batch) + 1) if per_reader % d == 0)
    return micro, per_reader // micro


def _readers_text(p: ParallelConfig) -> str:
    readers = batch_readers(p)
    return f"{p.dp} data-parallel ranks" if readers == p.dp else f"{readers} readers (dp x ep x --microbatches)"


def batch_change(before: Config, after: Config) -> list[str]:
    """The per-rank share's knobs that differ: ``["--grad-accum 1 -> 2"]``."""
    return [f"--{flag} {getattr(before.train, name)} -> {getattr(after.train, name)}"
            for flag, name in (("micro-batch", "micro_batch"), ("grad-accum", "grad_accum"))
            if getattr(before.train, name) != getattr(after.train, name)]


def global_batch(cfg: Config) -> str:
    """The sequences (or micro-batches, with ``--micro-batch auto``) of one optimizer step."""
    t = cfg.train
    if t.micro_batch == AUTO:
        return f"{t.grad_accum * batch_readers(cfg.parallel)} micro-batches"
    return f"{t.micro_batch * t.grad_accum * batch_readers(cfg.parallel)} sequences"


def _fixed_batch_knobs(cfg: Config, given: set[str]) -> str:
    fixed = [f"--{name.replace('_', '-')} {getattr(cfg.train, name)}" for name in ("micro_batch", "grad_accum")
             if name in given]
    return f" with {' and '.join(fixed)} as given" if fixed else ""


def _sources(cfg: Config, given: set[str]) -> str:
    """Where the layout's sizes came from: ``tp 2 given; pp, cp, ep as saved``."""
    named = [f"{name} {getattr(cfg.parallel, name)}" for name in ("dp",) + MODEL_PARALLEL if name in given]
    saved = [name for name in MODEL_PARALLEL if name not in given]
    return "; ".join(([f"{', '.join(named)} given"] if named else []) +
                     ([f"{', '.join(saved)} as saved"] if saved else []))

