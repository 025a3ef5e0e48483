"""``--micro-batch auto`` (planner/fit.py): the largest power of two the planner predicts to fit,
taken by every rank, reported beside the run's measured peak; refused where it has no meaning."""

from __future__ import annotations

import re

import pytest
import torch

from scaletrain.data import ByteTokenizer
from scaletrain.config import Config
from scaletrain.errors import UserError
from scaletrain.planner.fit import LARGEST, device_memory, largest_fitting
from scaletrain.planner.hardware import Cluster, cpu_device
from scaletrain.planner.predict import predict
from tests.conftest import run_cli

VOCAB = ByteTokenizer().vocab_size  # the byte tokenizer's


def _predicted(cfg: Config, micro_batch: int, memory: int) -> int:
    cluster = Cluster(cpu_device(1.0, memory), 1, 1)
    return predict(cfg.replace(micro_batch=micro_batch), 1, VOCAB, cluster).memory["total"]


def test_the_largest_power_of_two_that_fits_is_taken():
    cfg = Config().replace(name="llama-tiny", seq_len=64)
    four, eight = _predicted(cfg, 4, 2**40), _predicted(cfg, 8, 2**40)
    assert four < eight
    memory = (four + eight) // 2  # room for four sequences, not for eight
    chosen, predicted = largest_fitting(cfg, 1, VOCAB, memory, on_gpu=False)
    assert (chosen, predicted["total"]) == (4, _predicted(cfg, 4, memory))
    assert largest_fitting(cfg, 1, VOCAB, 2**40, on_gpu=False)[0] == LARGEST


def test_a_device_too_small_for_one_sequence_is_one_sentence():
    cfg = Config().replace(name="llama-tiny", seq_len=64)
    with pytest.raises(UserError, match=r"even one sequence per micro-batch is predicted to need .* GiB"):
        largest_fitting(cfg, 1, VOCAB, _predicted(cfg, 1, 2**40) // 2, on_gpu=False)


def test_a_run_takes_the_planners_choice_on_every_rank_and_reports_its_peak(corpus, tmp_path):
    done = run_cli("train", "--model", "llama-tiny", "--data", str(corpus), "--seq-len", "16", "--micro-batch", "auto",
                   "--nproc", "2", "--zero", "3", "--steps", "2", "--eval-every", "0", "--sample-tokens", "0",
                   "--no-progress", "--out", str(tmp_path / "run"), "--cache-dir", str(tmp_path / "cache"))
    assert done.returncode == 0, done.stderr[-2000:]
    chosen = re.search(r"--micro-batch auto: (\d+), the largest power of two", done.stdout)
    reported = re.search(r"--micro-batch auto: (\d+); weights, gradients, optimizer state and activations predicted "
                         r"([\d.]+) GiB on the busiest rank, measured ([\d.]+) GiB on rank 0's first step", done.stdout)
    assert chosen and reported and chosen[1] == reported[1] and float(reported[3]) > 0
    assert (tmp_path / "run" / "memory.json").is_file()  # the first step, measured by the ledger
    # the choice is the planner's for this layout and this machine's memory, shared by two processes
    cfg = Config().replace(name="llama-tiny", seq_len=16, dp=2, zero=3)
    expected, _ = largest_fitting(cfg, 2, VOCAB, device_memory(torch.device("cpu"), 2), on_gpu=False)
    assert int(chosen[1]) == expected
    steps = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert len(steps) == 2


@pytest.mark.parametrize("args, phrase", [
    (["train", "--model", "mlp", "--micro-batch", "auto"], "plans a decoder's memory; give the mlp a number"),
    (["parity", "--micro-batch", "auto"], "parity needs a number, such as --micro-batch 8"),
    (["train", "--micro-batch", "most"], "invalid value 'most': give a whole number or 'auto'"),
], ids=["mlp", "parity", "word"])
def test_where_auto_means_nothing_it_is_refused_in_one_sentence(args, phrase, tmp_path):
    done = run_cli(*args, "--out", str(tmp_path / "run"), cwd=tmp_path)
    assert done.returncode == 2 and phrase in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "run").exists()


def test_the_library_refuses_auto():
    from scaletrain.library_checks import engine_config

    with pytest.raises(UserError, match="setup\\(\\) needs a number"):
        engine_config({"micro_batch": "auto"})
