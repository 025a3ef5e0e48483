"""Everything that talks to torch.distributed, and nothing else does.

launch  where rank and world come from, process-group setup and teardown
spawn   starting local workers through torch's elastic launcher
mesh    ParallelDims (how the world splits into dp, ep, pp, cp and tp) and the
        process groups of each split
comm    Comm, the one door to the network, and the Ledger that counts what
        went through it
"""

from scaletrain.runtime.comm import Comm, Ledger, Pending
from scaletrain.runtime.launch import (
    DistRuntime,
    ProcessEnv,
    detect_environment,
    expand_nodelist,
    free_port,
    init_distributed,
    shutdown,
)
from scaletrain.runtime.mesh import DIM_NAMES, Group, Mesh, ParallelDims
from scaletrain.runtime.spawn import WorkerFailed, spawn_local

__all__ = [
    "DIM_NAMES",
    "Comm",
    "DistRuntime",
    "Group",
    "Ledger",
    "Mesh",
    "ParallelDims",
    "Pending",
    "ProcessEnv",
    "WorkerFailed",
    "detect_environment",
    "expand_nodelist",
    "free_port",
    "init_distributed",
    "shutdown",
    "spawn_local",
]
