"""An elastic torchrun job (``--nnodes 1:2``) that loses a node goes on, re-laid-out, on the
ranks that remain (docs/launching.md, "Elastic restarts"): dp shrunk to the new world, the
global batch kept by accumulation, so the losses are those of a run never stopped.

The re-derived layout and its sentence are checked without processes; one real job of two
agents on loopback, one of them killed mid-run, checks the whole path.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from scaletrain.config import Config, load_run_config
from scaletrain.errors import UserError
from scaletrain.planner.auto import PLAN_FILE, run_global_batch
from scaletrain.restart import continue_after_restart, run_world
from scaletrain.run_length import sequences_per_step
from scaletrain.runtime import free_port
from scaletrain.train.checkpoint import latest_checkpoint
from tests.conftest import run_cli
from tests.test_multinode import _kill_tree

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 180  # the job takes 20 to 45 s on two cores, by their load; this only stops a hang


def _begun(folder: Path, **layout) -> Config:
    """A run's folder as its first attempt left it (config.toml), and the restarted command line's
    settings: the same run, dp and the collective timeout still to derive."""
    command = Config().replace(name="gpt-tiny", micro_batch=4, out=str(folder), **layout)
    folder.mkdir()
    (folder / "config.toml").write_text(command.replace(dp=4 // command.parallel.tp, timeout=20.0).to_toml())
    return command


@pytest.fixture
def restarted(monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")


def test_a_restart_on_fewer_ranks_shrinks_dp_and_keeps_the_global_batch(restarted, tmp_path):
    command = _begun(tmp_path / "run")
    cfg, sentence, kept = continue_after_restart(command, 2)
    assert (cfg.parallel.dp, cfg.train.micro_batch, cfg.train.grad_accum, cfg.run.resume) == (2, 4, 2, True)
    assert kept is None  # nothing for --layout auto to choose
    assert continue_after_restart(command.replace(dp=4), 2)[0].parallel.dp == 2  # a given --dp: the world sets it
    assert cfg.parallel.timeout == 20.0  # the first attempt's, the same in every worker
    assert sentence == ("restart 1: 2 of 4 ranks lost (the world is 2); starting over (no checkpoint was complete) "
                        "as dp 4 -> 2, tp 1, pp 1, the global batch of 16 sequences kept by --grad-accum 1 -> 2")


def test_a_restart_on_the_same_world_or_of_another_run_changes_nothing(restarted, tmp_path):
    command = _begun(tmp_path / "run")
    cfg, sentence, _ = continue_after_restart(command, 4)
    assert (cfg.parallel.dp, cfg.train.grad_accum, cfg.run.resume, sentence) == (4, 1, True, None)
    other = command.replace(lr=0.5)  # not the run in the folder: the first attempt's refusals apply
    assert continue_after_restart(other, 2, frozenset({"lr"})) == (other, None, frozenset({"lr"}))


def test_a_world_the_saved_model_parallel_sizes_cannot_use_is_one_sentence(restarted, tmp_path):
    command = _begun(tmp_path / "run", tp=4, n_heads=4)
    with pytest.raises(UserError) as refused:
        continue_after_restart(command, 2)
    assert str(refused.value) == (
        "restart 1: 2 of 4 ranks lost (the world is 2), which cannot hold the run's tp 4 (their product 4 must "
        "divide the world); start the job again on a multiple of 4 ranks with --resume and the same --out (under "
        "--layout auto, sizes the command line does not give are planned anew).")


def test_local_sgd_which_keeps_an_optimizer_state_per_rank_is_refused_on_another_world(restarted, tmp_path):
    command = _begun(tmp_path / "run", sync_every=4)
    with pytest.raises(UserError, match=r"^restart 1: 2 of 4 ranks lost \(the world is 2\), but local SGD "
                                        r"\(--sync-every 4\) saved one optimizer state per data-parallel rank"):
        continue_after_restart(command, 2)


def test_a_layout_auto_run_on_fewer_ranks_is_planned_anew_at_its_global_batch(restarted, tmp_path):
    """The planner chose tp 2 x dp 2, ZeRO-1 and 4 x 2 sequences on 4 ranks; on 2 the workers plan
    again (rank 0 for all), keeping what the command gave, at the run's 16 sequences a step."""
    run = tmp_path / "run"
    command = Config().replace(name="gpt-tiny", seq_len=32, layout="auto", out=str(run))
    chosen = {"dp": 2, "tp": 2, "zero": 1, "micro_batch": 4, "grad_accum": 2}
    run.mkdir()
    (run / "config.toml").write_text(command.replace(**chosen, timeout=20.0, report_memory=True).to_toml())
    (run / PLAN_FILE).write_text(json.dumps({"layout": {**chosen, "pp": 1, "cp": 1, "ep": 1, "sp": False}}))
    cfg, sentence, kept = continue_after_restart(command, 2, frozenset({"seq_len", "layout", "dp", "grad_accum"}))
    assert kept == {"seq_len", "layout"}  # the world's sizes are the planner's again
    assert (cfg.parallel.tp, cfg.parallel.zero, cfg.run.resume, cfg.parallel.timeout) == (1, 0, True, 20.0)
    assert run_global_batch(cfg, 2, kept) == 16
    assert sentence == ("restart 1: 2 of 4 ranks lost (the world is 2); starting over (no checkpoint was complete), "
                        "re-planned by --layout auto at the global batch of 16 sequences")
    assert continue_after_restart(command, 4, kept)[0].parallel.tp == 2  # on its own world: the run's choice


