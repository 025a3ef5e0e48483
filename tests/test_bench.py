"""The races of ``scaletrain bench``, each started from its README line (tests/readme.py): measured,
not asserted on time; the equal work, the ratios and the memory shapes each must show."""

from __future__ import annotations

import json

import pytest

from scaletrain.bench.techniques import flags_of, parse_selection
from scaletrain.errors import UserError
from tests.conftest import run_cli
from tests.readme import readme_argv


def test_selection_keeps_the_baseline_first_and_refuses_unknown_names():
    assert parse_selection("compile,baseline,bf16") == ["baseline", "compile", "bf16"]
    assert parse_selection(None)[0] == "baseline"
    with pytest.raises(UserError, match="no technique named warp-drive"):
        parse_selection("bf16,warp-drive")


def test_flags_are_what_a_user_types():
    assert flags_of({"precision": "bf16", "param_dtype": "bf16"}) == "--precision bf16 --param-dtype bf16"
    assert flags_of({"compile": True}) == "--compile"
    assert flags_of({}) == "(none)"


def test_bench_techniques_shows_each_technique_where_it_acts(corpus, tmp_path):
    result = run_cli(*readme_argv("scaletrain bench techniques")[1:], "--json", "--model", "gpt-tiny",
                     "--data", str(corpus),
                     "--seq-len", "64", "--micro-batch", "4", "--steps", "3", "--warmup", "1",
                     "--cache-dir", str(tmp_path / "cache"),
                     "--techniques", "recompute-full,bf16,bf16-weights,adafactor,offload")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["what"] == "techniques" and report["setup"]["timed_steps"] == 2
    base, ours = report["peer"], report["ours"]["techniques"]
    assert set(ours) == {"recompute-full", "bf16", "bf16-weights", "adafactor", "offload"}
    assert set(report["ratios"]) == set(ours)
    assert report["ratio"] == pytest.approx(sorted(report["ratios"].values())[2])  # the median of five
    assert report["ours"]["median_s"] > 0 and base["median_s"] > 0
    for row in (base, *ours.values()):
        assert row["median_s"] > 0 and row["activations_peak"] > 0 and row["val_loss"] > 0
    # Activations: full recompute keeps block inputs plus one block; bf16 stores 2-byte activations.
    assert ours["recompute-full"]["activations_ratio"] < 0.7
    assert ours["bf16"]["activations_ratio"] < 0.85
    # Parameter-side bytes: bf16 weights halve params and add a 4-byte master under optimizer;
    # Adafactor's factored state is a sliver of AdamW's; offload adds the fp32 masters (here on the
    # same host) without changing parameter or gradient bytes.
    assert ours["bf16-weights"]["params"] * 2 == base["params"]
    assert ours["bf16-weights"]["optimizer"] == base["optimizer"] + base["params"]
    assert ours["adafactor"]["optimizer"] < 0.05 * base["optimizer"]
    assert ours["offload"]["params"] == base["params"]
    assert ours["offload"]["optimizer"] == base["optimizer"] + base["params"]
    # Same seed, data and batch: techniques that change no arithmetic reach the very same loss.
    assert ours["recompute-full"]["final_loss"] == base["final_loss"]
    assert ours["offload"]["final_loss"] == pytest.approx(base["final_loss"], rel=1e-6)


@pytest.mark.slow  # 30 s: each mistake starts a process
def test_bench_input_mistakes_are_one_sentence(corpus, tmp_path):
    for args, phrase in ((["bench", "warp"], "invalid choice: 'warp'"),
                         (["bench", "techniques", "--techniques", "nope"], "no technique named nope"),
                         (["bench", "techniques", "--steps", "3", "--warmup", "3"], "--warmup 3 leaves no timed step"),
                         (["bench", "dp"], "give --nproc 2 or more"),
                         (["bench", "zero"], "give --nproc 2 or more"),
                         (["bench", "allreduce"], "needs --nproc 2 or more")):
        result = run_cli(*args, "--data", str(corpus), "--cache-dir", str(tmp_path / "c"))
        assert result.returncode == 2, result.stderr
        assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1
        assert phrase in result.stderr


