"""Where this process's rank and world come from, and how the process group is set
up and torn down (starting several local processes: runtime/spawn.py).

Launchers announce a process's place through environment variables; they are
read in this order, the first that applies wins:

  torchrun   RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT
  Ray        the same variables, in a Ray Train worker (SCALETRAIN_LAUNCHER=ray,
             runtime/ray_launch.py), whose process group Ray has already made
  Slurm      srun with more than one task: SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID,
             SLURM_NTASKS_PER_NODE or SLURM_TASKS_PER_NODE ("4(x2),3") with SLURM_NODEID;
             MASTER_ADDR else the first host of the step's node list (task 0 runs
             there), MASTER_PORT else 29500 + SLURM_JOB_ID % 1000, so every task of
             a job agrees and jobs sharing a node rarely collide
  MPI        Open MPI (OMPI_COMM_WORLD_{RANK,SIZE,LOCAL_RANK,LOCAL_SIZE}) or
             MPICH / Intel MPI (PMI_RANK, PMI_SIZE, MPI_LOCALRANKID, MPI_LOCALNRANKS);
             MASTER_ADDR else 127.0.0.1 when every rank is on this node
  single     rank 0 of a world of 1

The process group's timeout is what turns a dead or stuck rank into an error
on the others instead of a job that hangs forever. Unless ``--timeout`` says
otherwise it is a minute on one machine's CPUs and ten minutes on GPUs or
across nodes (`default_timeout`).

With ``--backend mpi4py`` (processes started by mpirun) no torch process group
is made: MPI itself is the network, its communicators the mesh's groups and
`MpiComm` the door to it (runtime/mpi.py); `connect` hands out the mesh and the
Comm of whichever network the runtime has.
"""

from __future__ import annotations

import os
import re
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from scaletrain.errors import UserError
from scaletrain.runtime.comm import Comm, Ledger
from scaletrain.runtime.desync import CollectiveTracker
from scaletrain.runtime.mesh import Mesh, ParallelDims

DEFAULT_ADDR = "127.0.0.1"
SETTLE_S = 0.1  # what shutdown waits after its barrier for gloo's threads (`shutdown`)
DEFAULT_PORT = 29500
LAUNCHER_VARIABLE = "SCALETRAIN_LAUNCHER"  # "ray" in a Ray Train worker (runtime/ray_launch.py)
# The collective timeouts when --timeout is not given (`default_timeout`).
LOCAL_CPU_TIMEOUT_S = 60.0
CLUSTER_TIMEOUT_S = 600.0

# (rank, world size, local rank, local world size) variables of each MPI flavour.
_MPI_KEYS = (
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
)
_TORCHRUN_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


