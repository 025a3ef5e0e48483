"""``scaletrain generate``: text from a model.

``--from`` names a Hugging Face model folder, a run folder (its latest
complete checkpoint) or one of its ``checkpoints/step_NNNNNN`` folders, read
by job/model_source.py (which ``scaletrain eval`` shares): a checkpoint's
model rebuilt from its run's ``config.toml``, a LoRA fine-tune's adapters
merged, the text through the run's own tokenizer.

The text stops at the tokenizer's end-of-text token, where the model ends its
document (``--ignore-eos``: it goes on for every ``--tokens``, the token's
text marking each end). With ``--chat`` the prompt is a user's question
rendered by the model's chat template (a fine-tune with ``--sft`` learned to
answer in it: docs/data.md), and what comes back is the answer, cut at the
end-of-text token or the built-in template's end-of-turn marker.

Sampling is the model's own ``generate``: top-k, then temperature (0: the
most likely token each time), one seeded generator, so a seed gives the same
text again on the same device. There is no key/value cache: every new token
runs the model over the whole window (up to seq_len tokens), which keeps the
model code plain and is quick enough for a few hundred tokens.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch

from scaletrain.data.chat import BUILTIN_TEMPLATE, END_OF_TURN, ChatTemplate
from scaletrain.data.tokenizer import until_end
from scaletrain.errors import UserError
from scaletrain.job.data_setup import AnyTokenizer
from scaletrain.job.model_source import load_model, load_run_model  # noqa: F401 - load_run_model: tests import it here


def add_parser(commands) -> None:
    generate = commands.add_parser(
        "generate", help="continue a prompt with a trained model or released weights",
        description="Continue --prompt with a model and print the prompt and its continuation. The model is "
                    "a Hugging Face model folder (config.json, model.safetensors, its shards or pytorch_model.bin, and "
                    "tokenizer.json or vocab.json with merges.txt; nothing is downloaded), or one of ours: a "
                    "run folder for its latest complete checkpoint, or a checkpoint folder, with the run's "
                    "tokenizer.")
    generate.add_argument("--from", dest="source", metavar="CKPT_OR_HF_DIR", required=True,
                          help="a Hugging Face model folder, a run folder, or RUN/checkpoints/step_NNNNNN")
    generate.add_argument("--prompt", metavar="TEXT", required=True, help="the text to continue")
    generate.add_argument("--tokens", type=int, default=100, metavar="N", help="tokens to add [100]")
    generate.add_argument("--temperature", type=float, default=0.8, metavar="T",
                          help="divides the logits before sampling: below 1 sharper, above 1 flatter, 0 "
                               "always the most likely token [0.8]")
    generate.add_argument("--top-k", type=int, default=50, metavar="K",
                          help="sample among the K most likely tokens (0: among all) [50]")
    generate.add_argument("--chat", action="store_true",
                          help="the prompt is a user's question in the model's chat template; print the answer "
                               "alone, up to its end (a model fine-tuned with --sft)")
    generate.add_argument("--ignore-eos", action="store_true",
                          help="go on past the end-of-text token for every --tokens, writing the token's text "
                               "where the model ended a document (without it the text stops there)")
    generate.add_argument("--seed", type=int, default=1234, metavar="N",
                          help="seed of the sampling: the same seed gives the same text [1234]")
    generate.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    print(generate(Path(args.source), args.prompt, args.tokens, args.temperature, args.top_k, args.seed, args.chat,
                   args.ignore_eos))
    return 0


def check_options(prompt: str, tokens: int, temperature: float, top_k: int) -> None:
    """The sampling options, before any model is read: one sentence per mistake."""
    if not prompt:
        raise UserError("--prompt is empty; give the text to continue.")
    if tokens < 1:
        raise UserError(f"--tokens must be at least 1, not {tokens}.")
    if not (temperature >= 0 and math.isfinite(temperature)):
        raise UserError(f"--temperature must be 0 (the most likely token) or a positive number, not {temperature}.")
    if top_k < 0:
        raise UserError(f"--top-k must not be negative, not {top_k} (0 samples among every token).")


def chat_prompt(tokenizer: AnyTokenizer, prompt: str) -> tuple[list[int], str | None]:
    """``prompt`` as a user's turn in the tokenizer's chat template (the built-in one when it has
    none; data/chat.py), ending in the assistant's header, as the model saw its questions in
    instruction fine-tuning; and the text that ends an answer where no end-of-text id does."""
    template = ChatTemplate.for_tokenizer(tokenizer)
    text = template.render([{"role": "user", "content": prompt}], add_generation_prompt=True)
    ends = END_OF_TURN if template.source == BUILTIN_TEMPLATE else None
    return tokenizer.encode(text, special_tokens=False).tolist(), ends


def _answer(tokenizer: AnyTokenizer, new: list[int], ends: str | None) -> str:
    """The sampled ids up to the end of the answer: the end-of-text id, or the template's marker."""
    text = tokenizer.decode(until_end(tokenizer, new))
    return text.split(ends)[0] if ends else text


def generate(source: Path, prompt: str, tokens: int = 100, temperature: float = 0.8, top_k: int = 50,
             seed: int = 1234, chat: bool = False, ignore_eos: bool = False) -> str:
    """``prompt`` and up to ``tokens`` more tokens sampled by the model in ``source``, up to the
    end-of-text token (``ignore_eos``: all of them, each end written as the token's text);
    ``top_k`` 0 samples among every token. With ``chat``: the prompt is a user's question in
    the model's chat template, and the answer alone comes back, up to its end."""
    check_options(prompt, tokens, temperature, top_k)
    model, tokenizer = load_model(source)
    ends = None
    if chat:
        ids, ends = chat_prompt(tokenizer, prompt)
        ids = torch.tensor(ids, dtype=torch.long)
    else:
        ids = torch.tensor(tokenizer.encode(prompt), dtype=torch.long)
    vocab = model.cfg.vocab_size
    if int(ids.max()) >= vocab:
        raise UserError(f"the tokenizer gives --prompt the id {int(ids.max())}, beyond the model's {vocab} "
                        f"tokens; the tokenizer files belong to another model.")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    generator = torch.Generator(device=device).manual_seed(seed)
    out = model.to(device).generate(ids[None].to(device), tokens, temperature=temperature, top_k=top_k or None,
                                    generator=generator, stop_id=None if ignore_eos else tokenizer.eos_id)
    if ignore_eos:
        return tokenizer.decode(out[0].tolist(), skip_special_tokens=False)
    new = out[0, len(ids):].tolist()
    if chat:
        return _answer(tokenizer, new, ends)
    return tokenizer.decode(ids.tolist() + until_end(tokenizer, new))
