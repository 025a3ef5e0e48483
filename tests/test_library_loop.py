"""The library's loop as a user writes it (docs/library.md): resume that cannot go wrong, a
loop that ends, a word for settings that do nothing, and check_parity on a model with dropout."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import scaletrain
from scaletrain import UserError
from scaletrain.config_checks import setting_warnings
from scaletrain.library_checks import engine_config

DOCS = Path(__file__).resolve().parent.parent / "docs" / "library.md"


def docs_script() -> str:
    """The first Python block of docs/library.md: the loop a user copies."""
    return re.search(r"^```python\n(.*?)^```", DOCS.read_text(), re.S | re.M).group(1)


def _printed_records(stdout: str) -> dict[int, float]:
    """The records the script printed, the last one of each step (a restarted job prints some twice)."""
    records = [ast.literal_eval(line) for line in stdout.splitlines() if line.startswith("{'step'")]
    return {record["step"]: record["loss"] for record in records}


# Not in the portable-kernel rerun (marker numerics): the library's exact resume is rerun there by
# tests/test_library_loop.py's sampler cases below, on the same engine.
def test_the_docs_loop_runs_as_written_and_resumes_exactly(tmp_path):
    """docs/library.md's script, copied as it stands (its loader built before ``engine.load``),
    on two processes: straight, and with rank 1 killed in step 55 and the job restarted, the
    script resuming from its step-40 checkpoint. The loop ends by itself at step 120 both times,
    and the resumed run's losses are the straight run's: the sampler read on from step 40."""
    (tmp_path / "train.py").write_text(docs_script())
    runs = {}
    for name, fault in (("straight", ""), ("killed", "kill rank=1 step=55")):
        (tmp_path / name).mkdir()
        result = subprocess.run([sys.executable, "-m", "scaletrain", "run", "--nproc", "2", "--max-restarts", "1",
                                 str(tmp_path / "train.py")], cwd=tmp_path / name, capture_output=True, text=True,
                                timeout=300, env={**os.environ, "SCALETRAIN_FAULT": fault})
        assert result.returncode == 0, result.stderr[-3000:]
        runs[name] = _printed_records(result.stdout)
    assert sorted(runs["straight"]) == list(range(10, 121, 10))
    assert sorted(runs["killed"]) == list(range(10, 121, 10))
    assert [runs["killed"][s] for s in range(50, 121, 10)] == \
        pytest.approx([runs["straight"][s] for s in range(50, 121, 10)], rel=1e-6)


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


DATA = TensorDataset(torch.randn(96, 8, generator=torch.Generator().manual_seed(0)),
                     torch.randint(0, 4, (96,), generator=torch.Generator().manual_seed(1)))
OPTIONS = dict(lr=0.05, steps=6, warmup_steps=1, grad_accum=2, seed=3)


def _train(engine, loader, until: int | None = None) -> list[float]:
    """The docs' loop: forward, backward per micro-batch, step when ready; ``until`` stops early."""
    losses = []
    for x, y in loader:
        engine.backward(F.cross_entropy(engine(x), y))
        if engine.ready:
            losses.append(engine.step()["loss"])
            if engine.steps_done == until:
                break
    return losses


@pytest.mark.numerics
@pytest.mark.parametrize("sampler_first", [True, False], ids=["sampler-before-load", "sampler-after-load"])
def test_resume_reads_on_whether_the_sampler_was_built_before_load_or_after(tmp_path, sampler_first):
    torch.manual_seed(0)
    with scaletrain.setup(mlp(), **OPTIONS) as engine:
        straight = _train(engine, DataLoader(DATA, batch_size=4, sampler=engine.sampler(len(DATA), 4)))
    torch.manual_seed(0)
    with scaletrain.setup(mlp(), **OPTIONS) as engine:
        first = _train(engine, DataLoader(DATA, batch_size=4, sampler=engine.sampler(len(DATA), 4)), until=2)
        engine.save(tmp_path)
    torch.manual_seed(0)
    with scaletrain.setup(mlp(), **OPTIONS) as engine:
        if sampler_first:
            loader = DataLoader(DATA, batch_size=4, sampler=engine.sampler(len(DATA), 4))
            engine.load(tmp_path)
        else:
            engine.load(tmp_path)
            loader = DataLoader(DATA, batch_size=4, sampler=engine.sampler(len(DATA), 4))
        resumed = _train(engine, loader)
    assert len(straight) == 6 and len(first) == 2 and len(resumed) == 4  # each loop ended at steps=6
    assert first + resumed == pytest.approx(straight, rel=1e-6)


def test_load_while_the_loader_is_reading_is_refused(tmp_path):
    with scaletrain.setup(mlp(), **OPTIONS) as engine:
        engine.save(tmp_path)
        batches = iter(DataLoader(DATA, batch_size=4, sampler=engine.sampler(len(DATA), 4)))
        next(batches)
        with pytest.raises(UserError, match=r"engine.load\(\) came while a loader over engine.sampler\(\) was "
                                            r"reading from micro-batch 0"):
            engine.load(tmp_path)
        del batches  # the loop left: loading is fine again
        assert engine.load(tmp_path) == {}