@dataclass(frozen=True)
class ProcessEnv:
    """This process's place in the job, as its launcher described it."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    source: str  # "single", "torchrun", "ray", "slurm" or "mpi"


def _require(environ: Mapping[str, str], key: str, launcher: str) -> str:
    if key not in environ:
        raise UserError(f"{key} is not set although the job looks launched by {launcher}; set {key} or launch again.")
    return environ[key]


def _whole(environ: Mapping[str, str], key: str, launcher: str, minimum: int = 0) -> int:
    text = _require(environ, key, launcher)
    if not text.strip().isdecimal() or int(text) < minimum:
        raise UserError(f"{key}={text!r} must be a whole number of at least {minimum}; fix the {launcher} environment.")
    return int(text)


def _place(environ: Mapping[str, str], keys: tuple[str, str, str, str], launcher: str) -> tuple[int, int, int, int]:
    """Rank, world size, local rank and local world size, checked for consistency."""
    rank_key, world_key, local_rank_key, local_world_key = keys
    rank = _whole(environ, rank_key, launcher)
    world = _whole(environ, world_key, launcher, minimum=1)
    local_rank = _whole(environ, local_rank_key, launcher)
    local_world = _whole(environ, local_world_key, launcher, minimum=1)
    _check_place(rank, world, local_rank, local_world, launcher)
    return rank, world, local_rank, local_world


def _check_place(rank: int, world: int, local_rank: int, local_world: int, launcher: str) -> None:
    if rank >= world or local_rank >= local_world or local_world > world:
        raise UserError(
            f"{launcher} gave rank {rank} of {world} with local rank {local_rank} of {local_world}, "
            f"which do not fit together; fix the {launcher} environment."
        )


def _port(environ: Mapping[str, str], launcher: str, default: int | None) -> int:
    """MASTER_PORT, or `default` when it is unset (required when `default` is None)."""
    if "MASTER_PORT" not in environ and default is not None:
        return default
    port = _whole(environ, "MASTER_PORT", launcher, minimum=1)
    if port > 65535:
        raise UserError(f"MASTER_PORT={port} is not a TCP port; choose one between 1 and 65535.")
    return port


def expand_nodelist(nodelist: str) -> list[str]:
    """Host names of a Slurm host list such as "node[01-04,07],gpu5" (zero padding kept)."""
    hosts: list[str] = []
    # Split on the commas that are not inside brackets.
    for item in re.split(r",(?![^\[]*\])", nodelist):
        hosts.extend(_expand_host(item, nodelist))
    return hosts


def _expand_host(pattern: str, nodelist: str) -> list[str]:
    """Expand every bracket of one host pattern, e.g. "rack[1-2]-n[1,3]" -> 4 hosts."""
    match = re.search(r"\[([^\]]*)\]", pattern)
    if match is None:
        if "[" in pattern or "]" in pattern or not pattern:
            raise _bad_nodelist(nodelist)
        return [pattern]
    prefix, rest = pattern[: match.start()], pattern[match.end() :]
    if "]" in prefix or "[" in prefix:
        raise _bad_nodelist(nodelist)
    values: list[str] = []
    for part in match.group(1).split(","):
        bounds = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if bounds is None:
            raise _bad_nodelist(nodelist)
        low, high = bounds.group(1), bounds.group(2) or bounds.group(1)
        if int(high) < int(low):
            raise _bad_nodelist(nodelist)
        values.extend(str(i).zfill(len(low)) for i in range(int(low), int(high) + 1))
    tails = _expand_host(rest, nodelist) if rest else [""]
    return [prefix + value + tail for value in values for tail in tails]


def _bad_nodelist(nodelist: str) -> UserError:
    return UserError(
        f"the Slurm node list {nodelist!r} is not a host list like node[01-04,07],gpu5; set MASTER_ADDR instead."
    )


def _tasks_per_node(text: str) -> list[int]:
    """Expand SLURM_TASKS_PER_NODE, e.g. "4(x2),3" -> [4, 4, 3]."""
    counts: list[int] = []
    for item in text.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item.strip())
        if match is None:
            raise UserError(f"SLURM_TASKS_PER_NODE={text!r} is not of the form 4(x2),3; fix the Slurm environment.")
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts


def _from_slurm(environ: Mapping[str, str]) -> ProcessEnv:
    rank = _whole(environ, "SLURM_PROCID", "Slurm")
    world = _whole(environ, "SLURM_NTASKS", "Slurm", minimum=1)
    local_rank = _whole(environ, "SLURM_LOCALID", "Slurm")
    if "SLURM_NTASKS_PER_NODE" in environ:
        local_world = _whole(environ, "SLURM_NTASKS_PER_NODE", "Slurm", minimum=1)
    else:
        per_node = _tasks_per_node(_require(environ, "SLURM_TASKS_PER_NODE", "Slurm"))
        node = _whole(environ, "SLURM_NODEID", "Slurm") if "SLURM_NODEID" in environ else 0
        if node >= len(per_node):
            raise UserError(f"SLURM_NODEID={node} has no entry in SLURM_TASKS_PER_NODE; fix the Slurm environment.")
        local_world = per_node[node]
    _check_place(rank, world, local_rank, local_world, "Slurm")
    if "MASTER_ADDR" in environ:
        addr = environ["MASTER_ADDR"]
    else:
        key = next((k for k in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST") if k in environ), None)
        if key is None:
            raise UserError("Slurm gave no node list; set MASTER_ADDR to the host of task 0.")
        addr = expand_nodelist(environ[key])[0]
    job = _whole(environ, "SLURM_JOB_ID", "Slurm") if "SLURM_JOB_ID" in environ else 0
    port = _port(environ, "Slurm", DEFAULT_PORT + job % 1000)
    return ProcessEnv(rank, world, local_rank, local_world, addr, port, "slurm")


def _from_mpi(environ: Mapping[str, str], keys: tuple[str, str, str, str]) -> ProcessEnv:
    rank, world, local_rank, local_world = _place(environ, keys, "MPI")
    if "MASTER_ADDR" in environ:
        addr = environ["MASTER_ADDR"]
    elif local_world == world:
        addr = DEFAULT_ADDR
    else:
        raise UserError(
            f"MPI started {world} ranks on more than one node but MASTER_ADDR is not set; "
            "export MASTER_ADDR as the host of rank 0 to every rank (mpirun -x MASTER_ADDR)."
        )
    return ProcessEnv(rank, world, local_rank, local_world, addr, _port(environ, "MPI", DEFAULT_PORT), "mpi")


def detect_environment(environ: Mapping[str, str] = os.environ) -> ProcessEnv:
    """This process's rank and world, from whichever launcher started it."""
    if "RANK" in environ:
        rank, world, local_rank, local_world = _place(environ, _TORCHRUN_KEYS, "torchrun")
        addr = _require(environ, "MASTER_ADDR", "torchrun")
        port = _port(environ, "torchrun", default=None)
        source = "ray" if environ.get(LAUNCHER_VARIABLE) == "ray" else "torchrun"
        return ProcessEnv(rank, world, local_rank, local_world, addr, port, source)
    if "SLURM_PROCID" in environ and _whole(environ, "SLURM_NTASKS", "Slurm", minimum=1) > 1:
        return _from_slurm(environ)
    for keys in _MPI_KEYS:
        if keys[0] in environ:
            return _from_mpi(environ, keys)
    addr = environ.get("MASTER_ADDR", DEFAULT_ADDR)
    return ProcessEnv(0, 1, 0, 1, addr, _port(environ, "shell", DEFAULT_PORT), "single")