def _train(corpus: Path, out: Path, *extra: str) -> list[str]:
    return ["train", "--model", "gpt-tiny", "--data", str(corpus), "--seq-len", "32", "--micro-batch", "4",
            "--steps", "6", "--warmup-steps", "1", "--checkpoint-every", "1", "--eval-every", "0",
            "--eval-batches", "1", "--sample-tokens", "0", "--no-progress", "--cache-dir", str(out.parent / "cache"),
            "--out", str(out), *extra]


def _losses(run: Path) -> dict[int, float]:
    """The loss of each step, as the last attempt that took it recorded it."""
    records = (json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines())
    return {record["step"]: record["loss"] for record in records}


@pytest.mark.slow  # 30-40 s alone, 60 s beside a second copy: python3 -m pytest -m slow tests/test_elastic.py
@pytest.mark.parametrize("layout,said", [
    ([], "restart 1: 2 of 4 ranks lost (the world is 2); resuming from step_000003 as dp 4 -> 2, tp 1, pp 1, the "
         "global batch of 16 sequences kept by --grad-accum 1 -> 2"),
    (["--layout", "auto"], "restart 1: 2 of 4 ranks lost (the world is 2); resuming from step_000003, re-planned "
                           "by --layout auto at the global batch of 16 sequences"),
], ids=["given", "auto"])
def test_a_lost_node_restarts_on_the_survivor_re_laid_out_with_the_same_losses(corpus, tmp_path, layout, said):
    """Two agents of 2 workers (dp 4); the one that does not serve the rendezvous store hangs its
    workers in step 4 of the first attempt and is then killed, agent and workers, as a node is lost.
    The survivor's workers fail their collective at once (the dead peer's sockets close), its agent
    restarts them, the rendezvous settles on one node, and the run goes on from step_000003 as
    dp 2 with --grad-accum 2 (or as --layout auto plans it anew): steps 4 to 6 those of one process
    reading the global batch of 16."""
    run = tmp_path / "elastic" / "run"
    logs = tmp_path / "elastic" / "logs"
    logs.mkdir(parents=True)
    port = free_port()
    # A dead node is dropped once its keep-alives stop (keep_alive_interval x keep_alive_max_attempt
    # seconds, 15 by default), and the rendezvous then waits last_call_timeout for more nodes (30 s by
    # default). The first round waits as long, and with a minimum of one node an agent that joins
    # later than that would start the job alone: 5 s leaves a loaded machine's second agent time to
    # join; a live agent whose keep-alives a loaded machine delays by 3 s would be dropped.
    # --timeout 20 sets the heartbeats that name the dead rank (runtime/health.py) to 1 s.
    conf = "join_timeout=60,last_call_timeout=5,keep_alive_interval=1,keep_alive_max_attempt=3"
    agent = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2", "--nproc-per-node", "2",
             "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"elastic-{port}",
             "--local-addr", "127.0.0.1", "--max-restarts", "1", "--monitor-interval", "0.1"]
    job = ["-m", "scaletrain", *_train(corpus, run, "--timeout", "20", *layout)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # Only the lost node's workers see the fault, whichever ranks the rendezvous gives them.
    lost_env = {**env, "SCALETRAIN_FAULT": "; ".join(f"hang rank={rank} step=4" for rank in range(4))}
    agents = [subprocess.Popen([*agent, "--rdzv-conf", f"is_host={host},{conf}", *job], cwd=ROOT, env=agent_env,
                               stdout=(logs / f"{host}.out").open("w"), stderr=(logs / f"{host}.err").open("w"))
              for host, agent_env in (("true", env), ("false", lost_env))]
    survivor, lost = agents
    try:
        deadline = time.monotonic() + TIMEOUT_S
        # The newest checkpoint before the hang: the restart resumes from it whenever the kill lands.
        while not (run / "checkpoints").is_dir() or getattr(latest_checkpoint(run), "name", "") != "step_000003":
            assert time.monotonic() < deadline and lost.poll() is None, (logs / "false.err").read_text()[-3000:]
            time.sleep(0.05)
        _kill_tree(lost)
        code = survivor.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for process in agents:
            if process.poll() is None:
                _kill_tree(process)
    out, err = (logs / "true.out").read_text(), (logs / "true.err").read_text()
    assert code == 0, err[-4000:]
    assert [line for line in out.splitlines() if line.startswith("restart 1:")] == [said]
    saved = load_run_config(run)
    assert (run_world(saved), sequences_per_step(saved)) == (2, 16)
    if not layout:
        assert (saved.parallel.dp, saved.train.micro_batch, saved.train.grad_accum) == (2, 4, 2)

    straight = tmp_path / "straight" / "run"
    result = run_cli(*_train(corpus, straight, "--grad-accum", "4"), timeout=TIMEOUT_S)
    assert result.returncode == 0, result.stderr[-3000:]
    expected = _losses(straight)
    assert sorted(_losses(run)) == sorted(expected) == [1, 2, 3, 4, 5, 6]
    assert _losses(run) == pytest.approx(expected, rel=1e-5)  # parity's tolerance for fp32
