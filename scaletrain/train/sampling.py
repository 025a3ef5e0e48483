"""Text from a model however it is laid out: the run's closing sample, the library's ``generate``.

Every rank takes part: each holds a part of the model that a forward needs
(ZeRO-3's and hybrid sharding's shards, gathered over dp and cp; tp's slices;
pp's stages; ep's experts), so a rank that stayed out would leave the others
waiting in a collective. Each enters its parts' generation mode (whole logits
on every tp rank, whole sequences on every cp rank: parallel/tensor.py,
parallel/context.py) and draws from one generator seeded alike on every
rank, so every rank writes the same tokens, the ones one device writes with
the same weights and seed. There is no key/value cache: each new token runs
the model over the last ``context`` tokens.
"""

from __future__ import annotations

from contextlib import ExitStack

import torch

from scaletrain.data.batches import IGNORE_INDEX
from scaletrain.models.decoder import sample_next
from scaletrain.techniques.precision import autocast

PROMPT_CHARS = 48


def line_prompt(tokenizer, window: torch.Tensor) -> torch.Tensor:
    """The first ``PROMPT_CHARS`` characters from the start of a line or a document of ``window``'s
    text (special tokens spelled out, so that an end-of-text token inside stays one)."""
    text = tokenizer.decode(window.tolist(), skip_special_tokens=False)
    end = tokenizer.decode([tokenizer.eos_id], skip_special_tokens=False) if tokenizer.eos_id is not None else None
    # begin where a line or a document begins, not mid-word
    start = min((text.find(mark) + len(mark) for mark in ("\n", end) if mark and mark in text), default=0)
    if start > len(text) // 2:  # no line or document begins early enough: take the window as it is
        start = 0
    return torch.tensor(tokenizer.encode(text[start:start + PROMPT_CHARS]), dtype=torch.long)


def sft_prompt(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The prompt of a row's first instruction example, as training rendered it: its ids up to the
    first trained target (the answer's first token), which the model is to write next."""
    trained = (targets != IGNORE_INDEX).nonzero()
    return inputs[:int(trained[0]) + 1] if len(trained) else inputs


@torch.no_grad()
def generate(layout, prompt: torch.Tensor, tokens: int, *, context: int, vocab: int | None, precision: str,
             seed: int, temperature: float = 0.8, top_k: int | None = 50) -> torch.Tensor:
    """``prompt`` [batch, seq] and ``tokens`` more ids sampled by the model of ``layout``
    (train/layout.py), however it is split, the last ``context`` ids as its input; ``vocab``: the
    ids that may be drawn (the padded rows of --vocab-multiple never are; None: every logit's).
    Top-k, then temperature (0: the most likely id). The model is left in the mode it was in."""
    device = layout.device
    generator = torch.Generator(device=device).manual_seed(seed)
    model = layout.model
    training = model.training
    model.eval()

    def draw(logits: torch.Tensor) -> torch.Tensor:  # last-position logits [batch, vocab]
        return sample_next(logits[:, :vocab], temperature, top_k, generator)

    idx = prompt.to(device)
    try:
        with ExitStack() as generation:
            for part in (layout.tensor_parallel, layout.context_parallel):
                if part is not None:
                    generation.enter_context(part.generation())
            if layout.pipeline:
                return layout.pipeline.generate(idx, tokens, context=context, sample_next=draw,
                                                forward_context=lambda: autocast(precision, device))
            with autocast(precision, device):
                for _ in range(tokens):
                    idx = torch.cat([idx, draw(model(idx[:, -context:])[:, -1, :])], dim=1)
            return idx
    finally:
        model.train(training)
