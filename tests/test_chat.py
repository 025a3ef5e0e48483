"""Instruction data: tokenizer configs, chat templates against transformers, assistant-only masks."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from scaletrain.data.chat import BUILTIN_TEMPLATE, END_OF_TURN, ChatTemplate
from scaletrain.data.sft import ChatEncoder, record_messages
from scaletrain.data.tokenizer import (
    END_OF_TEXT,
    BPETokenizer,
    ByteTokenizer,
    TokenizerConfig,
    config_path,
    load_tokenizer,
)
from scaletrain.errors import UserError
from scaletrain.finetune.hf import load_hf_tokenizer

SENTENCES = ["You are a helpful assistant.", "What is the capital of France?", "The capital of France is Paris.",
             "Name three colours.", "Red, green and blue.", "Thanks! Anything else?", "No, that is all."] * 5
START, END = "<|im_start|>", "<|im_end|>"

# ChatML written on one line, adding a default system turn as some models' templates do.
CHATML = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
          "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
          "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
# The same format written over many lines: right only with trim_blocks and lstrip_blocks.
CHATML_LINES = """{% for message in messages %}
    {% if message['role'] not in ['system', 'user', 'assistant'] %}
        {{ raise_exception('unknown role ' + message['role']) }}
    {% endif %}
<|im_start|>{{ message['role'] }}
{{ message['content'] }}<|im_end|>
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}
"""
# Turns closed by the eos_token variable, the answers inside transformers' generation tag.
EOS_TAGGED = ("{% for message in messages %}{{ '<|' + message['role'] + '|>\\n' }}"
              "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + eos_token }}"
              "{% endgeneration %}{% else %}{{ message['content'] | tojson }}{% endif %}{{ '\\n' }}{% endfor %}"
              "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}")

SINGLE = [{"role": "user", "content": "What is the capital of France?"},
          {"role": "assistant", "content": "The capital of France is Paris."}]
MULTI = [{"role": "system", "content": "You are terse."},
         {"role": "user", "content": "Name three colours."},
         {"role": "assistant", "content": "Red, green and blue."},
         {"role": "user", "content": "Thanks! Anything else? é"},
         {"role": "assistant", "content": "No, that is all."}]


def chatml_tokenizer() -> Tokenizer:
    """A byte-level BPE with the ChatML markers as special tokens, and a post-processor adding
    <|im_start|> as a BOS would, so that encoding without special tokens is seen to skip it."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=[START, END], show_progress=False)
    tokenizer.train_from_iterator(SENTENCES, trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{START} $A", special_tokens=[(START, tokenizer.token_to_id(START))])
    return tokenizer


def write_folder(folder, template=CHATML, template_file=None, **config):
    folder.mkdir(parents=True, exist_ok=True)
    chatml_tokenizer().save(str(folder / "tokenizer.json"))
    settings = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": END, "pad_token": END, **config}
    if template_file is None:
        settings["chat_template"] = template
    else:
        (folder / template_file).write_text(template, encoding="utf-8")
    (folder / "tokenizer_config.json").write_text(json.dumps(settings), encoding="utf-8")
    return folder


@pytest.fixture
def transformers():
    return pytest.importorskip("transformers", reason="comparing with apply_chat_template needs transformers "
                                                      "installed (the dev extra)")


def masked_runs(tokenizer, ids, mask) -> list[str]:
    """The text of each run of masked tokens, special tokens spelled out (``tokenizer``: ours, or a
    tokenizers-library file)."""
    if isinstance(tokenizer, Path):
        tokenizer = Tokenizer.from_file(str(tokenizer))
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(np.int8), [0]])))
    return [tokenizer.decode(ids[a:b].tolist(), skip_special_tokens=False) for a, b in zip(edges[::2], edges[1::2])]


@pytest.mark.parametrize(("template", "template_file"), [(CHATML, None), (CHATML_LINES, "chat_template.jinja"),
                                                         (EOS_TAGGED, None)])
@pytest.mark.parametrize("messages", [SINGLE, MULTI], ids=["single", "multi"])
def test_rendering_and_ids_equal_transformers(tmp_path, transformers, template, template_file, messages):
    folder = write_folder(tmp_path / "model", template, template_file)
    reference = transformers.AutoTokenizer.from_pretrained(str(folder))
    tokenizer = load_hf_tokenizer(folder)
    chat = ChatTemplate.for_tokenizer(tokenizer)
    for prompt in (False, True):
        expected = reference.apply_chat_template(messages[:-1] if prompt else messages, tokenize=False,
                                                 add_generation_prompt=prompt)
        assert chat.render(messages[:-1] if prompt else messages, add_generation_prompt=prompt) == expected
    ids, mask = ChatEncoder(tokenizer)({"messages": messages})
    assert ids.dtype == np.int64 and mask.dtype == bool and ids.shape == mask.shape
    assert ids.tolist() == reference.apply_chat_template(messages, tokenize=True, return_dict=False)
    # Every template here closes a turn with <|im_end|> and a line break.
    answers = [m["content"] + END + "\n" for m in messages if m["role"] == "assistant"]
    assert masked_runs(folder / "tokenizer.json", ids, mask) == answers


