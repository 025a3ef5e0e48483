"""How long a run trains: ``--steps``, or ``--epochs`` over the rows its data prepared.

An epoch is one pass over the training split's rows (data/batches.py numbers
samples across epochs): packed rows with ``--sft`` or ``--pack``, one example a
row without packing, windows of ``--seq-len`` tokens of a text stream, the
digits' images. With G sequences per optimizer step (``micro_batch x grad_accum
x microbatches x dp x ep``: every rank that reads sequences of its own,
job/trainer.py), ``--epochs N`` trains

    steps = ceil(N x rows / G)

settled where the data is prepared (commands/train.py ``prepare_run``), before
any worker starts and before ``config.toml`` is written, which records the steps
beside the epochs: a resumed or restarted run goes on to the same last step, and
the learning-rate schedule decays over the same steps; only an ``--epochs``
given again on ``--resume`` derives them anew.
"""

from __future__ import annotations

import math
from fractions import Fraction

from scaletrain.config import Config, ParallelConfig
from scaletrain.config_checks import check_values
from scaletrain.data.batches import TokenBatches
from scaletrain.data.mixture import Mixture
from scaletrain.data.packing import SequenceBatches
from scaletrain.errors import UserError
from scaletrain.job.data_setup import PreparedData, open_data

def length_from_command(cfg: Config, given: set[str]) -> Config:
    """The run's length as the command line (or its TOML file) gives it, ``given`` the fields
    it names: ``--epochs`` leaves the steps to be derived (None until the data is prepared);
    ``--steps`` over a resumed run's epochs ends them; both at once are refused."""
    if {"steps", "epochs"} <= given:
        raise UserError(f"--epochs {cfg.train.epochs:g} and --steps {cfg.train.steps} both set how long the run "
                        f"trains; give one of them.")
    if "epochs" in given:
        return cfg.replace(steps=None)
    return cfg.replace(epochs=None) if "steps" in given else cfg


def batch_readers(p: ParallelConfig) -> int:
    """Micro-batches of different sequences per accumulation round: each dp x ep rank reads one per
    pipeline micro-batch (dp unresolved: one reader)."""
    return p.pipeline_sizes()[0] * (p.dp or 1) * p.ep


def sequences_per_step(cfg: Config) -> int:
    """The global batch: sequences every optimizer step reads."""
    return cfg.train.micro_batch * cfg.train.grad_accum * batch_readers(cfg.parallel)


def _parts(batches) -> list:
    return list(batches.sources) if isinstance(batches, Mixture) else [batches]


def epoch_sentence(train, packed: bool, per_step: int) -> str:
    """What one epoch of the training batches ``train`` is: ``N examples -> R rows (packed) -> S
    steps per epoch``, or for text ``T tokens -> R windows -> S steps per epoch``."""
    parts, rows = _parts(train), train.num_samples
    steps = f"{math.ceil(rows / per_step):,} steps per epoch"
    if all(isinstance(part, TokenBatches) for part in parts):
        return f"{sum(part.tokens for part in parts):,} tokens -> {rows:,} windows -> {steps}"
    if all(isinstance(part, SequenceBatches) for part in parts):
        examples = sum(part.examples for part in parts)
        return f"{examples:,} examples -> {rows:,} rows{' (packed)' if packed else ''} -> {steps}"
    return f"{rows:,} examples -> {steps}"  # in-memory arrays (the digits): one example a row


def settle_steps(cfg: Config, prepared: PreparedData) -> Config:
    """``cfg`` with the steps of its ``--epochs`` over the training rows of ``prepared``, said in one
    line and checked (``--stop-at``); a resumed run keeps the steps it saved unless ``--epochs`` was
    given again (its steps then None: ``length_from_command``). Without ``--epochs``, ``cfg`` itself."""
    t = cfg.train
    if t.epochs is None or (cfg.run.resume and t.steps is not None):
        return cfg
    train, per_step = open_data(prepared, cfg).train, sequences_per_step(cfg)
    # The epochs as written (0.1, not the float nearest it), so that 0.1 x 30 rows is 3 rows, not 4.
    steps = math.ceil(Fraction(str(t.epochs)) * train.num_samples / per_step)
    print(f"{epoch_sentence(train, prepared.pack, per_step)}; --epochs {t.epochs:g}: {steps:,} steps of "
          f"{per_step:,} sequences")
    settled = cfg.replace(steps=steps)
    check_values(settled)  # --stop-at, now that there is a last step to check it against
    return settled
