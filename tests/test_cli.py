"""The command line as a user meets it, in fresh interpreters."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from scaletrain.runtime.launch import free_port
from tests.conftest import run_cli


def _tiny(corpus, out, *extra):
    return ["train", "--model", "gpt-tiny", "--data", str(corpus), "--seq-len", "32", "--micro-batch", "4",
            "--steps", "3", "--warmup-steps", "1", "--eval-batches", "1", "--sample-tokens", "0",
            "--no-progress", "--out", str(out), "--cache-dir", str(out.parent / "cache"), *extra]


def _one_sentence_exit_2(result, phrase):
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert phrase in result.stderr


@pytest.mark.slow  # the README's --stop-at and --resume lines run by default (tests/test_readme.py)
def test_resume_after_stop_at_runs_to_the_end(corpus, tmp_path):
    """--stop-at limits one invocation: the resumed run goes on to --steps unless given its own."""
    out = tmp_path / "run"
    assert run_cli(*_tiny(corpus, out, "--stop-at", "1")).returncode == 0
    _one_sentence_exit_2(run_cli("train", "--out", str(out), "--resume", "--stop-at", "1"), "--stop-at 1 is not after")
    resumed = run_cli("train", "--out", str(out), "--resume")
    assert resumed.returncode == 0, resumed.stderr
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]


def test_nproc_2_launch_trains_and_accounts_every_byte(corpus, tmp_path):
    out = tmp_path / "run"
    result = run_cli(*_tiny(corpus, out, "--nproc", "2", "--report-comm"))
    assert result.returncode == 0, result.stderr
    assert "layout dp2 on 2 process(es)" in result.stdout
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    ledger = json.loads((out / "comm.json").read_text())
    assert set(ledger) == {"0", "1"}
    # gpt-tiny with the byte vocabulary: its parameters in fp32 bytes.
    from scaletrain.config import ModelConfig
    from scaletrain.data import ByteTokenizer
    from scaletrain.models import build_model
    model = build_model(ModelConfig(name="gpt-tiny"), vocab_size=ByteTokenizer().vocab_size, seq_len=32)
    param_bytes = 4 * sum(p.numel() for p in model.parameters())
    tensors = list(model.parameters()) + list(model.buffers())
    for rank in ("0", "1"):
        reduce = ledger[rank]["all_reduce"]["dp"]
        # per step: one flat gradient all-reduce and one 4-byte loss average
        assert reduce["calls"] == 2 * 3
        assert reduce["bytes"] == 3 * (param_bytes + 4)
        assert reduce["wire_bytes"] == 3 * (param_bytes + 4)  # 2(n-1)/n = 1 for n = 2
        broadcast = ledger[rank]["broadcast"]["dp"]
        assert broadcast["calls"] == len(tensors) and broadcast["bytes"] == param_bytes
    assert "all_reduce" in result.stdout  # the printed table


def test_parity_cli_json_and_exit_codes(corpus, tmp_path):
    common = ["parity", "--data", str(corpus), "--seq-len", "32", "--steps", "3",
              "--cache-dir", str(tmp_path / "cache"), "--json"]
    # exit 0 where it passes: the README's `scaletrain parity --nproc 2 --dp 2` (tests/test_readme.py)
    strict = run_cli(*common, "--nproc", "2", "--dp", "2", "--tolerance", "1e-30")
    assert strict.returncode == 1, strict.stderr
    report = json.loads(strict.stdout.strip().splitlines()[-1])
    assert report["pass"] is False and report["steps"] == 3 and report["layout"] == "dp2"
    assert report["max_loss_rel_diff"] <= 1e-5 and report["max_param_rel_diff"] <= 1e-5


def test_help_lists_the_contract_flags():
    result = run_cli("train", "--help")
    for flag in ("--config", "--model", "--data", "--steps", "--micro-batch", "--grad-accum", "--seq-len",
                 "--lr", "--seed", "--out", "--checkpoint-every", "--resume", "--nproc", "--dp", "--tp",
                 "--pp", "--cp", "--ep", "--timeout", "--report-comm"):
        assert flag in result.stdout


def test_torchrun_launch_prepares_on_rank_0(corpus, tmp_path):
    out = tmp_path / "run"
    args = _tiny(corpus, out)[1:]
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                             "--master-port", str(free_port()), "-m", "scaletrain", "train", *args],
                            capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("layout dp2 on 2 process(es)") == 1  # rank 0 speaks for the job
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 3


def test_torchrun_user_error_reaches_every_rank(corpus, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "other.txt").write_text("someone else's run")
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                             "--master-port", str(free_port()), "-m", "scaletrain", "train",
                             *_tiny(corpus, out)[1:]], capture_output=True, text=True, timeout=240)
    assert result.returncode != 0
    assert result.stderr.count("already holds another run") == 2  # both ranks stop with the sentence
    # torchrun's agent prints its own traceback for a failed child; none comes from our code
    assert 'scaletrain/' not in "".join(l for l in result.stderr.splitlines() if l.strip().startswith("File"))


def _ompi_env(rank: int, world: int, port: int) -> dict:
    """The environment Open MPI's mpirun gives rank ``rank`` of a one-node job, and no torchrun variables."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    env.update(OMPI_COMM_WORLD_RANK=str(rank), OMPI_COMM_WORLD_SIZE=str(world),
               OMPI_COMM_WORLD_LOCAL_RANK=str(rank), OMPI_COMM_WORLD_LOCAL_SIZE=str(world),
               MASTER_PORT=str(port))
    return env


def test_open_mpi_environment_launches_like_torchrun(corpus, tmp_path):
    """What mpirun -np 2 does, process by process: the ranks come from OMPI_COMM_WORLD_*."""
    out = tmp_path / "run"
    port = free_port()
    command = [sys.executable, "-m", "scaletrain", *_tiny(corpus, out, "--report-comm")]
    workers = [subprocess.Popen(command, env=_ompi_env(rank, 2, port), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True) for rank in range(2)]
    outputs = [worker.communicate(timeout=240) for worker in workers]
    for worker, (_, stderr) in zip(workers, outputs):
        assert worker.returncode == 0, stderr[-3000:]
    assert outputs[0][0].count("layout dp2 on 2 process(es)") == 1 and not outputs[1][0].strip()
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 3
    assert set(json.loads((out / "comm.json").read_text())) == {"0", "1"}


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="Open MPI's mpirun is not installed")
def test_mpirun_launch(corpus, tmp_path):
    out = tmp_path / "run"
    env = {**os.environ, "MASTER_PORT": str(free_port())}
    result = subprocess.run(["mpirun", "-np", "2", "--oversubscribe", "--allow-run-as-root",
                             sys.executable, "-m", "scaletrain", *_tiny(corpus, out)],
                            capture_output=True, text=True, timeout=240, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("layout dp2 on 2 process(es)") == 1
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 3
