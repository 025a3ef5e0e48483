"""scaletrain export: any checkpoint as one safetensors file that a fresh model
loads strictly, with the step and the configuration in its header."""

import pytest
import tomllib
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from scaletrain.commands.cli import main
from scaletrain.data import ByteTokenizer
from scaletrain.models import build_model
from scaletrain.train import checkpoint as ckpt
from scaletrain.commands.train import execute, launch, prepare_run

BYTE_VOCAB = ByteTokenizer().vocab_size  # the byte tokenizer's (with its end-of-text token), which tiny_cfg uses


@pytest.fixture
def trained(tiny_cfg):
    """A one-process run of two steps: (its config, its run folder)."""
    cfg = tiny_cfg.replace(steps=2)
    summary = execute(*prepare_run(cfg))
    return cfg, summary.run_dir


def fresh_gpt(cfg):
    return build_model(cfg.model, vocab_size=BYTE_VOCAB, seq_len=cfg.data.seq_len)


def export(source, target, *extra):
    return main(["export", "--from", str(source), "--to", str(target), *extra])


def header(path):
    with safe_open(str(path), "pt") as f:
        return f.metadata()


def test_a_one_process_checkpoint_loads_strictly_into_a_fresh_model(trained, tmp_path, capsys):
    cfg, run_dir = trained
    target = tmp_path / "model.safetensors"
    assert export(run_dir / "checkpoints" / "step_000002", target) == 0
    exported = load_file(target)
    model = fresh_gpt(cfg)
    model.load_state_dict(exported, strict=True)
    saved = ckpt.read_model_tensors(run_dir / "checkpoints" / "step_000002")
    assert exported.keys() == saved.keys() == model.state_dict().keys()
    assert all(torch.equal(exported[k], saved[k]) for k in saved)
    assert torch.equal(exported["head.weight"], exported["tok_emb.weight"])  # the tie, both names
    line = capsys.readouterr().out.strip()
    parameters = sum(p.numel() for p in model.parameters())  # the tied weight once
    assert line == (f"exported step 2: {len(saved)} tensors, {parameters:,} parameters, "
                    f"{target.stat().st_size:,} bytes to {target}")


def test_a_tensor_parallel_checkpoint_exports_whole_tensors(tiny_cfg, tmp_path):
    """Saved as tp2 slices, exported as the tensors one device holds: equal to the
    checkpoint loaded into a single-device model, the way a one-process resume does."""
    summary = launch(tiny_cfg.replace(nproc=2, tp=2, steps=2))
    target = tmp_path / "model.safetensors"
    assert export(summary.run_dir, target) == 0  # a run folder: its latest checkpoint
    exported = load_file(target)
    resumed = fresh_gpt(tiny_cfg)
    ckpt.load_checkpoint(summary.checkpoint, resumed, torch.optim.AdamW(resumed.parameters()))
    expected = resumed.state_dict()
    assert exported.keys() == expected.keys()
    for name, tensor in expected.items():
        assert exported[name].shape == tensor.shape, name
        assert torch.equal(exported[name], tensor), name
    fresh_gpt(tiny_cfg).load_state_dict(exported, strict=True)


def test_dtype_bf16_casts_every_tensor(trained, tmp_path):
    cfg, run_dir = trained
    target = tmp_path / "model.safetensors"
    assert export(run_dir, target, "--dtype", "bf16") == 0
    exported = load_file(target)
    saved = ckpt.read_model_tensors(ckpt.latest_checkpoint(run_dir))
    assert {t.dtype for t in exported.values()} == {torch.bfloat16}
    assert all(torch.equal(exported[k], saved[k].to(torch.bfloat16)) for k in saved)
    fresh_gpt(cfg).to(torch.bfloat16).load_state_dict(exported, strict=True)


def test_the_header_holds_the_step_and_the_configuration(trained, tmp_path):
    cfg, run_dir = trained
    target = tmp_path / "model.safetensors"
    assert export(run_dir, target) == 0
    meta = header(target)
    assert meta["format"] == "scaletrain-model-v1" and meta["step"] == "2"
    assert meta["tied"] == "head.weight=tok_emb.weight"
    assert meta["config"] == (run_dir / "config.toml").read_text()
    assert tomllib.loads(meta["config"])["model"]["name"] == cfg.model.name


def test_force_replaces_an_existing_file(trained, tmp_path):
    _, run_dir = trained
    out = tmp_path / "out"
    out.mkdir()
    target = out / "model.safetensors"
    target.write_text("an older export")
    assert export(run_dir, target, "--force") == 0
    assert header(target)["step"] == "2"
    assert [p.name for p in out.iterdir()] == ["model.safetensors"]  # no temporary file left


MISTAKES = {
    "missing --from": (lambda run, tmp: (tmp / "no-such-run", tmp / "m.safetensors"), "does not exist"),
    "no complete checkpoint": (lambda run, tmp: (run / "checkpoints" / "step_000009", tmp / "m.safetensors"),
                               "holds no complete checkpoint"),
    "missing --to folder": (lambda run, tmp: (run, tmp / "no-such-folder" / "m.safetensors"),
                            "does not exist; create it first"),
    "not .safetensors": (lambda run, tmp: (run, tmp / "m.pt"), "does not end in .safetensors"),
    "existing --to": (lambda run, tmp: (run, tmp / "kept.safetensors"), "add --force"),
}


@pytest.mark.parametrize("mistake", MISTAKES)
def test_mistakes_are_one_sentence_and_write_nothing(trained, tmp_path, capsys, mistake):
    _, run_dir = trained
    out = tmp_path / "out"
    out.mkdir()
    (out / "kept.safetensors").write_text("not to be touched")
    (run_dir / "checkpoints" / "step_000009").mkdir()  # a save that never completed
    paths, phrase = MISTAKES[mistake]
    source, target = paths(run_dir, out)
    assert export(source, target) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and phrase in err, err
    assert [p.name for p in out.iterdir()] == ["kept.safetensors"]
    assert (out / "kept.safetensors").read_text() == "not to be touched"
