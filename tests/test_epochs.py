"""``--epochs N`` (run_length.py): the steps derived from the training split's rows and the global
batch, said in one line as the run starts and recorded in config.toml, before any worker starts;
refused beside ``--steps``; kept by a resume and by a restarted job, derived anew only from an
``--epochs`` given again."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys

import pytest
import tomllib

from scaletrain.commands.cli import main
from scaletrain.job.metrics import read_metrics
from scaletrain.runtime import free_port

QUIET = ["--warmup-steps", "1", "--eval-every", "0", "--eval-batches", "1", "--sample-tokens", "0", "--no-progress"]
PACKED = re.compile(r"^(\d+) examples -> (\d+) rows \(packed\) -> (\d+) steps per epoch; --epochs 2: (\d+) steps of "
                    r"4 sequences$", re.M)
WINDOWS = re.compile(r"^([\d,]+) tokens -> ([\d,]+) windows -> (\d+) steps per epoch; --epochs ([\d.]+): (\d+) steps "
                     r"of (\d+) sequences$", re.M)


def text_run(corpus, run, *extra: str) -> list[str]:
    return ["train", "--model", "gpt-tiny", "--data", str(corpus), "--seq-len", "32", "--out", str(run),
            "--cache-dir", str(run.parent / "cache"), *QUIET, *extra]


def saved(run) -> dict:
    return tomllib.loads((run / "config.toml").read_text())["train"]


def test_epochs_of_packed_instruction_rows(tmp_path, capsys):
    """40 Alpaca records, one held out: 39 examples packed into fewer rows of 128 tokens; two
    epochs of 2 x 2 sequences a step are ceil(2 x rows / 4) steps, each recorded."""
    records = tmp_path / "alpaca.jsonl"
    records.write_text("".join(json.dumps({"instruction": f"Add {i} and {i + 1}.", "input": "",
                                           "output": str(2 * i + 1)}) + "\n" for i in range(40)))
    run = tmp_path / "run"
    assert main(["train", "--model", "gpt-tiny", "--data", str(records), "--sft", "--seq-len", "128",
                 "--micro-batch", "2", "--grad-accum", "2", "--epochs", "2", "--out", str(run),
                 "--cache-dir", str(tmp_path / "cache"), *QUIET]) == 0
    out = capsys.readouterr().out
    (examples, rows, per_epoch, steps), = [tuple(map(int, m)) for m in PACKED.findall(out)]
    assert examples == 39 and rows < examples  # several examples a row
    assert (per_epoch, steps) == (math.ceil(rows / 4), math.ceil(2 * rows / 4))
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == list(range(1, steps + 1))
    assert saved(run)["steps"] == steps and saved(run)["epochs"] == 2.0


def test_epochs_of_text_windows_over_two_data_parallel_ranks(corpus, tmp_path, capfd):
    """A text stream's windows, read by 2 ranks of 8 sequences: the global batch is 16, and the
    launching process settles the steps before the workers start."""
    run = tmp_path / "run"
    assert main(text_run(corpus, run, "--epochs", "0.05", "--micro-batch", "8", "--nproc", "2")) == 0
    out = capfd.readouterr().out
    (tokens, windows, per_epoch, epochs, steps, batch), = WINDOWS.findall(out)
    tokens, windows = int(tokens.replace(",", "")), int(windows.replace(",", ""))
    size = len(corpus.read_bytes())  # bytes, the plain text's tokens; the last 2% (at least 33) validate
    assert tokens == size - max(int(size * 0.02), 33) and windows == (tokens - 1) // 32
    assert (epochs, int(batch)) == ("0.05", 16)
    assert (int(per_epoch), int(steps)) == (math.ceil(windows / 16), math.ceil(0.05 * windows / 16))
    assert len(read_metrics(run / "metrics.jsonl")) == int(steps) == saved(run)["steps"]


@pytest.mark.parametrize("flags,toml,said", [
    (["--epochs", "2", "--steps", "3"], None, "--epochs 2 and --steps 3 both set how long the run trains; give one "
                                              "of them."),
    ([], "epochs = 1.5\nsteps = 3\n", "--epochs 1.5 and --steps 3 both set how long the run trains"),
    (["--epochs", "0"], None, "--epochs must be positive, not 0.0."),
    (["--epochs", "-1"], None, "--epochs must be positive, not -1.0."),
    (["--epochs", "1", "--micro-batch", "auto"], None, "--epochs counts steps of the global batch, which "
                                                       "--micro-batch auto settles only once the run has started"),
], ids=["with-steps", "both-in-toml", "zero", "negative", "micro-batch-auto"])
def test_a_bad_epochs_is_refused_in_one_sentence_before_any_work(corpus, tmp_path, capsys, flags, toml, said):
    run = tmp_path / "run"
    if toml:
        (tmp_path / "run.toml").write_text(toml)
        flags = ["--config", str(tmp_path / "run.toml")]
    assert main(text_run(corpus, run, *flags)) == 2
    captured = capsys.readouterr()
    assert said in captured.err and len(captured.err.strip().splitlines()) == 1
    assert captured.out == "" and not run.exists() and not (tmp_path / "cache").exists()


def test_a_resume_reaches_the_runs_steps_and_only_new_epochs_derive_more(corpus, tmp_path, capsys):
    """Stopped at step 4 of 0.1 epoch's 9 steps, the resumed run ends at step 9 with the learning rates
    (the schedule over 9 steps) and losses of the run never stopped; --epochs 0.2 given again goes on to 18."""
    epoch = ["--epochs", "0.1", "--micro-batch", "16"]
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    assert main(text_run(corpus, straight, *epoch)) == 0
    assert main(text_run(corpus, stopped, *epoch, "--stop-at", "4")) == 0
    capsys.readouterr()
    assert main(text_run(corpus, stopped, "--resume")) == 0
    assert "steps per epoch" not in capsys.readouterr().out  # the saved steps, not derived again
    records, expected = read_metrics(stopped / "metrics.jsonl"), read_metrics(straight / "metrics.jsonl")
    assert [r["step"] for r in records] == [r["step"] for r in expected] == list(range(1, 10))
    assert [r["lr"] for r in records] == [r["lr"] for r in expected]
    assert [r["loss"] for r in records] == pytest.approx([r["loss"] for r in expected], rel=1e-6)
    assert main(text_run(corpus, stopped, "--resume", "--epochs", "0.2")) == 0
    assert "--epochs 0.2: 18 steps of 16 sequences" in capsys.readouterr().out
    assert len(read_metrics(stopped / "metrics.jsonl")) == 18 == saved(stopped)["steps"]
    assert main(text_run(corpus, stopped, "--resume", "--steps", "20")) == 0  # --steps ends the epochs
    assert len(read_metrics(stopped / "metrics.jsonl")) == 20 and "epochs" not in saved(stopped)


def test_a_restarted_job_goes_on_to_the_steps_its_first_attempt_derived(corpus, tmp_path):
    """Under torchrun every process runs the command as typed (--epochs, no steps): killed in step 5,
    the restarted attempt takes the steps the first one saved and continues from step_000004."""
    run = tmp_path / "run"
    env = {**os.environ, "SCALETRAIN_FAULT": "kill rank=0 step=5 at=micro-batch", "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1",
                             "--max-restarts", "1", "--master-port", str(free_port()), "-m", "scaletrain",
                             *text_run(corpus, run, "--epochs", "0.1", "--micro-batch", "16", "--checkpoint-every",
                                       "2")], capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resumed from checkpoint step_000004" in result.stdout
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == list(range(1, 10)) and saved(run)["steps"] == 9


@pytest.mark.numerics
def test_parity_holds_over_the_derived_steps_with_a_linear_schedule(corpus, tmp_path, capfd):
    """dp 2 with ZeRO-1 against one device reading the same global batch of 8: both derive the same
    steps from --epochs, and decay linearly over them."""
    assert main(["parity", "--data", str(corpus), "--seq-len", "32", "--micro-batch", "4", "--epochs", "0.02",
                 "--lr-schedule", "linear", "--nproc", "2", "--dp", "2", "--zero", "1",
                 "--cache-dir", str(tmp_path / "cache"), "--json"]) == 0
    out = capfd.readouterr().out
    report = json.loads(out.strip().splitlines()[-1])
    windows = int(WINDOWS.findall(out)[0][1].replace(",", ""))
    assert report["pass"] and report["steps"] == math.ceil(0.02 * windows / 8)
