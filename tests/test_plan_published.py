"""The planner's step time against published tables it was not set against (docs/planner.md):
Megatron-LM's weak scaling on A100s (all ten rows of its Table 1 within 15%, the trend with
size as the paper's), and the H100 rows of llm-foundry, torchtitan and llm.c, each within 15%
or within the gap docs/planner.md records for it."""

from __future__ import annotations

import json

import pytest

from scaletrain.commands.cli import main
from scaletrain.planner import published

ROWS = published.TABLE_1


@pytest.fixture(scope="module")
def predicted() -> dict[str, float]:
    return {row.params: row.predicted_tflops() for row in ROWS}


@pytest.mark.parametrize("row", ROWS, ids=[row.params for row in ROWS])
def test_each_row_of_megatron_table_1_is_predicted_within_15_percent(row, predicted):
    assert abs(predicted[row.params] / row.tflops - 1) < 0.15, (predicted[row.params], row.tflops)


def test_the_largest_models_reach_more_of_the_peak_than_the_smallest_as_published(predicted):
    small, large = ROWS[0], ROWS[-1]
    assert predicted[large.params] > predicted[small.params]
    assert max(predicted, key=predicted.get) in {row.params for row in ROWS[-3:]}


def test_the_paper_layouts_are_its_scripts():
    """Every row's global batch is whole micro-batches over its data-parallel ranks, and its
    interleaved schedule sends whole groups of pp micro-batches (the schedule's rule)."""
    for row in ROWS:
        assert row.gpus % (row.tp * row.pp) == 0 and row.batch % (row.micro_batch * row.dp) == 0
        micro_batches = row.batch // (row.micro_batch * row.dp)
        assert row.virtual == 1 or (micro_batches % row.pp == 0 and row.layers % (row.pp * row.virtual) == 0)


MPT = ["--vocab", "50368", "--seq", "2048", "--gpu", "H100", "--grad-accum", "1", "--precision", "bf16", "--zero", "3"]


def _mpt(layers: int, hidden: int, heads: int, gpus: int, micro: int, recompute: str = "none") -> list[str]:
    """llm-foundry's layout, held: the planner's memory model would refuse some of them on 80 GB and
    the search would then pick recomputation the published run did without."""
    return ["--layers", str(layers), "--hidden", str(hidden), "--heads", str(heads), "--gpus", str(gpus), "--dp",
            str(gpus), "--micro-batch", str(micro), "--recompute", recompute, "--gpu-memory", "400GB", *MPT]


# (run, plan arguments, GPUs, published tokens/s per GPU, predicted / published as docs/planner.md records it)
H100_ROWS = [
    ("MPT-760M", _mpt(24, 1536, 12, 8, 24), 8, 63_147, 1.414),
    ("MPT-1B", _mpt(24, 2048, 16, 8, 14), 8, 45_455, 1.316),
    ("MPT-3B", _mpt(32, 2560, 20, 16, 10), 16, 24_142, 1.301),
    ("MPT-7B", _mpt(32, 4096, 32, 8, 6), 8, 10_643, 1.367),
    ("MPT-13B", _mpt(40, 5120, 40, 8, 2), 8, 4_792, 1.484),
    ("MPT-30B", _mpt(48, 7168, 64, 8, 3, "full"), 8, 2_002, 1.341),
    ("torchtitan Llama 3.1 8B", ["--model", "llama3-8b", "--seq", "8192", "--gpu", "H100", "--gpus", "8", "--dp", "8",
                                 "--zero", "3", "--micro-batch", "2", "--recompute", "selective", "--precision",
                                 "bf16", "--gpu-memory", "400GB"], 8, 6_667, 1.488),
    ("llm.c GPT-2 124M", ["--model", "gpt2-124m", "--gpu", "H100", "--gpus", "1", "--dp", "1", "--micro-batch", "64",
                          "--seq", "1024", "--precision", "bf16"], 1, 470_000, 0.793),
]


@pytest.mark.parametrize("name, args, gpus, published_tokens, documented", H100_ROWS, ids=[r[0] for r in H100_ROWS])
def test_h100_published_rows_within_15_percent_or_the_recorded_gap(name, args, gpus, published_tokens, documented,
                                                                    capsys):
    """A row the clock meets is held to 15%; one it misses (docs/planner.md names the term it lacks)
    to the gap recorded there, two points of slack: a change that widens a gap fails here."""
    assert main(["plan", *args, "--json"]) == 0
    ratio = json.loads(capsys.readouterr().out)["candidates"][0]["tokens_per_s"] / gpus / published_tokens
    assert min(0.85, documented - 0.02) < ratio < max(1.15, documented + 0.02), (name, ratio)
