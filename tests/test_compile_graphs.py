"""--compile without graph breaks or recompiles: over several steps of GPT and Llama, with plain
windows and with packed instruction rows (whose documents change every step), each block compiles
once into one graph that every block and step reuses. A graph break would split a block into
pieces that cannot fuse; a recompile would pay compilation again mid-run. Counted by dynamo's own
counters, in a process of its own (they are the process's)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from scaletrain.config import Config
from scaletrain.job.data_setup import prepare_data
from scaletrain.runtime.spawn import spawn_local
from tests.trainers import build_trainer


def _counts(cfg: Config, spec) -> dict:
    from torch._dynamo.utils import counters

    trainer = build_trainer(0, 1, cfg, spec)
    for step in range(cfg.train.steps):
        trainer.train_step(step)
    # A recompile (a guard that failed: another shape, another dtype) adds a graph to unique_graphs.
    return {"graph_breaks": sum(counters["graph_break"].values()), "graphs": counters["stats"]["unique_graphs"],
            "captured": counters["stats"]["calls_captured"]}


@pytest.fixture
def alpaca(tmp_path) -> str:
    records = [{"instruction": f"Name fox number {i}.", "output": f"Fox {i} is called Rusty {i % 9}."}
               for i in range(200)]
    (tmp_path / "alpaca.json").write_text(json.dumps(records))
    return str(tmp_path / "alpaca.json")


@pytest.mark.parametrize("name, packed, mode", [
    ("llama-tiny", True, "default"),
    # CUDA graphs' mode: on a CPU it compiles as the default does, one graph with no break
    ("llama-tiny", False, "reduce-overhead"),
    pytest.param("gpt-tiny", False, "default", marks=pytest.mark.slow),
    pytest.param("gpt-tiny", True, "default", marks=pytest.mark.slow),
    pytest.param("llama-tiny", False, "default", marks=pytest.mark.slow),
], ids=["llama-packed", "llama-reduce-overhead", "gpt", "gpt-packed", "llama"])
def test_the_compiled_step_has_no_graph_break_and_no_recompile(tiny_cfg, alpaca, name, packed, mode):
    cfg = tiny_cfg.replace(name=name, compile=True, compile_mode=mode, steps=4, seq_len=64, micro_batch=2,
                           **({"data": alpaca, "sft": True} if packed else {}))
    spec = prepare_data(cfg, Path(cfg.data.cache_dir))
    counts = spawn_local(1, _counts, (cfg, spec))[0]
    assert counts["graph_breaks"] == 0, counts
    assert counts["graphs"] == 1 and counts["captured"] > 0, counts  # one block graph, every block and step


def _whole_model_counts() -> dict:
    import dataclasses

    import torch
    from torch._dynamo.utils import counters

    from scaletrain.config import ModelConfig
    from scaletrain.models.llama import Llama
    from scaletrain.models.llama_spec import LLAMA_SPEC

    model = Llama(LLAMA_SPEC.configure(dataclasses.replace(ModelConfig(), name="llama-tiny"), 64, 16))
    compiled = torch.compile(model)
    for _ in range(3):
        compiled(torch.randint(64, (2, 16))).sum().backward()
    return {"graph_breaks": sum(counters["graph_break"].values()), "graphs": counters["stats"]["unique_graphs"]}


def test_the_model_compiled_whole_is_one_graph_from_its_first_step():
    """A plain loop compiles the whole model (bench throughput's peer): the rotary table the model keeps
    between steps is computed inside such a graph instead, so its first step is not compiled twice."""
    counts = spawn_local(1, _whole_model_counts, ())[0]
    assert counts == {"graph_breaks": 0, "graphs": 1}
