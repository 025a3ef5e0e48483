"""Where rank and world come from, and starting local workers."""

import os

import pytest
import torch

from scaletrain.errors import UserError
from scaletrain.runtime import (
    Comm,
    Mesh,
    ParallelDims,
    ProcessEnv,
    WorkerFailed,
    detect_environment,
    expand_nodelist,
    init_distributed,
    shutdown,
    spawn_local,
)

TORCHRUN = {
    "RANK": "3",
    "WORLD_SIZE": "8",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "2",
    "MASTER_ADDR": "10.0.0.5",
    "MASTER_PORT": "29400",
}
SLURM = {
    "SLURM_PROCID": "5",
    "SLURM_NTASKS": "8",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "1",
    "SLURM_TASKS_PER_NODE": "4(x2)",
    "SLURM_JOB_NODELIST": "node[07-08]",
    "SLURM_JOB_ID": "123456",
}


def test_single_process_by_default():
    assert detect_environment({}) == ProcessEnv(0, 1, 0, 1, "127.0.0.1", 29500, "single")


def test_torchrun():
    assert detect_environment(TORCHRUN) == ProcessEnv(3, 8, 1, 2, "10.0.0.5", 29400, "torchrun")


def test_torchrun_wins_over_slurm():
    assert detect_environment(SLURM | TORCHRUN).source == "torchrun"


def test_slurm_expands_tasks_per_node_and_picks_the_first_host():
    env = detect_environment(SLURM)
    assert env == ProcessEnv(5, 8, 1, 4, "node07", 29500 + 123456 % 1000, "slurm")


def test_slurm_prefers_explicit_values():
    env = detect_environment(SLURM | {"SLURM_NTASKS_PER_NODE": "2", "MASTER_ADDR": "head", "MASTER_PORT": "4000"})
    assert (env.local_world_size, env.master_addr, env.master_port) == (2, "head", 4000)


def test_uneven_slurm_nodes():
    env = detect_environment(SLURM | {"SLURM_NTASKS": "7", "SLURM_PROCID": "6", "SLURM_LOCALID": "2",
                                      "SLURM_NODEID": "2", "SLURM_TASKS_PER_NODE": "2(x2),3"})
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (6, 7, 2, 3)


def test_slurm_with_one_task_is_a_single_process():
    assert detect_environment(SLURM | {"SLURM_NTASKS": "1", "SLURM_PROCID": "0"}).source == "single"


