"""``scaletrain bench planner``: the planner's layouts trained for real, set against its predictions.
Measured, never asserted on time: every layout ran and was metered, the predicted figures are the
planner's own, and the summary (Spearman's rho, the pick) is computed as documented."""

from __future__ import annotations

import json
import math
import shlex

import pytest

from scaletrain.bench.planner import PREDICTED_ROWS, chosen, core, format_table, ranks, selection, spearman
from scaletrain.commands.cli import main
from scaletrain.config import Config
from scaletrain.errors import UserError
from scaletrain.planner.machine import this_machine
from scaletrain.planner.predict import predict
from scaletrain.planner.search import layout_text, layouts, refusal
from tests.readme import readme_argv

README_COMMAND = "scaletrain bench planner --nproc 4"


def test_ranks_put_ties_at_their_mean_rank():
    assert ranks([30.0, 10.0, 20.0]) == [2.0, 0.0, 1.0]
    assert ranks([1.0, 2.0, 2.0, 3.0]) == [0.0, 1.5, 1.5, 3.0]
    assert ranks([5.0, 5.0, 5.0]) == [1.0, 1.0, 1.0]


def test_spearman_on_known_rankings():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [40, 30, 20, 10]) == pytest.approx(-1.0)
    # d = (0, 1, -1, 0) over n = 4 distinct ranks: 1 - 6 * 2 / (4 * 15) = 0.8
    assert spearman([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(0.8)
    # ties: ranks (0, 1.5, 1.5, 3) against (0, 1, 2, 3), Pearson's r of the ranks
    tied, plain = [0, 1.5, 1.5, 3], [0, 1, 2, 3]
    mean = 1.5
    covariance = sum((a - mean) * (b - mean) for a, b in zip(tied, plain))
    expected = covariance / math.sqrt(sum((a - mean) ** 2 for a in tied) * sum((b - mean) ** 2 for b in plain))
    assert spearman([1, 2, 2, 3], [1, 2, 3, 4]) == pytest.approx(expected)
    assert math.isnan(spearman([1, 1, 1], [1, 2, 3]))


def test_core_names_the_layouts_asked_for_and_picks_each_from_the_enumeration():
    names = selection("core", 4)
    assert names == list(core(4))
    assert {"dp", "zero1", "zero2", "zero3", "recompute", "accumulation", "tp-dp", "tp-dp-sp", "tp", "pp-dp-1f1b",
            "pp-dp-interleaved", "pp-1f1b", "pp-interleaved", "cp-dp"} == set(names)
    assert selection("all", 4) is None
    with pytest.raises(UserError, match="no layout named warp"):
        selection("dp,warp", 4)
    base = Config().replace(name="gpt-small", n_layers=8, seq_len=128, micro_batch=4, nproc=4)
    enumerated = list(layouts(base, 4, 4, 16, set()))
    picked, missing = chosen(enumerated, names, 4)
    assert not missing
    assert picked["dp"].parallel.dp == 4 and picked["dp"].train.micro_batch == 4  # the largest micro-batch
    assert picked["accumulation"].train.micro_batch == 2 and picked["accumulation"].train.grad_accum == 2
    assert picked["tp-dp-sp"].parallel.sp and picked["tp-dp-sp"].parallel.tp == 2
    interleaved = picked["pp-interleaved"].parallel
    assert (interleaved.pp, interleaved.pp_schedule, interleaved.microbatches) == (4, "interleaved", 8)
    assert all(cfg in enumerated for cfg in picked.values())


def test_bench_planner_trains_each_layout_and_sets_it_against_the_planner(corpus, tmp_path, capsys):
    argv = readme_argv(README_COMMAND)[1:] + shlex.split(
        f"--nproc 2 --model gpt-tiny --seq-len 32 --steps 3 --warmup 2 --rounds 1 --layouts dp,tp --json "
        f"--data {corpus} --cache-dir {tmp_path / 'cache'}")
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["what"] == "planner" and report["setup"]["nproc"] == 2 and report["setup"]["global_batch"] == 8
    rows = {row["name"]: row for row in report["layouts"]}
    assert {"dp", "tp"} <= set(rows)
    # every layout ran and was metered
    for row in rows.values():
        assert row["measured"]["step_s"] > 0 and row["measured"]["memory_bytes"] > 0
        assert row["time_ratio"] == pytest.approx(row["predicted"]["step_s"] / row["measured"]["step_s"])
    # the predictions are the planner's own, on this machine as the planner weighs it
    base = Config().replace(name="gpt-tiny", seq_len=32, micro_batch=4, nproc=2)
    cluster, vocab = this_machine(2, 2, on_gpu=False), report["setup"]["vocab_size"]
    legal = [cfg for cfg in layouts(base, 2, 2, 8, set()) if refusal(cfg, 2) is None]
    by_text = {layout_text(p): p for p in (predict(cfg, 2, vocab, cluster) for cfg in legal)}
    for row in rows.values():
        prediction = by_text[row["layout"]]
        assert row["predicted"]["step_s"] == prediction.step_s
        assert row["predicted"]["memory_bytes"] == max(sum(stage[k] for k in PREDICTED_ROWS)
                                                       for stage in prediction.stages)
    # the summary: rho of the rows' own figures, the pick the lowest predicted
    ran = list(rows.values())
    assert report["spearman"] == pytest.approx(spearman([r["predicted"]["step_s"] for r in ran],
                                                        [r["measured"]["step_s"] for r in ran]), nan_ok=True)
    assert report["pick"]["predicted_s"] == min(r["predicted"]["step_s"] for r in ran)
    assert report["fastest"]["layout"] == min(ran, key=lambda r: r["measured"]["step_s"])["layout"]
    table = format_table(report)
    assert "Spearman's rank correlation" in table and "the planner's pick" in table
    assert all(row["layout"] in table for row in ran)


@pytest.mark.parametrize("flags, says", [("--nproc 1", "give --nproc 2 or more"),
                                         ("--nproc 2 --layouts dp,warp", "no layout named warp"),
                                         ("--nproc 2 --rounds 0", "--rounds must be at least 1")])
def test_bench_planner_refuses_in_one_sentence(flags, says, capsys):
    assert main(["bench", "planner", *flags.split()]) == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
