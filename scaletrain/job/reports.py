"""What a run leaves beside its metrics, gathered from every rank to the main one: the communication
ledger (comm.json), the memory ledger (memory.json) and a pipeline's recorded timeline (pipeline.json,
which ``scaletrain schedule --measured`` draws)."""

from __future__ import annotations

import json
from pathlib import Path

from scaletrain.config import Config
from scaletrain.runtime.comm import Comm
from scaletrain.runtime.mesh import Mesh
from scaletrain.train.memory import format_table as format_memory_table
from scaletrain.train.step_memory import format_points


def write_comm_report(comm: Comm, world, run_dir: Path, is_main: bool) -> None:
    """comm.json: every rank's ledger, gathered to the main rank and printed."""
    mine = comm.ledger.to_json()
    table = comm.ledger.table()
    ledgers = comm.all_gather_object(mine, world)
    if is_main:
        (run_dir / "comm.json").write_text(json.dumps({str(r): l for r, l in enumerate(ledgers)}, indent=2))
        print(f"\ncommunication ledger, rank 0 (all ranks in {run_dir}/comm.json)\n{table}")


def write_memory_report(mine: dict, comm: Comm, world, run_dir: Path, is_main: bool) -> None:
    """memory.json: every rank's memory ledger, gathered to the main rank and printed."""
    ledgers = comm.all_gather_object(mine, world)
    if is_main:
        (run_dir / "memory.json").write_text(json.dumps({str(r): l for r, l in enumerate(ledgers)}, indent=2))
        print(f"\nmemory ledger, rank 0 (all ranks in {run_dir}/memory.json)\n{format_memory_table(mine)}")
        for rank, ledger in enumerate(ledgers):
            if ledger.get("points"):
                print(f"\nrank {rank}, step {ledger['step']}\n{format_points(ledger['points'])}")


def write_pipeline_timeline(cfg: Config, step: int, spans: list | None, mesh: Mesh, comm: Comm,
                            run_dir: Path) -> None:
    """pipeline.json: the computations of the run's last step on each pp rank of
    the first replica, in seconds from the step's start (``scaletrain schedule
    --measured`` draws them beside the plan)."""
    first_replica = all(mesh.coords[dim] == 0 for dim in ("dp", "ep", "cp", "tp"))
    mine = [{"kind": s.action.kind, "micro": s.action.micro, "stage": s.action.stage, "start": s.start,
             "end": s.end} for s in spans or ()] if first_replica else None
    gathered = comm.all_gather_object((mesh.coords["pp"], mine), mesh.group("world"))
    if mesh.rank != 0:
        return
    micro, virtual = cfg.parallel.pipeline_sizes()
    ranks = [entries for _, entries in sorted((pp, e) for pp, e in gathered if e is not None)]
    (run_dir / "pipeline.json").write_text(json.dumps(
        {"schedule": cfg.parallel.pp_schedule, "pp": len(ranks), "microbatches": micro,
         "virtual_stages": virtual, "step": step, "ranks": ranks}))
