"""The command's training: its models, its data and its loss on the engine (train/stepper.py).

``scaletrain train`` is configuration + a model spec + data + the engine:
this module builds the run's model from its preset (or a Hugging Face folder,
or a checkpoint to fine-tune) with the family's plan, reads each step's
micro-batches from the run's data, and hands both to the engine, which owns
every technique. A user's script does the same with its own model and loop
(library.py).

The data is a pure function of the step: micro-batch ``m`` of step ``t`` on
rank ``r`` of the dp x ep group holds global samples
``((t*A + m)*dp*ep + r)*B ... +B`` of a seeded stream (see data/batches.py),
so a resumed run needs only the step number to continue exactly as if it had
never stopped. The loss is the cross-entropy summed over a micro-batch's
trained tokens, divided so that the step's gradient is that of the mean over
the global batch's trained tokens (`Trainer._step_batches`).
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from scaletrain.config import Config
from scaletrain.data.batches import IGNORE_INDEX
from scaletrain.data.tokenizer import until_end
from scaletrain.finetune.nf4 import NF4Linear
from scaletrain.finetune.sliced import FolderSource, folder_source
from scaletrain.job.base_model import start_from_base
from scaletrain.job.data_setup import PreparedData, open_data
from scaletrain.job.eval_tasks import training_tasks
from scaletrain.job.metrics import peak_tflops
from scaletrain.models import CLASSIFIER, build_model, spec_for
from scaletrain.models.spec import ModelPlan
from scaletrain.runtime.comm import Comm
from scaletrain.runtime.launch import DistRuntime
from scaletrain.runtime.mesh import Mesh
from scaletrain.techniques.precision import autocast
from scaletrain.train import checkpoint as ckpt
from scaletrain.train.layout import Layout
from scaletrain.train.sampling import generate, line_prompt, sft_prompt
from scaletrain.train.step_window import PendingStep, StepWindow, default_log_every
from scaletrain.train.stepper import Stepper


def first_sample(step: int, micro: int, grad_accum: int, dp_size: int, dp_rank: int, micro_batch: int) -> int:
    """Index in the data stream of the first sample of micro-batch ``micro`` of
    ``step`` on data-parallel rank ``dp_rank``: ranks read disjoint slices of
    the same global batch, and the index depends on nothing but the step."""
    return ((step * grad_accum + micro) * dp_size + dp_rank) * micro_batch


@dataclass
class RunModel:
    """The run's model as built here: whole (or on the meta device, its weights read from
    ``source`` after the splits), its plan, and its training FLOPs per token."""
    model: nn.Module
    plan: ModelPlan | None
    source: FolderSource | None
    flops_per_token: float


def build_run_model(cfg: Config, prepared: PreparedData, device: torch.device, n_features: int = 0,
                    n_classes: int = 0) -> RunModel:
    """The command's model: the preset built from the seed (the same initial weights on every
    rank and layout), a base's weights loaded, or a fine-tune's folder to read from."""
    family = None if cfg.model.name == CLASSIFIER else spec_for(cfg.model.name)
    family_cfg = family.configure(cfg.model, prepared.vocab_size, cfg.data.seq_len) if family else None
    # A fine-tune from a Hugging Face folder (full, or LoRA over a float base): the model is built on
    # the meta device and each weight read after the splits, each rank its own slice (finetune/sliced.py).
    source = folder_source(cfg, family_cfg)
    torch.manual_seed(cfg.train.seed)
    with torch.device("meta") if source else nullcontext():
        model = build_model(cfg.model, vocab_size=prepared.vocab_size, seq_len=cfg.data.seq_len,
                            n_features=n_features, n_classes=n_classes)
    if not source:
        model.to(device)
    if cfg.finetune.base:  # the base's weights (or the source's), frozen beside adapters with --lora-rank
        start_from_base(model, cfg.finetune, family, cfg.train.seed, source)
    # Of the whole model, before any split.
    return RunModel(model, family.plan(family_cfg) if family else None, source, model.flops_per_token())


def parameter_counts(model: nn.Module) -> str:
    """PEFT's line of trainable and all parameters (``print_trainable_parameters``) of the whole model
    as built, before a layout splits it over ranks: adapters and the modules to save train, a frozen
    base counts among all, and an NF4 weight (its codes held in buffers) by the elements it stands
    for, as PEFT counts a 4-bit one."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters()) + sum(
        m.in_features * m.out_features + (0 if m.bias is None else m.bias.numel())
        for m in model.modules() if isinstance(m, NF4Linear))
    return f"trainable params: {trainable:,} || all params: {total:,} || trainable%: {100 * trainable / total:.4f}"