def test_the_loop_ends_at_steps_or_after_the_epochs():
    with scaletrain.setup(mlp(), **OPTIONS) as engine:
        loader = DataLoader(DATA, batch_size=4, sampler=engine.sampler(len(DATA), 4))
        assert len(loader) == 6 * 2  # steps x grad_accum micro-batches
        assert len(_train(engine, loader)) == 6
        assert list(loader) == []  # the run's data is read: nothing more
    with scaletrain.setup(mlp(), **{**OPTIONS, "steps": 100}) as engine:
        # 96 items hold 24 micro-batches of 4 per epoch: 12 steps of 2, two epochs 24 steps
        loader = DataLoader(DATA, batch_size=4, sampler=engine.sampler(len(DATA), 4, epochs=2))
        assert len(_train(engine, loader)) == 24
        with pytest.raises(UserError, match=r"holds 1 micro-batch\(es\), fewer than one step's 2"):
            engine.sampler(len(DATA), 64, epochs=1)


def test_a_step_past_steps_says_so_once():
    with scaletrain.setup(mlp(), **OPTIONS) as engine:
        x, y = DATA[:4]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(9):
                engine.train_step([(x, y), (x, y)], F.cross_entropy)
        said = [str(w.message) for w in caught if "past steps" in str(w.message)]
        assert said == ["step 7 is past steps=6, where the learning-rate schedule ends (it stays at its floor, "
                        "min_lr_ratio x lr); give setup(steps=...) the run's length."]


def test_settings_that_do_nothing_are_said_at_setup():
    with pytest.warns(UserWarning, match=r"warmup_steps=20 \(--warmup-steps\) is not below steps=10, so the "
                                         r"learning rate never reaches lr=0.001"):
        scaletrain.setup(mlp(), steps=10).close()
    with pytest.warns(UserWarning, match=r"momentum is SGD's, but the optimizer is adamw"):
        scaletrain.setup(mlp(), momentum=0.5, warmup_steps=1).close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the defaults, and a momentum SGD takes, say nothing
        scaletrain.setup(mlp(), optimizer="sgd", momentum=0.5).close()
    # the command prints the same sentences (commands/train.py), of the flags' values
    assert setting_warnings(engine_config({"steps": 5})) == [
        "warmup_steps=20 (--warmup-steps) is not below steps=5, so the learning rate never reaches lr=0.001; lower "
        "warmup_steps or raise steps."]


def dropout_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Dropout(0.5), nn.Linear(32, 4))


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    return torch.randn(16, 8, generator=generator), torch.randint(0, 4, (16,), generator=generator)


@pytest.mark.slow  # about 15 s; check_parity's own runs by default: tests/test_library.py
@pytest.mark.numerics
def test_check_parity_switches_dropout_off_and_says_so():
    """Two ranks draw other masks than one process, so a model with dropout cannot match it: by
    default both runs switch dropout off, which the report says; kept, the runs differ, and the
    report says why."""
    report = scaletrain.check_parity(dropout_mlp, global_batch, F.cross_entropy, nproc=2, steps=2, lr=0.05,
                                     warmup_steps=1)
    assert report.passed, scaletrain.format_parity(report)
    assert "note: dropout 0.5 switched off in both runs" in scaletrain.format_parity(report)
    kept = scaletrain.check_parity(dropout_mlp, global_batch, F.cross_entropy, nproc=2, steps=2, lr=0.05,
                                   warmup_steps=1, dropout=True)
    assert not kept.passed
    assert json.dumps(kept.to_json()["notes"]).startswith('["dropout 0.5 kept: each rank draws its own masks')


def test_the_docs_give_every_option_with_its_default():
    """docs/library.md's table of options names each of setup's options as ``name=default``."""
    import dataclasses

    from scaletrain.config import FinetuneConfig, ParallelConfig, TrainConfig
    from scaletrain.library_checks import ENGINE_OPTIONS

    text = DOCS.read_text()
    section = text[text.index("## The options are the command's flags"):text.index("## Plans:")]
    defaults = {f.name: f.default for cls in (TrainConfig, ParallelConfig, FinetuneConfig)
                for f in dataclasses.fields(cls)}
    defaults["lora_targets"] = None  # the library's: the plan's Column and Row layers (library_lora.py)
    missing = [name for name in ENGINE_OPTIONS
               if f"`{name}={json.dumps(defaults[name]) if isinstance(defaults[name], str) else defaults[name]}`"
               not in section]
    assert not missing, f"docs/library.md's options table lacks (or gives another default for) {missing}"


class ConvBlocks(nn.Module):
    """A user's convolutional network, its repeated blocks in an nn.ModuleList and no attention."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Conv1d(4, 4, 3, padding=1), nn.Tanh()) for _ in range(3))
        self.head = nn.Linear(4 * 8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x.flatten(1))


def test_recompute_takes_any_repeated_blocks_and_refuses_a_model_without():
    batch = (torch.randn(8, 4, 8, generator=torch.Generator().manual_seed(0)), torch.arange(8) % 4)
    losses = {}
    for recompute in ("none", "full"):
        torch.manual_seed(0)
        with scaletrain.setup(ConvBlocks(), recompute=recompute, lr=0.05, warmup_steps=1) as engine:
            losses[recompute] = [engine.train_step([batch], F.cross_entropy)["loss"] for _ in range(3)]
    assert losses["full"] == pytest.approx(losses["none"], rel=1e-6)  # the same steps, activations recomputed
    with pytest.raises(UserError, match=r"recompute='full' recomputes the model's repeated blocks, but it has no "
                                        r"nn.ModuleList or nn.Sequential holding them"):
        scaletrain.setup(nn.Linear(8, 4), recompute="full")
