"""Parity's verdict from the runs' figures (commands/parity.py): steps that trained no token, and
the tolerance each precision is held to, in the table, in ``--json`` and in ``check_parity``."""

from __future__ import annotations

import json
import math

import pytest

import scaletrain
from scaletrain.commands.cli import main
from scaletrain.commands.parity import ParityReport, default_tolerance, format_table
from scaletrain.errors import UserError


def report(reference: list[float], layout: list[float]) -> ParityReport:
    """Two steps' losses; the gradient norms the same as the losses, the weights equal."""
    return ParityReport(layout="dp2", tolerance=1e-5, reference_losses=reference, layout_losses=layout,
                        reference_grad_norms=reference, layout_grad_norms=layout, param_rel_diffs={"w": 0.0})


def test_a_step_that_trained_no_token_in_either_run_passes_as_untrained():
    untrained = report([2.5, 0.0], [2.5, 0.0])
    assert untrained.passed and untrained.untrained_steps == [2]
    assert untrained.loss_rel_diffs == untrained.grad_norm_rel_diffs == [0.0, 0.0]
    table = format_table(untrained).splitlines()
    assert table[3].split()[-2:] == ["tokens", "0.00e+00"] and table[-1] == "PASS"
    assert any(line.startswith("note: step(s) 2 trained no token in either run") for line in table)
    said = json.loads(json.dumps(untrained.to_json()))
    assert said["pass"] and said["untrained_steps"] == [2] and said["max_loss_rel_diff"] == 0.0


def test_a_layout_that_trains_where_the_reference_trained_nothing_fails():
    trained_apart = report([2.5, 0.0], [2.5, 0.25])
    assert not trained_apart.passed and trained_apart.untrained_steps == []
    assert trained_apart.max_loss_rel_diff == trained_apart.max_grad_norm_rel_diff == math.inf
    table = format_table(trained_apart)
    assert "note: step 2: the reference trained no token (loss 0) but the layout's loss is 0.25" in table
    assert table.endswith("FAIL") and trained_apart.to_json()["pass"] is False
    said = json.loads(json.dumps(trained_apart.to_json(), allow_nan=False))  # valid JSON: no Infinity
    assert said["max_loss_rel_diff"] is None and said["max_grad_norm_rel_diff"] is None
    assert not report([2.5, 0.25], [2.5, 0.0]).passed  # the other way round: a plain relative difference of 1


@pytest.mark.parametrize("precision, tolerance", [("fp32", 1e-5), ("bf16", 1e-2), ("fp16", 1e-2), ("fp8", 1e-2)])
def test_the_default_tolerance_follows_the_precision(precision, tolerance):
    assert default_tolerance(precision) == tolerance


@pytest.mark.parametrize("flags, tolerance", [([], 1e-2), (["--tolerance", "3e-3"], 3e-3)],
                         ids=["bf16-default", "flag-overrides"])
def test_parity_holds_bf16_to_its_tolerance_unless_told(corpus, tmp_path, capsys, flags, tolerance):
    """One process each side (the layout is the reference's): what counts is the tolerance reported."""
    assert main(["parity", "--data", str(corpus), "--precision", "bf16", "--steps", "1", "--seq-len", "16",
                 "--micro-batch", "2", "--cache-dir", str(tmp_path / "cache"), "--json", *flags]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["tolerance"] == tolerance


def test_check_parity_takes_the_precisions_tolerance():
    """Its refusal of a bad count names the tolerance it would have used."""
    with pytest.raises(UserError, match=r"not nproc=0, steps=3, tolerance=0\.01\."):
        scaletrain.check_parity(None, None, nproc=0, precision="bf16")
