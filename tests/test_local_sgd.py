"""Local SGD (--sync-every N) on two real gloo ranks: N = 1 is data parallelism and matches one
device; N = 4 is its own definition (local steps, then the mean of the replicas), moves a quarter
of the bytes, keeps the AdamW moments per rank and checkpoints them per rank.

One distributed job (the module fixture) trains every variant side by side; the tests read it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from scaletrain.commands.train import check_optimizer_layout
from scaletrain.config import Config
from scaletrain.errors import UserError
from scaletrain.job.data_setup import prepare_data
from scaletrain.job.trainer import Trainer
from scaletrain.parallel.data import DataParallel
from scaletrain.parallel.local_sgd import LocalSGD
from scaletrain.runtime import Comm, Mesh, ParallelDims, ProcessEnv
from scaletrain.runtime.launch import DistRuntime
from tests.distributed import run_distributed
from tests.trainers import build_trainer

STEPS = 4  # steps taken by each variant; N = 4 averages once, after the last of them
N = 4


def _flat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).float() for t in tensors])


def _params(trainer: Trainer) -> torch.Tensor:
    return _flat(trainer.layout.model.parameters())


def _moments(trainer: Trainer) -> torch.Tensor:
    """AdamW's state, every parameter's: both moments and the step count."""
    return _flat(trainer.layout.optimizer.state[p][key] for p in trainer.layout.step_params
                 for key in ("exp_avg", "exp_avg_sq", "step"))


def _bytes(ledger: dict) -> int:
    return sum(entry["bytes"] for groups in ledger.values() for entry in groups.values())


def _single_device(cfg: Config, spec) -> Trainer:
    """The reference: one rank, a world of its own, the whole global batch."""
    env = ProcessEnv(0, 1, 0, 1, "127.0.0.1", 0, "single")
    return Trainer(cfg, spec, DistRuntime(env, None, torch.device("cpu")), Mesh.build(ParallelDims(), 0, 1),
                   Comm(), Path(cfg.run.out))


def _variants(rank: int, n: int, cfgs: dict[str, Config], spec) -> dict:
    seen: dict = {}
    trainers = {name: build_trainer(rank, n, cfg, spec) for name, cfg in cfgs.items() if name != "reference"}
    if rank == 0:
        trainers["reference"] = _single_device(cfgs["reference"], spec)
    seen["kinds"] = {name: type(t.layout.data_parallel).__name__ for name, t in trainers.items()}
    for name, trainer in trainers.items():
        losses, ledgers, params = [], [], []
        for step in range(STEPS):
            before = trainer.comm.ledger.snapshot()
            losses.append(trainer.train_step(step)["loss"])
            ledgers.append(trainer.comm.ledger.since(before))
            params.append(_params(trainer))
        seen[name] = {"losses": losses, "ledgers": ledgers, "params": params}
    for name in ("local", "apart"):
        seen[name]["moments"] = _moments(trainers[name])
    # The mean of the never-averaged replicas, by the same all-reduce as the average's.
    mean = _params(trainers["apart"])
    trainers["apart"].comm.all_reduce(mean, trainers["apart"].layout.replicas.dense, op="avg")
    seen["apart"]["mean"] = mean
    seen["checkpoint"] = str(trainers["local"].save(STEPS))
    resumed = build_trainer(rank, n, cfgs["local"].replace(resume=True), spec)
    seen["resumed"] = {"start": resumed.start_step, "params": _params(resumed), "moments": _moments(resumed)}
    seen["param_bytes"] = sum(p.numel() * p.element_size() for p in trainers["dp"].layout.model.parameters())
    return seen


@pytest.fixture(scope="module")
def runs(corpus, tmp_path_factory) -> list[dict]:
    root = tmp_path_factory.mktemp("local_sgd")
    base = Config().replace(name="gpt-tiny", data=str(corpus), seq_len=32, micro_batch=4, steps=2 * N,
                            warmup_steps=1, eval_every=0, eval_batches=1, sample_tokens=0, progress=False,
                            cache_dir=str(root / "cache"), nproc=2, dp=2)
    cfgs = {
        "dp": base.replace(sync_every=1, out=str(root / "dp")),
        "local": base.replace(sync_every=N, out=str(root / "local")),
        # averages first after step 2N: over the first N steps, the replicas as local SGD leaves them
        "apart": base.replace(sync_every=2 * N, out=str(root / "apart")),
        "reference": base.replace(nproc=1, dp=1, micro_batch=8, out=str(root / "reference")),
    }
    spec = prepare_data(base, Path(base.data.cache_dir))
    return run_distributed(_variants, 2, cfgs, spec, timeout_s=240)


def _rel(a, b) -> float:
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return ((a - b).norm() / b.norm()).item()


def test_sync_every_1_is_data_parallel_and_matches_one_device(runs):
    """--sync-every 1 (the default) is plain data parallelism: per-step losses and the final
    weights within 1e-5 of single-device training on the same global batch (fp32). N = 4 is
    not a parity layout: it departs from the second step on."""
    first = runs[0]
    assert first["kinds"]["dp"] == DataParallel.__name__ and first["kinds"]["local"] == LocalSGD.__name__
    reference, dp, local = first["reference"], first["dp"], first["local"]
    for got, want in zip(dp["losses"], reference["losses"]):
        assert abs(got - want) / abs(want) <= 1e-5, (dp["losses"], reference["losses"])
    assert _rel(dp["params"][-1], reference["params"][-1]) <= 1e-5
    assert reference["losses"][0] != reference["losses"][-1]
    assert local["losses"][0] == dp["losses"][0]  # the same weights and data at step 1
    assert abs(local["losses"][1] - dp["losses"][1]) / abs(dp["losses"][1]) > 1e-5


def test_replicas_drift_apart_and_are_identical_after_an_average(runs):
    zero, one = runs
    for step in range(N - 1):
        assert not torch.equal(zero["local"]["params"][step], one["local"]["params"][step])
    assert torch.equal(zero["local"]["params"][N - 1], one["local"]["params"][N - 1])


def test_an_average_is_the_mean_of_the_local_trajectories(runs):
    """Before the average each rank is where its own steps led (the never-averaged run, bit for bit);
    after it, every rank holds the mean of those replicas."""
    for seen in runs:
        for step in range(N - 1):
            assert torch.equal(seen["local"]["params"][step], seen["apart"]["params"][step])
        assert torch.equal(seen["local"]["params"][N - 1], seen["apart"]["mean"])
        assert not torch.equal(seen["apart"]["params"][N - 1], seen["apart"]["mean"])


def test_adamw_moments_stay_local_and_resume_per_rank(runs):
    zero, one = runs
    assert not torch.equal(zero["local"]["moments"], one["local"]["moments"])
    for seen in runs:
        assert torch.equal(seen["local"]["moments"], seen["apart"]["moments"])  # never averaged
        resumed = seen["resumed"]
        assert resumed["start"] == STEPS
        assert torch.equal(resumed["moments"], seen["local"]["moments"])  # this rank's own, back
        assert torch.equal(resumed["params"], seen["local"]["params"][-1])


def test_a_resume_keeps_to_the_per_rank_optimizer_state(runs):
    """The checkpoint holds two ranks' own moments: resumed by local SGD over 2 ranks, nothing else."""
    path = Path(runs[0]["checkpoint"])
    check_optimizer_layout(path, Config().replace(sync_every=N, dp=2))
    for changes in ({"sync_every": 1, "dp": 2}, {"sync_every": N, "dp": 4}):
        with pytest.raises(UserError, match="resume with --sync-every above 1 over 2 data-parallel ranks"):
            check_optimizer_layout(path, Config().replace(**changes))


