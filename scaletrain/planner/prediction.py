"""What the planner predicts for one layout (see planner/__init__.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from scaletrain.config import BF16_TRUE, BF16_TRUE_SETTINGS, Config, field_of

MEMORY_ROWS = ("params", "grads", "optimizer", "activations", "other", "total")
# What a layout is trained with beside its own choices and its precision and offload (scaletrain plan's training
# flags), shown where not scaletrain train's default
TRAINING_OPTIONS = ("param_dtype", "masters", "reduce_dtype", "stochastic_rounding", "optimizer", "momentum",
                    "compress_activations", "fused", "lora_rank", "lora_targets", "lora_modules_to_save", "quantize")


def training_options(cfg: Config) -> dict[str, Any]:
    """The options of `TRAINING_OPTIONS` ``cfg`` sets otherwise than scaletrain train's defaults."""
    given, default = cfg.flat(), Config().flat()
    return {name: given[name] for name in TRAINING_OPTIONS if given[name] != default[name]}


def as_flags(changes: dict[str, Any]) -> str:
    """Configuration fields as the flags a user types: ``{"zero": 3, "sp": True}`` is ``--zero 3 --sp``;
    the four settings of pure bf16 are ``--precision bf16-true``."""
    if all(changes.get(name) == value for name, value in BF16_TRUE_SETTINGS.items()):  # in place of the first
        changes = {("precision" if k in BF16_TRUE_SETTINGS else k): (BF16_TRUE if k in BF16_TRUE_SETTINGS else v)
                   for k, v in changes.items()}
    words = []
    for name, value in changes.items():
        flag = "--" + (field_of(name).metadata.get("flag") or name).replace("_", "-")
        words.append(flag if value is True else f"--no-{flag[2:]}" if value is False else f"{flag} {value}")
    return " ".join(words)


@dataclass
class Prediction:
    """One layout of one model on one cluster, predicted.

    ``memory``: bytes on the most loaded rank, by ``MEMORY_ROWS``; ``stages``:
    the same per pipeline rank (one entry without ``--pp``). ``comm``: one
    optimizer step's collectives on each pipeline rank, shaped like the
    communication ledger (``{op: {group: {"calls", "bytes", "wire_bytes"}}}``).
    ``time``: seconds per step, ``compute``, ``recompute``, ``comm`` (the
    exposed part), ``bubble`` and their sum ``step``.
    """

    cfg: Config
    world: int
    memory: dict[str, int]
    stages: list[dict[str, int]]
    comm: list[dict]
    time: dict[str, float]
    tokens_per_step: int
    fits: bool

    @property
    def step_s(self) -> float:
        return self.time["step"]

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.time["step"]

    def layout(self) -> dict:
        """The layout's choices, as flags name them."""
        p, t = self.cfg.parallel, self.cfg.train
        micro, virtual = p.pipeline_sizes()
        dp = self.world // (p.tp * p.pp * p.cp * p.ep)
        layout = {"dp": dp, "tp": p.tp, "pp": p.pp, "cp": p.cp, "ep": p.ep, "zero": p.zero, "sp": p.sp,
                  "recompute": t.recompute, "micro_batch": t.micro_batch, "grad_accum": t.grad_accum,
                  "precision": t.precision, "offload": t.offload}
        if p.pp > 1:
            layout.update(pp_schedule=p.pp_schedule, microbatches=micro, virtual_stages=virtual)
        if p.shard_group:
            layout.update(shard_group=p.shard_group)
        if p.quantize_weights != "none":
            layout.update(quantize_weights=p.quantize_weights)
        if p.pp > 1 and p.zero == 3:
            layout.update(zero3_gather=p.zero3_gather)
        return {**layout, **training_options(self.cfg)}
