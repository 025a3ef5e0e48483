"""The end-of-text token (data/tokenizer.py) from the data to the export's readers.

Every tokenizer made here ends a document with one ``<|endoftext|>`` id: between the files of
a text corpus and after every record. ``scaletrain generate`` stops there (``--ignore-eos``
goes on), and so does the run's closing sample. Runs and tokenizers saved before the token
existed resume with their own ids.

Each kind of run a user exports (from scratch with bytes or a BPE, GPT and Llama; a fine-tune
of a Hugging Face folder; SFT with the folder's chat template and with the built-in one; a
LoRA fine-tune as a PEFT folder) is read as written by ``transformers`` (``AutoTokenizer``
gives our ids, ``AutoModelForCausalLM`` our logits, ``generate`` stops at the end-of-text
token by itself, ``apply_chat_template`` gives training's ids), by lm-evaluation-harness's
``hf`` backend with no model arguments (every request's log-likelihood and generation equal
``scaletrain eval``'s), and by PEFT. The byte-level Llama run from scratch is scored by the
harness in tests/test_evaluation.py.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from scaletrain.commands.cli import main
from scaletrain.commands.train import execute, launch, prepare_run
from scaletrain.config import load_run_config
from scaletrain.data import BUILTIN_TEMPLATE, END_OF_TEXT, ByteTokenizer, ChatTemplate, load_tokenizer
from scaletrain.data.shards import open_prepared
from scaletrain.job import data_setup
from scaletrain.job.data_setup import open_data, prepare_data, run_tokenizer
from scaletrain.job.metrics import read_metrics
from scaletrain.job.model_source import load_model
from scaletrain.models.chat_templates import CHAT_TEMPLATES
from scaletrain.train.sampling import sft_prompt

transformers = pytest.importorskip("transformers", reason="reading the exports needs the dev extra")
transformers.utils.logging.disable_progress_bar()

WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
FACTS = [{"text": f"{WORDS[i % 10]} is {'odd' if i % 2 else 'even'}."} for i in range(200)]
CHATS = [{"messages": [{"role": "user", "content": f"Is {i % 10} odd?"},
                       {"role": "assistant", "content": "yes" if i % 2 else "no"}]} for i in range(60)]
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
QUIET = ["--micro-batch", "8", "--warmup-steps", "1", "--eval-every", "0", "--eval-batches", "1",
         "--sample-tokens", "0", "--no-progress"]
LEARN = ["--steps", "100", "--lr", "3e-3", "--seq-len", "32"]  # enough for each model to end its facts with the token
CHAT = ["--sft", "--seq-len", "64"]  # every conversation whole
PROBE = f"three is odd.{END_OF_TEXT}naïve café — 日本"


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _chat_folder(base: Path, folder: Path) -> Path:
    """``base`` with a ChatML template in its tokenizer_config.json."""
    shutil.copytree(base, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHATML}))
    return folder


def _bos_folder(base: Path, folder: Path) -> Path:
    """``base`` whose tokenizer puts its BOS before every text it encodes (as Llama's do), which a
    rendered conversation must not get twice, nor once where training had none."""
    from tokenizers import Tokenizer, processors

    shutil.copytree(base, folder)
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    bos = tokenizer.token_to_id(END_OF_TEXT)
    tokenizer.post_processor = processors.TemplateProcessing(single=f"{END_OF_TEXT} $A",
                                                             special_tokens=[(END_OF_TEXT, bos)])
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Each kind of run, trained and exported with ``--format hf`` (the LoRA one also as PEFT)."""
    from tests.test_evaluation import _llama_folder

    root = tmp_path_factory.mktemp("end-of-text")
    facts, chats = _jsonl(root / "facts.jsonl", FACTS), _jsonl(root / "chats.jsonl", CHATS)
    base = _llama_folder(root / "base")
    cache = ["--cache-dir", str(root / "cache")]
    commands = {
        "gpt-bpe": ["train", "--model", "gpt-tiny", "--tokenizer", "bpe", "--vocab-size", "300", "--data", facts, *LEARN],
        "llama-bytes": ["train", "--model", "llama-tiny", "--data", facts, *LEARN],
        "hf-finetune": ["finetune", "--from", base, "--data", facts, *LEARN],
        "hf-sft-lora": ["finetune", "--from", _chat_folder(base, root / "chat-base"), "--data", chats, *CHAT,
                        "--lora-rank", "4", "--steps", "3"],
        "bytes-sft": ["train", "--model", "llama-tiny", "--data", chats, *CHAT, "--steps", "2"],
        # a folder without a chat template: the built-in one, each answer ended by the base's own EOS
        "hf-sft-eos": ["finetune", "--from", _bos_folder(base, root / "bos-base"), "--data", chats, *CHAT, "--lora-rank", "8", "--steps", "40",
                       "--lr", "1e-2"],
        "hf-sft-alpaca": ["finetune", "--from", base, "--data", chats, *CHAT, "--chat-template", "alpaca",
                          "--steps", "2"],
    }
    for name, command in commands.items():
        assert main([*map(str, command), "--out", str(root / name), *cache, *QUIET]) == 0, name
        assert main(["export", "--from", str(root / name), "--to", str(root / f"{name}-hf"), "--format", "hf"]) == 0
    for name in ("hf-sft-lora", "hf-sft-eos"):
        assert main(["export", "--from", str(root / name), "--to", str(root / f"{name}-peft"), "--format", "peft"]) == 0
    return root


# -- the data ---------------------------------------------------------------------------------


def test_text_files_and_records_end_each_document_with_the_token(tmp_path, tiny_cfg):
    folder = tmp_path / "corpus"
    folder.mkdir()
    for i in range(3):
        (folder / f"{i}.txt").write_text(f"document {i}\n" * 200)
    byte = ByteTokenizer()
    prepared = prepare_data(tiny_cfg.replace(data=str(folder)), tmp_path / "cache")
    tokens = np.fromfile(prepared.tokens_path, dtype=np.uint16)
    assert tokens.tolist() == byte.encode(END_OF_TEXT.join((folder / f"{i}.txt").read_text() for i in range(3))).tolist()
    records = prepare_data(tiny_cfg.replace(data=str(_jsonl(tmp_path / "facts.jsonl", FACTS)), pack=True),
                           tmp_path / "cache")
    shard = open_prepared(Path(records.prepared[0]))
    ends = np.asarray(shard.starts[1:]) - 1  # each record's last id
    assert (np.asarray(shard.tokens)[ends] == byte.eos_id).all() and len(ends) == len(FACTS)
    assert np.count_nonzero(np.asarray(shard.tokens) == byte.eos_id) == len(FACTS)


@pytest.mark.numerics
def test_a_run_saved_before_the_token_resumes_with_its_own_ids(tiny_cfg, monkeypatch):
    """A byte run of the earlier 256-id tokenizer, resumed by this version, continues exactly as
    it would have run on: the same losses as a straight run of that tokenizer."""

    class Earlier(ByteTokenizer):
        def __init__(self):
            super().__init__(end_of_text=None)

    with monkeypatch.context() as earlier:
        earlier.setattr(data_setup, "ByteTokenizer", Earlier)
        straight = launch(tiny_cfg.replace(out=str(Path(tiny_cfg.run.out).with_name("straight"))))
        stopped = tiny_cfg.replace(checkpoint_every=2, stop_at=2)
        execute(*prepare_run(stopped))
    resumed = launch(tiny_cfg.replace(resume=True))
    assert run_tokenizer(resumed.run_dir).vocab_size == 256
    assert (resumed.run_dir / "tokenizer.json").read_text() == '{"kind": "byte"}'
    losses = [[row["loss"] for row in read_metrics(summary.run_dir / "metrics.jsonl")] for summary in (straight, resumed)]
    assert losses[0] == losses[1] and len(losses[0]) == tiny_cfg.train.steps


# -- generation --------------------------------------------------------------------------------


def test_generate_stops_at_the_token_and_ignore_eos_goes_on(runs, capsys):
    for name in ("gpt-bpe", "llama-bytes"):
        outputs = []
        for extra in ([], ["--ignore-eos"]):
            capsys.readouterr()
            assert main(["generate", "--from", str(runs / name), "--prompt", "three is", "--temperature", "0",
                         "--tokens", "60", *extra]) == 0
            outputs.append(capsys.readouterr().out.removesuffix("\n"))
        stopped, going_on = outputs
        assert END_OF_TEXT in going_on and going_on.startswith(stopped + END_OF_TEXT), name
        assert stopped.startswith("three is") and END_OF_TEXT not in stopped


# -- the readers -------------------------------------------------------------------------------


# Not rerun on the portable kernels (the numerics marker): that rerun would train every run of the
# fixture again, and the logits of an export against transformers' rerun there in tests/test_llama_hf.py.
@pytest.mark.parametrize("name", ["gpt-bpe", "llama-bytes", "hf-finetune", "hf-sft-lora", "bytes-sft"])
def test_transformers_reads_the_export_as_written(runs, name):
    """Our ids, our logits, the end-of-text token as EOS (BOS too where we made the tokenizer)."""
    folder = runs / f"{name}-hf"
    ours, tokenizer = load_model(runs / name)
    theirs = transformers.AutoTokenizer.from_pretrained(folder)
    ids = tokenizer.encode(PROBE).tolist()
    assert theirs(PROBE)["input_ids"] == ids and theirs.decode(ids) == tokenizer.decode(ids, skip_special_tokens=False)
    assert theirs.eos_token_id == tokenizer.eos_id is not None
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert model.generation_config.eos_token_id == tokenizer.eos_id and model.config.bos_token_id is not None
    with torch.no_grad():
        mine, hf = ours(torch.tensor([ids]))[..., :model.config.vocab_size], model(torch.tensor([ids])).logits
    assert ((mine - hf).norm() / hf.norm()).item() < 1e-5


@pytest.mark.parametrize("name", ["gpt-bpe", "llama-bytes", "hf-finetune"])
def test_transformers_generate_stops_at_the_token_by_itself(runs, name):
    folder = runs / f"{name}-hf"
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    for word in ("three", "eight"):
        prompt = tokenizer(f"{word} is", return_tensors="pt")
        written = model.generate(**prompt, max_new_tokens=40, do_sample=False)[0, prompt["input_ids"].shape[1]:]
        assert written[-1] == tokenizer.eos_token_id and len(written) < 40, tokenizer.decode(written)


@pytest.mark.parametrize("name", ["hf-sft-lora", "bytes-sft", "hf-sft-eos", "hf-sft-alpaca"])
def test_apply_chat_template_on_the_export_gives_trainings_ids(runs, name):
    """The folder's ChatML, the built-in template, or --chat-template's, as the run recorded it and
    wrote it into the export: transformers renders the held-out record's prompt to the ids of the
    training rows, token for token, and the whole conversation as the run's tokenizer does."""
    tokenizer = run_tokenizer(runs / name)
    template = ChatTemplate.for_tokenizer(tokenizer)
    assert template.source == (CHAT_TEMPLATES["alpaca"] if name == "hf-sft-alpaca" else
                               CHATML if name == "hf-sft-lora" else BUILTIN_TEMPLATE)
    theirs = transformers.AutoTokenizer.from_pretrained(runs / f"{name}-hf")
    cfg = load_run_config(runs / name)
    inputs, targets = open_data(prepare_data(cfg, Path(cfg.data.cache_dir)), cfg).val.get(0, 1)[:2]
    held_out = CHATS[-1]["messages"]  # the one validation record: the last
    assert theirs.apply_chat_template(held_out[:1], add_generation_prompt=True, tokenize=True,
                                      return_dict=False) == sft_prompt(inputs[0], targets[0]).tolist()
    ids = tokenizer.encode(template.render(held_out), special_tokens=False).tolist()
    assert theirs.apply_chat_template(held_out, tokenize=True, return_dict=False) == ids


@pytest.mark.parametrize("reader", ["hf", "peft"])
def test_an_sft_export_answers_and_stops_by_itself_in_transformers(runs, reader):
    """A LoRA SFT of a folder without a chat template: transformers' plain generate (no stop strings)
    on the merged export, or PEFT's over the base, writes the answer and the EOS and stops."""
    folder = runs / "hf-sft-eos-hf"
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    if reader == "hf":
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    else:
        peft = pytest.importorskip("peft", reason="reading the adapters needs peft (the dev extra)")
        base = transformers.AutoModelForCausalLM.from_pretrained(load_run_config(runs / "hf-sft-eos").finetune.base,
                                                                 dtype=torch.float32)
        model = peft.PeftModel.from_pretrained(base, runs / "hf-sft-eos-peft").eval()
    for number in range(10):
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": f"Is {number} odd?"}],
                                               add_generation_prompt=True, return_tensors="pt", return_dict=True)
        written = model.generate(**prompt, max_new_tokens=20, do_sample=False)[0, prompt["input_ids"].shape[1]:]
        assert written[-1] == tokenizer.eos_token_id and len(written) < 20, tokenizer.decode(written)


