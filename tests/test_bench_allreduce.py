"""scaletrain bench allreduce: measured, not asserted on time; the figures must agree with each other."""

from __future__ import annotations

import json

import pytest

from scaletrain.bench.allreduce import format_table, run, size_label
from scaletrain.errors import UserError


def test_bench_allreduce_reports_consistent_figures_and_a_plot(tmp_path):
    plot = tmp_path / "plots" / "a.png"
    result = run(2, sizes=[4096, 65536], repeats=2, warmup=1, plot=plot)
    json.dumps(result)
    assert result["what"] == "allreduce" and result["ranks"] == 2 and result["machine"]
    assert result["peer"]["name"] == "gloo all_reduce"
    assert [row["bytes"] for row in result["sizes"]] == [4096, 65536]
    for row in result["sizes"]:
        assert row["ours_s"] > 0 and row["peer_s"] > 0
        for key in ("ours", "peer"):
            # busbw = algbw x 2(n-1)/n, which is algbw itself for two ranks.
            assert row[f"{key}_busbw_gbps"] == pytest.approx(row["bytes"] / row[f"{key}_s"] * 2 * 1 / 2 / 1e9)
        assert row["ratio"] == pytest.approx(row["ours_s"] / row["peer_s"])
    largest = result["sizes"][-1]
    assert result["ours"]["median_s"] == largest["ours_s"] and result["peer"]["median_s"] == largest["peer_s"]
    assert result["ours"]["busbw_gbps"] == largest["ours_busbw_gbps"]
    assert result["ratio"] == pytest.approx(result["ours"]["median_s"] / result["peer"]["median_s"])
    assert result["plot"] == str(plot)
    assert plot.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    table = format_table(result)
    assert "2 ranks" in table and "64K" in table and str(plot) in table


def test_bench_allreduce_needs_two_processes():
    with pytest.raises(UserError, match="--nproc 2 or more"):
        run(1)


def test_size_labels():
    assert [size_label(b) for b in (4096, 2**20, 64 * 2**20, 6000)] == ["4K", "1M", "64M", "6000"]
