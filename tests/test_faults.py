"""A rank dies or hangs mid-step: the others end with its name, and a restarted job resumes exactly.

Faults are real (faults.py: SIGKILL or SIGSTOP of one worker process) and so
are the launches: workers started one by one as mpirun or srun would (no
agent to stop the others, so each must notice on its own), and torchrun with
``--max-restarts``, whose restarted job must continue from the newest
complete checkpoint and log the losses an uninterrupted run logs, bit for bit.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from scaletrain.runtime import free_port
from scaletrain.runtime.desync import CollectiveTracker
from scaletrain.runtime.health import Health
from scaletrain.runtime.launch import ProcessEnv, default_timeout
from scaletrain.runtime.mesh import Group

TIMEOUT_S = 10  # --timeout of these jobs: short, as a test's should be


def _train(corpus: Path, out: Path, *extra: str) -> list[str]:
    return ["train", "--model", "gpt-tiny", "--data", str(corpus), "--seq-len", "32", "--micro-batch", "4",
            "--grad-accum", "2", "--steps", "6", "--checkpoint-every", "2", "--warmup-steps", "1",
            "--eval-every", "0", "--eval-batches", "1", "--sample-tokens", "0", "--no-progress",
            "--timeout", str(TIMEOUT_S), "--cache-dir", str(out.parent / "cache"), "--out", str(out), *extra]


def _rank_env(rank: int, world: int, port: int, fault: str) -> dict[str, str]:
    """What mpirun gives one rank of a one-node job (Open MPI's variables), plus the fault."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(OMPI_COMM_WORLD_RANK=str(rank), OMPI_COMM_WORLD_SIZE=str(world),
               OMPI_COMM_WORLD_LOCAL_RANK=str(rank), OMPI_COMM_WORLD_LOCAL_SIZE=str(world),
               MASTER_PORT=str(port), SCALETRAIN_FAULT=fault, OMP_NUM_THREADS="1")
    return env


def _launch_ranks(args: list[str], world: int, fault: str, deadline_s: float,
                  hung: tuple[int, ...] = ()) -> list[tuple[int, str, float]]:
    """Every rank's exit code, stderr and seconds until it ended; the ``hung`` ones are not
    waited for, and every rank still there at the end is killed."""
    port = free_port()
    start = time.monotonic()
    workers = [subprocess.Popen([sys.executable, "-m", "scaletrain", *args], env=_rank_env(r, world, port, fault),
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
               for r in range(world)]
    ended: dict[int, tuple[int, str, float]] = {}
    try:
        while len(ended) < world - len(hung) and time.monotonic() - start < deadline_s:
            for rank, worker in enumerate(workers):
                if rank not in ended and worker.poll() is not None:
                    ended[rank] = (worker.returncode, worker.stderr.read(), time.monotonic() - start)
            time.sleep(0.1)
    finally:
        for worker in workers:
            worker.kill()  # a SIGSTOPped rank ends only this way
            worker.wait()
    return [ended.get(rank, (None, "", deadline_s)) for rank in range(world)]


@pytest.mark.parametrize("layout, world, victim, step, at", [
    (["--dp", "3"], 3, 1, 3, "micro-batch"),
    pytest.param(["--tp", "2"], 2, 1, 3, "optimizer", marks=pytest.mark.slow),
    (["--pp", "2"], 2, 1, 3, "micro-batch"),
    # rank 0 hosts the rendezvous store
    pytest.param(["--pp", "2", "--dp", "2"], 4, 0, 3, "step", marks=pytest.mark.slow),
])
def test_a_killed_rank_ends_every_other_rank_with_its_name(corpus, tmp_path, layout, world, victim, step, at):
    args = _train(corpus, tmp_path / "run", *layout)
    results = _launch_ranks(args, world, f"kill rank={victim} step={step} at={at}", deadline_s=180)
    killed_at = results[victim][2]
    assert results[victim][0] == -signal.SIGKILL
    culprit = "rank 0, its host" if victim == 0 else f"rank {victim} died or hangs"
    for rank, (code, stderr, seconds) in enumerate(results):
        if rank == victim:
            continue
        assert code == 1, stderr[-3000:]
        assert "Traceback" not in stderr and len(stderr.strip().splitlines()) == 1, stderr[-3000:]
        assert culprit in stderr and f"so rank {rank} stopped in step" in stderr
        assert "newest complete checkpoint is step_000002" in stderr
        assert seconds - killed_at < TIMEOUT_S, f"rank {rank} took {seconds - killed_at:.1f} s after the kill"


@pytest.mark.slow
def test_a_hung_rank_is_named_once_the_timeout_passes(corpus, tmp_path):
    """SIGSTOP keeps the rank's sockets open: nothing fails until the collective timeout."""
    args = _train(corpus, tmp_path / "run", "--dp", "2")
    (code, stderr, seconds), hung = _launch_ranks(args, 2, "hang rank=1 step=3 at=step", deadline_s=180, hung=(1,))
    assert hung[0] is None  # still stopped when the survivor had given up
    assert seconds < 120
    assert code == 1 and "rank 1 died or hangs, so rank 0 stopped in step 3" in stderr, stderr[-3000:]
    assert len(stderr.strip().splitlines()) == 1


def test_a_collective_one_rank_never_calls_ends_in_one_sentence(corpus, tmp_path):
    """The hang a user meets (a collective one rank leaves out: SCALETRAIN_FAULT's skip), launched
    as a user launches it, with no debugging flag: once --timeout passes, one sentence names the
    rank that waits, the collective, the rank it waits for and the checkpoint to resume from."""
    out = tmp_path / "run"
    args = _train(corpus, out, "--nproc", "2", "--timeout", "4")
    result = subprocess.run([sys.executable, "-m", "scaletrain", *args], capture_output=True, text=True,
                            timeout=240, env={**os.environ, "SCALETRAIN_FAULT": "skip rank=1 step=3"})
    assert result.returncode == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr[-3000:]
    sentence = result.stderr.strip()
    assert sentence.startswith("scaletrain train: collective desync: rank ")
    assert " waits in " in sentence and ("which rank " in sentence or " while rank " in sentence)
    assert "stopped in step 3" in sentence and "newest complete checkpoint is step_000002" in sentence


def test_the_default_timeout_is_a_minute_on_one_machines_cpus():
    one_node = ProcessEnv(0, 4, 0, 4, "127.0.0.1", 29500, "torchrun")
    two_nodes = ProcessEnv(0, 8, 0, 4, "10.0.0.1", 29500, "torchrun")
    assert default_timeout("gloo", one_node) == default_timeout("mpi4py", one_node) == 60
    assert default_timeout("nccl", one_node) == default_timeout("gloo", two_nodes) == 600


def _losses(run: Path) -> list[float]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    return [r["loss"] for r in records]


def test_heartbeats_stop_before_the_process_exits():
    """No heartbeat thread outlives `Health.stop`: one that is inside ``store.add`` while a
    torchrun worker's interpreter finalizes aborts the finished process (runtime/health.py)."""
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, 1, is_master=True, timeout=timedelta(seconds=5))  # noqa: F841
    health = Health(ProcessEnv(0, 1, 0, 1, "127.0.0.1", port, "torchrun"), timeout_s=2)
    assert any(thread.name == "scaletrain-heartbeat" for thread in threading.enumerate())
    health.stop()
    assert not any(thread.name == "scaletrain-heartbeat" for thread in threading.enumerate())


