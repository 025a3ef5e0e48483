"""A restarted job goes on with the run its first attempt began, on the world it now has.

torchrun's agent, or ``--max-restarts``, starts a failed job's workers again with
the same command line (attempt 1, 2, ...: runtime/launch.py ``restart_attempt``).
Such an attempt continues the run in --out from its newest complete checkpoint
instead of refusing the folder its first attempt filled.

Under torchrun with an elastic node range (``--nnodes MIN:MAX``) the attempt may
meet on fewer ranks (a node was lost) or more (one joined). The run then goes on
re-laid-out, as ``--resume`` on another number of processes does
(resume_layout.py): tp, pp, cp and ep as the run had them, dp what they leave of
the new world, the global batch kept by accumulation, so that the losses go on
as the uninterrupted run's would (data-parallel training's invariance to how the
global batch is split: the same sequences, summed alike, per step). The
checkpoint holds whole tensors or chunks any layout reads (train/checkpoint.py).
A ``--layout auto`` run is planned anew for the new world instead (planner/auto.py),
the command's given sizes kept, at the run's global batch.

Every rank decides this alike before the process group forms, from the run's
config.toml, which rank 0 rewrites only after the group has formed.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from pathlib import Path

from scaletrain.config import AUTO, Config, load_run_config
from scaletrain.errors import UserError
from scaletrain.planner.auto import PLAN_FILE, run_global_batch
from scaletrain.resume_layout import MODEL_PARALLEL, batch_change, global_batch, resumed_layout
from scaletrain.run_length import sequences_per_step
from scaletrain.runtime.launch import restart_attempt
from scaletrain.train.checkpoint import latest_checkpoint

Kept = frozenset[str] | None  # the sizes --layout auto keeps while it is still to choose; None: nothing to choose


def continue_after_restart(cfg: Config, world: int, kept: Kept = None) -> tuple[Config, str | None, Kept]:
    """A job that torchrun or --max-restarts restarted (attempt 1, 2, ...) on ``world`` ranks
    continues the run its first attempt began in --out, from the newest complete checkpoint
    (from the start when none was complete yet), whenever that folder holds a run of this very
    configuration; on a world of another size re-laid-out, with the sentence that says what
    was lost or gained and the new layout (None: the layout as it was). ``kept``: the command's
    --layout auto axes, returned as they are for any other folder (which gets the first
    attempt's checks and refusals), None for the run's own layout, or the axes to re-plan a
    ``--layout auto`` run over on its new world (`replanned`)."""
    out = Path(cfg.run.out)
    if restart_attempt() == 0 or cfg.run.resume or not (out / "config.toml").is_file():
        return cfg, None, kept
    begun = load_run_config(out).replace(resume=False)
    if not same_run(begun, cfg, planned_fields(out) if begun.parallel.layout == AUTO else ()):
        return cfg, None, kept
    resumed = begun.replace(resume=True)
    before = run_world(begun)
    if before == world:
        return resumed, None, None
    change = world_change(before, world)
    auto = begun.parallel.layout == AUTO
    # The sizes the new world must hold: the run's, or under --layout auto only those the command gave.
    held = {name: getattr(begun.parallel, name) for name in MODEL_PARALLEL if not auto or name in (kept or ())}
    product = math.prod(held.values())
    if world % product:
        sizes = " x ".join(f"{name} {size}" for name, size in held.items() if size > 1)
        raise UserError(f"{change}, which cannot hold the run's {sizes} (their product {product} must divide the "
                        f"world); start the job again on a multiple of {product} ranks with --resume and the same "
                        f"--out (under --layout auto, sizes the command line does not give are planned anew).")
    if auto:
        return replanned(begun, cfg, world, kept or frozenset(), change)
    if begun.parallel.sync_every > 1:
        raise UserError(f"{change}, but local SGD (--sync-every {begun.parallel.sync_every}) saved one optimizer "
                        f"state per data-parallel rank, which cannot follow dp to another size; start the job again "
                        f"on {before} ranks with --resume and the same --out.")
    try:
        relaid, _ = resumed_layout(begun, resumed, set(), world)
    except UserError as exc:
        raise UserError(f"{change}: {exc}") from None
    return relaid, f"{change}; {resumed_from(out)} as {layout_change(begun, relaid)}", None


def replanned(begun: Config, command: Config, world: int, kept: frozenset[str],
              change: str) -> tuple[Config, str, frozenset[str]]:
    """A ``--layout auto`` run on another world: the command's settings (its given sizes, the rest
    the search's again) at the run's global batch, for the workers to plan (planner/auto.py
    `plan_in_workers`, rank 0 deciding for all). dp and the accumulation the world changes are
    not kept; the accumulation is set so that the planner's batch (`run_global_batch`) is the run's."""
    kept = kept - {"dp", "grad_accum"}
    batch = sequences_per_step(begun)
    base = command.replace(resume=True, steps=begun.train.steps, timeout=begun.parallel.timeout)
    for micro in (base.train.micro_batch,) if "micro_batch" in kept else (base.train.micro_batch, 1):
        one_round = run_global_batch(base.replace(micro_batch=micro, grad_accum=1), world, kept)
        if batch % one_round == 0:
            said = f"{change}; {resumed_from(Path(begun.run.out))}, re-planned by --layout auto at the global " \
                   f"batch of {batch} sequences"
            return base.replace(micro_batch=micro, grad_accum=batch // one_round), said, kept
    raise UserError(f"{change}: the run's global batch of {batch} sequences does not split over the ranks the "
                    f"given sizes leave of {world}; start the job again on {run_world(begun)} ranks with --resume "
                    f"and the same --out.")


def planned_fields(out: Path) -> tuple[str, ...]:
    """The fields ``--layout auto`` chose for the run in ``out`` (plan.json's layout), and the
    memory ledger it turns on: the restarted command line leaves them to the planner."""
    plan = out / PLAN_FILE
    chosen = json.loads(plan.read_text()).get("layout", {}) if plan.is_file() else {}
    return (*(name for name in chosen if name in Config().flat()), "report_memory")


def same_run(begun: Config, cfg: Config, planned: Iterable[str] = ()) -> bool:
    """Whether ``cfg`` (the restarted command line) is the run ``begun`` saved, apart from what
    its first attempt (or a restart before this one) derived: dp and the per-rank share of the
    global batch from the world, the collective timeout from the backend, --epochs' steps, and
    the ``planned`` fields --layout auto chose."""
    derived = {"dp": begun.parallel.dp, "micro_batch": begun.train.micro_batch,
               "grad_accum": begun.train.grad_accum}
    chosen = begun.flat()
    derived.update({name: chosen[name] for name in planned})
    if cfg.parallel.timeout is None:
        derived["timeout"] = begun.parallel.timeout
    if cfg.train.steps is None:  # --epochs: the steps the first attempt derived, so the job ends where it was to
        derived["steps"] = begun.train.steps
    return begun.to_dict() == cfg.replace(**derived).to_dict()


def run_world(cfg: Config) -> int:
    """The ranks the saved run's layout spans."""
    return cfg.parallel.dp * math.prod(getattr(cfg.parallel, name) for name in MODEL_PARALLEL)


def world_change(before: int, after: int) -> str:
    """``restart 1: 2 of 4 ranks lost (the world is 2)``."""
    if after < before:
        return f"restart {restart_attempt()}: {before - after} of {before} ranks lost (the world is {after})"
    return f"restart {restart_attempt()}: {after - before} rank{'s' if after - before > 1 else ''} joined " \
           f"(the world is {after}, was {before})"


def resumed_from(out: Path) -> str:
    latest = latest_checkpoint(out)
    return f"resuming from {latest.name}" if latest else "starting over (no checkpoint was complete)"


def layout_change(before: Config, after: Config) -> str:
    """``dp 2 -> 1, tp 1, pp 1, the global batch of 16 sequences kept by --grad-accum 1 -> 2``."""
    sizes = [f"dp {before.parallel.dp} -> {after.parallel.dp}"] + [
        f"{name} {getattr(after.parallel, name)}" for name in MODEL_PARALLEL
        if name in ("tp", "pp") or getattr(after.parallel, name) > 1]
    knobs = batch_change(before, after)
    kept = f"kept by {', '.join(knobs)}" if knobs else "kept"
    return f"{', '.join(sizes)}, the global batch of {global_batch(after)} {kept}"