def test_bench_dp_races_torch_ddp_on_equal_work(corpus, tmp_path):
    result = run_cli(*readme_argv("scaletrain bench dp --nproc 2")[1:], "--json", "--model", "gpt-tiny",
                     "--data", str(corpus),
                     "--seq-len", "32", "--micro-batch", "4", "--grad-accum", "2", "--steps", "4",
                     "--warmup", "1", "--bucket-mb", "0.1", "--cache-dir", str(tmp_path / "cache"))
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["what"] == "dp" and report["setup"]["ranks"] == 2 and report["setup"]["timed_steps"] == 3
    assert report["peer"]["name"].startswith("torch DDP") and len(report["peers"]) == 2
    assert report["ratio"] == pytest.approx(report["ours"]["median_s"] / report["peer"]["median_s"])
    # The timing compares equal work: the same losses, step by step, as torch DDP.
    for peer in report["peers"]:
        assert peer["max_loss_rel_diff_to_ours"] <= 1e-5


def _two_rank_race(command: str, corpus, tmp_path, steps: int) -> dict:
    """The README's ``command`` (``scaletrain bench WHAT --nproc 2``) with ``--json`` on gpt-tiny; its
    report, with the timing checked: positive medians and ratio = ours / peer."""
    what = command.split()[2]
    result = run_cli(*readme_argv(command)[1:], "--json", "--model", "gpt-tiny", "--data", str(corpus),
                     "--seq-len", "32", "--micro-batch", "4", "--grad-accum", "2", "--steps", str(steps),
                     "--warmup", "1", "--cache-dir", str(tmp_path / "cache"))
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    ours, peer = report["ours"], report["peer"]
    assert report["what"] == what and ours["median_s"] > 0 and peer["median_s"] > 0
    assert report["ratio"] == pytest.approx(ours["median_s"] / peer["median_s"])
    return report


def test_bench_zero_races_fsdp2_on_equal_work(corpus, tmp_path):
    report = _two_rank_race("scaletrain bench zero --nproc 2", corpus, tmp_path, steps=4)
    assert report["setup"]["ranks"] == 2 and report["setup"]["timed_steps"] == 3
    ours, peer = report["ours"], report["peer"]
    assert peer["name"].startswith("torch FSDP2") and report["peers"][0] == peer
    # DeepSpeed is optional: raced when it imports, else left out with the reason.
    if report["deepspeed"] is None:
        assert len(report["peers"]) == 1 and "deepspeed" in report["deepspeed_skipped"]
    else:
        assert report["peers"][1] == report["deepspeed"]
    # The timing compares equal work: the same weights and batches give the same losses, step by step.
    for row in report["peers"]:
        assert row["max_loss_rel_diff_to_ours"] <= 1e-5
    # Both shard everything over the 2 ranks: each holds about half of params + grads + AdamW state.
    for row in (ours, peer):
        assert (row["cuda_peak_bytes"] is None) == (report["setup"]["device"] == "cpu")
        for rank in row["state_bytes_per_rank"]:
            assert rank["optimizer"] == pytest.approx(2 * rank["params"], rel=0.01)
            assert rank["grads"] == rank["params"]
    assert ours["state_bytes"] == pytest.approx(peer["state_bytes"], rel=0.01)


@pytest.mark.slow  # 9 s; the bench's machinery runs by default with the ZeRO and pipeline races
def test_bench_tp_races_torch_dtensor_tp_on_equal_work(corpus, tmp_path):
    report = _two_rank_race("scaletrain bench tp --nproc 2", corpus, tmp_path, steps=3)
    assert report["nproc"] == 2 and report["steps"] == 3 and report["warmup"] == 1
    assert report["setup"]["tp"] == 2 and report["setup"]["dp"] == 1 and report["setup"]["timed_steps"] == 2
    assert isinstance(report["machine"], str) and report["machine"]
    ours, peer = report["ours"], report["peer"]
    assert ours["name"].startswith("scaletrain") and peer["name"].startswith("torch DTensor TP")
    # The timing compares equal work: with q, k, v regrouped by rank and the head re-tied to the
    # embedding, torch's split computes our function of the same weights, step by step.
    assert report["max_loss_rel_diff"] == peer["max_loss_rel_diff_to_ours"]
    assert report["max_loss_rel_diff"] < 1e-4 and len(ours["losses"]) == len(peer["losses"]) == 3
    assert peer["final_loss"] == pytest.approx(ours["final_loss"], rel=1e-4)