def test_a_timed_out_collective_with_every_member_in_it_is_named_as_such():
    """When no rank died and none is behind (every member is in the collective that timed out),
    the sentence names the collective and the timeout; any other error is left as it is."""
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, 1, is_master=True, timeout=timedelta(seconds=5))  # noqa: F841
    health = Health(ProcessEnv(0, 2, 0, 2, "127.0.0.1", port, "torchrun"), timeout_s=60)
    try:
        tracker = CollectiveTracker()
        health.track(tracker)
        assert health.stuck(RuntimeError("Timed out waiting 60000ms for recv operation to complete")) is None
        group = Group("dp", (0, 1), 0)
        with pytest.raises(RuntimeError), tracker.waiting(tracker.start("all_reduce", group)):
            raise RuntimeError("the call failed")  # a failed call stays the one this rank is in
        phrase = health.stuck(RuntimeError("Timed out waiting 60000ms for recv operation to complete"))
        assert phrase.startswith("rank 0 waited --timeout (60 s) in all_reduce on dp (call #1 of torch group ")
        assert "with every member alive and in it" in phrase
        assert health.stuck(RuntimeError("Connection reset by peer")) is None  # not a timeout: its own report
    finally:
        health.stop()


def test_torchrun_restarts_the_job_and_it_resumes_exactly(corpus, tmp_path):
    """Rank 1 is killed in step 5 of the first attempt; torchrun restarts both workers,
    which continue from step_000004 and log what an uninterrupted run logs."""
    run = tmp_path / "restarted"
    env = {**os.environ, "SCALETRAIN_FAULT": "kill rank=1 step=5 at=micro-batch", "OMP_NUM_THREADS": "1"}
    restarted = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                                "--max-restarts", "1", "--master-port", str(free_port()), "-m", "scaletrain",
                                *_train(corpus, run, "--pp", "2")],
                               capture_output=True, text=True, timeout=300, env=env)
    assert restarted.returncode == 0, restarted.stderr[-3000:]
    assert "exitcode: -9" in restarted.stderr  # the first attempt did lose a rank
    assert "resumed from checkpoint step_000004" in restarted.stdout

    straight = tmp_path / "straight"
    result = subprocess.run([sys.executable, "-m", "scaletrain", *_train(corpus, straight, "--pp", "2", "--nproc",
                                                                        "2")],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert _losses(run) == _losses(straight)  # exactly: fp32 on CPU, the same arithmetic


def test_max_restarts_restarts_local_workers_before_the_first_checkpoint(corpus, tmp_path):
    """Killed before anything was saved, the restarted job starts its run over, in the same folder."""
    run = tmp_path / "run"
    env = {**os.environ, "SCALETRAIN_FAULT": "kill rank=0 step=2 at=optimizer"}
    result = subprocess.run([sys.executable, "-m", "scaletrain", *_train(corpus, run, "--nproc", "2",
                                                                         "--max-restarts", "1")],
                            capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resumed from" not in result.stdout
    assert len(_losses(run)) == 6
