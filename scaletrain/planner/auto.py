"""``--layout auto``: the run takes the planner's fastest layout predicted to fit the machine it starts on.

The choice is the planner's search (planner/search.py) for this run, on this
machine (planner/machine.py), at this run's global batch:

    chosen = argmax { tokens/s (predicted) : layouts the trainer accepts, predicted total <= device memory }

ties to the lighter layout, as `scaletrain plan` ranks them. The axes the user
gave (``--tp 2``, ``--zero 1``, ``--micro-batch 4``, ...) stay as given, the
others are searched. The global batch is what the
given (or default) micro-batch, accumulation, pipeline micro-batches and
data-parallel ranks mean on this world, so ``--layout auto --nproc 4`` trains
the batch a plain ``--nproc 4`` run trains (search.py `derived_global_batch`).
``--offload`` is not searched: the planner prices its memory but not the host's
step and transfers, so an offloaded layout would tie on time and win on memory.

One process decides and every rank takes its choice: the launching process of
``--nproc N`` or of a single process, which first measures a machine that has
no profile yet (``scaletrain plan --calibrate``'s figures, saved for the next
run: planner/machine.py); under torchrun, SLURM or MPI rank 0 of the workers,
after the process group exists and before the mesh is built, on the machine's
profile or without one its datasheet figures, its choice (or its refusal)
broadcast on the default group. The run records the choice in config.toml (its sizes, ``layout =
"auto"``) and in plan.json, the prediction beside what the run measured: the
median step time after the first two steps (metrics.jsonl's ``step_s``) and
the memory ledger's counted rows on the busiest rank (``--report-memory``, on
with auto; on a GPU also CUDA's peak).

A library user's module (`module_layout`, for ``setup(..., layout="auto")``)
is priced from its parameters alone (planner/gate.py `module_price`), so only
ZeRO's stage is chosen there: the lowest whose weights, gradients and
optimizer state fit this device.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from scaletrain.config import AUTO, Config
from scaletrain.errors import UserError
from scaletrain.models import CLASSIFIER
from scaletrain.planner.gate import Machine, module_price, module_weights, run_vocab
from scaletrain.planner.hardware import Cluster
from scaletrain.planner.machine import this_machine
from scaletrain.planner.predict import predict
from scaletrain.planner.search import (
    ZERO_STAGES,
    derived_global_batch,
    layout_text,
    search,
    size_text,
)
from scaletrain.runtime.launch import DistRuntime, connect
from scaletrain.runtime.mesh import ParallelDims

PLAN_FILE = "plan.json"
TIMED_AFTER = 2  # the first steps warm caches and allocators: the measured step is the median after them
COUNTED_ROWS = {"params": "params", "grads": "grads", "optimizer": "optimizer", "activations": "activations_peak"}


@dataclass
class Planned:
    """The chosen layout as the run's configuration, what the plan.json of the run records of it
    (``record``: the layout, the predicted step time and memory by row), and the machine it was
    planned for."""

    cfg: Config
    record: dict[str, Any]
    cluster: Cluster

    @property
    def sentence(self) -> str:
        return self.record["sentence"]


def kept_axes(cfg: Config, given: Iterable[str]) -> frozenset[str] | None:
    """The fields the command line gave, each layout field among them kept by the search, where
    ``--layout auto`` is still to choose; None where it is not (no auto, or a resume, which keeps
    the run's choice)."""
    if cfg.parallel.layout != AUTO or cfg.run.resume:
        return None
    refuse_unplannable(cfg)
    return frozenset(given)  # the search changes only layout fields: the others are kept whatever they are


def refuse_unplannable(cfg: Config) -> None:
    """What ``--layout auto`` cannot plan, one sentence each."""
    if cfg.model.name == CLASSIFIER:
        raise UserError("--layout auto plans a decoder's layout, which the mlp classifier is not; give the mlp its "
                        "sizes (--dp, --zero) and drop --layout.")
    if cfg.parallel.launcher != "local":
        raise UserError(f"--layout auto plans for the machine the run starts on, which --launcher "
                        f"{cfg.parallel.launcher} does not; give the layout's sizes, or drop --launcher.")
    if cfg.train.micro_batch == AUTO:
        raise UserError("--layout auto chooses the micro-batch with the rest of the layout; drop --micro-batch auto "
                        "(a number keeps that micro-batch).")


def run_global_batch(cfg: Config, world: int, kept: Iterable[str]) -> int:
    """The sequences a step of this run means on ``world`` ranks: its micro-batch, accumulation and
    pipeline micro-batches (given or default) over the data-parallel ranks the kept sizes leave."""
    microbatches = cfg.parallel.pipeline_sizes()[0] if cfg.parallel.pp > 1 else 1
    meant = {*kept, "micro_batch", "grad_accum", "microbatches"}
    return derived_global_batch(cfg.replace(microbatches=microbatches), world, meant)


def plan_for_run(cfg: Config, world: int, processes_here: int, on_gpu: bool, kept: Iterable[str],
                 global_batch: int | None = None, local_rank: int = 0, calibrate_if_missing: bool = False) -> Planned:
    """The fastest layout of ``cfg`` predicted to fit ``world`` ranks, ``processes_here`` of them on this
    machine, the ``kept`` fields as ``cfg`` has them, at ``global_batch`` sequences a step (default:
    `run_global_batch`); its memory ledger on, to measure the prediction. A restart on another world
    calls it with the run's global batch. Where no layout fits: the search's sentence.
    ``calibrate_if_missing``: a machine without a profile is measured first (planner/machine.py), by
    the process that launches the run's, before they start."""
    refuse_unplannable(cfg)
    kept = set(kept)
    cluster = this_machine(world, processes_here, on_gpu, local_rank, backend=cfg.parallel.backend,
                           calibrate_if_missing=calibrate_if_missing)
    batch = global_batch or run_global_batch(cfg, world, kept)
    try:
        result = search(cfg, cluster, run_vocab(cfg), batch, kept, predict)
        best = result.best()
    except UserError as exc:
        raise UserError(f"--layout auto: {exc}") from None
    processes = f"{world} process" + ("" if world == 1 else "es")
    sentence = (f"--layout auto: {layout_text(best)}, the fastest of {len(result.ranked)} layouts predicted to fit "
                f"{processes} of this machine: {best.step_s:.3g} s a step, {size_text(best.memory['total'])} on "
                f"the busiest rank")
    record = {"layout": best.layout(), "layout_text": layout_text(best), "kept": sorted(kept & set(best.layout())),
              "global_batch": batch, "processes": world, "device": cluster.device.name,
              "device_memory_bytes": cluster.device.memory_bytes,
              "layouts_fitting": len(result.ranked), "layouts_weighed": result.considered, "sentence": sentence,
              "predicted": {"step_s": best.step_s, "tokens_per_s": best.tokens_per_s,
                            "memory_bytes": dict(best.memory)}}
    return Planned(best.cfg.replace(layout=AUTO, report_memory=True), record, cluster)


def agreed(decide: Callable[[], Any], runtime: DistRuntime) -> Any:
    """Rank 0's ``decide()`` on every rank, its refusal too, through the runtime's Comm over the whole
    world (before the run's mesh exists; one process has nothing to send)."""
    outcome = None
    if runtime.is_main:
        try:
            outcome = decide()
        except UserError as exc:
            outcome = exc
    mesh, comm = connect(runtime, ParallelDims(dp=runtime.env.world_size))
    outcome = comm.all_gather_object(outcome, mesh.group("world"))[0]
    if isinstance(outcome, UserError):
        raise UserError(str(outcome))
    return outcome


def plan_in_workers(cfg: Config, kept: frozenset[str] | None, runtime) -> tuple[Config, Planned | None]:
    """Where no launching process chose (one process, torchrun, SLURM, MPI): rank 0 plans for the
    world and this machine's processes, every rank takes its choice; ``kept`` None: nothing to choose."""
    if kept is None:
        return cfg, None
    env = runtime.env
    planned = agreed(lambda: plan_for_run(cfg, env.world_size, env.local_world_size, runtime.device.type == "cuda",
                                          kept, local_rank=env.local_rank), runtime)
    return planned.cfg, planned


def announce(planned: Planned | None, run_dir: Path) -> None:
    """The choice said once the run folder holds the run, and kept there (plan.json)."""
    if planned is None:
        return
    print(planned.sentence)
    (run_dir / PLAN_FILE).write_text(json.dumps(planned.record, indent=2))


def measured_step_s(run_dir: Path, first_step: int) -> tuple[float | None, int]:
    """(the median seconds of this invocation's steps after its first `TIMED_AFTER`, how many), from
    metrics.jsonl's step timings; None where the run took no step past them."""
    times = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record.get("step", 0) > first_step + TIMED_AFTER and "step_s" in record:
            times.append(record["step_s"])
    return (statistics.median(times) if times else None), len(times)


def report_measured(cfg: Config, run_dir: Path, first_step: int) -> None:
    """plan.json's prediction beside what this run measured (module docstring), written there and
    said; nothing where the run has no prediction of its layout (not auto, or resumed on another
    layout than the one chosen) or no memory ledger."""
    path, ledger_path = run_dir / PLAN_FILE, run_dir / "memory.json"
    if cfg.parallel.layout != AUTO or not path.is_file() or not ledger_path.is_file():
        return
    plan = json.loads(path.read_text())
    if any(plan["layout"].get(name) != value for name, value in _sizes(cfg).items()):
        return
    step_s, timed = measured_step_s(run_dir, first_step)
    ledgers = list(json.loads(ledger_path.read_text()).values())
    busiest = max(ledgers, key=_counted)
    memory = {row: busiest[key] for row, key in COUNTED_ROWS.items()}
    measured = {"step_s": step_s, "steps_timed": timed, "memory_bytes": {**memory, "counted": _counted(busiest)}}
    cuda_peaks = [ledger["cuda_peak"] for ledger in ledgers if ledger.get("cuda_peak")]
    if cuda_peaks:
        measured["cuda_peak_bytes"] = max(cuda_peaks)
    plan["measured"] = measured
    path.write_text(json.dumps(plan, indent=2))
    print(_measured_sentence(plan, path))


def _sizes(cfg: Config) -> dict[str, int]:
    """The sizes that make a layout another, as `Prediction.layout` names them."""
    p, t = cfg.parallel, cfg.train
    return {"dp": p.dp, "tp": p.tp, "pp": p.pp, "cp": p.cp, "ep": p.ep, "zero": p.zero,
            "micro_batch": t.micro_batch, "grad_accum": t.grad_accum}


def _counted(ledger: dict) -> int:
    return sum(ledger[key] for key in COUNTED_ROWS.values())


def _measured_sentence(plan: dict, path: Path) -> str:
    predicted, measured = plan["predicted"], plan["measured"]
    step_s, timed = measured["step_s"], measured["steps_timed"]
    time_text = (f"measured {step_s:.3g} s (the median of {timed} step(s) after the first {TIMED_AFTER})"
                 if step_s is not None else f"not measured (no step after the first {TIMED_AFTER})")
    cuda = (f"; {size_text(predicted['memory_bytes']['total'])} predicted in all, CUDA's peak "
            f"{size_text(measured['cuda_peak_bytes'])}" if "cuda_peak_bytes" in measured else "")
    counted_predicted = sum(predicted["memory_bytes"][row] for row in COUNTED_ROWS)
    return (f"--layout auto: {plan['layout_text']} predicted {predicted['step_s']:.3g} s a step, {time_text}; "
            f"weights, gradients, optimizer state and activations predicted {size_text(counted_predicted)} on the "
            f"busiest rank, measured {size_text(measured['memory_bytes']['counted'])} on the busiest rank's first "
            f"step{cuda} ({path})")


def module_layout(model: nn.Module, cfg: Config, dims: ParallelDims, machine: Machine, given: Iterable[str],
                  force: bool) -> tuple[int, str]:
    """``setup(..., layout="auto")``: (the lowest ZeRO stage (unless ``zero`` was given) whose weights,
    gradients and optimizer state of ``model`` are predicted to fit ``machine`` on the mesh ``dims``,
    the sentence that says so); ZeRO needs data-parallel copies to shard over. Where none fits:
    one sentence, or with ``force`` the stage that needs the least."""
    sharable = dims.dp * dims.cp > 1
    stages = (cfg.parallel.zero,) if "zero" in given or not sharable else ZERO_STAGES
    price = module_price(module_weights(model), cfg, dims, machine)
    priced = [(stage, needed) for stage in stages if (needed := price({"zero": stage}, 1)) is not None]
    fitting = [(stage, needed) for stage, needed in priced if needed["total"] <= machine.memory]
    if not fitting and not force:
        least = min(priced, key=lambda found: found[1]["total"])
        raise UserError(f"setup(layout='auto'): no ZeRO stage over {dims.dp * dims.cp} data-parallel process(es) fits "
                        f"the module's weights, gradients and optimizer state in the {machine.describe()} (zero="
                        f"{least[0]} needs {size_text(least[1]['total'])}); start more processes, or pass "
                        f"force=True to go on.")
    stage, needed = fitting[0] if fitting else min(priced, key=lambda found: found[1]["total"])
    why = ("given" if "zero" in given else "the only stage without data-parallel copies" if not sharable
           else "the lowest stage predicted to fit" if fitting else "the least memory of any stage, forced")
    return stage, (
        f"setup(layout='auto'): zero={stage} over dp={dims.dp}, {why}: weights, gradients and optimizer state "
        f"{size_text(needed['total'])} of the {machine.describe()} (activations, which only the forward knows, "
        f"not priced)")
