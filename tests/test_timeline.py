"""Pipeline timeline pictures and ``scaletrain schedule``, without any process."""

from __future__ import annotations

import json

import pytest

from scaletrain.commands.cli import main
from scaletrain.parallel.pipeline import timeline
from scaletrain.parallel.pipeline.schedules import bubble, build, simulate


def _rows(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("rank")]


def test_gpipe_two_ranks_two_micro_batches_drawn_exactly():
    assert timeline.draw_text(simulate(build("gpipe", 2, 2))) == (
        "timeline, 1 unit = 3 characters:\n"
        "rank 0 |F0 F1 .........B0    B1    |\n"
        "rank 1 |...F0 F1 B0    B1    ......|"
    )


def test_1f1b_rows_hold_every_micro_batch_and_idle_cells_are_the_bubble():
    spans = simulate(build("1f1b", 4, 8))
    rows = _rows(timeline.draw_text(spans))
    assert len(rows) == 4 and len({len(row) for row in rows}) == 1
    assert max(len(row) for row in rows) <= 120
    for row in rows:
        blocks = row.split("|")[1].replace(".", " ").split()
        assert sorted(blocks) == sorted(f"{kind}{i}" for kind in "FB" for i in range(8))
    cells = "".join(row.split("|")[1] for row in rows)
    assert cells.count(".") / len(cells) == pytest.approx(bubble(spans))


def test_too_narrow_for_labels_every_block_is_its_letter_repeated():
    spans = simulate(build("1f1b", 4, 16))  # "F15" needs three characters a unit: 3 x 57 > 125
    rows = _rows(timeline.draw_text(spans))
    assert set("".join(row.split("|")[1] for row in rows)) == {"F", "B", "."}
    assert rows[3].split("|")[1].startswith("......FFBBBBFF")
    cells = "".join(row.split("|")[1] for row in rows)
    assert cells.count(".") / len(cells) == pytest.approx(bubble(spans))


def test_zero_bubble_draws_weight_gradients_and_interleaved_marks_chunks():
    zb = _rows(timeline.draw_text(simulate(build("zb-h1", 4, 8))))
    assert all(f"W{i}" in row for row in zb for i in range(8))
    interleaved = timeline.load("interleaved", 4, 8, None).report()
    assert all("f0" in row and "F0" in row and "b7" in row and "B7" in row for row in _rows(interleaved))
    assert "lower case: the rank's odd chunks" in interleaved


def test_pipedream_2bw_draws_a_steady_step_its_older_version_in_upper_case(capsys):
    """Step 1 of N=4, M=8: micro-batches 8-15 forwarded on version 1 (odd: lower case), each rank's
    first N-r-1 backwards finishing version 0's micro-batches 5-7; the fill is the only idle time."""
    assert main(["schedule", "--pp", "4", "--microbatches", "8", "--pp-schedule", "pipedream-2bw"]) == 0
    out = capsys.readouterr().out
    rows = [row.split("|")[1].replace(".", " ").split() for row in _rows(out)]
    for r, blocks in enumerate(rows):
        lag = 3 - r
        assert blocks[:2] == ["f8", f"B{8 - lag}" if lag else "b8"]
        assert sorted(blocks) == sorted([f"f{i}" for i in range(8, 16)] + [f"B{i}" for i in range(8 - lag, 8)]
                                        + [f"b{i}" for i in range(8, 16 - lag)])
    assert "bubble: planned 0.1111 (formula (N-1)/(3M+N-1) = 0.1111)" in out
    assert "peak live activations per rank: 4, 3, 2, 1" in out


def test_colour_only_on_request():
    spans = simulate(build("zb-h1", 2, 2))
    assert "\x1b[" not in timeline.draw_text(spans)
    coloured = timeline.draw_text(spans, colour=True)
    assert "\x1b[44" in coloured and "\x1b[42" in coloured and "\x1b[43" in coloured


def test_png_is_written_into_new_folders(tmp_path):
    path = tmp_path / "figures" / "deep" / "zb.png"
    timeline.draw_png(path, timeline.load("zb-h1", 4, 8, None).panels())
    assert path.read_bytes().startswith(b"\x89PNG")


def test_command_prints_the_bubble_line(capsys):
    assert main(["schedule", "--pp", "4", "--microbatches", "8", "--pp-schedule", "zb-h1"]) == 0
    out = capsys.readouterr().out
    assert "bubble: planned 0.1111 (formula (N-1)/(3M+N-1) = 0.1111)" in out
    assert "peak live activations per rank: 4, 4, 4, 4" in out
    assert "\x1b[" not in out  # not a terminal: plain text
    assert len(_rows(out)) == 4