def test_the_folder_config_is_read_as_transformers_reads_it(tmp_path):
    folder = write_folder(tmp_path / "dicts", template=[{"name": "tool_use", "template": "{{ tools }}"},
                                                        {"name": "default", "template": CHATML}],
                          eos_token={"content": END, "lstrip": False, "special": True}, bos_token=None,
                          add_bos_token=False, unk_token={"content": "<unk>"})
    tokenizer = load_hf_tokenizer(folder)
    assert tokenizer.config == TokenizerConfig(eos_token=END, pad_token=END, chat_template=CHATML,
                                               extra_tokens={"unk_token": "<unk>"})
    assert tokenizer.eos_id == Tokenizer.from_file(str(folder / "tokenizer.json")).token_to_id(END)
    # chat_template.jinja wins over the config's entry; a processor's chat_template.json comes last.
    (folder / "chat_template.json").write_text(json.dumps({"chat_template": "from json"}))
    assert load_hf_tokenizer(folder).config.chat_template == CHATML
    (folder / "chat_template.jinja").write_text("from jinja")
    assert load_hf_tokenizer(folder).config.chat_template == "from jinja"
    bare = write_folder(tmp_path / "bare", template=None, eos_token=None, pad_token=None)
    (bare / "chat_template.json").write_text(json.dumps({"chat_template": "from json"}))
    assert load_hf_tokenizer(bare).config == TokenizerConfig(chat_template="from json")
    (bare / "chat_template.json").unlink()
    assert load_hf_tokenizer(bare).config is None and load_hf_tokenizer(bare).eos_id is None
    # An older folder's special_tokens_map.json overrides the config, unless it has added_tokens_decoder.
    (bare / "special_tokens_map.json").write_text(json.dumps({"eos_token": {"content": START}}))
    assert load_hf_tokenizer(bare).config == TokenizerConfig(eos_token=START)
    write_folder(bare, template=None, added_tokens_decoder={})
    assert load_hf_tokenizer(bare).config == TokenizerConfig(eos_token=END, pad_token=END)
    with pytest.raises(UserError, match="named"):
        load_hf_tokenizer(write_folder(tmp_path / "unnamed", template=[{"name": "tool_use", "template": "x"}]))


def test_encoding_without_special_tokens_skips_the_post_processor_but_keeps_written_ones(tmp_path):
    tokenizer = load_hf_tokenizer(write_folder(tmp_path / "model"))
    start = tokenizer.encode(START, special_tokens=False).tolist()
    assert len(start) == 1 and tokenizer.encode("Red").tolist() == start + tokenizer.encode("Red", False).tolist()
    assert tokenizer.encode(f"{START}user", special_tokens=False).tolist()[:1] == start
    assert ByteTokenizer().encode("é", special_tokens=False).tolist() == [0xC3, 0xA9]
    assert ByteTokenizer().encode("a<|endoftext|>", special_tokens=False).tolist() == [97, 256]


def test_a_saved_tokenizer_keeps_its_config_and_a_save_without_one_drops_it(tmp_path):
    tokenizer = load_hf_tokenizer(write_folder(tmp_path / "model"))
    saved = tmp_path / "run" / "tokenizer.json"
    saved.parent.mkdir()
    tokenizer.save(saved)
    assert config_path(saved) == tmp_path / "run" / "tokenizer.config.json" and config_path(saved).is_file()
    loaded = load_tokenizer(saved)
    assert loaded.config == tokenizer.config and loaded.config.chat_template == CHATML
    assert loaded.eos_id == tokenizer.eos_id is not None
    record = {"messages": MULTI}
    assert all(np.array_equal(a, b) for a, b in zip(ChatEncoder(loaded)(record), ChatEncoder(tokenizer)(record)))
    BPETokenizer(Tokenizer.from_file(str(saved))).save(saved)
    assert not config_path(saved).exists() and load_tokenizer(saved).config is None


def test_train_from_texts_round_trips():
    tokenizer = BPETokenizer.train_from_texts(iter(SENTENCES), vocab_size=300)
    assert tokenizer.vocab_size == 300 and tokenizer.eos_id == 299  # the end-of-text token, last
    assert tokenizer.config.eos_token == tokenizer.config.bos_token == "<|endoftext|>"
    assert tokenizer.decode(tokenizer.encode("The capital of Peru? é")) == "The capital of Peru? é"
    with pytest.raises(UserError, match="byte alphabet"):
        BPETokenizer.train_from_texts(SENTENCES, vocab_size=100)


def test_alpaca_records_become_a_user_and_an_assistant_turn():
    assert record_messages({"instruction": "Add.", "input": "2 + 2", "output": "4"}) == [
        {"role": "user", "content": "Add.\n\n2 + 2"}, {"role": "assistant", "content": "4"}]
    assert record_messages({"instruction": "Say hi.", "input": "", "output": "Hi"})[0]["content"] == "Say hi."
    assert record_messages({"instruction": "Say hi.", "output": "Hi"})[0]["content"] == "Say hi."