def restart_attempt(environ: Mapping[str, str] = os.environ) -> int:
    """How many times torchrun's agent (or ``--max-restarts``) has restarted this job's workers: 0 at first."""
    return int(environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


@dataclass
class DistRuntime:
    """The process's place plus the backend and device it computes with.

    `backend` is None when the world is one process and no group exists.
    """

    env: ProcessEnv
    backend: str | None
    device: torch.device
    timeout_s: float = CLUSTER_TIMEOUT_S  # how long a collective waits for a rank

    @property
    def is_main(self) -> bool:
        return self.env.rank == 0

    @property
    def torch_group(self) -> bool:
        """Whether a torch.distributed process group (and its rendezvous store) exists."""
        return self.backend in ("nccl", "gloo")


def default_timeout(backend: str, env: ProcessEnv) -> float:
    """How long a collective waits for a rank when --timeout is not given.

    On one machine's CPUs (gloo or MPI over loopback) a healthy collective takes milliseconds, and
    the longest a healthy rank waits in one is for another's work alone: a checkpoint written, the
    first step compiled, at the sizes a CPU trains seconds (tens under a loaded machine). A minute
    shows a hang quickly and leaves that margin. GPUs (first-step compilation and autotuning,
    checkpoints of billions of weights) and several nodes (a late node, a congested link) keep
    NCCL's own ten minutes."""
    one_node = env.local_world_size == env.world_size
    return LOCAL_CPU_TIMEOUT_S if backend != "nccl" and one_node else CLUSTER_TIMEOUT_S


def _choose_backend(backend: str | None) -> str:
    cuda = torch.cuda.is_available()
    if backend is None:
        return "nccl" if cuda else "gloo"
    if backend not in ("nccl", "gloo", "mpi4py"):
        raise UserError(f"--backend {backend} is not supported; use nccl, gloo or mpi4py.")
    if backend == "nccl" and not cuda:
        raise UserError("--backend nccl needs a CUDA GPU, but none is visible; use --backend gloo.")
    return backend


def check_backend(backend: str | None, env: ProcessEnv) -> str:
    """The backend to use (default: nccl with a GPU, else gloo), checked against how the
    processes were started: mpi4py needs MPI's own launcher and a world MPI agrees with."""
    chosen = _choose_backend(backend)
    if chosen == "mpi4py":
        if env.source not in ("mpi", "single"):
            raise UserError(f"--backend mpi4py needs its processes started by mpirun, not {env.source}; "
                            f"run mpirun -n {env.world_size} scaletrain train ... or choose --backend gloo.")
        from scaletrain.runtime.mpi import import_mpi
        world = import_mpi().COMM_WORLD
        if (world.Get_rank(), world.Get_size()) != (env.rank, env.world_size):
            raise UserError(f"MPI counts rank {world.Get_rank()} of {world.Get_size()} but the environment says "
                            f"{env.rank} of {env.world_size}; launch with this MPI library's own mpirun.")
    return chosen


def init_distributed(env: ProcessEnv, timeout_s: float | None, backend: str | None = None) -> DistRuntime:
    """Pick the backend and device, and join the process group when there is more than one process;
    ``timeout_s``: how long a collective waits for a rank (None: `default_timeout`).

    nccl computes on GPU local_rank; gloo and mpi4py compute on the CPU.
    """
    if env.source == "ray" and dist.is_initialized():
        backend = dist.get_backend()  # Ray chose it from the workers' GPUs (runtime/ray_launch.py)
    chosen = check_backend(backend, env)
    timeout_s = timeout_s or default_timeout(chosen, env)
    device = torch.device("cpu")
    if chosen == "nccl":
        if env.local_rank >= torch.cuda.device_count():
            raise UserError(
                f"local rank {env.local_rank} has no GPU: this node shows {torch.cuda.device_count()}; "
                f"start at most {torch.cuda.device_count()} processes per node."
            )
        device = torch.device("cuda", env.local_rank)
        torch.cuda.set_device(device)
    if device.type == "cpu" and env.local_world_size > 1 and "OMP_NUM_THREADS" not in os.environ:
        # Processes sharing a machine's cores: each takes its share, as torchrun's
        # OMP_NUM_THREADS=1 intends; more threads each would only contend.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // env.local_world_size))
    if env.world_size == 1:
        return DistRuntime(env, None, device, timeout_s)
    if chosen == "mpi4py":  # MPI started with the import in check_backend; no torch group
        return DistRuntime(env, chosen, device, timeout_s)
    if env.source == "ray" and dist.is_initialized():  # Ray Train's rendezvous made the group
        return DistRuntime(env, chosen, device, timeout_s)
    if dist.is_initialized():
        raise UserError("this process already joined a process group; scaletrain joins the job itself, from the "
                        "launcher's variables: remove your init_process_group call, and call scaletrain.setup "
                        "once per process.")
    timeout = timedelta(seconds=timeout_s)
    if env.source == "torchrun":
        dist.init_process_group(chosen, store=_attempt_store(env, timeout), rank=env.rank,
                                world_size=env.world_size, timeout=timeout)
    else:  # rank 0 starts the rendezvous store at MASTER_ADDR:MASTER_PORT
        dist.init_process_group(chosen, init_method=f"tcp://{env.master_addr}:{env.master_port}", rank=env.rank,
                                world_size=env.world_size, timeout=timeout)
    return DistRuntime(env, chosen, device, timeout_s)


def _attempt_store(env: ProcessEnv, timeout: timedelta) -> dist.Store:
    """The rendezvous store of this launch attempt under torchrun (or `spawn_local`).

    The agent serves one store at MASTER_ADDR:MASTER_PORT for the whole job,
    restarts included, so the keys the first attempt's ranks left (each one's
    address) are still there when the restarted ranks meet, and a rank may
    read another's old address before its new one: the connection is refused.
    A prefix per attempt keeps attempts apart. (Without the agent's store,
    rank 0 serves one, as under the other launchers.)
    """
    agent_serves = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(env.master_addr, env.master_port, env.world_size,
                          is_master=env.rank == 0 and not agent_serves, timeout=timeout)
    return dist.PrefixStore(f"scaletrain/attempt_{restart_attempt()}", store)


def attempt_rendezvous(env: ProcessEnv, timeout_s: float = 600.0) -> tuple[str, int]:
    """Where a script that calls ``init_process_group`` itself should meet in this launch attempt.

    Under torch's elastic agent (torchrun, ``--nproc``) such a script's ``env://`` rendezvous
    reads and writes the agent's store, which outlives a restart: a restarted rank may read a
    dead rank's address from the failed attempt and wait on it for good (`_attempt_store`
    keeps the trainer's attempts apart by a prefix, which a user's script cannot take). So
    rank 0 of each attempt picks a fresh port, tells the others through the agent's store under
    the attempt's own key, and hosts that attempt's store itself. Elsewhere (one process,
    SLURM, MPI: no agent, no restarts) the launcher's address stands."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or env.world_size == 1:
        return env.master_addr, env.master_port
    agent = dist.TCPStore(env.master_addr, env.master_port, env.world_size, is_master=False,
                          timeout=timedelta(seconds=timeout_s))
    key = f"scaletrain/script/attempt_{restart_attempt()}"
    if env.rank == 0:
        one_node = env.local_world_size == env.world_size
        host = env.master_addr if one_node else socket.getfqdn()
        agent.set(key, f"{host}:{free_port(env.master_addr if one_node else '')}")
    host, port = agent.get(key).decode().rsplit(":", 1)
    return host, int(port)


def shutdown(runtime: DistRuntime, barrier: bool = True) -> None:
    """Leave the process group; the barrier first lets every rank finish its
    last transfers, without which teardown aborts at random on torch 2.13.
    A caller that met the others at its own barrier (the trainer's, tracked
    for the desync report), or leaves because the job failed, skips it: the
    ranks it would wait for may be dead or stuck."""
    if not runtime.torch_group:  # one process, or MPI, which mpi4py finalises at exit
        return
    if barrier:
        dist.barrier()
    # Gloo's worker threads release a finished collective's tensors just after its waiter
    # wakes, taking the GIL for the ones Python made; a thread still doing so when the
    # interpreter finalises aborts the process ("terminate called without an active
    # exception", rank != 0 at random). The GIL given up for a moment lets them finish.
    time.sleep(SETTLE_S)
    dist.destroy_process_group()


def connect(runtime: DistRuntime, dims: ParallelDims,
            tracker: CollectiveTracker | None = None) -> tuple[Mesh, Comm]:
    """The mesh's groups and the Comm over them on the runtime's network: MPI communicators
    and `MpiComm` with --backend mpi4py, else torch process groups and `Comm`; with a
    ``tracker`` every collective is numbered for the desync detector (runtime/desync.py)."""
    if runtime.backend == "mpi4py":
        from scaletrain.runtime.mpi import MpiComm, MpiGroups

        comm = MpiComm(Ledger(), tracker)
        return Mesh.build(dims, runtime.env.rank, runtime.env.world_size, MpiGroups(comm.MPI)), comm
    return Mesh.build(dims, runtime.env.rank, runtime.env.world_size), Comm(Ledger(), tracker)


def free_port(host: str = DEFAULT_ADDR) -> int:
    """A TCP port free on `host` right now (another process could still take it before use)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
