"""The GPU script: its plan fits its budget by its own estimates, in two calls (the goals' rows, then
the rest), and its dry run on the CPU (``--tiny``) runs every row into the two files. The dry run is
behind slow (about a minute): ``python3 -m pytest -m slow tests/test_gpu_figures.py``."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "gpu-figures.sh"


def test_each_call_of_the_gpu_script_fits_its_budget_by_its_own_estimates(tmp_path):
    rows = {}
    for tier, flags in ((1, []), (2, ["--more"])):
        done = subprocess.run(["bash", str(SCRIPT), str(tmp_path / "out"), "--plan", *flags], capture_output=True,
                              text=True, timeout=60, cwd=tmp_path)
        assert done.returncode == 0, done.stderr[-2000:]
        lines = done.stdout.strip().splitlines()
        total, budget = (float(word.rstrip("s")) for word in lines[-1].split() if word.rstrip("s").isdigit())
        assert total <= budget == 470 and "over the budget" not in done.stdout
        rows[tier] = [line.split("  ")[0] for line in lines[:-1]]
    assert rows[1][:2] == ["throughput tinyllama-1.1b", "profile"]  # the headline, then what to fix in it
    assert {"throughput gpt2-124m", "packing", "fp8"} <= set(rows[1])  # every goal's row in the first call
    assert not set(rows[1]) & set(rows[2]) and len(rows[2]) >= 8
    assert not (tmp_path / "out").exists()  # the plan runs nothing


@pytest.mark.slow
def test_the_gpu_script_dry_runs_on_the_cpu(tmp_path):
    done = subprocess.run(["bash", str(SCRIPT), str(tmp_path / "out"), "--tiny"], capture_output=True, text=True,
                          timeout=900, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    figures = json.loads((tmp_path / "out" / "figures.json").read_text())
    rows = {r["row"]: r for r in figures["results"]}
    assert {"throughput llama-tiny", "adam", "ladder", "planner", "profile", "fp8"} <= set(rows)
    assert all(r["rc"] == 0 for r in rows.values())
    assert rows["throughput llama-tiny"]["json"]["what"] == "throughput"
    assert rows["profile"]["json"]["top"] and rows["planner"]["json"]["counted_bytes"] > 0
    assert set(rows["fp8"]["json"]["tokens_per_s"]) == {"bf16", "fp8"} and rows["fp8"]["json"]["ratio"][""] > 0
    table = (tmp_path / "out" / "figures.md").read_text()
    assert table.startswith("# GPU figures on cpu") and "## throughput llama-tiny" in table
