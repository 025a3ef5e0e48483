"""Instruction fine-tuning from a Hugging Face folder with its own chat template.

The folder is a Qwen2-style model saved by transformers, its tokenizer holding
ChatML's special tokens and its tokenizer_config.json the ChatML template, as
a downloaded chat model's does. The examples are rendered and tokenized as
transformers' apply_chat_template renders and tokenizes them, the loss is on
the answers only, and a fine-tune with LoRA reproduces one device.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from scaletrain.commands.cli import main
from scaletrain.commands.parity import run_parity
from scaletrain.config import Config
from scaletrain.data.shards import open_prepared
from scaletrain.data.tokenizer import load_tokenizer
from tests.test_llama_hf import make_folder

transformers = pytest.importorskip("transformers", reason="comparing with transformers needs the dev extra")

CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
RECORDS = [
    {"instruction": "Name the animal that jumps.", "output": "The fox jumps."},
    {"instruction": "What does the dog do?", "input": "the lazy dog", "output": "The dog sleeps."},
    {"messages": [{"role": "system", "content": "Answer briefly."},
                  {"role": "user", "content": "Who jumps over the dog?"},
                  {"role": "assistant", "content": "The fox."},
                  {"role": "user", "content": "And then?"},
                  {"role": "assistant", "content": "The dog sleeps."}]},
] * 12


@pytest.fixture(scope="module")
def chat_folder(tmp_path_factory) -> Path:
    folder = make_folder(tmp_path_factory.mktemp("chat") / "qwen2", "qwen2")
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "chat_template": CHATML}))
    return folder


@pytest.fixture(scope="module")
def instructions(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("records") / "alpaca.jsonl"
    path.write_text("".join(json.dumps(record) + "\n" for record in RECORDS))
    return path


def _messages(record: dict) -> list[dict]:
    if "messages" in record:
        return record["messages"]
    prompt = record["instruction"] + (f"\n\n{record['input']}" if record.get("input") else "")
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": record["output"]}]


def test_finetune_renders_with_the_folder_template_and_trains_on_answers(chat_folder, instructions, tmp_path):
    run, cache = tmp_path / "run", tmp_path / "cache"
    assert main(["finetune", "--from", str(chat_folder), "--data", str(instructions), "--sft", "--lora-rank", "4",
                 "--steps", "2", "--seq-len", "64", "--micro-batch", "2", "--eval-every", "0", "--eval-batches", "1",
                 "--sample-tokens", "0", "--no-progress", "--out", str(run), "--cache-dir", str(cache)]) == 0
    theirs = transformers.AutoTokenizer.from_pretrained(chat_folder)
    (folder,) = cache.glob("prepared-*")
    prepared = open_prepared(folder)
    assert load_tokenizer(prepared.tokenizer_path).config.chat_template == CHATML  # kept with the shards
    end = theirs.convert_tokens_to_ids("<|im_end|>")
    for number in range(3):  # one of each kind of record
        start, stop = prepared.starts[number], prepared.starts[number + 1]
        ids = np.asarray(prepared.tokens[start:stop]).tolist()
        assert ids == list(theirs.apply_chat_template(_messages(RECORDS[number]), tokenize=True,
                                                      return_dict=False))
        trained = [i for i, keep in zip(ids, np.asarray(prepared.mask[start:stop])) if keep]
        answers = [m["content"] for m in _messages(RECORDS[number]) if m["role"] == "assistant"]
        # every answer, each with its end-of-turn token and newline, and nothing else
        assert theirs.decode(trained) == "".join(f"{a}<|im_end|>\n" for a in answers)
        assert trained.count(end) == len(answers)
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert all(0 < step["trained_tokens"] < 2 * 64 for step in steps)
    assert all(step["trained_tokens_per_s"] < step["tokens_per_s"] for step in steps)


@pytest.mark.numerics
def test_lora_sft_from_a_folder_reproduces_single_device_training(chat_folder, instructions, tmp_path):
    cfg = Config().replace(base=str(chat_folder), data=str(instructions), sft=True, lora_rank=4, nproc=2, dp=2,
                           seq_len=64, micro_batch=2, steps=3, lr=1e-2, warmup_steps=1, grad_clip=0.5,
                           eval_every=0, eval_batches=1, sample_tokens=0, progress=False,
                           out=str(tmp_path / "run"), cache_dir=str(tmp_path / "cache"))
    report = run_parity(cfg, tolerance=1e-5)
    assert report.passed, report.to_json()


def test_chat_generation_answers_as_transformers_does(chat_folder):
    """``generate --chat`` greedy: the question in the folder's template, the answer cut at its end,
    equal to transformers' greedy generation from apply_chat_template's prompt."""
    import torch

    from scaletrain.commands.generate import generate

    question = "Who jumps over the dog?"
    ours = generate(chat_folder, question, tokens=12, temperature=0, chat=True)
    theirs_tokenizer = transformers.AutoTokenizer.from_pretrained(chat_folder)
    prompt = theirs_tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=True,
                                                  add_generation_prompt=True, return_dict=False)
    model = transformers.AutoModelForCausalLM.from_pretrained(chat_folder).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, len(prompt):].tolist()
    end = theirs_tokenizer.convert_tokens_to_ids("<|im_end|>")
    answer = out[:out.index(end)] if end in out else out
    assert ours == theirs_tokenizer.decode(answer, skip_special_tokens=True)
