"""Fine-tuning from a Hugging Face GPT-2 folder and from BPE runs: the new data tokenized by the
base's own tokenizer, the GPT-2 architecture rebuilt from a run's config.toml (resume, generate,
export), the first step's loss equal to transformers' on the same tokens.

The GPT-2 folder is made here, never downloaded: a random transformers GPT2LMHeadModel saved with
save_pretrained, beside a small byte-level BPE (vocab.json + merges.txt) trained with the
tokenizers library, as a user's downloaded folder holds them.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from tokenizers import ByteLevelBPETokenizer

from scaletrain.commands.cli import main
from scaletrain.commands.generate import load_run_model
from scaletrain.commands.parity import run_parity
from scaletrain.commands.train import execute, launch
from scaletrain.config import Config, load_run_config
from scaletrain.data import TokenBatches, load_tokenizer, load_tokens, split_tokens
from scaletrain.finetune.lora import adapters, apply_lora
from scaletrain.job.metrics import read_metrics
from scaletrain.models import build_model
from scaletrain.train import checkpoint as ckpt

PROSE = "".join(f"The fox number {i} jumps over the lazy dog, and the dog sleeps.\n" for i in range(600))
EXTRA_ROWS = 7  # config.json's vocab_size above the tokenizer's, as padded releases have: the model's wins
SEQ = 32
FLAGS = ["--lora-rank", "4", "--seq-len", str(SEQ), "--micro-batch", "4", "--lr", "1e-2", "--warmup-steps", "1",
         "--eval-every", "0", "--eval-batches", "1", "--sample-tokens", "0", "--no-progress"]


@pytest.fixture(scope="module")
def transformers():
    return pytest.importorskip("transformers", reason="comparing with transformers' GPT-2 needs transformers "
                                                      "installed (the dev extra)")


@pytest.fixture(scope="module")
def prose(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("prose") / "prose.txt"
    path.write_text(PROSE)
    return path


@pytest.fixture(scope="module")
def gpt2_folder(transformers, tmp_path_factory) -> Path:
    """save_pretrained of a random 2-layer GPT-2 (64 positions), and its vocab.json and merges.txt."""
    folder = tmp_path_factory.mktemp("gpt2")
    tokenizer = ByteLevelBPETokenizer()
    tokenizer.train_from_iterator([PROSE], vocab_size=300, min_frequency=2, show_progress=False)
    tokenizer.save_model(str(folder))
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_head=4, n_embd=64, n_positions=64, vocab_size=tokenizer.get_vocab_size() + EXTRA_ROWS,
        bos_token_id=None, eos_token_id=None))
    with torch.no_grad():  # biases and norms off their initial 0 and 1
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    model.eval().save_pretrained(folder, safe_serialization=True)
    return folder


def _token_file(cache: Path) -> Path:
    (path,) = cache.glob("tokens-*.bin")
    return path


def _first_batch(tokens: np.ndarray, cfg: Config) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 0's micro-batch as the trainer reads it (one rank: global samples 0..B-1)."""
    train, _ = split_tokens(tokens, cfg.data.val_fraction, cfg.data.seq_len)
    return TokenBatches(train, cfg.data.seq_len, seed=cfg.train.seed, shuffle=True).get(0, cfg.train.micro_batch)


def test_finetune_a_gpt2_folder_resume_generate_and_export(transformers, gpt2_folder, prose, tmp_path, capsys):
    run, cache = tmp_path / "ft", tmp_path / "cache"
    common = ["--no-progress", "--out", str(run)]
    assert main(["finetune", "--from", str(gpt2_folder), "--data", str(prose), "--steps", "3", "--stop-at", "2",
                 "--cache-dir", str(cache), *FLAGS, *common]) == 0
    assert main(["finetune", "--resume", *common]) == 0  # the model rebuilt from config.toml, checkpoint checked
    capsys.readouterr()

    cfg = load_run_config(run)
    hf = transformers.GPT2LMHeadModel.from_pretrained(gpt2_folder).eval()
    m = cfg.model
    assert (m.n_layers, m.n_heads, m.d_model, m.bias, m.norm_eps, m.n_positions, m.n_vocab, m.vocab_multiple) == \
        (2, 4, 64, True, hf.config.layer_norm_epsilon, 64, hf.config.vocab_size, 1)
    assert cfg.data.tokenizer_from == str(gpt2_folder)

    # The data went through the folder's tokenizer, as transformers' own GPT2Tokenizer cuts it.
    hf_ids = transformers.AutoTokenizer.from_pretrained(gpt2_folder)(PROSE)["input_ids"]
    tokens = load_tokens(_token_file(cache))
    assert np.array_equal(np.asarray(tokens), hf_ids)
    assert load_tokenizer(run / "tokenizer.json").encode(PROSE).tolist() == hf_ids

    # Step 1 ran the base alone (B = 0): its loss is transformers' on the same tokens.
    x, y = _first_batch(tokens, cfg)
    with torch.no_grad():
        hf_loss = F.cross_entropy(hf(x).logits.flatten(0, 1), y.flatten()).item()
    losses = [record["loss"] for record in read_metrics(run / "metrics.jsonl")]
    assert len(losses) == 3 and losses[0] == pytest.approx(hf_loss, rel=1e-5)
    assert losses[-1] < losses[0]

    # generate rebuilds the GPT-2 model from config.toml, merges the adapters, and tokenizes with tokenizer.json.
    tuned, _ = load_run_model(ckpt.latest_checkpoint(run))
    with torch.no_grad():
        assert F.cross_entropy(tuned(x).flatten(0, 1), y.flatten()).item() < hf_loss - 0.05
    assert main(["generate", "--from", str(run), "--prompt", "The fox", "--tokens", "8", "--temperature", "0"]) == 0
    assert capsys.readouterr().out.startswith("The fox")

    # export merges: the plain biased GPT of config.toml computes what the fine-tune (base + adapters) computes.
    assert main(["export", "--from", str(run), "--to", str(tmp_path / "merged.safetensors")]) == 0
    vocab = load_tokenizer(run / "tokenizer.json").vocab_size
    plain = build_model(cfg.model, vocab_size=vocab, seq_len=SEQ)
    plain.load_state_dict(load_file(tmp_path / "merged.safetensors"))  # strict: biases and 64 positions included
    adapted = build_model(cfg.model, vocab_size=vocab, seq_len=SEQ)
    apply_lora(adapted, cfg.finetune.lora_targets.split(","), 4, cfg.finetune.lora_alpha, 0.0)
    adapted.load_state_dict(ckpt.read_model_tensors(ckpt.latest_checkpoint(run)))
    assert all(layer.lora_B.abs().sum() > 0 for layer in adapters(adapted))
    with torch.no_grad():
        torch.testing.assert_close(plain(x), adapted(x), rtol=0, atol=1e-5)


