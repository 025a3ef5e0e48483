"""scaletrain's models in EleutherAI's lm-evaluation-harness: ``scaletrain eval`` and ``--eval-tasks``
(the tasks and the evaluation around this model: job/eval_tasks.py).

`ScaletrainLM` is the harness's language model (``lm_eval.api.model.TemplateLM``, the ``LM``
that tokenizes requests the way its Hugging Face backend does) over any model of ours, whole on
one device or split over tensor-parallel and pipeline ranks, with the run's own tokenizer. It
answers the harness's three kinds of request the way the harness's ``hf`` backend
(lm_eval/models/huggingface.py) does, so the numbers are the ones
``lm_eval --model hf`` gives on the ``scaletrain export --format hf`` folder of the same weights:

- ``loglikelihood(context, continuation)``: context and continuation tokenized together, the
  continuation's tokens split off the end (TemplateLM); the sequence left-truncated to the
  model's context window (``seq_len`` positions: ``(context + continuation)[-(window + 1):][:-1]``),
  scored in batches of ``--batch-size`` right-padded rows, longest first, one forward for the
  choices that share a context and differ in one last token (the harness's ``Collator``). The
  answer is the summed log-probability of the continuation's tokens under a log-softmax over every
  row of the head (as the training loss sees them, --vocab-multiple's padding included) and
  whether greedy decoding would write exactly the continuation.
- ``loglikelihood_rolling(text)``: the text's tokens in disjoint windows of the context window,
  each scored with as much context as fits (``lm_eval.utils.get_rolling_token_windows``), the
  first token predicted from the prefix token.
- ``generate_until(context, until, max_gen_toks)``: the context left-truncated to the window less
  ``max_gen_toks``, then greedy tokens (or sampled, with ``do_sample``) until a stop string, the
  end-of-text token or ``max_gen_toks``; the text is cut at the first stop string. A batch of
  ``--batch-size`` contexts runs as rows of one length at a time, unpadded: the hf backend pads
  on the left under an attention mask, which our models take only as packed documents, whose
  GPU kernel (FlexAttention, compiled for one shape) would compile again at every new length.
  There is no key/value cache (as in ``scaletrain generate``): each new token runs the model
  over the row.

The prefix token (what an empty context and a text's first token are predicted from) is the
hf backend's: the tokenizer's beginning-of-text token, else its end-of-text token; a tokenizer
with neither (our byte tokenizer, a BPE trained here) has the last token of the blank line that
ends a document in training (data/sources.py). The hf backend given that id as
``prefix_token_id`` scores the same.

A task that asks for a chat template (``--apply-chat-template``) renders with the tokenizer's
template or the built-in one a fine-tune with ``--sft`` learned (data/chat.py), as
``scaletrain generate --chat`` does; an assistant's message to continue is cut where it ends,
as transformers' ``continue_final_message``.

Distributed (``--nproc``, and every rank of a training run): each rank holds the whole model,
or with ``--tp`` and ``--pp`` its slices of its stages (job/eval_layout.py), and runs the harness
whole (its documents, few-shot contexts, filters and metrics, all cheap and the same on every
rank); only the model's work is split. Each of this class's three request methods takes its share
of the requests it is handed (the contiguous share of its rank in ``group``, the ranks that split
the requests; the tp and pp ranks of one copy of the model, which compute it together, answer the
same share, each forward under the tp split's generation mode and, with a pipeline, one
forward-only round whose last stage's logits it sends to every stage: whole logits on every one
of them), answers them, and gathers every share's answers in order (runtime/comm.py's
``all_gather_object``, the one door: gloo on CPUs, NCCL on GPUs), so every rank holds what one
process would have computed.
The harness's own split (``lm.rank``/``lm.world_size``: every ``world_size``-th document to a
rank, its request lists padded to equal length, per-document metrics gathered on rank 0) is not
used: it draws each rank's few-shot examples from one seeded stream over that rank's documents
alone (lm_eval/api/task.py, ``build_all_requests``), so with ``--num-fewshot`` a document's prompt,
and the score, would depend on the number of processes.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import nn

from scaletrain.data.chat import ChatTemplate
from scaletrain.data.tokenizer import document_separator
from scaletrain.errors import UserError
from scaletrain.job.eval_tasks import require_lm_eval
from scaletrain.models.decoder import sample_next
from scaletrain.techniques.precision import autocast

try:
    from lm_eval.api.model import TemplateLM
except ImportError:  # the [eval] extra is absent: require_lm_eval says so in one sentence before any use
    TemplateLM = object

CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "  # transformers' marker of a message to continue
MAX_GEN_TOKS = 256  # the hf backend's default for a task that names none


def _special_id(tokenizer, token: str | None) -> int | None:
    """The id of a named special token; None where the tokenizer has no such single token."""
    if token is None:
        return None
    ids = tokenizer.encode(token, special_tokens=False).tolist()
    return ids[0] if len(ids) == 1 else None


class ScaletrainLM(TemplateLM):
    """The harness's language model over ``model`` (a decoder of ours: ``model(ids)`` gives
    logits, ``model.cfg`` its ``positions`` and ``vocab_size``) and its tokenizer
    (data/tokenizer.py); see the module docstring. ``comm`` and ``group``: the ranks that split
    the requests (None: this process alone); ``tensor_parallel``: the split of a model whose
    slices this rank holds (job/eval_layout.py), None for a whole one; ``pipeline``: the stages
    this rank holds, None for all of them, and ``head_rows`` the rows of the head, which the
    stages without it need to receive its logits."""

    backend = "causal"

    def __init__(self, model: nn.Module, tokenizer, *, batch_size: int = 8, device: torch.device | None = None,
                 precision: str = "fp32", comm=None, group=None, tensor_parallel=None, pipeline=None,
                 head_rows: int | None = None, name: str = "scaletrain", seed: int = 1234):
        require_lm_eval()
        super().__init__()
        self._device = device or next(model.parameters()).device
        self.model = model.to(self._device).eval()
        self._tok = tokenizer
        self.batch_size = batch_size
        self.precision = precision
        self.name = name
        self.seed = seed
        self.comm, self.group, self.tensor_parallel, self.pipeline = comm, group, tensor_parallel, pipeline
        self.head_rows = head_rows
        self.parameter_count = self._count_parameters()  # on every rank: under pp the stages add theirs
        config = getattr(tokenizer, "config", None)
        self.bos_text = config.bos_token if config is not None else None
        bos = _special_id(tokenizer, self.bos_text)
        eos = tokenizer.eos_id
        self._prefix = bos if bos is not None else eos if eos is not None else int(document_separator(tokenizer)[-1])
        # The prefix token's text, special tokens spelled out (as the hf backend decodes it): a string
        # that begins with it gets no special tokens added.
        self._prefix_text = self.bos_text if bos is not None else config.eos_token if eos is not None \
            else tokenizer.decode([self._prefix])
        self.template = ChatTemplate.for_tokenizer(tokenizer)
        self._renders_chats = False  # set once the harness asks for a conversation in the template

    # -- what the harness reads -------------------------------------------------
    @property
    def eot_token_id(self) -> int | None:
        return self._tok.eos_id

    @property
    def prefix_token_id(self) -> int:
        return self._prefix

    @property
    def max_length(self) -> int:
        """The model's context window: the most tokens one forward reads."""
        return self.model.cfg.positions

    @property
    def max_gen_toks(self) -> int:
        return MAX_GEN_TOKS

    @property
    def tokenizer_name(self) -> str:
        return self.name.replace("/", "__")

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        return self.template.source if chat_template else None

    @property
    def is_main(self) -> bool:
        """Whether this rank reports the results: the first tp and pp rank of the first copy of the model."""
        first_tp_rank = self.tensor_parallel is None or self.tensor_parallel.group.rank == 0
        first_stage = self.pipeline is None or self.pipeline.group.rank == 0
        return first_tp_rank and first_stage and (self.group is None or self.group.rank == 0)

    @property
    def processes(self) -> int:
        """The processes that evaluate: the request-splitting groups times the ranks of each model."""
        return (self.group.size if self.group is not None else 1) * self.tp_size * self.pp_size

    @property
    def tp_size(self) -> int:
        """The ranks that hold the model together (1: a whole model)."""
        return self.tensor_parallel.group.size if self.tensor_parallel is not None else 1

    @property
    def pp_size(self) -> int:
        """The pipeline stages' ranks (1: every stage here)."""
        return self.pipeline.group.size if self.pipeline is not None else 1

    def _count_parameters(self) -> int:
        """The whole model's parameters: under pp each stage's, summed over the pipeline group, a
        tied weight counted on its first holder only."""
        held = [p for p in self.model.parameters() if self.pipeline is None or self.pipeline.counts(p)]
        count = torch.tensor(sum(self._whole_numel(p) for p in held), dtype=torch.int64, device=self._device)
        if self.pipeline is not None:
            self.comm.all_reduce(count, self.pipeline.group)
        return int(count)

    def _whole_numel(self, param: nn.Parameter) -> int:
        """Elements of the whole weight ``param`` is (a tp slice: the full tensor's)."""
        split = self.tensor_parallel.splits.get(param) if self.tensor_parallel is not None else None
        return math.prod(split.full_shape) if split is not None else param.numel()

    def get_model_info(self) -> dict:
        return {"model_num_parameters": self.parameter_count,
                "model_dtype": str(next(self.model.parameters()).dtype), "model_source": self.name,
                "prefix_token_id": self._prefix, "max_length": self.max_length, "precision": self.precision}

    # -- the model's work split over the group (module docstring) ------------------
    def _shared(self, requests: list, answer) -> list:
        """``answer(requests)``, each rank answering its contiguous share; every rank's answers, in order."""
        if self.group is None or self.group.size == 1:
            return answer(requests)
        size, rank = self.group.size, self.group.rank
        mine = answer(requests[len(requests) * rank // size:len(requests) * (rank + 1) // size])
        return [result for part in self.comm.all_gather_object(mine, self.group) for result in part]

    # -- tokens -------------------------------------------------------------------
    def tok_encode(self, string: str, add_special_tokens: bool | None = None, left_truncate_len: int | None = None,
                   **kwargs) -> list[int]:
        """As the hf backend: the tokenizer's special tokens added, unless asked otherwise or the
        string already begins with the prefix token's text; but none to a rendered conversation, whose
        template writes its own, as SFT tokenized it and transformers' ``apply_chat_template`` does
        (the hf backend would add a BOS the fine-tune never saw before its prompts)."""
        if add_special_tokens is None:
            add_special_tokens = not (self._renders_chats or self._prefix_text and string.startswith(self._prefix_text))
        ids = self._tok.encode(string, special_tokens=add_special_tokens).tolist()
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def tok_decode(self, tokens) -> str:
        return self._tok.decode(tokens)

    @torch.no_grad()
    def _logits(self, ids: torch.Tensor) -> torch.Tensor:
        """fp32 logits [batch, seq, rows of the head] of ``ids`` [batch, seq]; whole on every rank of
        a tp group (its generation mode gathers the vocabulary slices) and of a pipeline (the last
        stage's, sent to the others)."""
        whole = self.tensor_parallel.generation() if self.tensor_parallel is not None else contextlib.nullcontext()
        ids = ids.to(self._device)
        with whole:
            if self.pipeline is not None:
                return self.pipeline.logits(ids, self.head_rows,
                                            forward_context=lambda: autocast(self.precision, self._device))
            with autocast(self.precision, self._device):
                return self.model(ids).float()

    # -- loglikelihood --------------------------------------------------------------
    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """(log-probability, greedy) of each (context, continuation): TemplateLM's tokenization, then
        `_loglikelihood_tokens`."""
        return self._shared(requests, lambda mine: super(ScaletrainLM, self).loglikelihood(mine, disable_tqdm))

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs: int | None = None
                              ) -> list[tuple[float, bool]]:
        """(log-probability, greedy) of each request's continuation tokens after its context
        tokens: the hf backend's ``_loglikelihood_tokens`` on our forward."""
        from lm_eval.models.utils import Collator

        def longest_first(request):
            tokens = request[1] + request[2]
            return -len(tokens), tuple(tokens)

        reordered = Collator(requests, sort_fn=longest_first, group_by="contexts",
                             group_fn=lambda request: request[-2] + request[-1][:-1])
        results = []
        for chunk in reordered.get_batched(n=override_bs or self.batch_size):
            rows = []
            for _, context, continuation in chunk:
                if not 0 < len(continuation) <= self.max_length:
                    raise UserError(f"a continuation of {len(continuation)} tokens does not fit the model's context "
                                    f"window of {self.max_length}; give the task shorter answers.")
                rows.append((context + continuation)[-(self.max_length + 1):][:-1])
            width = max(len(row) for row in rows)
            ids = torch.tensor([row + [0] * (width - len(row)) for row in rows], dtype=torch.long)
            logprobs = F.log_softmax(self._logits(ids), dim=-1)
            for (request, context, continuation), row, scores in zip(chunk, rows, logprobs, strict=True):
                scores = scores[len(row) - len(continuation):len(row)].unsqueeze(0)  # [1, continuation, vocab]
                greedy = scores.argmax(dim=-1)
                # The requests whose context + continuation[:-1] is this one's share its scores (a
                # one-token answer among several: one forward for all the choices).
                for shared, tokens, shared_scores in reordered.get_cache(
                        req_str=request, cxt_toks=context, cont_toks=continuation, logits=scores):
                    wanted = torch.tensor(tokens, dtype=torch.long, device=scores.device).unsqueeze(0)
                    exact = bool((greedy[:, -wanted.shape[1]:] == wanted).all())
                    answer = (float(torch.gather(shared_scores, 2, wanted.unsqueeze(-1)).sum()), exact)
                    results.append(answer)
                    if shared is not None:
                        self.cache_hook.add_partial("loglikelihood", shared, answer)
        return reordered.get_original(results)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each text's log-probability, token by token, in disjoint windows of the context window."""
        return self._shared(requests, self._loglikelihood_rolling)

    def _loglikelihood_rolling(self, requests) -> list[float]:
        from lm_eval import utils

        windows, counts = [], []
        for (text,) in (request.args for request in requests):
            mine = [(None, *utils.make_disjoint_window(window)) for window in utils.get_rolling_token_windows(
                token_list=self.tok_encode(text), prefix_token=self._prefix, max_seq_len=self.max_length,
                context_len=1)]
            windows.extend(mine)
            counts.append(len(mine))
        scores = iter(self._loglikelihood_tokens(windows))
        totals = []
        for request, count in zip(requests, counts, strict=True):
            total = sum(next(scores)[0] for _ in range(count))
            totals.append(total)
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    # -- generation -------------------------------------------------------------------
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Each context's continuation up to its first stop string (the hf backend's batching
        and truncation; our forward)."""
        return self._shared(requests, self._generate_until)

    def _generate_until(self, requests) -> list[str]:
        from lm_eval.models.utils import (
            Collator,
            handle_stop_sequences,
            normalize_gen_kwargs,
            postprocess_generated_text,
        )

        reordered = Collator([request.args for request in requests],
                             sort_fn=lambda args: (-len(self.tok_encode(args[0])), args[0]),
                             group_by="gen_kwargs", group_fn=lambda args: args[1])
        generator = torch.Generator(device=self._device).manual_seed(self.seed)
        results = []
        for chunk in reordered.get_batched(n=self.batch_size):
            contexts, all_kwargs = zip(*chunk, strict=True)
            kwargs = normalize_gen_kwargs(all_kwargs[0], self.max_gen_toks)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=None)  # the end-of-text id stops below
            new_tokens = kwargs.pop("max_gen_toks")
            room = self.max_length - new_tokens
            if room <= 0:
                raise UserError(f"the task asks for up to {new_tokens} new tokens, which leaves no room for its "
                                f"context in the model's window of {self.max_length}.")
            temperature = float(kwargs.get("temperature") or 0.0) if kwargs.get("do_sample") else 0.0
            top_k = kwargs.get("top_k")
            # As the hf backend's batch encoding: special tokens added unless the first context already
            # begins with the beginning-of-text token.
            special = not (self.bos_text and contexts[0].startswith(self.bos_text))
            rows = [self._tok.encode(context, special_tokens=special).tolist()[-room:] for context in contexts]
            written = {}
            for length in dict.fromkeys(len(row) for row in rows):  # rows of one length at a time: no padding
                same = [i for i, row in enumerate(rows) if len(row) == length]
                written.update(zip(same, self._generate([rows[i] for i in same], new_tokens, until, temperature,
                                                        top_k, generator), strict=True))
            for i, (context, gen_kwargs) in enumerate(chunk):
                text = postprocess_generated_text(self.tok_decode(written[i]), until, None)
                results.append(text)
                self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
        return reordered.get_original(results)

    @torch.no_grad()
    def _generate(self, rows: list[list[int]], new_tokens: int, until: list[str], temperature: float,
                  top_k: int | None, generator: torch.Generator) -> list[list[int]]:
        """Each row's new tokens (rows of one length): up to ``new_tokens``, ended by the end-of-text
        id (left out) or once a stop string shows in the decoded text."""
        ids = torch.tensor(rows, dtype=torch.long)
        eos, vocab = self._tok.eos_id, self.model.cfg.vocab_size
        written: list[list[int]] = [[] for _ in rows]
        open_rows = set(range(len(rows)))
        for _ in range(new_tokens):
            chosen = sample_next(self._logits(ids)[:, -1, :vocab], temperature, top_k, generator).cpu()
            ids = torch.cat([ids, chosen], dim=1)
            for row in sorted(open_rows):
                token = int(chosen[row, 0])
                if token == eos:
                    open_rows.discard(row)
                    continue
                written[row].append(token)
                if any(stop and stop in self.tok_decode(written[row]) for stop in until):
                    open_rows.discard(row)
            if not open_rows:
                break
        return written

    # -- chat templates -------------------------------------------------------------------
    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The conversation in the model's chat template, ending in the assistant's header; with
        ``add_generation_prompt`` False, the last (assistant's) message left open to continue. A
        template that refuses a system message gets the conversation without it, as the hf
        backend retries."""
        self._renders_chats = True  # every context of this evaluation is a rendered conversation
        try:
            return self._render(chat_history, add_generation_prompt)
        except UserError:
            without_system = [message for message in chat_history if message["role"] != "system"]
            if len(without_system) == len(chat_history):
                raise
            return self._render(without_system, add_generation_prompt)

    def _render(self, chat_history: list[dict[str, str]], add_generation_prompt: bool) -> str:
        if add_generation_prompt or not chat_history:
            return self.template.render(chat_history, add_generation_prompt=True)
        messages = [dict(message) for message in chat_history]
        messages[-1]["content"] = messages[-1]["content"] + CONTINUE_TAG
        text = self.template.render(messages, add_generation_prompt=False)
        cut = text.rfind(CONTINUE_TAG.strip())
        if cut < 0:
            raise UserError(f"{self.template.name} drops the message to continue; give a template that writes "
                            f"each message's content.")
        return text[:cut] if text[cut:cut + len(CONTINUE_TAG)] == CONTINUE_TAG else text[:cut].rstrip()

