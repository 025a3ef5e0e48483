"""--debug-dist: ranks that disagree are named before training, a rank that leaves a collective
out is named when the others time out, and every rank writes its own log with torch's debug
output switched on before its process group existed."""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn

from scaletrain.config import Config
from scaletrain.errors import JobFailed, UserError
from scaletrain.runtime import Comm, Group, ProcessEnv, free_port
from scaletrain.runtime.debug import (
    DEBUG_ENVIRONMENT,
    RankLog,
    check_same_config,
    check_same_parameters,
    debug_environment,
)
from scaletrain.runtime.desync import CollectiveTracker, explain_desync
from scaletrain.runtime.faults import Faults, parse
from scaletrain.runtime.health import Health
from scaletrain.commands.train import explain_failure
from tests.distributed import run_distributed


def _disagreeing(rank: int, n: int) -> list[str]:
    """Rank 1 built another model, and was started with another micro-batch: both are named."""
    world = Group("world", tuple(range(n)), rank, dist.group.WORLD)
    comm = Comm()
    said = []
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 5 if rank == 1 else 4))
    check_same_parameters(comm, world, tuple(range(n)), nn.Linear(8, 8).named_parameters())  # alike
    try:
        check_same_parameters(comm, world, tuple(range(n)), model.named_parameters())
    except JobFailed as exc:
        said.append(str(exc))
    # Replicas are compared only with their own copies: rank 1 alone holds its kind here.
    check_same_parameters(comm, world, (rank,), model.named_parameters())
    cfg = Config().replace(micro_batch=8 if rank == 1 else 4, out=f"runs/{rank}")  # --out may differ
    try:
        check_same_config(comm, world, cfg.to_dict())
    except UserError as exc:
        said.append(str(exc))
    check_same_config(comm, world, Config().replace(out=f"runs/{rank}").to_dict())
    return said


GROUP = "torch group 1 of ranks 0,1"


def _record(calls: dict, waiting: list, members: list[int]) -> dict:
    return {"calls": {GROUP: calls}, "members": {GROUP: members}, "waiting": waiting}


def _call(op: str, seq: int, name: str = "dp") -> dict:
    return {"op": op, "name": name, "group": GROUP, "seq": seq}


def test_explain_desync_names_the_rank_behind_and_where_it_is():
    waiting = _record({"n": 3, "op": "all_reduce on dp"}, [_call("all_reduce", 3)], [0, 1])
    behind = _record({"n": 2, "op": "all_reduce on dp"}, [], [0, 1])
    assert explain_desync({0: waiting, 1: behind}) == (
        "collective desync: rank 0 waits in all_reduce on dp (call #3 of torch group 1 of ranks 0,1), which rank 1 "
        "has not "
        "reached (it made 2 calls there and is in no collective)")
    other_op = _record({"n": 3, "op": "broadcast on world"}, [_call("broadcast", 3, "world")], [0, 1])
    assert "rank 0 waits in all_reduce on dp (call #3 of torch group 1 of ranks 0,1) while rank 1 waits in " \
           "broadcast on world (call #3 of torch group 1 of ranks 0,1)" in explain_desync({0: waiting, 1: other_op})
    assert explain_desync({0: waiting, 1: other_op}).count(" while ") == 1  # the pair said once
    passed = _record({"n": 4, "op": "all_gather_object on world"}, [], [0, 1])
    assert "which rank 1 passed with other calls (it made 4 there, the last all_gather_object on world)" in \
        explain_desync({0: waiting, 1: passed})
    together = _record({"n": 3, "op": "all_reduce on dp"}, [_call("all_reduce", 3)], [0, 1])
    assert explain_desync({0: waiting, 1: together}) is None  # both in it: not a desync (a slow link?)
    assert "rank 1 published no record" in explain_desync({0: waiting, 1: None})


def _misbehaving_rank(rank: int, n: int, store_port: int, run_dir: str) -> tuple[list[str], str]:
    """What `_disagreeing` reports, then: rank 1 leaves out the second of three loss averages
    over a short-timeout group, and each rank returns the sentence its failure is reported with
    (one set of processes for both, as processes are slow to start)."""
    disagreements = _disagreeing(rank, n)
    store = dist.TCPStore("127.0.0.1", store_port, n, is_master=rank == 0)  # noqa: F841 (served while alive)
    health = Health(ProcessEnv(rank, n, rank, n, "127.0.0.1", store_port, "single"), timeout_s=2)
    tracker = CollectiveTracker()
    health.track(tracker)
    comm = Comm(tracker=tracker)
    handles = {name: dist.new_group([0, 1], timeout=timedelta(seconds=2)) for name in ("dp", "world")}
    dp, world = (Group(name, (0, 1), rank, handle) for name, handle in handles.items())
    try:
        for step in range(3):
            if not (rank == 1 and step == 1):
                comm.all_reduce(torch.ones(4), dp)  # the loss average
            comm.all_reduce(torch.zeros(1), world)  # the non-finite verdict
    except RuntimeError as exc:
        return disagreements, str(explain_failure(exc, health, f"in step {step + 1}", run_dir))
    finally:
        health.stop()
        dist.barrier()  # over the default group, whose timeout is long: rank 0 serves the store till here
    return disagreements, "no failure"


