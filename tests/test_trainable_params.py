"""Every run's start says ``trainable params: X || all params: Y || trainable%: Z`` as PEFT's
``print_trainable_parameters`` does (job/trainer.py ``parameter_counts``): a LoRA fine-tune of a
Hugging Face folder says PEFT's own line for the same adapters, QLoRA the same (a 4-bit weight counts
its original elements), a full run its whole model, and a layout that splits the model over ranks
the same line as one process."""

from __future__ import annotations

import pytest
import torch

from scaletrain.commands.cli import main
from scaletrain.config import ModelConfig
from scaletrain.data import ByteTokenizer
from scaletrain.models import build_model
from tests.test_llama_hf import PROSE, make_folder

transformers = pytest.importorskip("transformers", reason="loading the folder needs the dev extra")
peft = pytest.importorskip("peft", reason="the reference line is peft's (the dev extra)")

QUIET = ["--steps", "1", "--seq-len", "32", "--micro-batch", "2", "--warmup-steps", "0", "--eval-every", "0",
         "--eval-batches", "1", "--sample-tokens", "0", "--no-progress"]
HF_NAMES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]  # --lora-targets qkv,proj,fc


def said(out: str) -> str:
    (line,) = [line for line in out.splitlines() if line.startswith("trainable params: ")]
    return line


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("llama")
    (tmp / "prose.txt").write_text(PROSE)
    return make_folder(tmp / "base", "llama"), tmp / "prose.txt"


def peft_line(base, capsys) -> str:
    model = transformers.AutoModelForCausalLM.from_pretrained(base, torch_dtype=torch.float32)
    peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=HF_NAMES)).print_trainable_parameters()
    return capsys.readouterr().out.strip()


@pytest.mark.parametrize("flags", [[], ["--quantize", "nf4"]], ids=["lora", "qlora"])
def test_a_lora_fine_tune_says_peft_s_line(llama, tmp_path, capsys, flags):
    base, prose = llama
    assert main(["finetune", "--from", str(base), "--data", str(prose), "--lora-rank", "4", "--lora-alpha", "8",
                 *flags, "--out", str(tmp_path / "run"), "--cache-dir", str(tmp_path / "cache"), *QUIET]) == 0
    ours = said(capsys.readouterr().out)
    assert ours == peft_line(base, capsys)
    assert not ours.endswith("trainable%: 100.0000")


def test_a_full_run_trains_every_parameter_of_its_model(corpus, tmp_path, capsys):
    assert main(["train", "--model", "gpt-tiny", "--data", str(corpus), "--out", str(tmp_path / "run"),
                 "--cache-dir", str(tmp_path / "cache"), *QUIET]) == 0
    model = build_model(ModelConfig(name="gpt-tiny"), vocab_size=ByteTokenizer().vocab_size, seq_len=32)
    n = sum(p.numel() for p in model.parameters())
    assert said(capsys.readouterr().out) == f"trainable params: {n:,} || all params: {n:,} || trainable%: 100.0000"


def test_a_layout_says_the_whole_models_count(corpus, tmp_path, capfd):
    """Tensor parallelism splits the blocks' matrices, the embedding and the head over 2 ranks: the
    line counts the model, not rank 0's part of it."""
    lines = []
    for name, layout in (("one", []), ("split", ["--nproc", "2", "--tp", "2"])):
        assert main(["train", "--model", "gpt-tiny", "--data", str(corpus), "--out", str(tmp_path / name),
                     "--cache-dir", str(tmp_path / "cache"), *QUIET, *layout]) == 0
        lines.append(said(capfd.readouterr().out))
    assert lines[0] == lines[1]
