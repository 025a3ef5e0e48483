"""Chat templates: a conversation rendered to text the way its model was trained to read it.

A chat model sees a conversation as one text with role headers and end-of-turn
markers in its own format, which the model's folder ships as a Jinja template
(tokenizer_config.json's ``chat_template`` or chat_template.jinja). Fine-tuning
must render with that template exactly as inference will, so `ChatTemplate`
reproduces transformers' ``apply_chat_template(tokenize=False)``
(transformers/utils/chat_template_utils.py): the template compiled once in
Jinja's immutable sandbox (templates come from downloaded folders, so they may
call no Python beyond the sandbox's), with ``trim_blocks`` and
``lstrip_blocks``, the ``raise_exception`` and ``strftime_now`` globals, a
``tojson`` filter that keeps non-ASCII characters and does not escape HTML,
the ``loopcontrols`` extension and a ``{% generation %}`` tag that renders its
body, and as variables ``messages``, ``add_generation_prompt``, ``tools`` and
``documents`` (None) and every named special token of the tokenizer.

Tokenizers without a template (our byte and BPE tokenizers, a model folder
that ships none) get `BUILTIN_TEMPLATE`::

    <|system|>
    You are terse.
    <|user|>
    What is 2 + 2?
    <|assistant|>
    4<|endoftext|>

Each turn is a header line naming its role followed by the content and a
newline; an assistant turn ends instead with the tokenizer's end-of-text
token (its ``eos_token``), so a model trained on it learns to write
the one token that every reader stops at (``generate``, transformers'
``generate``, the harness), a token the base model already knows. The role
markers are plain text, read but never written by the model. A tokenizer
without an end-of-text token (one saved before this project's had one) ends
the answer with the text `END_OF_TURN`, ``<|end|>``, and a newline, as it
always did.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from scaletrain.errors import UserError
from scaletrain.models.chat_templates import CHAT_TEMPLATES

END_OF_TURN = "<|end|>"

BUILTIN_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] }}"
    "{% if message['role'] != 'assistant' %}{{ '\\n' }}"
    "{% elif eos_token is defined %}{{ eos_token }}"
    "{% else %}{{ '" + END_OF_TURN + "\\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: transformers marks assistant text with it for its
    own masks; templates that use it must still compile, and the tag renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    @staticmethod
    def _body(caller) -> str:
        return caller()


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _compile(source: str, name: str) -> jinja2.Template:
    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    try:
        return environment.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise UserError(f"{name} does not compile (line {exc.lineno}: {_first_sentence(exc)}); fix the template "
                        f"or use a model folder whose template transformers can apply.") from None


def _first_sentence(exc: BaseException) -> str:
    """A Jinja or template message cut to its first sentence, to fit inside ours."""
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0].split(". ")[0].rstrip(".")


class ChatTemplate:
    """A Jinja chat template, compiled once, with the tokenizer's special tokens as variables.

    Picklable (data preparation runs it in worker processes): only the source and the tokens
    travel, and each process compiles its own copy.
    """

    def __init__(self, source: str, tokens: dict[str, str] | None = None, name: str = "the chat template"):
        self.source = source
        self.tokens = dict(tokens or {})
        self.name = name
        self._template = _compile(source, name)

    @classmethod
    def chosen(cls, choice: str | None, tokenizer) -> ChatTemplate:
        """``--chat-template``: None or ``tokenizer`` (the tokenizer's own, else the built-in one),
        ``builtin``, a name of `CHAT_TEMPLATES`, or a Jinja file; the tokenizer's special tokens
        as its variables."""
        if choice in (None, "tokenizer"):
            return cls.for_tokenizer(tokenizer)
        tokens = {} if tokenizer.config is None else tokenizer.config.template_tokens()
        if choice == "builtin":
            return cls(BUILTIN_TEMPLATE, tokens, name="the built-in chat template")
        if choice in CHAT_TEMPLATES:
            return cls(CHAT_TEMPLATES[choice], tokens, name=f"the {choice} chat template")
        path = Path(choice)
        if not path.is_file():
            raise UserError(f"--chat-template {choice} is neither a template's name (tokenizer, builtin, "
                            f"{', '.join(CHAT_TEMPLATES)}) nor a Jinja file; give one of those.")
        try:
            source = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            raise UserError(f"--chat-template {choice} cannot be read as UTF-8 text; give a readable Jinja "
                            f"file.") from None
        return cls(source, tokens, name=f"the chat template in {choice}")

    @classmethod
    def for_tokenizer(cls, tokenizer) -> ChatTemplate:
        """The tokenizer's own template, or `BUILTIN_TEMPLATE` when it has none."""
        config = tokenizer.config
        if config is None or config.chat_template is None:
            return cls(BUILTIN_TEMPLATE, {} if config is None else config.template_tokens(),
                       name="the built-in chat template")
        return cls(config.chat_template, config.template_tokens(), name="the tokenizer's chat template")

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        """The conversation as text. Message keys holding None are dropped first, as transformers
        does, since templates test for a key's presence rather than for None."""
        messages = [{key: value for key, value in message.items() if value is not None} for message in messages]
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         tools=None, documents=None, **self.tokens)
        except (jinja2.TemplateError, TypeError) as exc:
            raise UserError(f"{self.name} cannot render this conversation ({_first_sentence(exc)}); give messages "
                            f"in the roles and order the template accepts.") from None

    def __getstate__(self) -> dict:
        return {"source": self.source, "tokens": self.tokens, "name": self.name}

    def __setstate__(self, state: dict) -> None:
        self.__init__(**state)
