"""The soak test's analysis on synthetic records and ledgers, one short real
run whose report must come from that run, and (slow) the real soak."""

from __future__ import annotations

import json

import pytest

from scaletrain.commands import soak
from scaletrain.job.metrics import read_metrics

MIB = 2**20
STEPS = 1000
SAVES = soak.checkpoint_steps(STEPS, 100)


def records(rss_per_step: float = 0.0, late_slowdown: float = 1.0, save_slowdown: float = 1.0) -> list[dict]:
    """A healthy-looking run of STEPS steps: RSS near 400 MiB with page-sized wobble,
    about 20,000 tokens/s with a little jitter; optionally RSS rising by
    ``rss_per_step`` bytes a step, the last quarter's throughput divided by
    ``late_slowdown``, and the checkpoint steps and the steps after them
    ``save_slowdown`` times slower."""
    out = []
    for step in range(1, STEPS + 1):
        seconds = 0.0064 * (1 + 0.02 * (step % 7 - 3) / 3)
        if step > STEPS * 3 // 4:
            seconds *= late_slowdown
        if step in SAVES or step - 1 in SAVES:
            seconds *= save_slowdown
        out.append({"step": step, "step_s": seconds, "tokens_per_s": 128 / seconds,
                    "mem_bytes": int(400 * MIB + 4096 * (step % 3) + rss_per_step * step)})
    return out


def test_flat_steady_run_passes():
    report = soak.summarize(records(), SAVES)
    assert report["warmup_steps"] == 200 and report["steps_recorded"] == STEPS
    assert report["memory"]["flat"] and abs(report["memory"]["slope_bytes_per_1000_steps"]) < 4096
    assert report["memory"]["rss_start_bytes"] == records()[200]["mem_bytes"]
    assert report["throughput"]["steady"] and report["throughput"]["ratio"] == pytest.approx(1, abs=0.02)


def test_linear_rss_growth_is_flagged_with_its_slope():
    report = soak.summarize(records(rss_per_step=2048), SAVES)  # 2 KiB a step, twice the threshold
    memory = report["memory"]
    assert not memory["flat"]
    assert memory["slope_bytes_per_1000_steps"] == pytest.approx(2048 * 1000, rel=0.01)
    assert memory["slope_last_half_bytes_per_1000_steps"] == pytest.approx(2048 * 1000, rel=0.01)
    assert memory["growth_bytes"] == pytest.approx(2048 * 799, abs=8192)
    assert report["throughput"]["steady"]


def test_throughput_drop_is_flagged():
    report = soak.summarize(records(late_slowdown=1.5), SAVES)
    assert not report["throughput"]["steady"]
    assert report["throughput"]["ratio"] == pytest.approx(1 / 1.5, rel=0.02)
    assert report["memory"]["flat"]


def test_checkpoint_steps_are_reported_apart_and_left_out_of_the_medians():
    plain, slowed = soak.summarize(records(), SAVES), soak.summarize(records(save_slowdown=50), SAVES)
    assert slowed["throughput"] == plain["throughput"]
    checkpoints = slowed["checkpoints"]
    assert checkpoints["steps"] == list(range(100, 1001, 100))
    assert checkpoints["step_s_median"] == pytest.approx(50 * plain["throughput"]["median_step_s"], rel=0.05)
    assert len(checkpoints["next_step_s"]) == 9  # the last save has no step after it


def test_checkpoint_schedule_matches_the_trainers():
    assert soak.checkpoint_steps(1000, 250) == [250, 500, 750, 1000]
    assert soak.checkpoint_steps(60, 25) == [25, 50, 60]  # and the last step
    assert soak.checkpoint_steps(60, 0) == [60]


