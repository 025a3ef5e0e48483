"""The examples of examples/, run as a user runs them: under ``scaletrain run --nproc N`` and
under torchrun, each layout's learning curve and final weights equal to one process with the
same global batch (parity's rule: relative 1e-5, the whole model's weights at once)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from scaletrain.commands.parity import relative_diffs
from scaletrain.runtime.launch import free_port
from scaletrain.train import checkpoint as ckpt
from tests.readme import readme_argv

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
TOLERANCE = 1e-5


def _run(launcher: list[str], script: str, out: Path, *args: str) -> tuple[list[float], dict]:
    result = subprocess.run([*launcher, str(EXAMPLES / script), "--out", str(out), *args],
                            capture_output=True, text=True, timeout=400)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("step ") == 1, result.stdout  # the main rank alone reports
    if (out / "metrics.jsonl").exists():  # a record per step
        losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    else:  # the learning curve at the end
        losses = json.loads((out / "losses.json").read_text())
    return losses, ckpt.read_model_tensors(ckpt.latest_checkpoint(out))


def torchrun(nproc: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
            "--master-port", str(free_port())]


def assert_parity(reference: tuple[list[float], dict], layout: tuple[list[float], dict]) -> None:
    (ref_losses, ref_weights), (losses, weights) = reference, layout
    assert len(losses) == len(ref_losses)
    assert max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)) < TOLERANCE
    assert relative_diffs(weights, ref_weights)[1] < TOLERANCE
    assert ref_losses[-1] < ref_losses[0]  # it learns


def readme_run(command: str, out: Path, *args: str) -> tuple[list[float], dict]:
    """One of the README's ``scaletrain run`` lines, as written, with ``args`` after it."""
    words = readme_argv(command)
    script = next(word for word in words if word.startswith("examples/"))
    launcher, flags = words[:words.index(script)], words[words.index(script) + 1:]
    return _run([sys.executable, "-m", *launcher], Path(script).name, out, *flags, *args)


def test_digits_made_data_parallel_learns_as_one_process(tmp_path):
    steps = ("--steps", "12")
    reference = _run([sys.executable], "digits.py", tmp_path / "one", *steps)
    assert_parity(reference, readme_run("scaletrain run --nproc 2 examples/digits.py", tmp_path / "dp2", *steps))


def test_own_transformer_under_tensor_parallelism_and_zero3(tmp_path):
    steps = ("--steps", "4", "--batch", "8")
    reference = _run([sys.executable], "transformer.py", tmp_path / "one", *steps)
    assert_parity(reference, readme_run("scaletrain run --nproc 4 examples/transformer.py --tp 2 --zero 3",
                                        tmp_path / "tp2-zero3", *steps))


def test_transformers_model_under_zero3_and_dp(tmp_path):
    pytest.importorskip("transformers")
    steps = ("--steps", "4", "--batch", "8")
    reference = _run([sys.executable], "hf_causal_lm.py", tmp_path / "one", *steps, "--zero", "0")
    assert_parity(reference, readme_run("scaletrain run --nproc 2 examples/hf_causal_lm.py --zero 3",
                                        tmp_path / "zero3", *steps))


@pytest.mark.slow
def test_the_examples_under_torchrun(tmp_path):
    """The digits under ZeRO-3, the transformer's pipeline and the transformers model's plain dp,
    under torchrun: `python3 -m pytest -m slow tests/test_examples.py`."""
    pytest.importorskip("transformers")
    digits = ("--steps", "12")
    reference = _run([sys.executable], "digits.py", tmp_path / "digits-one", *digits)
    assert_parity(reference, _run(torchrun(2), "digits.py", tmp_path / "digits-zero3", *digits, "--zero", "3"))
    steps = ("--steps", "4", "--batch", "8")
    reference = _run([sys.executable], "transformer.py", tmp_path / "one", *steps)
    assert_parity(reference, _run(torchrun(2), "transformer.py", tmp_path / "pp2", *steps, "--pp", "2"))
    reference = _run([sys.executable], "hf_causal_lm.py", tmp_path / "hf-one", *steps, "--zero", "0")
    assert_parity(reference, _run(torchrun(2), "hf_causal_lm.py", tmp_path / "dp2", *steps, "--zero", "0"))