@pytest.mark.parametrize("args, formula", [
    (["--pp-schedule", "1f1b"], 3 / 11),
    (["--pp-schedule", "interleaved", "--virtual-stages", "2"], 3 / 19),
])
def test_json_bubble_planned_equals_the_formula(capsys, args, formula):
    assert main(["schedule", "--pp", "4", "--microbatches", "8", "--json", *args]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["bubble_planned"] == pytest.approx(result["bubble_formula"], abs=1e-12)
    assert result["bubble_formula"] == pytest.approx(formula)
    assert "bubble_measured" not in result and len(result["live_activations"]) == 4


def _span(kind, micro, stage, start_ms, end_ms):
    return {"kind": kind, "micro": micro, "stage": stage, "start": start_ms / 1e3, "end": end_ms / 1e3}


@pytest.fixture
def run_dir(tmp_path):
    """GPipe on two ranks, two micro-batches; rank 0 busy 7 of 10 ms, rank 1 busy 6."""
    run = tmp_path / "run"
    run.mkdir()
    ranks = [[_span("F", 0, 0, 0, 1), _span("F", 1, 0, 1, 2), _span("BW", 0, 0, 5, 7), _span("BW", 1, 0, 7, 10)],
             [_span("F", 0, 1, 1, 2), _span("F", 1, 1, 2, 3), _span("BW", 0, 1, 3, 5), _span("BW", 1, 1, 5, 7)]]
    record = {"schedule": "gpipe", "pp": 2, "microbatches": 2, "virtual_stages": 1, "step": 10, "ranks": ranks}
    (run / "pipeline.json").write_text(json.dumps(record))
    return run


def test_measured_run_gives_its_bubble_and_two_panels(run_dir, tmp_path, capsys, monkeypatch):
    drawn = []
    monkeypatch.setattr(timeline, "draw_png", lambda path, panels, pale: drawn.append(panels))
    assert main(["schedule", "--measured", str(run_dir), "--png", str(tmp_path / "t.png")]) == 0
    out = capsys.readouterr().out
    assert ("bubble: planned 0.3333 (formula (N-1)/(M+N-1) = 0.3333), measured 0.3500 "
            "(per rank: 0.3000, 0.4000)") in out
    assert len(_rows(out)) == 4  # planned and measured, two ranks each
    [panels] = drawn
    assert [(title.split(": ")[1].split(",")[0], xlabel) for title, _, xlabel in panels] == [
        ("planned", "time (units of one forward)"), ("measured at step 10", "time (ms)")]
    assert panels[1][1][0][-1].end == pytest.approx(10.0)  # measured seconds drawn in ms

    assert main(["schedule", "--measured", str(run_dir), "--pp", "2", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["bubble_measured"] == pytest.approx(0.35)
    assert result["bubble_measured_per_rank"] == pytest.approx([0.3, 0.4])
    assert (result["schedule"], result["pp"], result["microbatches"]) == ("gpipe", 2, 2)


def test_measured_png_has_two_panels_on_disk(run_dir, tmp_path):
    png = tmp_path / "out" / "measured.png"
    assert main(["schedule", "--measured", str(run_dir), "--png", str(png), "--json"]) == 0
    assert png.read_bytes().startswith(b"\x89PNG")


def _exit_2_one_line(capsys, args, phrase):
    assert main(["schedule", *args]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert phrase in err


def test_missing_or_corrupt_run_dir_says_to_train_with_pp(capsys, tmp_path):
    _exit_2_one_line(capsys, ["--measured", str(tmp_path / "nothing")],
                     "does not exist; give the folder of a run trained with --pp 2 or more")
    _exit_2_one_line(capsys, ["--measured", str(tmp_path)],
                     "holds no pipeline timeline (pipeline.json); train with --pp 2 or more")
    (tmp_path / "pipeline.json").write_text("{not json")
    _exit_2_one_line(capsys, ["--measured", str(tmp_path)], "train with --pp 2 or more")


@pytest.mark.parametrize("args, phrase", [
    (["--pp", "4"], "--pp 4 disagrees with pp 2 recorded in"),
    (["--pp-schedule", "1f1b"], "--pp-schedule 1f1b disagrees with schedule gpipe"),
])
def test_flags_that_disagree_with_the_run_are_refused(capsys, run_dir, args, phrase):
    _exit_2_one_line(capsys, ["--measured", str(run_dir), *args], phrase)


@pytest.mark.parametrize("args, phrase", [
    (["--pp-schedule", "interleaved", "--pp", "4", "--microbatches", "6"], "divisible by 4, not 6"),
    (["--pp", "0"], "must be at least 1"),
    (["--virtual-stages", "2"], "needs --pp-schedule interleaved"),
    (["--pp-schedule", "pipedream-2bw", "--pp", "4", "--microbatches", "2"], "choose --microbatches 4 or more, not 2"),
])
def test_bad_sizes_exit_2(capsys, args, phrase):
    _exit_2_one_line(capsys, args, phrase)