@pytest.mark.slow  # 13 s; the bench's machinery runs by default with the ZeRO race
def test_bench_pp_races_torch_pipelining_on_equal_work(corpus, tmp_path):
    report = _two_rank_race("scaletrain bench pp --nproc 2", corpus, tmp_path, steps=3)
    assert report["nproc"] == 2 and report["steps"] == 3 and report["warmup"] == 1
    setup = report["setup"]
    assert setup["pp"] == 2 and setup["dp"] == 1 and setup["timed_steps"] == 2
    assert setup["microbatches"] == 4 and setup["grad_accum"] == 2  # M defaults to 2 x pp
    assert setup["stage_layers"] == [[0, 1], [1, 2]]  # gpt-tiny's two blocks, one per stage
    assert isinstance(report["machine"], str) and report["machine"]
    assert report["ours"]["name"].startswith("scaletrain") and report["peer"]["name"] == "torch.distributed.pipelining"
    # Both schedules raced; the top-level figures are 1F1B's.
    assert set(report["schedules"]) == {"gpipe", "1f1b"}
    top = report["schedules"]["1f1b"]
    assert report["ours"] == top["ours"] and report["peer"] == top["peer"] and report["ratio"] == top["ratio"]
    reference = report["schedules"]["gpipe"]["ours"]["losses"]
    for name, row in report["schedules"].items():
        ours, peer = row["ours"], row["peer"]
        assert ours["schedule"] == peer["schedule"] == name
        assert ours["median_s"] > 0 and peer["median_s"] > 0
        assert row["ratio"] == pytest.approx(ours["median_s"] / peer["median_s"])
        # The timing compares equal work: same cuts, weights, micro-batches and loss scaling give
        # the same losses step by step (measured bit for bit equal), under either schedule.
        assert len(ours["losses"]) == len(peer["losses"]) == 3
        assert row["max_loss_rel_diff"] == peer["max_loss_rel_diff_to_ours"] <= 1e-6
        assert peer["final_loss"] == pytest.approx(ours["final_loss"], rel=1e-6)
        assert ours["losses"] == pytest.approx(reference, rel=1e-6)
    assert report["max_loss_rel_diff"] <= 1e-6


@pytest.mark.slow
def test_bench_pp_races_our_2bw_beside_our_1f1b(corpus, tmp_path):
    """With --pp-schedule pipedream-2bw our 2BW joins the race, timed against our 1F1B; its first
    loss is 1F1B's (the same weights), the next differs (no update yet, by design)."""
    result = run_cli("bench", "pp", "--json", "--nproc", "2", "--pp", "2", "--pp-schedule", "pipedream-2bw",
                     "--model", "gpt-tiny", "--data", str(corpus), "--seq-len", "32", "--micro-batch", "4",
                     "--steps", "3", "--warmup", "1", "--cache-dir", str(tmp_path / "cache"))
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert set(report["schedules"]) == {"gpipe", "1f1b", "pipedream-2bw"}
    row, one_f_one_b = report["schedules"]["pipedream-2bw"], report["schedules"]["1f1b"]["ours"]
    assert row["ratio_to_1f1b"] == pytest.approx(row["ours"]["median_s"] / one_f_one_b["median_s"])
    assert row["ours"]["losses"][0] == one_f_one_b["losses"][0] and row["ours"]["losses"][1] != one_f_one_b["losses"][1]
    assert report["max_loss_rel_diff"] <= 1e-6  # ours against torch, 2BW left out
