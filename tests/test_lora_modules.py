"""``--lora-targets`` in the model's Hugging Face module names and ``--lora-modules-to-save``
(finetune/adapters.py, job/export_peft.py, finetune/peft_adapter.py): PEFT's common
``q_proj,v_proj,o_proj`` trains exactly those layers (o_proj apart from down_proj); the embedding and
the head train whole beside the adapters, over data-parallel ranks and ZeRO-1 as on one device;
``export --format peft`` writes both so that ``PeftModel.from_pretrained`` computes the run's
logits (and ``--format hf`` merges them), and ``finetune --adapter`` takes the folder back; a head
tied to the embedding is one tensor, written with ``ensure_weight_tying``; an unknown name is one
sentence listing the accepted ones."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from scaletrain.commands.cli import main
from scaletrain.commands.generate import load_run_model
from scaletrain.commands.parity import run_parity
from scaletrain.config import Config
from scaletrain.train import checkpoint as ckpt
from tests.test_finetune_adapter import continue_from, exported_adapter, gpt2_base
from tests.test_hf import TEXT
from tests.test_llama_hf import PROSE, SEQ, make_folder, relative, their_logits

transformers = pytest.importorskip("transformers", reason="loading the folders needs the dev extra")
peft = pytest.importorskip("peft", reason="loading the adapter needs peft (the dev extra)")

FINETUNE = ["--lora-rank", "4", "--lora-alpha", "8", "--steps", "2", "--seq-len", str(SEQ), "--micro-batch", "4",
            "--lr", "3e-2", "--warmup-steps", "1", "--eval-every", "0", "--eval-batches", "1",
            "--sample-tokens", "0", "--no-progress"]


def finetune(base: Path, run: Path, text: str, *flags: str) -> int:
    data = run.parent / f"{run.name}.txt"
    data.write_text(text)
    return main(["finetune", "--from", str(base), "--data", str(data), "--out", str(run),
                 "--cache-dir", str(run.parent / "cache"), *FINETUNE, *flags])


def peft_logits(base: Path, adapter: Path, ids: torch.Tensor) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(base, torch_dtype=torch.float32)
    with torch.no_grad():
        return peft.PeftModel.from_pretrained(model, adapter).eval()(ids).logits


def check_round_trip(base: Path, run: Path, vocab: int, text: str) -> dict:
    """The run's PEFT export over ``base`` and its merged export compute the run's logits, and a
    fine-tune continued from the PEFT folder starts from exactly its tensors; the folder's config."""
    assert main(["export", "--from", str(run), "--to", str(run.parent / "merged"), "--format", "hf"]) == 0
    saved = exported_adapter(run)
    adapter = run.parent / f"{run.name}-peft"
    ours, _ = load_run_model(ckpt.latest_checkpoint(run))
    ids = torch.randint(0, vocab, (2, SEQ), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = ours(ids)
        assert relative(peft_logits(base, adapter, ids), logits) < 1e-5
        assert relative(their_logits(run.parent / "merged", ids), logits) < 1e-5
        assert relative(their_logits(base, ids), logits) > 1e-3  # the fine-tune moved the logits
    assert continue_from(base, adapter, run.parent / "continued", text) == 0
    back = exported_adapter(run.parent / "continued")
    assert back.keys() == saved.keys() and all(torch.equal(back[key], saved[key]) for key in saved)
    return json.loads((adapter / "adapter_config.json").read_text())


@pytest.mark.numerics
def test_hugging_face_targets_and_the_embedding_and_head_cross_to_peft_and_back(tmp_path, capsys):
    base = make_folder(tmp_path / "base", "llama")
    run = tmp_path / "run"
    assert finetune(base, run, PROSE, "--lora-targets", "q_proj,v_proj,o_proj",
                    "--lora-modules-to-save", "embed,head") == 0
    tuned = ckpt.read_model_tensors(ckpt.latest_checkpoint(run))
    # o_proj is the attention's output alone: down_proj (the MLP's) stays frozen
    assert {key.removesuffix(".lora_A") for key in tuned if key.endswith(".lora_A")} == \
        {f"blocks.{i}.attn.{layer}" for i in range(2) for layer in ("q", "v", "proj")}
    config = check_round_trip(base, run, 300, PROSE)
    assert config["target_modules"] == ["o_proj", "q_proj", "v_proj"]
    assert (config["modules_to_save"], config["ensure_weight_tying"]) == (["embed_tokens", "lm_head"], False)
    adapter = load_file(tmp_path / "run-peft" / "adapter_model.safetensors")
    assert torch.equal(adapter["base_model.model.model.embed_tokens.weight"], tuned["tok_emb.weight"])
    assert torch.equal(adapter["base_model.model.lm_head.weight"], tuned["head.weight"])
    first = load_file(base / "model.safetensors")  # both trained, apart
    assert not torch.equal(tuned["tok_emb.weight"], first["model.embed_tokens.weight"])
    assert not torch.equal(tuned["head.weight"], first["lm_head.weight"])
    capsys.readouterr()
    lines = (tmp_path / "continued" / "config.toml").read_text().splitlines()
    assert {'lora_targets = "q_proj,v_proj,o_proj"', 'lora_modules_to_save = "embed,head"'} <= set(lines)


@pytest.mark.numerics
def test_a_head_tied_to_the_embedding_is_one_tensor_in_both_roles(tmp_path, capsys):
    """GPT-2's head is its embedding: ``head`` trains the one tensor, which the export writes under
    both modules with ensure_weight_tying; attn.c_proj names the attention's c_proj alone."""
    base = gpt2_base(tmp_path / "base")
    run = tmp_path / "run"
    assert finetune(base, run, TEXT, "--lora-targets", "c_attn,attn.c_proj", "--lora-modules-to-save", "head") == 0
    tuned, first = ckpt.read_model_tensors(ckpt.latest_checkpoint(run)), load_file(base / "model.safetensors")
    assert torch.equal(tuned["tok_emb.weight"], tuned["head.weight"])
    assert not torch.equal(tuned["tok_emb.weight"], first["wte.weight"])
    config = check_round_trip(base, run, 300, TEXT)
    assert config["target_modules"] == ["attn.c_proj", "c_attn"]
    assert (config["modules_to_save"], config["ensure_weight_tying"]) == (["lm_head", "wte"], True)
    capsys.readouterr()


@pytest.mark.numerics
def test_peft_own_tied_embedding_continues_as_one_tensor_and_apart_is_refused(tmp_path, capsys):
    """peft's ensure_weight_tying (named by lm_head) trains the pair as one, which continues; the embedding
    alone, without it, peft trains apart from the head the base ties to it, which is refused."""
    base = gpt2_base(tmp_path / "base")
    for tied in (True, False):
        model = transformers.AutoModelForCausalLM.from_pretrained(base, torch_dtype=torch.float32)
        adapted = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"],
                                                             fan_in_fan_out=True, ensure_weight_tying=tied,
                                                             modules_to_save=["lm_head" if tied else "wte"]))
        torch.manual_seed(1)
        with torch.no_grad():
            for param in adapted.parameters():
                if param.requires_grad:  # B and the trained copy of the embedding off their start
                    param.add_(0.05 * torch.randn_like(param))
        adapted.save_pretrained(tmp_path / f"adapter-{tied}")
    assert continue_from(base, tmp_path / "adapter-True", tmp_path / "run", TEXT) == 0
    assert 'lora_modules_to_save = "embed"' in (tmp_path / "run" / "config.toml").read_text()
    assert main(["export", "--from", str(tmp_path / "run"), "--to", str(tmp_path / "merged"), "--format", "hf"]) == 0
    ids = torch.randint(0, 300, (2, SEQ), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        started_as = their_logits(tmp_path / "merged", ids)
        assert relative(peft_logits(base, tmp_path / "adapter-True", ids), started_as) < 1e-5
        assert relative(their_logits(base, ids), started_as) > 1e-3
    capsys.readouterr()
    assert continue_from(base, tmp_path / "adapter-False", tmp_path / "apart", TEXT) == 2
    err = capsys.readouterr().err
    assert "trains transformer.wte whole apart from lm_head, which the base ties to it" in err, err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "apart").exists()


