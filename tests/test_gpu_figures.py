"""The one-call GPU script, dry-run on the CPU (``--tiny``): every row runs and the two files hold
them. Behind slow (about a minute): ``python3 -m pytest -m slow tests/test_gpu_figures.py``."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "gpu-figures.sh"


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
