"""LoRA and QLoRA over a ZeRO-3 base (parallel/zero.py's frozen units, a 4-bit base's codes in units of
bytes): parity with one device under dp2 and hybrid sharding, the ledgers equal to the planner's with
the base's bytes a rank falling as 1/N, and what ``plan`` prices."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from safetensors.torch import load_file

from scaletrain.commands.cli import main
from scaletrain.commands.parity import relative_diffs, run_parity
from scaletrain.commands.train import launch
from scaletrain.config import Config
from scaletrain.finetune.lora import ADAPTER_FILE
from scaletrain.job.base_model import as_finetune
from scaletrain.job.data_setup import prepare_data
from tests.distributed import run_distributed
from tests.test_llama_hf import PROSE, SEQ, make_folder
from tests.test_plan import assert_predicted
from tests.trainers import assert_resumes_both_ways, build_trainer


def llama_and_prose(root: Path) -> tuple[Path, Path]:
    """A random Llama-shaped Hugging Face folder and the prose to fine-tune it on, in ``root``."""
    prose = root / "prose.txt"
    prose.write_text(PROSE)
    return make_folder(root / "llama", "llama"), prose


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> tuple[Path, Path]:
    return llama_and_prose(tmp_path_factory.mktemp("lora-zero3"))


def _config(base: tuple[Path, Path], root: Path, **changes) -> Config:
    folder, prose = base
    settings = dict(base=str(folder), data=str(prose), lora_rank=4, seq_len=SEQ, micro_batch=4, steps=3, lr=1e-2,
                    warmup_steps=1, eval_every=0, eval_batches=1, sample_tokens=0, progress=False,
                    out=str(root / "run"), cache_dir=str(root / "cache"))
    return Config().replace(**{**settings, **changes})


@pytest.mark.numerics
@pytest.mark.parametrize("changes", [
    dict(nproc=2, dp=2, zero=3, micro_batch=2),
    pytest.param(dict(nproc=4, dp=4, zero=3, shard_group=2, micro_batch=1), marks=pytest.mark.slow),
    pytest.param(dict(nproc=2, dp=2, zero=3, micro_batch=2, recompute="full", offload="optimizer"),
                 marks=pytest.mark.slow),
    dict(nproc=2, dp=2, zero=3, micro_batch=2, quantize="nf4"),
    pytest.param(dict(nproc=4, dp=4, zero=3, shard_group=2, micro_batch=1, quantize="nf4"),
                 marks=pytest.mark.slow),
    pytest.param(dict(nproc=2, dp=2, zero=3, micro_batch=2, quantize="nf4", offload="base", recompute="full"),
                 marks=pytest.mark.slow),
], ids=["dp2", "shard-group-2", "recompute-offload", "qlora-dp2", "qlora-shard-group-2", "qlora-offload-base"])
def test_lora_over_a_zero3_base_reproduces_one_device(base, tmp_path, changes):
    """scaletrain parity at fp32's 1e-5 over the same global batch. The slow ones (about 20 s each):
    ``pytest -m slow tests/test_lora_zero3.py``."""
    report = run_parity(_config(base, tmp_path, **changes), tolerance=1e-5)
    assert report.passed, report.to_json()
    assert report.reference_losses[-1] < report.reference_losses[0]


def exported(run: Path) -> dict[str, dict]:
    """A fine-tune's adapters file and its ``export --format peft`` and ``--format hf`` folders' tensors,
    exported beside the run folder."""
    for form in ("peft", "hf"):
        assert main(["export", "--from", str(run), "--to", str(run.parent / form), "--format", form]) == 0
    return {"adapters": load_file(run / ADAPTER_FILE),
            "peft": load_file(run.parent / "peft" / "adapter_model.safetensors"),
            "hf": load_file(run.parent / "hf" / "model.safetensors")}


@pytest.mark.parametrize("quantize", ["none", pytest.param("nf4", marks=pytest.mark.slow)])
def test_a_zero3_fine_tune_writes_and_exports_the_adapters_one_device_does(base, tmp_path, quantize):
    """The adapters file and ``export --format peft`` / ``--format hf`` of a dp2 ZeRO-3 run (gathered
    from its shards by the checkpoint, a 4-bit base's codes too), against one device's over the same
    global batch (the parity figure over each file's tensors; about 8 s each)."""
    files = {}
    for name, changes in (("one", {}), ("zero3", dict(nproc=2, dp=2, zero=3, micro_batch=2))):
        files[name] = exported(launch(_config(base, tmp_path / name, quantize=quantize, **changes)).run_dir)
    for form, reference in files["one"].items():
        _, whole = relative_diffs(files["zero3"][form], reference)
        assert whole < 1e-5, form


def _measure(rank: int, n: int, cfg: Config, spec) -> tuple:
    """This rank's memory ledger, its second step's communication, and the bytes of its shard of the base."""
    trainer = build_trainer(rank, n, cfg, spec)
    trainer.train_step(0)
    before = trainer.comm.ledger.snapshot()
    trainer.train_step(1)
    zero = trainer.stepper.layout.zero
    base_shard = {codes: sum(unit.shard.nbytes for unit in zero.frozen_units if unit.in_bytes == codes)
                  for codes in (False, True)}
    whole_now = sum(unit.full.untyped_storage().nbytes() for unit in zero.frozen_units)  # all freed after a step
    return (trainer.stepper.memory, trainer.comm.ledger.since(before)), base_shard, whole_now


@pytest.mark.parametrize("quantize", [pytest.param("none", marks=pytest.mark.slow), "nf4"])
def test_the_base_is_sharded_as_1_over_n_and_the_planner_predicts_the_ledgers(base, tmp_path, quantize):
    """Two and four ranks: every rank holds 1/N of the frozen base (its padding aside; a 4-bit base's
    codes too), none of it gathered between steps, and each rank's memory and communication ledgers
    are the planner's. The float base alone (about 15 s): ``pytest -m slow tests/test_lora_zero3.py``."""
    cfg = as_finetune(_config(base, tmp_path, zero=3, report_memory=True, steps=2, quantize=quantize))
    spec = prepare_data(cfg, Path(cfg.data.cache_dir))
    shards = {}
    for n in (2, 4):
        measured = run_distributed(_measure, n, cfg, spec, timeout_s=300)
        assert all(whole == 0 for _, _, whole in measured)
        assert_predicted(cfg, n, spec.vocab_size, [ledgers for ledgers, _, _ in measured])
        shards[n] = [shard for _, shard, _ in measured]
    for codes in (False, True) if quantize == "nf4" else (False,):
        per_rank = {n: {shard[codes] for shard in shards[n]} for n in (2, 4)}
        assert len(per_rank[2]) == 1 and len(per_rank[4]) == 1
        assert min(per_rank[2]) > 0 and min(per_rank[4]) == pytest.approx(min(per_rank[2]) / 2, rel=0.01)


def _plan(capsys, *flags: str) -> dict:
    assert main(["plan", "--model", "llama2-7b", "--gpus", "4", "--gpu", "A100", "--micro-batch", "4", "--seq",
                 "512", "--dp", "4", "--param-dtype", "bf16", "--lora-rank", "16", *flags, "--json"]) == 0, \
        capsys.readouterr().err
    return json.loads(capsys.readouterr().out)["candidates"][0]


def test_plan_prices_lora_over_a_zero3_base_at_a_quarter_of_the_base(capsys):
    sharded, whole = _plan(capsys, "--zero", "3"), _plan(capsys, "--zero", "2")
    assert sharded["layout"]["zero"] == 3 and sharded["layout"]["lora_rank"] == 16
    # 7B frozen bf16 weights: whole on every rank under ZeRO-2, a quarter of them under ZeRO-3
    assert whole["memory_bytes"]["params"] > 13e9
    assert sharded["memory_bytes"]["params"] == pytest.approx(whole["memory_bytes"]["params"] / 4, rel=0.01)


@pytest.mark.slow
@pytest.mark.numerics
def test_a_qlora_zero3_checkpoint_resumes_on_one_device_and_back(base, tmp_path):
    """Saved under dp2 ZeRO-3 after step 2 (the 4-bit codes as each rank's bytes), resumed on one
    process, and the other way: steps 3 and 4 as the uninterrupted run's (fp32, 1e-5; about 25 s)."""
    cfg = as_finetune(_config(base, tmp_path / "zero3", quantize="nf4", steps=4, nproc=2, dp=2, zero=3,
                              micro_batch=2))
    one = as_finetune(_config(base, tmp_path / "one", quantize="nf4", steps=4))
    assert_resumes_both_ways(cfg, one, prepare_data(cfg, Path(cfg.data.cache_dir)), 2)


def test_llama3_70b_qlora_fits_two_24_gb_gpus_with_its_base_on_the_host(capsys):
    """The planner's row for Answer.AI's demonstration (a 70B QLoRA on two 24 GB GPUs, the base's shards
    offloaded): it fits, with the frozen base's shards counted on the host, not the device."""
    flags = ["plan", "--model", "llama3-70b", "--gpus", "2", "--gpu", "A100", "--gpu-memory", "24GB", "--seq", "512",
             "--global-batch", "8", "--param-dtype", "bf16", "--lora-rank", "16", "--quantize", "nf4", "--zero", "3",
             "--json"]
    assert main([*flags, "--offload", "base"]) == 0
    best = json.loads(capsys.readouterr().out)["candidates"][0]
    memory = best["memory_bytes"]
    assert best["fits"] and best["layout"]["zero"] == 3 and memory["total"] <= 24e9
    host = sum(bytes_ for row, bytes_ in memory.items() if row != "total") - memory["total"]
    assert host > 17e9  # half of the 4-bit base (about 0.52 bytes a weight) on each rank's host
    assert main(flags) == 2  # on the device, the same shards do not fit
    assert "no layout fits" in capsys.readouterr().err


def test_offload_base_without_a_sharded_base_is_one_sentence(base, tmp_path, capsys):
    folder, prose = base
    assert main(["finetune", "--from", str(folder), "--data", str(prose), "--nproc", "2", "--zero", "2",
                 "--lora-rank", "4", "--offload", "base", "--seq-len", str(SEQ), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "--offload base keeps ZeRO-3's shards of a fine-tune's frozen base in host memory" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists()
