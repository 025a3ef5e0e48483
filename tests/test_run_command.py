"""``scaletrain run``: a user's own script on N processes, under every launcher, failures named.

The scripts here use torch.distributed alone, as a user's would: what they rely on is the
place ``scaletrain run`` gives each process (the variables ``init_process_group`` reads),
the arguments passed through, and the failure reports and restarts of the command.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from scaletrain.commands.cli import main
from scaletrain.runtime import free_port

ALL_REDUCE = '''
import sys
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
total = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(total)
attempt = __import__("os").environ.get("TORCHELASTIC_RESTART_COUNT", "0")
with open(f"{sys.argv[1]}/rank{dist.get_rank()}.txt", "w") as f:
    f.write(f"{total.item():g} {dist.get_world_size()} {attempt} {' '.join(sys.argv[2:])}")
dist.barrier()
dist.destroy_process_group()
'''


def _script(folder: Path, text: str, name: str = "train.py") -> Path:
    path = folder / name
    path.write_text(text)
    return path


def _written(folder: Path) -> dict[str, str]:
    return {p.name: p.read_text() for p in sorted(folder.glob("rank*.txt"))}


def test_a_script_runs_on_n_processes_with_its_arguments(tmp_path):
    script = _script(tmp_path, ALL_REDUCE)
    assert main(["run", "--nproc", "2", str(script), str(tmp_path), "--epochs", "3"]) == 0
    assert _written(tmp_path) == {"rank0.txt": "3 2 0 --epochs 3", "rank1.txt": "3 2 0 --epochs 3"}


def test_a_script_alone_is_a_world_of_one(tmp_path):
    script = _script(tmp_path, ALL_REDUCE)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "SLURM", "OMPI", "PMI"))}
    env["MASTER_PORT"] = str(free_port())
    done = subprocess.run([sys.executable, "-m", "scaletrain", "run", str(script), str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert _written(tmp_path) == {"rank0.txt": "1 1 0 "}


def test_under_slurm_the_same_script_finds_its_place(tmp_path):
    """Two tasks as srun starts them (SLURM_* only): each becomes a rank of one world."""
    script = _script(tmp_path, ALL_REDUCE)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "MASTER", "LOCAL"))}
    slurm = {"SLURM_NTASKS": "2", "SLURM_TASKS_PER_NODE": "2", "SLURM_JOB_NODELIST": "localhost",
             "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    tasks = [subprocess.Popen([sys.executable, "-m", "scaletrain", "run", str(script), str(tmp_path)],
                              env={**base, **slurm, "SLURM_PROCID": str(i), "SLURM_LOCALID": str(i)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    for task in tasks:
        _, err = task.communicate(timeout=120)
        assert task.returncode == 0, err
    assert _written(tmp_path) == {"rank0.txt": "3 2 0 ", "rank1.txt": "3 2 0 "}


def test_a_failing_rank_is_named_with_its_traceback(tmp_path, capsys):
    script = _script(tmp_path, "import os\nif os.environ['RANK'] == '1':\n    raise ValueError('bad shape')\n")
    assert main(["run", "--nproc", "2", str(script)]) == 1
    err = capsys.readouterr().err
    assert "rank 1" in err and "ValueError: bad shape" in err


def test_a_failed_attempt_is_restarted_and_told_its_number(tmp_path):
    failing_once = ALL_REDUCE.replace("dist.init_process_group", "import os\n"
                                      "if os.environ['TORCHELASTIC_RESTART_COUNT'] == '0' and "
                                      "os.environ['RANK'] == '0':\n    raise SystemExit(3)\n"
                                      "dist.init_process_group", 1)
    script = _script(tmp_path, failing_once)
    assert main(["run", "--nproc", "2", "--max-restarts", "1", str(script), str(tmp_path)]) == 0
    assert _written(tmp_path) == {"rank0.txt": "3 2 1 ", "rank1.txt": "3 2 1 "}


def test_mistakes_are_one_sentence(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("x")
    for argv, phrase in ((["run", str(tmp_path / "missing.py")], "does not exist"),
                         (["run", str(tmp_path / "notes.txt")], "is not a .py file"),
                         (["run", "--nproc", "0", str(_script(tmp_path, "pass\n"))], "--nproc is 0")):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and phrase in err, err