class Trainer:
    """The steps of a run: its model and data on the `Stepper` (train/stepper.py), with its
    checkpoints and the state a resume brings back."""

    def __init__(self, cfg: Config, prepared: PreparedData, runtime: DistRuntime, mesh: Mesh, comm: Comm,
                 run_dir: Path):
        self.cfg, self.prepared, self.runtime, self.mesh, self.comm = cfg, prepared, runtime, mesh, comm
        self.run_dir = run_dir
        self.is_main = runtime.is_main
        self.device = runtime.device
        self.log_every = cfg.run.log_every or default_log_every(self.device)
        self.step: int | None = None  # the step under way, counted from 1, for failure reports
        self.where = "before training"  # where the run stands, for failure reports (job/loop.py)
        self.data = open_data(prepared, cfg)
        t = cfg.train
        built = build_run_model(cfg, prepared, self.device, self.data.n_features, self.data.n_classes)
        self.flops_per_token = built.flops_per_token
        self.parameter_counts = parameter_counts(built.model)  # said as the run starts (commands/train.py)
        self.stepper = Stepper(built.model, t, cfg.parallel, mesh, comm, self.device, plan=built.plan,
                               seq_len=cfg.data.seq_len, sample=self.data.train.get(0, t.micro_batch)[0],
                               source=built.source, fused_head=prepared.kind == "text", run_dir=run_dir,
                               log_every=self.log_every, report_memory=cfg.run.report_memory)
        layout = self.layout
        positions = cfg.data.seq_len if prepared.kind == "text" else 1
        self.tokens_per_step = t.micro_batch * t.grad_accum * layout.micro_batches * layout.replicas.batch.size \
            * positions
        self.start_step = 0
        latest = ckpt.latest_checkpoint(run_dir) if cfg.run.resume else None
        if latest:  # (none: a job restarted before its first checkpoint, commands/train.py)
            self.start_step = self.stepper.load_checkpoint(latest)["step"]
        self.peak = peak_tflops(t.peak_tflops, self.device)
        # --eval-tasks' tasks (job/eval_tasks.py), every name checked and every data set read before the
        # first step, by every rank for itself. None without --eval-tasks.
        self.tasks = training_tasks(t)

    def tasks_due(self, step: int) -> bool:
        """Whether --eval-tasks run after ``step`` (counted from 1): every --eval-tasks-every steps,
        and at the run's last step."""
        every = self.cfg.train.eval_tasks_every
        return self.tasks is not None and ((every > 0 and step % every == 0) or step == self.cfg.train.steps)

    @property
    def layout(self) -> Layout:
        return self.stepper.layout

    # -- one optimizer step --------------------------------------------------
    def _micro_batch(self, step: int, micro: int) -> tuple[torch.Tensor, ...]:
        layout = self.layout
        t = self.cfg.train
        per_step = t.grad_accum * layout.micro_batches
        if micro == min(1, per_step - 1):
            self.stepper.faults.strike("micro-batch", step + 1)
        first = first_sample(step, micro, per_step, layout.replicas.batch.size,
                             layout.replicas.batch.rank, t.micro_batch)
        return layout.local(*self.data.train.get(first, t.micro_batch))

    def _step_batches(self, step: int) -> tuple[list[tuple[torch.Tensor, ...]], float | torch.Tensor,
                                                torch.Tensor | None]:
        """The step's micro-batches on this rank, read before any forward; the divisor of each
        micro-batch's loss and the global batch's count of trained tokens (None: all are).

        Each loss is the sum over its trained tokens / its positions P (train/layout.py). With
        T trained tokens in the whole global batch and R ranks averaging the gradients (dp x
        ep x cp: replicas.py), dividing by D = T / (P * R) makes the averaged gradient that of
        the sum over every trained token / T: the mean over the global batch's trained tokens,
        however masking and packing spread them over micro-batches and ranks (one all-reduce of
        a count). Where every target is trained, T = P * R * micro-batches, and D is their number."""
        layout = self.layout
        batches = [self._micro_batch(step, micro) for micro in range(self.cfg.train.grad_accum * layout.micro_batches)]
        if self.data.train.every_target_trained:  # known on the host: no count, no device work
            return batches, float(len(batches)), None
        trained = sum((batch[1] != IGNORE_INDEX).sum() for batch in batches)
        self.comm.all_reduce(trained, layout.replicas.dense)
        positions = batches[0][1].numel() * layout.replicas.dense.size
        # No trained token at all (every answer cut away): a zero loss, not 0 / 0.
        return batches, (trained.clamp(min=1).double() / positions).float(), trained

    def train_step(self, step: int, record: bool = False) -> dict[str, float]:
        """One optimizer step, its numbers read at once (``fit`` reads them a window at a time)."""
        window = StepWindow(1, self.tokens_per_step)
        window.add(self.queue_step(step, record))
        (read,) = window.read()
        if read.nonfinite:
            raise self.late_stop(read.record)
        return read.record

    def queue_step(self, step: int, record: bool) -> PendingStep:
        """One optimizer step on the engine; its numbers left on the device (train/step_window.py)."""
        batches, divisor, trained = self._step_batches(step)
        pending = self.stepper.step(step, batches, self.layout.loss_fn, divisor, record)
        if trained is not None:  # masked or packed data: how many tokens the step trained on
            pending.device["trained_tokens"] = trained
        return pending

    def late_stop(self, record: dict) -> Exception:
        return self.stepper.late_stop(record, self.step)

    def memory_report(self) -> dict:
        """This rank's memory ledger (params, grads, optimizer, activations peak)
        as measured on the first step of this run."""
        return self.stepper.memory

    @property
    def timeline(self):
        """The pipeline's recorded round on the run's last step."""
        return self.stepper.timeline

    @torch.no_grad()
    def evaluate(self) -> float | None:
        """The mean loss over the validation batches' trained tokens; None where they hold none (every
        answer cut off by --too-long truncate): a mean over nothing, not a loss of 0."""
        layout = self.layout
        layout.model.eval()
        batches = [layout.local(*batch) for batch in
                   self.data.val.eval_batches(self.cfg.train.micro_batch, self.cfg.train.eval_batches)]
        if layout.pipeline:  # the mean over batches of each one's summed loss
            summed = layout.pipeline.evaluate(batches, lambda logits, y: layout.loss_fn(logits, y) * y.numel(),
                                              lambda: autocast(self.cfg.train.precision, self.device)) * len(batches)
        else:
            loss_of = self.stepper.forward_loss(layout.loss_fn)
            summed = sum(loss_of(*batch).item() * batch[1].numel() for batch in batches)
        totals = torch.tensor([summed, sum((batch[1] != IGNORE_INDEX).sum().item() for batch in batches)],
                              dtype=torch.float64, device=self.device)
        if layout.context_parallel:  # each cp rank has its positions' share
            self.comm.all_reduce(totals, layout.cp_group)
        return (totals[0] / totals[1]).item() if totals[1] > 0 else None

    def evaluate_tasks(self, checkpoint: Path) -> dict[str, float]:
        """--eval-tasks on the model ``checkpoint`` holds: saved at this step by every rank, whatever
        the layout, and read back whole by each (job/model_source.py, as ``scaletrain eval --from``
        reads it), each rank scoring its share of the documents (job/harness.py). The metrics, as
        ``eval/<task>/<metric>``, on the main rank; {} on the others."""
        from scaletrain.job import eval_tasks
        from scaletrain.job.harness import ScaletrainLM
        from scaletrain.job.model_source import load_run_model

        t = self.cfg.train
        model, tokenizer = load_run_model(checkpoint)
        lm = ScaletrainLM(model, tokenizer, batch_size=t.micro_batch, device=self.device, precision=t.precision,
                          comm=self.comm, group=self.mesh.group("world"), name=str(checkpoint), seed=t.seed)
        results = eval_tasks.evaluate(lm, self.tasks, limit=t.eval_tasks_limit, bootstrap_iters=0, seed=t.seed,
                                      quiet=True)
        del lm, model
        if self.device.type == "cuda":  # the copy gone, the next steps' peak memory is training's own
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
        return eval_tasks.metrics(results) if results is not None else {}

    def sample(self) -> str | None:
        """A continuation of a line from the validation text, or with --sft the answer (greedy) to
        the first validation prompt as training rendered it (language models only; train/sampling.py)."""
        tokenizer = self.data.tokenizer
        if tokenizer is None or self.cfg.run.sample_tokens == 0:
            return None
        inputs, targets = self.data.val.get(0, 1)[:2]
        t = self.cfg.train
        prompt = sft_prompt(inputs[0], targets[0]) if self.cfg.data.sft else line_prompt(tokenizer, inputs[0])
        written = generate(self.layout, prompt[None], self.cfg.run.sample_tokens, context=self.cfg.data.seq_len,
                           vocab=self.prepared.vocab_size, precision=t.precision, seed=t.seed,
                           temperature=0 if self.cfg.data.sft else 0.8)[0].tolist()
        # The sample ends where the model ends its document: past the end-of-text token lies another.
        return tokenizer.decode(written[:len(prompt)] + until_end(tokenizer, written[len(prompt):]))

    def save(self, step: int) -> Path:
        return self.stepper.save_checkpoint(step, keep_last=self.cfg.run.keep_last)