@pytest.mark.parametrize(
    ("nodelist", "hosts"),
    [
        ("gpu5", ["gpu5"]),
        ("node[01-04,07],gpu5", ["node01", "node02", "node03", "node04", "node07", "gpu5"]),
        ("n[098-101]", ["n098", "n099", "n100", "n101"]),
        ("rack[1-2]-n[8,10]", ["rack1-n8", "rack1-n10", "rack2-n8", "rack2-n10"]),
        ("a[1],b[002-003]", ["a1", "b002", "b003"]),
    ],
)
def test_nodelist_expansion(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize("nodelist", ["", "a,,b", "n[1-", "n[3-1]", "n[x]", "n]1[", "n[[1]]"])
def test_malformed_nodelist(nodelist):
    with pytest.raises(UserError, match="is not a host list like node"):
        detect_environment(SLURM | {"SLURM_JOB_NODELIST": nodelist})


def test_open_mpi():
    environ = {
        "OMPI_COMM_WORLD_RANK": "2",
        "OMPI_COMM_WORLD_SIZE": "4",
        "OMPI_COMM_WORLD_LOCAL_RANK": "2",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
    }
    assert detect_environment(environ) == ProcessEnv(2, 4, 2, 4, "127.0.0.1", 29500, "mpi")


def test_mpich_pmi():
    environ = {"PMI_RANK": "5", "PMI_SIZE": "8", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "4",
               "MASTER_ADDR": "head", "MASTER_PORT": "1234"}
    assert detect_environment(environ) == ProcessEnv(5, 8, 1, 4, "head", 1234, "mpi")


def test_multi_node_mpi_needs_master_addr():
    environ = {"PMI_RANK": "5", "PMI_SIZE": "8", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "4"}
    with pytest.raises(UserError, match="more than one node but MASTER_ADDR is not set"):
        detect_environment(environ)


@pytest.mark.parametrize(
    ("changes", "phrase"),
    [
        ({"RANK": "three"}, "RANK='three' must be a whole number"),
        ({"WORLD_SIZE": "0"}, "WORLD_SIZE='0' must be a whole number of at least 1"),
        ({"RANK": "8"}, "rank 8 of 8 with local rank 1 of 2, which do not fit together"),
        ({"LOCAL_RANK": "2"}, "which do not fit together"),
        ({"MASTER_PORT": "70000"}, "MASTER_PORT=70000 is not a TCP port"),
        ({"MASTER_PORT": ""}, "MASTER_PORT='' must be a whole number"),
    ],
)
def test_malformed_torchrun_values(changes, phrase):
    with pytest.raises(UserError, match=phrase):
        detect_environment(TORCHRUN | changes)


def test_missing_torchrun_value():
    environ = dict(TORCHRUN)
    del environ["LOCAL_RANK"]
    with pytest.raises(UserError, match="LOCAL_RANK is not set although the job looks launched by torchrun"):
        detect_environment(environ)


def test_malformed_slurm_values():
    with pytest.raises(UserError, match=r"SLURM_TASKS_PER_NODE='4\(y2\)' is not of the form"):
        detect_environment(SLURM | {"SLURM_TASKS_PER_NODE": "4(y2)"})
    with pytest.raises(UserError, match="SLURM_NTASKS='-2' must be a whole number"):
        detect_environment(SLURM | {"SLURM_NTASKS": "-2"})


def test_backend_choice_is_checked():
    with pytest.raises(UserError, match="--backend mpi is not supported"):
        init_distributed(detect_environment({}), timeout_s=5, backend="mpi")
    if not torch.cuda.is_available():
        with pytest.raises(UserError, match="--backend nccl needs a CUDA GPU"):
            init_distributed(detect_environment({}), timeout_s=5, backend="nccl")
    # MPI's ranks come from mpirun; a torchrun job cannot use them (checked before importing MPI)
    with pytest.raises(UserError, match="--backend mpi4py needs its processes started by mpirun, not torchrun"):
        init_distributed(detect_environment(TORCHRUN), timeout_s=5, backend="mpi4py")


def _sum_ranks(scale: int) -> tuple:
    env = detect_environment()
    runtime = init_distributed(env, timeout_s=30, backend="gloo")
    mesh = Mesh.build(ParallelDims(dp=env.world_size), env.rank, env.world_size)
    total = torch.tensor([float(env.rank * scale)])
    Comm().all_reduce(total, mesh.group("dp"))
    shutdown(runtime)
    return env.source, env.rank, env.world_size, env.local_rank, env.local_world_size, runtime.backend, total.item()


def test_spawn_local_returns_every_rank():
    results = spawn_local(2, _sum_ranks, (10,))
    assert results == {
        0: ("torchrun", 0, 2, 0, 2, "gloo", 10.0),
        1: ("torchrun", 1, 2, 1, 2, "gloo", 10.0),
    }


def _user_error_on_rank_one() -> None:
    env = detect_environment()
    runtime = init_distributed(env, timeout_s=20, backend="gloo")
    if env.rank == 1:
        raise UserError("--lr -1 must be positive; choose a learning rate above 0.")
    # Rank 0 goes on to a collective whose peer has left.
    mesh = Mesh.build(ParallelDims(dp=2), env.rank, env.world_size)
    Comm().all_reduce(torch.zeros(1), mesh.group("dp"))
    shutdown(runtime)


def test_spawn_local_reraises_a_user_error():
    with pytest.raises(UserError) as caught:
        spawn_local(2, _user_error_on_rank_one, ())
    assert str(caught.value) == "--lr -1 must be positive; choose a learning rate above 0."


def _crash_on_rank_one(message: str) -> str:
    rank = detect_environment().rank
    if rank == 1:
        raise ValueError(f"{message} on rank {rank}")
    return "fine"


def test_spawn_local_names_failed_workers():
    with pytest.raises(WorkerFailed) as caught:
        spawn_local(2, _crash_on_rank_one, ("boom",))
    first_line, traceback = str(caught.value).split("\n", 1)
    assert first_line == "1 of 2 workers failed (rank 1: ValueError: boom on rank 1)"
    assert traceback.startswith("Traceback") and "in _crash_on_rank_one" in traceback


def _where_forked(say: str) -> tuple[int, str | None, str]:
    """The worker's fork server (its parent), what it reads of the environment and folder; ``say``
    printed to its standard output."""
    print(say, flush=True)
    return os.getppid(), os.environ.get("SCALETRAIN_TEST_MARK"), os.getcwd()


def test_a_later_launch_forks_from_the_same_server_until_what_workers_inherit_changes(monkeypatch, tmp_path):
    """One server for launch after launch (no second import of torch), while a worker forked from it
    would take what a new one would; a changed environment, folder or output starts a new one."""
    monkeypatch.setenv("SCALETRAIN_TEST_MARK", "1")
    first, again = spawn_local(2, _where_forked, ("",)), spawn_local(1, _where_forked, ("",))
    server = first[0][0]
    assert {ppid for ppid, _, _ in (*first.values(), *again.values())} == {server}
    monkeypatch.setenv("SCALETRAIN_TEST_MARK", "2")
    monkeypatch.chdir(tmp_path)
    ppid, mark, folder = spawn_local(1, _where_forked, ("",))[0]
    assert ppid != server and (mark, folder) == ("2", str(tmp_path))
    # standard output led elsewhere between two launches: each one's worker prints where it led then
    saved = os.dup(1)
    try:
        for name in ("a", "b"):
            with open(tmp_path / name, "w") as out:
                os.dup2(out.fileno(), 1)
            spawn_local(1, _where_forked, (f"printed {name}",))
    finally:
        os.dup2(saved, 1)
        os.close(saved)
    for name in ("a", "b"):
        assert (tmp_path / name).read_text() == f"printed {name}\n"