def comm_json(steps: int, saves: int, *, more_reduces_after: int | None = None,
              growing_objects: bool = False) -> dict:
    """A two-rank comm.json: 20 broadcasts and one object gathered at start, 2
    all-reduces of 1000 bytes a step, 3 barriers and one gathered object of about
    400 bytes (a few more or less, as pickles vary) a save. With
    ``more_reduces_after``, one more all-reduce in every step after that one; with
    ``growing_objects``, each save's object 400 bytes larger than the last's."""
    reduces = 2 * steps + max(0, steps - more_reduces_after) if more_reduces_after is not None else 2 * steps
    objects = 3000 + sum(400 * (i + 1) if growing_objects else 400 + i % 3 for i in range(saves))
    rank = {"broadcast": {"dp": {"calls": 20, "bytes": 4000, "wire_bytes": 2000}},
            "all_reduce": {"dp": {"calls": reduces, "bytes": 1000 * reduces, "wire_bytes": 1000 * reduces}},
            "barrier": {"world": {"calls": 3 * saves, "bytes": 0, "wire_bytes": 0}},
            "all_gather_object": {"world": {"calls": 1 + saves, "bytes": objects, "wire_bytes": objects // 2}}}
    return {"0": rank, "1": rank}


def checked(soak_comm: dict) -> dict:
    """The ledger check of a 3000-step, 12-save soak against the three calibration runs."""
    n = soak.CALIBRATION_STEPS
    short = soak.flat_ledger(comm_json(n, 1))
    model = soak.LedgerModel.calibrate(n, short, soak.flat_ledger(comm_json(n + 1, 1)),
                                       soak.flat_ledger(comm_json(n + 1, 2)))
    return soak.ledger_check(model, soak.flat_ledger(soak_comm), 3000, 12, short)


def test_a_ledger_that_grows_by_the_step_matches_its_calibration():
    check = checked(comm_json(3000, 12))
    assert check["constant"] and not check["mismatched"]
    assert check["entries"] == check["entries_short_run"] == {"0": 4, "1": 4}
    assert check["calls_per_step"] == {"0": 2, "1": 2} and check["calls_per_save"] == {"0": 4, "1": 4}
    assert check["calls_fixed"] == {"0": 21, "1": 21}
    assert check["calls"]["0"] == 21 + 2 * 3000 + 4 * 12


def test_more_calls_per_step_over_time_are_flagged():
    check = checked(comm_json(3000, 12, more_reduces_after=1000))
    assert not check["constant"]
    assert "0/all_reduce/dp/calls" in check["mismatched"] and "1/all_reduce/dp/bytes" in check["mismatched"]


def test_gathered_objects_growing_with_the_run_are_flagged():
    check = checked(comm_json(3000, 12, growing_objects=True))
    assert check["mismatched"] == [f"{rank}/all_gather_object/world/{field}"
                                   for rank in "01" for field in ("bytes", "wire_bytes")]


def test_a_new_entry_is_flagged():
    grown = comm_json(3000, 12)
    grown["0"] = {**grown["0"], "all_to_all": {"world": {"calls": 1, "bytes": 64, "wire_bytes": 32}}}
    check = checked(grown)
    assert not check["constant"] and check["entries"] == {"0": 5, "1": 4}
    assert "0/all_to_all/world/calls" in check["mismatched"]


def test_short_real_run_reports_its_own_figures(corpus, tmp_path, capsys):
    out = tmp_path / "soak"
    code = soak.main(["--steps", "60", "--checkpoint-every", "20", "--out", str(out), "--data", str(corpus),
                      "--json"])
    report = json.loads(capsys.readouterr().out)  # stdout holds the report alone
    assert code == (0 if report["passed"] else 1)
    records = read_metrics(out / "soak" / "metrics.jsonl")
    assert report["steps_recorded"] == len(records) == 60
    assert report["checkpoints"]["steps"] == report["checkpoints"]["written"] == [20, 40, 60]
    by_step = {r["step"]: r for r in records}
    assert report["checkpoints"]["step_s"] == [by_step[s]["step_s"] for s in (20, 40, 60)]
    memory = report["memory"]
    assert report["warmup_steps"] == 12
    assert (memory["rss_start_bytes"], memory["rss_end_bytes"]) == (by_step[13]["mem_bytes"],
                                                                    by_step[60]["mem_bytes"])
    # One process talks to nobody: an empty ledger, predicted exactly by the calibration runs.
    assert report["comm"]["constant"] and report["comm"]["entries"] == {}
    for name in ("short", "longer", "saved_twice"):
        assert (out / f"ledger-{name}" / "comm.json").is_file()


def test_too_short_a_soak_is_refused(tmp_path, capsys):
    assert soak.main(["--steps", "10", "--out", str(tmp_path / "soak")]) == 2
    assert "--steps 10" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("nproc", [1, 2])
def test_soak_memory_flat_throughput_steady_ledger_constant(tmp_path, nproc):
    report = soak.soak(steps=2500, checkpoint_every=250, nproc=nproc, out=tmp_path)
    assert report["memory"]["flat"], soak.format_report(report)
    # Generous: the machine running the tests may be busy with other work.
    assert 0.5 <= report["throughput"]["ratio"] <= 2, soak.format_report(report)
    assert report["comm"]["constant"], soak.format_report(report)
    assert report["checkpoints"]["written"] == list(range(250, 2501, 250))
    assert nproc == 1 or report["comm"]["calls_per_step"]["0"] > 0
