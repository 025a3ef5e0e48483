"""The text a run ends with: the model continuing a line of the validation text.

Every rank of the main rank's model replica runs the generation (tp ranks
hold slices of every layer, pp ranks the stages a token passes through), each
in its parts' generation mode (parallel/tensor.py, parallel/context.py), with
one seeded generator, so the ranks draw the same tokens.
"""

from __future__ import annotations

from contextlib import ExitStack

import torch

from scaletrain.models.decoder import sample_next
from scaletrain.precision import autocast

PROMPT_CHARS = 48


def line_prompt(tokenizer, window: torch.Tensor) -> torch.Tensor:
    """The first ``PROMPT_CHARS`` characters from the start of a line of ``window``'s text."""
    text = tokenizer.decode(window.tolist())
    start = text.find("\n") + 1  # begin at a line, not mid-word
    if start > len(text) // 2:  # no line break early enough: take the window as it is
        start = 0
    return torch.tensor(tokenizer.encode(text[start:start + PROMPT_CHARS]), dtype=torch.long)


@torch.no_grad()
def generate(layout, prompt: torch.Tensor, tokens: int, cfg, vocab: int) -> torch.Tensor:
    """``tokens`` tokens after ``prompt`` by the model of ``layout`` (train/layout.py), however it is
    split, of run configuration ``cfg``; ``vocab``: the tokenizer's ids (the padded rows of
    --vocab-multiple are never sampled)."""
    device = layout.device
    generator = torch.Generator(device=device).manual_seed(cfg.train.seed)
    layout.model.eval()
    prompt = prompt[None].to(device)
    with ExitStack() as generation:
        for part in (layout.tensor_parallel, layout.context_parallel):
            if part is not None:
                generation.enter_context(part.generation())
        if layout.pipeline:
            return layout.pipeline.generate(
                prompt, tokens, context=cfg.data.seq_len,
                sample_next=lambda logits: sample_next(logits[:, :vocab], generator=generator),
                forward_context=lambda: autocast(cfg.train.precision, device))[0]
        with autocast(cfg.train.precision, device):
            return layout.model.generate(prompt, tokens, generator=generator)[0]