def test_eval_with_the_chat_template_answers_as_transformers_does_on_the_export(runs, tmp_path):
    """``scaletrain eval --apply-chat-template`` renders the prompts as training did (no BOS of its
    own before them), so its greedy answers are transformers' greedy answers from
    ``apply_chat_template`` on the export, request by request."""
    pytest.importorskip("lm_eval", reason="scaletrain eval needs the [eval] extra")
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    _jsonl(tasks / "questions.jsonl", [{"question": f"Is {i} odd?", "answer": "yes" if i % 2 else "no"}
                                       for i in range(10)])
    (tasks / "odd.yaml").write_text(
        f"task: odd\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {tasks / 'questions.jsonl'}\n"
        "test_split: test\noutput_type: generate_until\ndoc_to_text: '{{question}}'\ndoc_to_target: '{{answer}}'\n"
        "generation_kwargs:\n  until: ['\\n']\n  max_gen_toks: 8\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n")
    assert main(["eval", "--from", str(runs / "hf-sft-eos"), "--tasks", "odd", "--include", str(tasks),
                 "--apply-chat-template", "--log-samples", "--out", str(tmp_path / "ours.json")]) == 0
    samples = json.loads((tmp_path / "ours.json").read_text())["samples"]["odd"]
    folder = runs / "hf-sft-eos-hf"
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    for sample in samples:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": sample["doc"]["question"]}],
                                               add_generation_prompt=True, return_tensors="pt", return_dict=True)
        written = model.generate(**prompt, max_new_tokens=8, do_sample=False)[0, prompt["input_ids"].shape[1]:]
        assert sample["resps"][0][0] == tokenizer.decode(written, skip_special_tokens=True).split("\n")[0]
    assert len(samples) == 10