def test_ranks_that_disagree_or_skip_a_collective_are_named(tmp_path):
    results = run_distributed(_misbehaving_rank, 2, free_port(), tmp_path, timeout_s=60)
    for disagreements, _ in results:
        shapes, config = disagreements
        assert shapes == ("rank 1 holds other parameters than rank 0, which holds copies of the same weights: "
                          "1.weight is float32 [4, 16] on rank 0 and float32 [5, 16] on rank 1; every rank must "
                          "build the same model (the same code and configuration).")
        assert config == ("rank 1 was started with another configuration than rank 0: --micro-batch is 8 there "
                          "and 4 on rank 0; launch every rank with the same command and config file.")
    said = [sentence for _, sentence in results]
    assert said[0].startswith("collective desync: rank 0 waits in all_reduce on dp (call #2 of torch group 1 of "
                              "ranks 0,1), which rank 1 has not reached (it made 1 calls there and waits in "
                              "all_reduce on world (call #2 of torch group 2 of ranks 0,1))")
    assert said[0].endswith("so rank 0 stopped in step 2; the run has no complete checkpoint yet: run the same "
                            "command again.")
    assert "rank 1 waits in all_reduce on world (call #2 of torch group 2 of ranks 0,1), which rank 0 has not " \
           "reached" in said[1]


def test_debug_environment():
    environ = {"NCCL_DEBUG": "WARN"}
    debug_environment(environ)
    assert environ == DEBUG_ENVIRONMENT


@pytest.mark.parametrize("echo", [False, True])
def test_rank_log_takes_both_streams_at_the_descriptor(tmp_path, capfd, echo):
    log = RankLog(tmp_path, rank=1, world_size=2, echo=echo)
    print("from python", file=sys.__stdout__)
    os.write(2, b"from C\n")  # what torch's C++ side and NCCL write
    log.close()
    text = (tmp_path / "logs" / "rank1.log").read_text()
    assert text.startswith("# rank 1 of 2, pid ")
    assert "from python\n" in text and "from C\n" in text
    seen = capfd.readouterr()
    assert ("from python" in seen.out and "from C" in seen.err) == echo
    os.write(1, b"after\n")
    assert "after" not in (tmp_path / "logs" / "rank1.log").read_text()


@pytest.mark.slow
def test_a_skipped_collective_is_named_end_to_end(corpus, tmp_path):
    """A real job: rank 1 of two leaves out the loss average of step 2 (SCALETRAIN_FAULT). The
    ranks pair it with the next collective of the same shape and lose step, so it ends in a
    timeout; the sentence names the rank and the calls. Each rank wrote its own log, with
    torch's debug level set before the process group (its checker wrapped every collective)."""
    out = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-m", "scaletrain", "train", "--model", "gpt-tiny", "--data", str(corpus), "--seq-len",
         "32", "--micro-batch", "4", "--steps", "3", "--eval-every", "0", "--eval-batches", "1",
         "--sample-tokens", "0", "--no-progress", "--nproc", "2", "--timeout", "4", "--debug-dist",
         "--cache-dir", str(tmp_path / "cache"), "--out", str(out)],
        capture_output=True, text=True, timeout=240,
        env={**os.environ, "SCALETRAIN_FAULT": "skip rank=1 step=2", "OMP_NUM_THREADS": "1"})
    assert result.returncode == 1, result.stderr[-3000:]
    sentence = [line for line in result.stderr.splitlines() if line.startswith("scaletrain train: ")]
    assert len(sentence) == 1, result.stderr[-3000:]
    assert sentence[0].startswith("scaletrain train: collective desync: rank 0 waits in all_reduce on ")
    assert "rank 1 " in sentence[0] and "so rank 0 stopped in step 2" in sentence[0]
    for rank in (0, 1):
        log = (out / "logs" / f"rank{rank}.log").read_text()
        header = log.splitlines()[0]
        assert header.startswith(f"# rank {rank} of 2, pid ")
        assert all(f"{key}={value}" in header for key, value in DEBUG_ENVIRONMENT.items())
        assert f"[Rank {rank}] Running collective: CollectiveFingerPrint" in log  # DETAIL's checker


def test_the_skip_fault():
    assert Faults(parse("skip rank=1 step=2"), rank=1, attempt=0).skips(2)
    assert not Faults(parse("skip rank=1 step=2"), rank=0, attempt=0).skips(2)
    assert not Faults(parse("skip rank=1 step=2"), rank=1, attempt=0).skips(3)
    with pytest.raises(UserError, match="needs a kind among kill, hang, nan, skip"):
        parse("skip rank=1 step=2 at=optimizer")