@pytest.mark.slow
def test_finetune_a_gpt2_folder_over_two_data_parallel_ranks_equals_one_device(gpt2_folder, prose, tmp_path):
    cfg = Config().replace(base=str(gpt2_folder), lora_rank=4, data=str(prose), seq_len=SEQ, micro_batch=2,
                           steps=2, lr=1e-2, warmup_steps=1, eval_every=0, eval_batches=1, sample_tokens=0,
                           progress=False, out=str(tmp_path / "ft"), cache_dir=str(tmp_path / "cache"),
                           nproc=2, dp=2)
    report = run_parity(cfg, tolerance=1e-5)
    assert report.passed, report.to_json()


def test_a_bpe_run_is_a_base_whose_tokenizer_tokenizes_the_new_data(tiny_cfg, prose, tmp_path, capsys):
    base = execute(tiny_cfg.replace(steps=2, tokenizer="bpe", vocab_size=300), None).run_dir
    saved = load_tokenizer(base / "tokenizer.json")
    summary = launch(tiny_cfg.replace(base=str(base), lora_rank=4, data=str(prose), steps=2,
                                      out=str(tmp_path / "ft"), cache_dir=str(tmp_path / "ft-cache")))
    cfg = load_run_config(summary.run_dir)
    assert (cfg.data.tokenizer, cfg.data.tokenizer_from) == ("bpe", str(base))
    # The prose is cut by the base's BPE (trained on code), not by a BPE of its own.
    assert np.array_equal(np.asarray(load_tokens(_token_file(tmp_path / "ft-cache"))), saved.encode(PROSE))
    assert (summary.run_dir / "tokenizer.json").read_text() == (base / "tokenizer.json").read_text()
    capsys.readouterr()
    assert main(["generate", "--from", str(summary.run_dir), "--prompt", "The fox", "--tokens", "5"]) == 0
    assert capsys.readouterr().out.startswith("The fox")


def _one_sentence(capsys, phrase: str) -> None:
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and phrase in err, err


def test_a_seq_len_beyond_the_folder_positions_is_one_sentence(gpt2_folder, prose, tmp_path, capsys):
    assert main(["finetune", "--from", str(gpt2_folder), "--data", str(prose), "--out", str(tmp_path / "ft"),
                 "--cache-dir", str(tmp_path / "cache"), "--seq-len", "128"]) == 2
    _one_sentence(capsys, "--seq-len 128 is longer than the model's 64 positions")
    assert not any(tmp_path.iterdir())


def test_a_tokenizer_larger_than_the_folder_vocabulary_is_one_sentence(gpt2_folder, prose, tmp_path, capsys):
    folder = tmp_path / "gpt2"
    folder.mkdir()
    for name in ("model.safetensors", "vocab.json", "merges.txt"):
        (folder / name).write_bytes((gpt2_folder / name).read_bytes())
    config = json.loads((gpt2_folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "vocab_size": 200}))
    assert main(["finetune", "--from", str(folder), "--data", str(prose), "--out", str(tmp_path / "ft")]) == 2
    _one_sentence(capsys, "more than the vocab_size 200 of its config.json")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpt2"]


def test_the_gpt2_architecture_round_trips_through_config_toml(tmp_path):
    cfg = Config().replace(name="gpt-tiny", bias=True, norm_eps=1e-6, n_positions=48, n_vocab=301, seq_len=16)
    (tmp_path / "config.toml").write_text(cfg.to_toml())
    assert tomllib.loads(cfg.to_toml())["model"]["n_positions"] == 48
    model = build_model(load_run_config(tmp_path).model, vocab_size=256, seq_len=16)
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    assert shapes["pos_emb.weight"] == (48, 64) and shapes["tok_emb.weight"] == (301, 64)
    assert shapes["blocks.1.mlp.fc.bias"] == (256,) and model.ln_f.eps == 1e-6
