"""A LoRA fine-tune's adapters as a PEFT folder (job/export_peft.py): ``PeftModel.from_pretrained``
over the base folder computes the logits of the run, as its merged ``--format hf`` export does, and
``finetune --adapter`` takes the folder back (finetune/peft_adapter.py), starting from exactly those
adapters."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from scaletrain.commands.cli import main
from tests.test_finetune_adapter import continue_from, exported_adapter
from tests.test_llama_hf import PROSE, SEQ, make_folder, relative, their_logits

transformers = pytest.importorskip("transformers", reason="loading the folders needs the dev extra")
peft = pytest.importorskip("peft", reason="loading the adapter needs peft (the dev extra)")

FINETUNE = ["--lora-rank", "4", "--lora-alpha", "8", "--steps", "3", "--seq-len", str(SEQ), "--micro-batch", "4",
            "--lr", "3e-2", "--warmup-steps", "1", "--eval-every", "0", "--eval-batches", "1",
            "--sample-tokens", "0", "--no-progress"]


@pytest.mark.numerics
def test_the_adapters_load_in_peft_over_the_base_give_the_runs_logits_and_come_back(tmp_path, capsys):
    base = make_folder(tmp_path / "base", "llama")
    prose, run = tmp_path / "prose.txt", tmp_path / "run"
    prose.write_text(PROSE)
    assert main(["finetune", "--from", str(base), "--data", str(prose), "--out", str(run),
                 "--cache-dir", str(tmp_path / "cache"), *FINETUNE]) == 0
    assert main(["export", "--from", str(run), "--to", str(tmp_path / "merged"), "--format", "hf"]) == 0
    assert main(["export", "--from", str(run), "--to", str(tmp_path / "adapter"), "--format", "peft"]) == 0
    capsys.readouterr()
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["fan_in_fan_out"]) == (4, 8.0, False)
    assert config["target_modules"] == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj",
                                        "v_proj"]
    model = transformers.AutoModelForCausalLM.from_pretrained(base, torch_dtype=torch.float32)
    adapted = peft.PeftModel.from_pretrained(model, tmp_path / "adapter").eval()
    ids = torch.randint(0, 300, (2, SEQ), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        merged = their_logits(tmp_path / "merged", ids)
        assert relative(adapted(ids).logits, merged) < 1e-5
        assert relative(their_logits(base, ids), merged) > 1e-3  # the adapters moved the logits
    # And back: a fine-tune continued from the folder starts from exactly its adapters, as the
    # model PeftModel computes (a step that moves nothing: tests/test_finetune_adapter.py).
    assert continue_from(base, tmp_path / "adapter", tmp_path / "continued") == 0
    assert main(["export", "--from", str(tmp_path / "continued"), "--to", str(tmp_path / "continued-merged"),
                 "--format", "hf"]) == 0
    saved = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    back = exported_adapter(tmp_path / "continued")
    assert back.keys() == saved.keys() and all(torch.equal(back[key], saved[key]) for key in saved)
    with torch.no_grad():
        assert relative(adapted(ids).logits, their_logits(tmp_path / "continued-merged", ids)) < 1e-5


def test_a_run_without_adapters_is_refused_in_one_sentence(tiny_cfg, capsys, tmp_path):
    run = tmp_path / "run"
    assert main(["train", "--model", "gpt-tiny", "--data", tiny_cfg.data.data, "--steps", "1", "--seq-len", "32",
                 "--micro-batch", "2", "--eval-every", "0", "--eval-batches", "1", "--sample-tokens", "0",
                 "--no-progress", "--out", str(run), "--cache-dir", str(tmp_path / "cache")]) == 0
    capsys.readouterr()
    assert main(["export", "--from", str(run), "--to", str(tmp_path / "adapter"), "--format", "peft"]) == 2
    err = capsys.readouterr().err
    assert "--format peft writes a LoRA fine-tune's adapters" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "adapter").exists()