def test_sync_every_4_moves_a_quarter_of_the_bytes_per_step(runs):
    for seen in runs:
        dp, local = seen["dp"]["ledgers"], seen["local"]["ledgers"]
        # steps 1..N-1 of local SGD move only the 4-byte loss average and non-finite flag
        scalars = _bytes(local[0])
        assert scalars <= 8 and all(_bytes(ledger) == scalars for ledger in local[:N - 1])
        assert all(_bytes(ledger) == seen["param_bytes"] + scalars for ledger in dp)
        model_traffic = {name: sum(_bytes(ledger) for ledger in ledgers) - STEPS * scalars
                         for name, ledgers in (("dp", dp), ("local", local))}
        assert model_traffic["local"] * N == model_traffic["dp"] == STEPS * seen["param_bytes"]
        assert local[N - 1]["all_reduce"]["dp"]["bytes"] == seen["param_bytes"] + 4


def _replicas_after_each_step(rank: int, n: int, cfg: Config, spec) -> dict:
    trainer = build_trainer(rank, n, cfg, spec)
    weights, masters, losses, ops = [], [], [], set()
    for step in range(cfg.train.steps):
        before = trainer.comm.ledger.snapshot()
        losses.append(trainer.train_step(step)["loss"])
        ops.update(trainer.comm.ledger.since(before))
        weights.append(_params(trainer))
        masters.append(_flat(trainer.layout.step_params))
    return {"weights": weights, "masters": masters, "losses": losses, "ops": ops}


@pytest.mark.slow
def test_bf16_masters_averaged_by_the_ring(corpus, tmp_path):
    """With --param-dtype bf16 the fp32 masters are what is averaged (and rounded into the bf16
    model), here by the hand-written ring: identical replicas, masters and weights, after every
    second step, different ones in between."""
    cfg = Config().replace(name="gpt-tiny", data=str(corpus), seq_len=32, micro_batch=4, steps=4, warmup_steps=1,
                           eval_every=0, eval_batches=1, sample_tokens=0, progress=False, nproc=2, dp=2,
                           cache_dir=str(tmp_path / "cache"), out=str(tmp_path / "run"), sync_every=2,
                           allreduce="ring", precision="bf16", param_dtype="bf16")
    zero, one = run_distributed(_replicas_after_each_step, 2, cfg, prepare_data(cfg, tmp_path / "cache"),
                                timeout_s=240)
    assert "send" in zero["ops"]
    for step in range(4):
        same = step % 2 == 1
        for kind in ("weights", "masters"):
            assert torch.equal(zero[kind][step], one[kind][step]) == same, (kind, step)
    assert zero["losses"][-1] < zero["losses"][0]