@pytest.fixture(scope="module")
def llama_base(tmp_path_factory) -> Path:
    return make_folder(tmp_path_factory.mktemp("llama") / "base", "llama")


@pytest.mark.numerics
@pytest.mark.parametrize("zero", [0, 1], ids=["dp2", "zero1"])
def test_the_embedding_and_head_train_over_data_parallel_ranks_as_on_one_device(llama_base, tmp_path, zero):
    prose = tmp_path / "prose.txt"
    prose.write_text(PROSE)
    cfg = Config().replace(base=str(llama_base), lora_rank=4, lora_modules_to_save="embed,head", data=str(prose),
                           seq_len=SEQ, micro_batch=4, steps=3, lr=1e-3, warmup_steps=1, eval_every=0,
                           eval_batches=1, sample_tokens=0, progress=False, out=str(tmp_path / "run"),
                           cache_dir=str(tmp_path / "cache"), nproc=2, dp=2, zero=zero)
    report = run_parity(cfg, tolerance=1e-5)
    assert report.passed, report.to_json()


@pytest.mark.parametrize("flags,said", [
    (["--lora-targets", "q_proj,wq"], "--lora-targets q_proj,wq names wq; choose among qkv, q, k, v, proj, fc, gate, "
                                      "up, q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj."),
    (["--lora-modules-to-save", "embed,norm"], "--lora-modules-to-save embed,norm names norm; choose among embed, "
                                               "head, embed_tokens, lm_head."),
    (["--lora-rank", "0", "--lora-modules-to-save", "head"], "--lora-modules-to-save trains modules whole beside"),
])
def test_an_unknown_name_is_one_sentence_listing_the_accepted_ones(llama_base, tmp_path, capsys, flags, said):
    assert finetune(llama_base, tmp_path / "run", PROSE, *flags) == 2
    err = capsys.readouterr().err
    assert said in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "run").exists()


def test_modules_to_save_without_a_base_is_one_sentence(tiny_cfg, tmp_path, capsys):
    assert main(["train", "--model", "llama-tiny", "--data", tiny_cfg.data.data, "--lora-modules-to-save", "embed",
                 "--out", str(tmp_path / "run"), "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "--lora-modules-to-save adapts a base model, and there is none without --from" in err, err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "run").exists()
