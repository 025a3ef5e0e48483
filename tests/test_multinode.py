"""A real two-node launch on one machine: two torchrun agents meet through c10d.

Each agent plays one node of ``--nnodes 2 --nproc-per-node 2``; both run the
same ``scaletrain train`` command, as they would on two hosts of a cluster
(docs/launching.md). The job must train exactly as the same layout does when
``--nproc 4`` starts it on one node.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path

import pytest

from scaletrain.runtime import free_port
from scaletrain.runtime.mesh import ParallelDims

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 180  # each launch takes about 15 s on two cores; this only stops a hang


def _tiny(corpus: Path, out: Path, *extra: str) -> list[str]:
    return ["train", "--model", "gpt-tiny", "--data", str(corpus), "--seq-len", "32", "--micro-batch", "4",
            "--steps", "3", "--warmup-steps", "1", "--eval-every", "0", "--eval-batches", "1",
            "--sample-tokens", "0", "--no-progress", "--cache-dir", str(out.parent / "cache"),
            "--out", str(out), "--pp", "2", "--tp", "2", *extra]


def _descendants(pid: int) -> list[int]:
    """Every living descendant of `pid` (Linux /proc; empty elsewhere).

    torchrun starts each worker in a session of its own, so killing an
    agent's process group would not reach them; they are found by parent id.
    """
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            # The field after the parenthesised command name is the state, then the parent id.
            ppid = int(entry.joinpath("stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        parents.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        children = parents.get(todo.pop(), [])
        found.extend(children)
        todo.extend(children)
    return found


def _kill_tree(process: subprocess.Popen) -> None:
    for pid in [*_descendants(process.pid), process.pid]:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    process.wait()


def _run_together(commands: list[list[str]], logs: Path) -> list[tuple[int, str, str]]:
    """Start every command at once; return each one's exit code, stdout and stderr.

    Output goes to files, not pipes, so that no process blocks on a full pipe
    while another is being waited for. Past the deadline every process and
    all its children are killed, so a failed rendezvous cannot hang the suite.
    """
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    logs.mkdir(parents=True, exist_ok=True)
    with ExitStack() as files:
        processes = [subprocess.Popen(command, cwd=ROOT, env=env,
                                      stdout=files.enter_context(open(logs / f"{i}.out", "w")),
                                      stderr=files.enter_context(open(logs / f"{i}.err", "w")))
                     for i, command in enumerate(commands)]
        deadline = time.monotonic() + TIMEOUT_S
        try:
            for process in processes:
                process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        finally:
            hung = [process for process in processes if process.poll() is None]
            for process in hung:
                _kill_tree(process)
    results = [(process.returncode, (logs / f"{i}.out").read_text(), (logs / f"{i}.err").read_text())
               for i, process in enumerate(processes)]
    assert not hung, f"{len(hung)} launch(es) still ran after {TIMEOUT_S} s and were killed:\n" + "\n".join(
        err[-3000:] for _, _, err in results)
    return results


def _losses(run: Path) -> list[float]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    return [r["loss"] for r in records]


@pytest.mark.slow  # 30 s; test_launch checks the environment torchrun gives each node
def test_two_torchrun_agents_on_loopback_train_the_one_node_job(corpus, tmp_path):
    run = tmp_path / "two-nodes" / "run"
    port = free_port()
    # Two agents on one host both see the endpoint 127.0.0.1 as their own
    # address, so torch's guess (is_host: does the endpoint name this machine?)
    # makes both try to serve the c10d store, and the loser only falls back to
    # being a client because its bind happened to fail. is_host=true/false in
    # --rdzv-conf settles it: the first agent serves the store, the second only
    # connects (retrying until the store is up, so the start order does not
    # matter). --node-rank would not help: torchrun ignores it outside the
    # static rendezvous; c10d numbers the agents by their sorted (address,
    # pid). --local-addr 127.0.0.1 is the address an agent advertises; the
    # agent that becomes node 0 hands it to every worker as MASTER_ADDR, so
    # the workers meet on loopback without resolving this machine's host name.
    agent = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
             "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"test-{port}",
             "--local-addr", "127.0.0.1", "--max-restarts", "0"]
    job = ["-m", "scaletrain", *_tiny(corpus, run)]
    results = _run_together([[*agent, "--rdzv-conf", f"is_host={host},join_timeout=120", *job]
                             for host in ("true", "false")], tmp_path / "two-nodes" / "logs")
    for node, (code, _, err) in enumerate(results):
        assert code == 0, f"agent {node} exited with {code}:\n{err[-4000:]}"

    stdout = "".join(out for _, out, _ in results)
    # tp innermost: each node holds one tp group (one pipeline stage); pp crosses the nodes.
    assert stdout.count("layout pp2 x tp2 on 4 process(es)") == 1  # rank 0 speaks for the job
    table = ParallelDims(pp=2, tp=2).layout_table()
    assert stdout.count(table) == 1
    header = stdout.splitlines().index(table.splitlines()[0])
    assert [line.split()[0] for line in stdout.splitlines()[header + 1:header + 5]] == ["0", "1", "2", "3"]

    two_nodes = _losses(run)
    assert all(math.isfinite(loss) for loss in two_nodes)

    reference = tmp_path / "one-node" / "run"
    [(code, _, err)] = _run_together([[sys.executable, "-m", "scaletrain", *_tiny(corpus, reference, "--nproc", "4")]],
                                     tmp_path / "one-node" / "logs")
    assert code == 0, err[-4000:]
    one_node = _losses(reference)
    for step, (a, b) in enumerate(zip(two_nodes, one_node, strict=True), start=1):
        assert abs(a - b) <= 1e-5 * abs(b), f"step {step}: two nodes {a}, one node {b}"
