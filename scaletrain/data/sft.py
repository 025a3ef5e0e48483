"""Instruction records to token ids and an assistant-only loss mask.

Supervised fine-tuning trains a model to answer: the loss counts the tokens of
the assistant's turns and skips the prompt around them, as Ouyang et al. 2022
("Training language models to follow instructions with human feedback") and
TRL's ``assistant_only_loss`` do. A record is a chat
(``messages``: ``{role, content}`` turns, an optional system turn first) or an
Alpaca record (Taori et al. 2023: ``instruction``, optional ``input``,
``output``), which becomes one user turn and one assistant turn.

`ChatEncoder` finds the assistant turns by rendering incrementally: for the
assistant turn at message k, the conversation before it with the generation
prompt (ending in the template's assistant header) and the conversation
through it. The text between the two is that turn: its answer and the
end-of-turn tokens the template writes after it (``<|im_end|>``, an eos), so
the model also learns to stop. This needs a prefix-stable template, where each
rendering begins with the one before; one that rewrites earlier turns once
later ones exist (dropping their reasoning, say) is refused.

The pieces are tokenized one by one, without the post-processor's BOS/EOS (a
template writes its own). Splitting at a boundary is what inference does too:
its prompt ends at the assistant header, and the model writes the answer's
tokens from there. Where every boundary falls on a special token or a line
break, as in ChatML, the ids equal those of the whole text tokenized at once,
which is what transformers' ``apply_chat_template(tokenize=True)`` gives.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from scaletrain.data.chat import ChatTemplate
from scaletrain.errors import UserError

ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class ChatOptions:
    """How instruction records are rendered: the template (``--chat-template``, data/chat.py's
    `ChatTemplate.chosen`), the loss on the prompts too (``--train-on-inputs``), a system turn
    for the records that have none (``--system-prompt``)."""

    template: str | None = None
    train_on_inputs: bool = False
    system_prompt: str | None = None


def _chat_messages(messages) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise UserError("the record's messages field is not a non-empty list; give a list of {role, content} turns.")
    for number, message in enumerate(messages, 1):
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise UserError(f"message {number} has no role or no content; give each turn as {{role, content}}.")
        role, content = message["role"], message["content"]
        if role not in ROLES:
            raise UserError(f"message {number} has the unknown role {role!r}; use system, user or assistant.")
        if not isinstance(content, str):
            raise UserError(f"the content of message {number} is not text; give each turn's content as a string.")
        if role == "assistant" and not content.strip():
            raise UserError(f"message {number} is an empty assistant answer; give the answer or drop the turn.")
    if messages[-1]["role"] != "assistant":
        raise UserError(f"the conversation ends with a {messages[-1]['role']} turn, not an assistant answer; end "
                        f"it with the answer to train on.")
    return [dict(message) for message in messages]


def _text_field(record: dict, key: str) -> str:
    value = record.get(key)
    if value is None:
        return ""
    if not isinstance(value, str):
        raise UserError(f"the record's {key} is not text; give it as a string.")
    return value


def _alpaca_messages(record: dict) -> list[dict]:
    instruction, extra, output = (_text_field(record, key) for key in ("instruction", "input", "output"))
    if "output" not in record:
        raise UserError("the record has an instruction but no output; give the answer to train on as output.")
    if not instruction.strip():
        raise UserError("the record's instruction is missing or empty; give the instruction its output answers.")
    if not output.strip():
        raise UserError("the record's output is empty; give the answer to train on.")
    prompt = f"{instruction}\n\n{extra}" if extra else instruction
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": output}]


def record_messages(record) -> list[dict]:
    """The conversation a record holds, checked: a chat's messages, or an Alpaca record's two turns."""
    if not isinstance(record, dict):
        raise UserError("the record is not an object; give {messages: [...]} or {instruction, input, output}.")
    if "messages" in record:
        return _chat_messages(record["messages"])
    if "instruction" in record or "output" in record:
        return _alpaca_messages(record)
    raise UserError(f"the record has neither messages nor instruction and output (its fields: "
                    f"{', '.join(map(str, record)) or 'none'}); give a chat or an Alpaca record.")


class ChatEncoder:
    """``encoder(record) -> (ids, mask)``: int64 ids of the rendered conversation and a bool mask, True
    exactly on the assistant turns' tokens (every token with ``train_on_inputs``); a record without a
    system turn gets ``system_prompt`` first, where one is given. Picklable, so data preparation can
    run it in workers."""

    def __init__(self, tokenizer, template: ChatTemplate | None = None, train_on_inputs: bool = False,
                 system_prompt: str | None = None):
        self.tokenizer = tokenizer
        self.template = template if template is not None else ChatTemplate.for_tokenizer(tokenizer)
        self.train_on_inputs = train_on_inputs
        self.system_prompt = system_prompt

    @classmethod
    def chosen(cls, tokenizer, options: ChatOptions) -> ChatEncoder:
        return cls(tokenizer, ChatTemplate.chosen(options.template, tokenizer), options.train_on_inputs,
                   options.system_prompt)

    def identity(self) -> list:
        """What the ids and masks depend on besides the tokenizer: the cache's key."""
        return [self.template.source, self.train_on_inputs, self.system_prompt]

    def _messages(self, record) -> list[dict]:
        messages = record_messages(record)
        if self.system_prompt and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        return messages

    def _pieces(self, messages: list[dict]) -> list[tuple[str, bool]]:
        """The rendered conversation cut into (text, is an assistant turn), in order."""
        pieces, done = [], ""
        for k, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            prompt = self.template.render(messages[:k], add_generation_prompt=True)
            through = self.template.render(messages[: k + 1])
            if not prompt.startswith(done) or not through.startswith(prompt):
                raise UserError(f"{self.template.name} is not prefix-stable (rendering message {k + 1} changes "
                                f"the text before it), so the assistant turns cannot be located; use a "
                                f"template that renders earlier turns unchanged.")
            answer = through[len(prompt):]
            if message["content"].strip() not in answer:
                raise UserError(f"{self.template.name} does not write assistant message {k + 1} after its "
                                f"generation prompt, so the answer cannot be located; use a template that "
                                f"renders each answer as given.")
            pieces += [(prompt[len(done):], False), (answer, True)]
            done = through
        return pieces

    def __call__(self, record: dict) -> tuple[np.ndarray, np.ndarray]:
        ids, mask = [], []
        for text, trained in self._pieces(self._messages(record)):
            piece = self.tokenizer.encode(text, special_tokens=False).astype(np.int64)
            ids.append(piece)
            mask.append(np.full(len(piece), trained or self.train_on_inputs))
        return np.concatenate(ids), np.concatenate(mask)