def test_peft_reads_the_adapter_folder_over_the_base(runs):
    peft = pytest.importorskip("peft", reason="reading the adapters needs peft (the dev extra)")
    base = load_run_config(runs / "hf-sft-lora").finetune.base
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    adapted = peft.PeftModel.from_pretrained(model, runs / "hf-sft-lora-peft").eval()
    merged = transformers.AutoModelForCausalLM.from_pretrained(runs / "hf-sft-lora-hf", dtype=torch.float32).eval()
    ids = torch.tensor([transformers.AutoTokenizer.from_pretrained(base)(PROBE)["input_ids"]])
    with torch.no_grad():
        assert ((adapted(ids).logits - merged(ids).logits).norm() / merged(ids).logits.norm()).item() < 1e-5


@pytest.mark.parametrize("name", ["gpt-bpe", "hf-finetune", "bytes-sft"])
def test_the_harness_hf_backend_reads_the_export_with_no_model_arguments(runs, name, tmp_path):
    """``lm_eval --model hf --model_args pretrained=EXPORT`` (and fp32), against ``scaletrain eval``
    on the run: every request's answer equal."""
    pytest.importorskip("lm_eval", reason="scaletrain eval needs the [eval] extra")
    from tests.test_evaluation import _write_tasks, assert_same_answers, ours, theirs

    tasks = _write_tasks(tmp_path / "tasks")
    mine = ours(runs / name, tasks, "toy_mc,toy_gen", tmp_path / "ours.json")
    hf = theirs(runs / f"{name}-hf", tasks, "toy_mc,toy_gen")
    for task in ("toy_mc", "toy_gen"):
        assert_same_answers(mine, hf, task)
    assert mine["config"]["prefix_token_id"] == load_tokenizer(runs / name / "tokenizer.json").eos_id
