"""The switches of instruction tuning under the names users know (docs/finetuning.md): the answer
ended by the tokenizer's EOS in the built-in template, ``--chat-template``, ``--train-on-inputs``,
``--system-prompt``, the template recorded in the run, the end-of-run sample an answer to a
templated prompt, and losses over no trained token shown as n/a, never 0."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from scaletrain.commands.cli import main
from scaletrain.data import END_OF_TURN, ByteTokenizer, ChatEncoder, ChatTemplate
from scaletrain.data.sft import ChatOptions
from scaletrain.errors import UserError
from scaletrain.job.data_setup import run_tokenizer
from scaletrain.models.chat_templates import CHAT_TEMPLATES

CHAT = [{"role": "user", "content": "Is 3 odd?"}, {"role": "assistant", "content": "yes"}]
RUN = ["--model", "gpt-tiny", "--sft", "--seq-len", "64", "--micro-batch", "4", "--steps", "2", "--warmup-steps",
       "1", "--eval-batches", "1", "--sample-tokens", "8", "--no-progress"]


def _answer(encoder: ChatEncoder, messages=CHAT) -> list[int]:
    ids, mask = encoder({"messages": messages})
    return ids[mask].tolist()


def test_the_builtin_template_ends_an_answer_with_the_tokenizers_eos():
    """One token every reader stops at, not text the model never saw; a tokenizer saved without one
    keeps the <|end|> text it trained with."""
    byte = ByteTokenizer()
    assert _answer(ChatEncoder(byte)) == byte.encode("yes").tolist() + [byte.eos_id]
    earlier = ByteTokenizer(end_of_text=None)
    assert _answer(ChatEncoder(earlier)) == earlier.encode(f"yes{END_OF_TURN}\n").tolist()


def test_train_on_inputs_and_a_system_prompt():
    byte = ByteTokenizer()
    ids, mask = ChatEncoder.chosen(byte, ChatOptions(train_on_inputs=True))({"messages": CHAT})
    assert mask.all() and len(ids) > len(_answer(ChatEncoder(byte)))
    told = ChatEncoder.chosen(byte, ChatOptions(system_prompt="Be terse."))
    ids, _ = told({"messages": CHAT})
    assert byte.decode(ids).startswith("<|system|>\nBe terse.\n<|user|>")
    own = [{"role": "system", "content": "Mine."}, *CHAT]
    assert byte.decode(told({"messages": own})[0]).count("<|system|>") == 1  # a record's own system turn stays


def test_chat_template_names_files_and_mistakes(tmp_path):
    byte = ByteTokenizer()
    for name, source in CHAT_TEMPLATES.items():
        assert ChatTemplate.chosen(name, byte).source == source
    alpaca = _answer(ChatEncoder.chosen(byte, ChatOptions(template="alpaca")))
    assert alpaca == byte.encode("yes").tolist() + [byte.eos_id]
    jinja = tmp_path / "mine.jinja"
    jinja.write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}")
    assert ChatTemplate.chosen(str(jinja), byte).render(CHAT) == "[user] Is 3 odd?\n[assistant] yes\n"
    with pytest.raises(UserError, match="neither a template's name"):
        ChatTemplate.chosen(str(tmp_path / "missing.jinja"), byte)


@pytest.mark.parametrize("flags, phrase", [
    (["--chat-template", "chatml"], "--chat-template shapes how instruction records are rendered; add --sft"),
    (["--train-on-inputs"], "--train-on-inputs shapes how instruction records are rendered; add --sft"),
    (["--sft", "--chat-template", "nope"], "--chat-template nope is neither a template's name"),
])
def test_rendering_mistakes_are_one_sentence(tmp_path, capsys, flags, phrase):
    data = tmp_path / "chats.jsonl"
    data.write_text(json.dumps({"messages": CHAT}) + "\n" + json.dumps({"messages": CHAT}) + "\n")
    assert main(["train", "--model", "gpt-tiny", "--data", str(data), "--steps", "1", "--out", str(tmp_path / "run"),
                 "--cache-dir", str(tmp_path / "cache"), *flags]) == 2
    err = capsys.readouterr().err
    assert phrase in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not (tmp_path / "run").exists()


def _chats(path: Path, rows: list[list[dict]]) -> Path:
    path.write_text("".join(json.dumps({"messages": messages}) + "\n" for messages in rows))
    return path


def test_the_run_records_its_template_and_samples_an_answer(tmp_path, capsys):
    data = _chats(tmp_path / "chats.jsonl", [[{"role": "user", "content": f"Is {i} odd?"},
                                              {"role": "assistant", "content": "yes" if i % 2 else "no"}]
                                             for i in range(40)])
    run = tmp_path / "run"
    assert main(["train", "--data", str(data), "--chat-template", "alpaca", "--out", str(run), "--cache-dir",
                 str(tmp_path / "cache"), *RUN]) == 0
    out = capsys.readouterr().out
    assert run_tokenizer(run).config.chat_template == CHAT_TEMPLATES["alpaca"]
    sample = out.split("--- sample ---\n")[1]
    assert sample.startswith("### Instruction:\nIs 39 odd?\n\n### Response:\n")  # the held-out record's prompt


def test_losses_over_no_trained_token_are_not_available_rather_than_zero(tmp_path, capsys):
    """Every answer past --seq-len: the run says how many examples train nothing, and its losses are
    n/a, not 0.0000 (metrics.jsonl: val_loss null)."""
    data = _chats(tmp_path / "long.jsonl", [[{"role": "user", "content": "x" * 100},
                                             {"role": "assistant", "content": "ok"}]] * 20)
    run = tmp_path / "run"
    assert main(["train", "--data", str(data), "--out", str(run), "--cache-dir", str(tmp_path / "cache"),
                 *RUN]) == 0
    out = capsys.readouterr().out
    assert "19 examples longer than --seq-len 64 were cut to fit; 19 of them lost every answer token" in out
    assert "train loss n/a (no trained token), validation loss n/a (no trained token)" in out
    assert "0.0000" not in out.split("finished step")[1].splitlines()[0]
    last = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["val_loss"] is None and last["trained_tokens"] == 0


def test_each_rendering_option_prepares_its_own_cache(tmp_path):
    """The cache's key holds the template and the switches: a run with other options never reads
    rows rendered for another."""
    data = _chats(tmp_path / "chats.jsonl", [CHAT] * 4)
    from scaletrain.data.sources import cached_folder

    folders = {cached_folder(data, ByteTokenizer(), True, "text", tmp_path / "cache", 1, False, options)
               for options in (ChatOptions(), ChatOptions(template="chatml"), ChatOptions(train_on_inputs=True),
                               ChatOptions(system_prompt="Be terse."))}
    assert len(folders) == 4
    masks = [np.fromfile(next(folder.glob("*.mask")), dtype=np.uint8) for folder in sorted(folders)]
    assert any(mask.all() for mask in masks) and not all(mask.all() for mask in masks)
