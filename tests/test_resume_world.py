"""``--resume`` on another number of processes: dp derived from the new world, the global
batch kept by accumulation (or smaller micro-batches), one line saying so, and the losses
those of the uninterrupted run; a layout or batch the new world cannot take refused in
one sentence naming where each size came from (docs/checkpoints.md)."""

import json
import shutil

import pytest

from scaletrain.commands.cli import main
from scaletrain.config import Config, load_run_config
from scaletrain.errors import UserError
from scaletrain.resume_layout import resumed_layout


def _losses(run) -> dict[int, float]:
    records = (json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines())
    return {r["step"]: r["loss"] for r in records}


def _crashed_after_step_2(run, into):
    """The run folder as a crash after step 3 leaves it: step 2's checkpoint its newest."""
    shutil.copytree(run, into)
    shutil.rmtree(into / "checkpoints" / "step_000004")
    return into


@pytest.mark.numerics
@pytest.mark.slow  # 8 s; resuming in another layout runs by default: tests/test_nd.py, test_zero_pipeline.py
def test_a_dp2_run_resumes_on_one_process_and_back_as_if_never_stopped(corpus, tmp_path, capsys):
    """A dp-2 run (ZeRO-1: its optimizer state saved in shards) resumed with --nproc 1 and no
    --dp accumulates 2 micro-batches, and back on 2 processes 1: steps 3 and 4 are the
    uninterrupted dp-2 run's (fp32, 1e-5)."""
    straight = tmp_path / "straight"
    assert main(["train", "--model", "gpt-tiny", "--data", str(corpus), "--seq-len", "32", "--micro-batch", "4",
                 "--steps", "4", "--warmup-steps", "1", "--eval-every", "0", "--eval-batches", "1",
                 "--sample-tokens", "0", "--no-progress", "--checkpoint-every", "2", "--zero", "1",
                 "--nproc", "2", "--out", str(straight), "--cache-dir", str(tmp_path / "cache")]) == 0
    expected = _losses(straight)
    capsys.readouterr()

    one = _crashed_after_step_2(straight, tmp_path / "one")
    assert main(["train", "--nproc", "1", "--out", str(one), "--resume"]) == 0
    said = capsys.readouterr().out.splitlines()
    assert "resuming on 1 process: dp 2 -> 1 (tp, pp, cp, ep as saved); the global batch kept by " \
           "--grad-accum 1 -> 2" in said
    saved = load_run_config(one)
    assert (saved.parallel.dp, saved.train.micro_batch, saved.train.grad_accum) == (1, 4, 2)
    assert _losses(one) == pytest.approx(expected, rel=1e-5)

    two = _crashed_after_step_2(one, tmp_path / "two")
    assert main(["train", "--nproc", "2", "--out", str(two), "--resume"]) == 0
    assert "resuming on 2 processes: dp 1 -> 2 (tp, pp, cp, ep as saved); the global batch kept by " \
           "--grad-accum 2 -> 1" in capsys.readouterr().out.splitlines()
    assert _losses(two) == pytest.approx(expected, rel=1e-5)


def _saved_run(folder, **settings):
    """A run folder as a run of ``settings`` saves it (its config.toml; no checkpoint is read
    before the layout is settled)."""
    folder.mkdir()
    (folder / "config.toml").write_text(Config().replace(name="gpt-tiny", micro_batch=4, **settings).to_toml())
    return folder


@pytest.mark.parametrize("saved,command,sentence", [
    (dict(nproc=2, tp=2, dp=1), ["--nproc", "3"],
     "resuming on 3 processes, --tp 2 (saved with the run) = 2 does not divide 3; give sizes whose product "
     "divides 3 on the command line (they replace the saved ones), or resume on a multiple of 2 processes."),
    (dict(nproc=2, tp=2, dp=1), ["--nproc", "4", "--dp", "3"],
     "resuming on 4 processes, --dp 3 (given) x --tp 2 (saved with the run) = 6 is not 4;"),
    (dict(nproc=2, dp=2), ["--nproc", "3"],
     "resuming on 3 processes with dp 3, the run's global batch of 8 sequences does not split into equal whole "
     "micro-batches over 3 data-parallel ranks; give --micro-batch and --grad-accum for a new global batch"),
], ids=["saved-tp-on-3", "given-dp", "batch-over-3"])
def test_a_world_the_layout_or_batch_cannot_use_is_one_sentence(tmp_path, capsys, saved, command, sentence):
    run = _saved_run(tmp_path / "run", **saved)
    assert main(["train", "--out", str(run), "--resume", *command]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and sentence in err
    assert sorted(p.name for p in run.iterdir()) == ["config.toml"]  # nothing written


def _resumed(world, given=(), **changes):
    saved = Config().replace(micro_batch=4, grad_accum=1, dp=2)
    cfg = saved.replace(**changes)
    return resumed_layout(saved, cfg, set(given) | set(changes), world)


def test_the_global_batch_is_kept_by_the_knobs_the_command_line_left_free():
    more, line = _resumed(4)  # 8 sequences over 4 ranks: each its 2, in one smaller micro-batch
    assert (more.parallel.dp, more.train.micro_batch, more.train.grad_accum) == (4, 2, 1)
    assert line.endswith("dp 2 -> 4 (tp, pp, cp, ep as saved); the global batch kept by --micro-batch 4 -> 2")
    given_micro, _ = _resumed(1, micro_batch=2)  # 8 sequences on one rank in micro-batches of 2
    assert (given_micro.train.micro_batch, given_micro.train.grad_accum) == (2, 4)
    planned, line = _resumed(1, micro_batch="auto")  # the planner sizes micro-batches: their number kept
    assert (planned.train.micro_batch, planned.train.grad_accum) == ("auto", 2)
    both, line = _resumed(1, micro_batch=2, grad_accum=2)
    assert line.endswith("the global batch 8 sequences -> 4 sequences, as given")
    with_tp, line = _resumed(2, tp=2)  # the same world, tp given: dp follows, the batch with it
    assert (with_tp.parallel.dp, with_tp.train.grad_accum) == (1, 2)
    assert line == "resuming on 2 processes: dp 2 -> 1 (tp 2 given; pp, cp, ep as saved); the global batch " \
                   "kept by --grad-accum 1 -> 2"
    assert _resumed(2) == (Config().replace(micro_batch=4, grad_accum=1, dp=2), None)  # the same world: as saved
    with pytest.raises(UserError, match="with --grad-accum 3 as given"):
        _resumed(1, grad_accum=3)
