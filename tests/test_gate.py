"""The planner as a gate (planner/gate.py): scaletrain train, finetune and setup() stop a run
predicted not to fit this machine's memory in one sentence, before anything is allocated or
written, naming the nearest change that fits; --force (force=True) goes on; a run that fits is
let through."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

import scaletrain
from scaletrain.config import Config
from scaletrain.errors import UserError
from scaletrain.planner.fit import device_memory, machine_cluster
from scaletrain.planner.gate import Machine, check_module, check_run, run_vocab
from scaletrain.planner.predict import predict
from scaletrain.runtime.mesh import ParallelDims
from tests.conftest import run_cli

GIB = 2**30
LAPTOP = Machine(24 * GIB, on_gpu=False)
FIX = re.compile(r"; (.*) is predicted to fit \(([\d.]+) GiB\)")


def _refusal(cfg: Config, machine: Machine, world: int = 1) -> str:
    with pytest.raises(UserError) as refused:
        check_run(cfg, world, machine)
    return str(refused.value)


def _flags_to_fields(text: str) -> dict:
    """``--zero 3 --micro-batch 2`` back to configuration fields, numbers as numbers."""
    fields = {}
    for flag, value in re.findall(r"--([a-z-]+) (\S+)", text):
        fields[flag.replace("-", "_")] = int(value) if value.isdigit() else value
    return fields


@pytest.mark.parametrize("cfg, machine, fix", [
    (Config().replace(name="llama3.2-1b", seq_len=1024, micro_batch=8), LAPTOP,
     "--recompute full --micro-batch 2 --grad-accum 4"),
    (Config().replace(name="llama3-8b", seq_len=1024, micro_batch=4), Machine(80 * 10**9, on_gpu=True),
     "--recompute full --offload optimizer"),
    (Config().replace(name="llama3-8b", seq_len=512, micro_batch=4, precision="bf16", param_dtype="bf16",
                      base="a-base-run"), Machine(24 * GIB, on_gpu=True), "--lora-rank 16 --quantize nf4"),
], ids=["1b-on-a-laptop", "8b-on-an-h100", "8b-fine-tune-on-24gib"])
def test_a_run_too_big_is_refused_naming_the_nearest_change_that_fits(cfg, machine, fix):
    sentence = _refusal(cfg, machine)
    assert sentence.startswith("the planner predicts this run needs ") and sentence.endswith(
        "or give --force to start anyway.")
    found = FIX.search(sentence)
    assert found and found[1] == fix, sentence
    # the change named is one the planner really predicts to fit, at the figure said
    changed = cfg.replace(**_flags_to_fields(fix))
    total = predict(changed, 1, run_vocab(cfg), machine_cluster(1, machine.memory, machine.on_gpu)).memory["total"]
    assert total <= machine.memory and f"{total / GIB:.1f}" == found[2]


def test_where_nothing_on_this_machine_fits_more_machines_are_named_and_past_them_nothing():
    eight = _refusal(Config().replace(name="llama3-8b"), LAPTOP)
    assert re.search(r"--zero 3 .*on \d+ processes, each with as much memory as this one, is predicted to fit", eight)
    seventy = _refusal(Config().replace(name="llama3-70b", seq_len=1024), Machine(4 * GIB, on_gpu=False))
    assert "none of the changes the planner tried fits (the least, --zero 3" in seventy
    assert "take a smaller model or shorter sequences, or a machine with more memory" in seventy


def test_what_fits_passes_and_force_skips_the_gate():
    check_run(Config().replace(name="gpt-tiny", seq_len=32, micro_batch=4, nproc=2, dp=2), 2, LAPTOP)
    check_run(Config().replace(name="llama3-70b", force=True), 1, LAPTOP)
    check_run(Config().replace(name="mlp"), 1, Machine(1, on_gpu=False))  # the classifier is not planned
    # --micro-batch auto: priced at one sequence, which fits where 16 would not
    auto = Config().replace(name="llama3.2-1b", seq_len=1024, micro_batch="auto", recompute="full")
    check_run(auto, 1, LAPTOP)
    with pytest.raises(UserError):
        check_run(auto.replace(micro_batch=16), 1, LAPTOP)


def test_train_stops_in_one_sentence_before_writing_anything(tmp_path):
    """The command's gate, on this machine: the sentence the planner gives for it, exit code 2, no
    run folder, before any data is read (the data named does not exist)."""
    cfg = Config().replace(name="llama3-8b")
    machine = Machine.here(on_gpu=torch.cuda.is_available(), processes=1)  # train's default device
    predicted = predict(cfg, 1, run_vocab(cfg), machine_cluster(1, machine.memory, machine.on_gpu)).memory["total"]
    if predicted <= machine.memory:
        pytest.skip(f"this device's {machine.memory / GIB:.0f} GiB hold an 8B model's training")
    done = run_cli("train", "--model", "llama3-8b", "--data", str(tmp_path / "missing.txt"), cwd=tmp_path)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip() == f"scaletrain train: {_refusal(cfg, machine)}"
    assert list(tmp_path.iterdir()) == []  # no runs/ folder, no cache
    forced = run_cli("train", "--model", "llama3-8b", "--force", "--data", str(tmp_path / "missing.txt"), cwd=tmp_path)
    # past the gate, the next check speaks: the data, before any model is built
    assert forced.returncode == 2 and "missing.txt does not exist" in forced.stderr
    assert "the planner predicts" not in forced.stderr and list(tmp_path.iterdir()) == []


def test_a_small_run_goes_through(corpus, tmp_path):
    done = run_cli("train", "--model", "gpt-tiny", "--data", str(corpus), "--seq-len", "16", "--micro-batch", "2",
                   "--steps", "1", "--eval-every", "0", "--sample-tokens", "0", "--no-progress", "--out",
                   str(tmp_path / "run"), "--cache-dir", str(tmp_path / "cache"))
    assert done.returncode == 0, done.stderr[-2000:]
    assert (tmp_path / "run" / "metrics.jsonl").is_file()


# -- the library: a module priced from its parameters -------------------------------
def _blocks(width: int = 1024, depth: int = 8) -> nn.Module:
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)])


def test_a_module_is_priced_from_its_parameters_and_zero_shards_it():
    model = _blocks()  # 8.4M weights: 134 MB of fp32 AdamW
    one, four = ParallelDims.infer(1), ParallelDims.infer(4)
    check_module(model, Config(), one, Machine(GIB, on_gpu=False))
    with pytest.raises(UserError, match=r"^setup\(\): the module's weights, gradients and optimizer state alone are "
                                        r"predicted to need 128.1 MiB per process \(weights 32.0 MiB, gradients 32.0 "
                                        r"MiB, optimizer state 64.1 MiB\), more than the 64.0 MiB") as refused:
        check_module(model, Config(), one, Machine(64 * 2**20, on_gpu=False))
    pure_bf16_8bit = "precision='bf16', param_dtype='bf16', reduce_dtype='bf16', masters='none', optimizer='adamw8bit'"
    assert str(refused.value).endswith(f"; {pure_bf16_8bit} is predicted to fit (48.1 MiB), or pass force=True to "
                                      f"go on.")
    # over four data-parallel copies ZeRO-3 keeps a quarter of the weights and their state on each
    with pytest.raises(UserError, match=r"; zero=3 is predicted to fit \(48.0 MiB\)"):
        check_module(model, Config(), four, Machine(64 * 2**20, on_gpu=False))
    check_module(model, Config().replace(zero=3), four, Machine(64 * 2**20, on_gpu=False))


def _paper_giant(machine_bytes: int) -> nn.Module:
    """A module whose frozen weight is larger than this machine on paper (an expanded tensor: one
    element of storage), beside a small trained layer."""
    model = nn.Linear(8, 8)
    model.giant = nn.Parameter(torch.zeros(1).expand(machine_bytes // 2), requires_grad=False)
    return model


def test_setup_refuses_a_module_too_big_for_this_machine_unless_forced():
    model = _paper_giant(device_memory(torch.device("cpu"), 1))
    # on the CPU (gloo) whatever the machine: a GPU would copy the expanded weight whole
    with pytest.raises(UserError, match=r"^setup\(\): the module's weights, gradients and optimizer state alone"):
        scaletrain.setup(model, backend="gloo")
    with scaletrain.setup(model, force=True, backend="gloo") as engine:  # past the gate: the engine is built
        assert engine.world_size == 1
