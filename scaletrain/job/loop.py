"""The run loop: a ``Trainer``'s steps from where the run stands to its end.

Each step is queued on the device (``Trainer.queue_step``) and its numbers
are read a window of ``--log-every`` steps at a time (train/step_window.py);
an evaluation or a checkpoint ends a window early, so each sees its own
step's weights and a non-finite step is found before either. With
``--eval-tasks``, a step the harness runs at (every ``--eval-tasks-every``
steps, and the last) is saved as a checkpoint first, which every rank then
reads whole and scores its share of the tasks' documents on (job/harness.py);
the metrics join that step's record as ``eval/<task>/<metric>``. The records
go to ``metrics.jsonl`` and the trackers, one per step; the run ends with a
sample of text that every rank takes part in generating (train/sampling.py).
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from scaletrain.job.metrics import MetricsWriter, drop_records_after, mfu, step_memory_bytes
from scaletrain.job.trainer import Trainer
from scaletrain.train.step_window import StepWindow


@dataclass
class RunSummary:
    run_dir: Path
    steps_done: int
    final_loss: float  # NaN: the last step trained no token
    val_loss: float | None  # None: never evaluated; NaN: the validation batches hold no trained token
    checkpoint: Path | None
    sample: str | None
    unigram_entropy: float | None


def fit(trainer: Trainer) -> RunSummary:
    """Train from ``trainer.start_step`` to the run's end: steps, their records read a window at a
    time, evaluations, checkpoints, and the closing sample."""
    cfg = trainer.cfg
    end = cfg.run.stop_at or cfg.train.steps
    writer = None
    if trainer.is_main:
        drop_records_after(trainer.run_dir / "metrics.jsonl", trainer.start_step)
        writer = MetricsWriter(cfg, trainer.run_dir, append=cfg.run.resume)
    # The bar redraws one line with carriage returns: only where a terminal shows both streams. A log
    # file, a pipe or --no-progress gets a plain line every --log-every steps instead.
    drawn = cfg.run.progress and sys.stdout.isatty() and sys.stderr.isatty()
    bar = tqdm(total=cfg.train.steps, initial=trainer.start_step, unit="step", dynamic_ncols=True,
               disable=not (trainer.is_main and drawn))
    plain = trainer.is_main and not drawn
    record: dict = {}
    val_loss, saved = None, None
    window = StepWindow(trainer.log_every, trainer.tokens_per_step)
    try:
        for step in range(trainer.start_step, end):
            trainer.step = done = step + 1
            trainer.where = f"in step {done}"
            window.open_if_empty()
            window.add(trainer.queue_step(step, record=done == end))
            evaluating = (cfg.train.eval_every and done % cfg.train.eval_every == 0) or done == end
            saving = (cfg.run.checkpoint_every and done % cfg.run.checkpoint_every == 0) or done == end
            tasks_due = trainer.tasks_due(done)
            if not (window.due(done) or evaluating or saving or tasks_due):
                continue
            read = window.read()
            memory = step_memory_bytes(trainer.device)
            if evaluating and not any(r.nonfinite for r in read):
                read[-1].record["val_loss"] = evaluated = trainer.evaluate()  # None: no trained token
                val_loss = math.nan if evaluated is None else evaluated
            for record, nonfinite in ((r.record, r.nonfinite) for r in read):
                if nonfinite:  # the steps before it are recorded, as a stop at once would have
                    raise trainer.late_stop(record)
                record.update(mfu=mfu(record["tokens_per_s"], trainer.flops_per_token, trainer.peak,
                                      trainer.runtime.env.world_size), mem_bytes=memory)
                if tasks_due and record is read[-1].record:  # the harness reads this step's checkpoint
                    saved, saving = trainer.save(done), False
                    trainer.where = f"in the --eval-tasks run after step {done}"
                    record.update(trainer.evaluate_tasks(saved))
                    trainer.where = f"in step {done}"
                if writer:
                    writer.write(record)
                if plain and (record["step"] % trainer.log_every == 0 or record["step"] == end):
                    print(step_line(record), flush=True)
            bar.update(len(read))
            bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{record['tokens_per_s']:,.0f}")
            if saving:
                saved = trainer.save(done)
    except BaseException as exc:
        if writer:  # the trackers hear how the run ended; metrics.jsonl holds what was done
            # An exit or an interrupt is a stop from outside (Ctrl-C, a sweep's scheduler), not a failure.
            writer.close("failed" if isinstance(exc, Exception) else "stopped")
        raise
    bar.close()
    if writer:
        writer.close("finished", final=saved if end == cfg.train.steps else None)
    # Every rank generates: each holds a part of the model its replica's forward needs (ZeRO-3's
    # and hybrid sharding's shards over dp and cp, tp's slices, pp's stages, ep's experts), and
    # the seeded draws are the same on every rank, so every replica writes the same text.
    trainer.where = "in the end-of-run sample"
    sample = trainer.sample() if end == cfg.train.steps else None
    trainer.where = "at the end of the run"
    return RunSummary(run_dir=trainer.run_dir, steps_done=end, final_loss=step_loss(record),
                      val_loss=val_loss, checkpoint=saved, sample=sample if trainer.is_main else None,
                      unigram_entropy=trainer.prepared.unigram_entropy)


def loss_text(value: float) -> str:
    """A loss as a person reads it: NaN, a mean over no trained token, as n/a (never 0.0000)."""
    return "n/a (no trained token)" if math.isnan(value) else f"{value:.4f}"


def step_loss(record: dict) -> float:
    """A step record's loss; NaN for a step that trained no token (its record holds 0)."""
    return math.nan if record.get("trained_tokens") == 0 else record.get("loss", math.nan)


def step_line(record: dict) -> str:
    """A step's plain line: ``step N loss X lr Y tok/s Z`` (a step that trained no token has no loss,
    one the loss scaler skipped no learning rate)."""
    loss = loss_text(step_loss(record))
    lr = "n/a" if record["lr"] is None else f"{record['lr']:.3g}"
    return f"step {record['step']} loss {loss} lr {lr} tok/s {record['tokens_per_s']:,.0f}"
