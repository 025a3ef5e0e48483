"""Ctrl-C on a real run, sent as a terminal sends it (SIGINT to the whole process group): one
line naming the step and the newest checkpoint, exit code 130, no traceback from any process."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from scaletrain.job.interrupt import interrupted_sentence
from scaletrain.train.checkpoint import latest_checkpoint

INTERRUPTED = re.compile(r"scaletrain train: interrupted at step (\d+); the newest checkpoint is (\S+); "
                         r"rerun with --resume\.")


@pytest.mark.parametrize("nproc", [(), ("--nproc", "2")], ids=["one process", "nproc 2"])
def test_ctrl_c_ends_in_one_line_naming_the_newest_checkpoint(nproc, corpus, tmp_path):
    out = tmp_path / "run"
    run = subprocess.Popen(
        [sys.executable, "-m", "scaletrain", "train", "--model", "gpt-tiny", "--seq-len", "32", "--micro-batch", "2",
         "--steps", "1000", "--checkpoint-every", "1", "--eval-every", "0", "--sample-tokens", "0", "--no-progress",
         *nproc, "--data", str(corpus), "--out", str(out), "--cache-dir", str(tmp_path / "cache")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + 180
    while latest_checkpoint(out) is None:
        assert run.poll() is None and time.monotonic() < deadline, run.communicate()
        time.sleep(0.05)
    os.killpg(run.pid, signal.SIGINT)  # the launching process, the agent in it, and every worker
    stdout, stderr = run.communicate(timeout=120)
    assert run.returncode == 130, stderr
    assert "Traceback" not in stdout + stderr, stderr
    said = INTERRUPTED.fullmatch(_ours(stderr)[-1])
    assert said, stderr
    assert said.group(2) == str(latest_checkpoint(out))
    recorded = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines() if line]
    assert int(said.group(1)) == recorded[-1] >= int(latest_checkpoint(out).name.removeprefix("step_"))


def _ours(stderr: str) -> list[str]:
    """stderr's lines but for the warning Python's multiprocessing resource tracker may print at its own exit
    when a worker the signal stopped held a semaphore (its file's line and the source line it quotes)."""
    lines = stderr.strip().splitlines()
    tracker = [i for i, line in enumerate(lines) if "multiprocessing/resource_tracker.py" in line]
    return [line for i, line in enumerate(lines) if not any(i in (t, t + 1) for t in tracker)]


def test_an_interrupt_before_the_first_checkpoint_says_there_is_nothing_to_resume(tmp_path):
    (tmp_path / "config.toml").write_text("")
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n{"st')  # the last line cut short
    assert interrupted_sentence(tmp_path) == (f"interrupted at step 2, before the first checkpoint, so there is "
                                              f"nothing to resume; delete {tmp_path} and run the same command again.")
    assert "before the first step" in interrupted_sentence(tmp_path / "never-written")