@pytest.mark.parametrize("end", [END_OF_TEXT, None], ids=["end-of-text", "saved-before-it"])
def test_the_builtin_template_with_the_byte_tokenizer(end):
    """Each answer ended by the tokenizer's EOS; by the <|end|> text where a tokenizer has none."""
    tokenizer = ByteTokenizer(end_of_text=end)
    encoder = ChatEncoder(tokenizer)
    assert encoder.template.source == BUILTIN_TEMPLATE
    ending = END_OF_TEXT if end else END_OF_TURN + "\n"
    ids, mask = encoder({"instruction": "Add.", "input": "2 + 2", "output": "4 é"})
    text = "<|user|>\nAdd.\n\n2 + 2\n<|assistant|>\n4 é" + ending
    assert tokenizer.decode(ids, skip_special_tokens=False) == text and ids.dtype == np.int64
    assert tokenizer.decode(ids[mask], skip_special_tokens=False) == "4 é" + ending
    multi = encoder.template.render(MULTI, add_generation_prompt=False)
    assert multi.startswith("<|system|>\nYou are terse.\n<|user|>\nName three colours.\n<|assistant|>\n")
    assert encoder.template.render(MULTI[:2], add_generation_prompt=True).endswith("colours.\n<|assistant|>\n")
    ids, mask = encoder({"messages": MULTI})
    assert masked_runs(tokenizer, ids, mask) == ["Red, green and blue." + ending, "No, that is all." + ending]



def test_the_encoder_pickles(tmp_path):
    for tokenizer in (ByteTokenizer(), load_hf_tokenizer(write_folder(tmp_path / "model"))):
        encoder = ChatEncoder(tokenizer)
        copy = pickle.loads(pickle.dumps(encoder))
        for got, expected in zip(copy({"messages": MULTI}), encoder({"messages": MULTI})):
            assert np.array_equal(got, expected)


def _user(content="Hi"):
    return {"role": "user", "content": content}


def _assistant(content="Hello"):
    return {"role": "assistant", "content": content}


BAD_RECORDS = {
    "neither form": ({"prompt": "Hi", "completion": "Hello"}, "neither messages nor instruction"),
    "not an object": (["Hi"], "not an object"),
    "messages not a list": ({"messages": "Hi"}, "not a non-empty list"),
    "no messages": ({"messages": []}, "not a non-empty list"),
    "no role": ({"messages": [{"content": "Hi"}, _assistant()]}, "message 1 has no role or no content"),
    "no content": ({"messages": [_user(), {"role": "assistant"}]}, "message 2 has no role or no content"),
    "unknown role": ({"messages": [{"role": "bot", "content": "Hi"}, _assistant()]}, "unknown role 'bot'"),
    "content not text": ({"messages": [_user(), _assistant(["Hello"])]}, "content of message 2 is not text"),
    "ends with a user turn": ({"messages": [_user(), _assistant(), _user()]}, "ends with a user turn"),
    "no assistant turn": ({"messages": [_user()]}, "ends with a user turn"),
    "empty answer": ({"messages": [_user(), _assistant(" "), _user(), _assistant()]}, "message 2 is an empty"),
    "no output": ({"instruction": "Add."}, "instruction but no output"),
    "no instruction": ({"output": "4"}, "instruction is missing or empty"),
    "empty output": ({"instruction": "Add.", "output": ""}, "output is empty"),
    "input not text": ({"instruction": "Add.", "input": 4, "output": "4"}, "input is not text"),
}


@pytest.mark.parametrize("case", sorted(BAD_RECORDS))
def test_bad_records_are_one_sentence(case):
    record, expected = BAD_RECORDS[case]
    with pytest.raises(UserError, match=expected) as caught:
        ChatEncoder(ByteTokenizer())(record)
    assert str(caught.value).count(". ") == 0 and str(caught.value).endswith(".")


UNSTABLE = ("{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}"
            "{% if add_generation_prompt %}{{ 'assistant: ' }}{% else %}{{ '<END>' }}{% endif %}")
REWRITTEN = ("{% for m in messages %}{{ m['role'] + ': ' + (m['content'] | upper) + '\\n' }}{% endfor %}"
             "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}")
ALTERNATING = ("{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
               "{{ raise_exception('Roles must alternate user/assistant/user/assistant.') }}{% endif %}"
               "{{ m['content'] }}{% endfor %}")


@pytest.mark.parametrize(("template", "messages", "expected"), [
    (UNSTABLE, [_user(), _assistant(), _user(), _assistant()], "not prefix-stable"),
    (REWRITTEN, [_user(), _assistant()], "cannot be located"),
    (ALTERNATING, [_user(), _user(), _assistant()], "Roles must alternate user/assistant/user/assistant"),
])
def test_templates_that_cannot_mask_are_one_sentence(template, messages, expected):
    with pytest.raises(UserError, match=expected) as caught:
        ChatEncoder(ByteTokenizer(), ChatTemplate(template))({"messages": messages})
    assert str(caught.value).count(". ") == 0


def test_a_template_that_does_not_compile_is_one_sentence():
    with pytest.raises(UserError, match=r"does not compile \(line 1") as caught:
        ChatTemplate("{% for m in messages %}{{ m }}")
    assert str(caught.value).count(". ") == 0
