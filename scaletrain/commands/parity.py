"""``scaletrain parity``: a layout against single-device training.

Two runs with the same seed, the same data stream and the same global batch:
the reference in one process (micro-batch ``B * dp``, so one device sees the
whole global batch), and the requested layout. Then, from their run folders:

    loss_rel_diff(t) = |loss_layout(t) - loss_ref(t)| / |loss_ref(t)|     every step t
    norm_rel_diff(t) = the same for the gradient norm before clipping     every step t
    param_rel_diff   = ||theta_layout - theta_ref||_2 / ||theta_ref||_2   all final weights

The gradient norm is checked on its own because a layout spreads gradients
over ranks (slices, shards, stages, replicas) and must count every element
exactly once; a norm counted wrong clips by the wrong factor, which the loss
shows only once clipping is active. The layout passes when the largest loss
and norm differences and the parameter difference are within the tolerance, whose default
follows the precision: 1e-5 in fp32, whose sums taken in another order differ by a few ulps per
step (a wrong gradient shows up as 1e-3 or more within a step or two), and 1e-2 in bf16, fp16 and
fp8, where rounding every output to 16 bits sets it. Parameters come from the final
checkpoints, read into full tensors whatever layout wrote them, so the same
check serves every strategy. PipeDream-2BW's update lags a step by design, so
its layouts are compared with one device applying the same 1-stale update
(parallel/pipeline/two_bw.py), not the synchronous one.

Why the whole parameter vector and not each tensor: Adam divides every
gradient element by its own running magnitude, so an element whose true
gradient is at fp32's noise floor (|g| near Adam's eps, 1e-8) takes a step of
up to the learning rate in whichever direction its rounding points. A layout
that reorders the sums inside matrix products (tensor parallelism) moves such
an element's noise by 1e-9 and its step by up to 1e-5 absolute: alone in a
[64, 256] tensor of norm 1.3 that is a 1e-5 relative difference for the
tensor while the model as a whole differs by 1e-6. The per-tensor figures are
still reported (``worst_tensor``), and a real error still shows: a wrong
gradient moves every element of its tensor by up to the learning rate per step.

A step whose global batch holds no trained token (instruction data whose every answer
``--too-long truncate`` cut off) has loss 0 and gradient norm 0, and no ratio: where both runs
trained nothing the step is reported as such and differs by nothing; where only the reference
trained nothing, the layout trained tokens one device did not, and the step fails, its difference
infinite.
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from scaletrain.commands.train import execute, prepare_run, world_size_for
from scaletrain.config import Config, add_config_flags, given_values, resolve
from scaletrain.config_checks import check_here, resolve_layout
from scaletrain.errors import UserError
from scaletrain.job.base_model import as_finetune
from scaletrain.job.metrics import read_metrics
from scaletrain.models import TINY_PRESET
from scaletrain.parallel.pipeline.schedules import PIPEDREAM_2BW
from scaletrain.run_length import length_from_command
from scaletrain.runtime.launch import detect_environment
from scaletrain.runtime.mesh import ParallelDims
from scaletrain.train import checkpoint as ckpt

# fp32: sums taken in another order, a few ulps apart; bf16, fp16 and fp8: every output rounded to 16 bits.
FP32_TOLERANCE, LOW_PRECISION_TOLERANCE = 1e-5, 1e-2


@dataclass
class ParityReport:
    layout: str
    tolerance: float
    reference_losses: list[float]
    layout_losses: list[float]
    reference_grad_norms: list[float | None] = field(default_factory=list)
    layout_grad_norms: list[float | None] = field(default_factory=list)
    param_rel_diffs: dict[str, float] = field(default_factory=dict)
    param_rel_diff: float = 0.0
    notes: tuple[str, ...] = ()  # what the comparison changed or could not compare, printed with it

    @property
    def loss_rel_diffs(self) -> list[float]:
        return [rel_diff(a, b) for a, b in zip(self.layout_losses, self.reference_losses)]

    @property
    def untrained_steps(self) -> list[int]:
        """The steps (from 1) at which neither run trained a token: loss 0 in both."""
        return [step for step, (a, b) in enumerate(zip(self.layout_losses, self.reference_losses), start=1)
                if a == b == 0]

    @property
    def max_loss_rel_diff(self) -> float:
        return max(self.loss_rel_diffs)

    @property
    def grad_norm_rel_diffs(self) -> list[float]:
        """Per step; a step that updates nothing (PipeDream-2BW's first) has no norm on either side."""
        return [rel_diff(a, b) for a, b in zip(self.layout_grad_norms, self.reference_grad_norms)]

    @property
    def max_grad_norm_rel_diff(self) -> float:
        return max(self.grad_norm_rel_diffs, default=0.0)

    @property
    def max_param_rel_diff(self) -> float:
        """The whole model's relative difference (the one parameter figure the pass rule uses)."""
        return self.param_rel_diff

    @property
    def worst_tensor(self) -> tuple[str, float]:
        name = max(self.param_rel_diffs, key=self.param_rel_diffs.get)
        return name, self.param_rel_diffs[name]

    @property
    def passed(self) -> bool:
        return (len(self.layout_losses) == len(self.reference_losses)
                and len(self.layout_grad_norms) == len(self.reference_grad_norms)
                and max(self.max_loss_rel_diff, self.max_grad_norm_rel_diff, self.max_param_rel_diff)
                <= self.tolerance)

    @property
    def remarks(self) -> list[str]:
        """The notes, then what the comparison found of the steps that trained no token."""
        said = list(self.notes)
        if self.untrained_steps:
            said.append(f"step(s) {', '.join(map(str, self.untrained_steps))} trained no token in either run "
                        f"(loss 0: every answer of the global batch cut off or masked), so they have no ratio")
        said += [f"step {step}: the reference trained no token (loss 0) but the layout's loss is {got:.6g}, so "
                 f"the layout trained tokens one device did not"
                 for step, (got, ref) in enumerate(zip(self.layout_losses, self.reference_losses), start=1)
                 if ref == 0 and got != 0]
        return said

    def to_json(self) -> dict:
        """The report as JSON holds it: a difference that is not a number (infinite where the layout trained
        where the reference trained nothing, `rel_diff`; NaN in a diverged run) is null, which JSON has."""
        return _finite({"pass": self.passed, "steps": len(self.reference_losses),
                        "max_loss_rel_diff": self.max_loss_rel_diff, "max_param_rel_diff": self.max_param_rel_diff,
                        "max_grad_norm_rel_diff": self.max_grad_norm_rel_diff,
                        "tolerance": self.tolerance, "layout": self.layout,
                        "worst_tensor": dict(zip(("name", "rel_diff"), self.worst_tensor)),
                        "reference_losses": self.reference_losses, "layout_losses": self.layout_losses,
                        "untrained_steps": self.untrained_steps, "notes": self.remarks})


def _finite(value):
    """``value`` with every infinite or NaN float, however deep in lists and dicts, made None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, list):
        return [_finite(item) for item in value]
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    return value


def rel_diff(got: float | None, ref: float | None) -> float:
    """|got - ref| / |ref|, one step's figure for a loss or a gradient norm. Both absent (a step that
    updates nothing) or both 0 (a step that trained no token) differ by nothing; the reference's
    alone absent or 0 leaves the layout's value unexplained: an infinite difference."""
    if got == ref and not ref:
        return 0.0
    if got is None or not ref:
        return math.inf
    return abs(got - ref) / abs(ref)


def default_tolerance(precision: str) -> float:
    """The tolerance within which a run of ``precision`` follows its reference (module docstring)."""
    return FP32_TOLERANCE if precision == "fp32" else LOW_PRECISION_TOLERANCE


DEFAULTS = Config().replace(name=TINY_PRESET, steps=10, seq_len=64, micro_batch=4, warmup_steps=2, eval_every=0,
                            eval_batches=1, sample_tokens=0, cache_dir=str(Path("runs", ".cache")))


def add_parser(commands) -> None:
    parity = commands.add_parser(
        "parity", help="check a layout against single-device training",
        description="Train the single-device reference and the requested layout with the same seed, "
                    "data and global batch; compare per-step losses and final parameters. Exit code "
                    "0 when they agree within --tolerance, 1 when they do not. Defaults differ from "
                    f"train: --model {TINY_PRESET} --steps 10 --seq-len 64 --micro-batch 4 --cache-dir runs/.cache.")
    add_config_flags(parity)
    parity.add_argument("--tolerance", type=float, default=None,
                        help=f"largest relative difference allowed, per step and of the final weights [by "
                             f"--precision: {FP32_TOLERANCE:g} for fp32, {LOW_PRECISION_TOLERANCE:g} for bf16, fp16 "
                             f"and fp8]")
    parity.add_argument("--json", action="store_true", help="print one JSON object")
    parity.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    cfg = length_from_command(resolve(args, DEFAULTS), set(given_values(args)))
    report = run_parity(cfg, tolerance=args.tolerance)
    print(json.dumps(report.to_json(), allow_nan=False) if args.json else format_table(report))
    return 0 if report.passed else 1


def relative_diffs(layout: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]
                    ) -> tuple[dict[str, float], float]:
    """Each tensor's relative difference, and the whole parameter vector's (the pass rule's figure,
    which tests comparing trained weights use too: the module docstring says why not per element)."""
    if layout.keys() != reference.keys():
        missing = sorted(set(reference) ^ set(layout))
        raise RuntimeError(f"the layout's checkpoint holds other tensors than the reference's: {missing}")
    squares = {name: ((layout[name].double() - ref.double()).square().sum().item(),
                      ref.double().square().sum().item()) for name, ref in reference.items()}
    per_tensor = {name: math.sqrt(diff / max(norm, 1e-60)) for name, (diff, norm) in squares.items()}
    total = math.sqrt(sum(d for d, _ in squares.values()) / max(sum(n for _, n in squares.values()), 1e-60))
    return per_tensor, total


def reference_config(cfg: Config, dims: ParallelDims, out: Path) -> Config:
    """The single-device run that ``cfg``'s layout (of mesh ``dims``) must reproduce, in ``out``: one
    device sees the whole global batch, each micro-batch dp x ep times larger (the ranks reading
    different samples) and the pipeline's micro-batches as accumulation steps. PipeDream-2BW's
    reference keeps its name: with --pp 1 it runs the same 1-stale rule on one device."""
    micro_batches, _ = cfg.parallel.pipeline_sizes()
    delayed = cfg.parallel.pp_schedule == PIPEDREAM_2BW
    reference, _ = resolve_layout(
        cfg.replace(out=str(out), nproc=1, dp=1, tp=1, sp=False, pp=1, cp=1, ep=1, zero=0, shard_group=None,
                    quantize_weights="none", microbatches=None, virtual_stages=None,
                    pp_schedule=PIPEDREAM_2BW if delayed else "1f1b", sync_every=1,
                    micro_batch=cfg.train.micro_batch * dims.dp * dims.ep,
                    grad_accum=cfg.train.grad_accum * micro_batches,
                    # the base's shards offloaded: one device holds its base whole, on the device
                    offload="none" if cfg.train.offload == "base" else cfg.train.offload), 1)
    return reference


def run_parity(cfg: Config, tolerance: float | None = None) -> ParityReport:
    """``cfg``'s layout against one device, within ``tolerance`` (None: its precision's, `default_tolerance`)."""
    cfg = as_finetune(cfg)
    check_here(cfg, "parity")
    env = detect_environment()
    if env.world_size > 1:
        raise UserError("parity starts its own processes; run it with --nproc N, not under a launcher.")
    if tolerance is None:
        tolerance = default_tolerance(cfg.train.precision)
    if tolerance <= 0:
        raise UserError(f"--tolerance must be positive, not {tolerance}.")
    with tempfile.TemporaryDirectory(prefix="scaletrain-parity-") as tmp:
        # Parity compares training; the harness's tasks would only run twice.
        quiet = dict(progress=False, sample_tokens=0, resume=False, checkpoint_every=0, stop_at=None,
                     report_comm=False, eval_tasks=None, eval_tasks_every=0, eval_tasks_include=None,
                     eval_tasks_limit=None)
        layout_cfg, dims = resolve_layout(cfg.replace(out=str(Path(tmp, "layout")), **quiet),
                                          world_size_for(cfg, env))
        reference_cfg = reference_config(layout_cfg, dims, Path(tmp, "reference"))
        runs = []
        for run_cfg in (reference_cfg, layout_cfg):
            summary = execute(*prepare_run(run_cfg))
            records = read_metrics(summary.run_dir / "metrics.jsonl")
            runs.append(([r["loss"] for r in records], [r["grad_norm"] for r in records],
                         ckpt.read_model_tensors(summary.checkpoint)))
        (ref_losses, ref_norms, ref_params), (layout_losses, layout_norms, layout_params) = runs
        per_tensor, whole = relative_diffs(layout_params, ref_params)
        return ParityReport(layout=_describe(cfg, dims), tolerance=tolerance, reference_losses=ref_losses,
                            layout_losses=layout_losses, reference_grad_norms=ref_norms,
                            layout_grad_norms=layout_norms, param_rel_diffs=per_tensor, param_rel_diff=whole)


def _describe(cfg: Config, dims) -> str:
    """The layout in words: its mesh, and the options that change how it runs."""
    text = dims.describe() + (" with sp" if cfg.parallel.sp else "")
    if dims.pp > 1:
        micro, virtual = cfg.parallel.pipeline_sizes()
        text += f" {cfg.parallel.pp_schedule}, {micro} micro-batches" + (f", {virtual} stages per rank"
                                                                          if virtual > 1 else "")
    if cfg.parallel.pp_schedule == PIPEDREAM_2BW:
        text += " (its 1-stale update, run the same way on one device)"
    return text


def format_table(report: ParityReport) -> str:
    """The report as the table ``scaletrain parity`` prints: each step's losses and differences,
    the final weights' difference, PASS or FAIL (``scaletrain.format_parity``)."""
    lines = [f"parity: {report.layout} against one device, tolerance {report.tolerance:g}",
             f"{'step':>5}  {'reference loss':>16}  {'layout loss':>16}  {'rel diff':>10}  {'grad norm diff':>14}"]
    untrained = set(report.untrained_steps)
    for step, (ref, got, diff, norm_diff) in enumerate(zip(report.reference_losses, report.layout_losses,
                                                           report.loss_rel_diffs, report.grad_norm_rel_diffs),
                                                       start=1):
        shown = "no tokens" if step in untrained else f"{diff:.2e}"
        lines.append(f"{step:>5}  {ref:>16.10f}  {got:>16.10f}  {shown:>10}  {norm_diff:>14.2e}")
    worst, worst_diff = report.worst_tensor
    lines.append(f"final parameters: relative difference {report.max_param_rel_diff:.2e} "
                 f"(largest for one tensor: {worst_diff:.2e}, {worst})")
    lines += [f"note: {note}" for note in report.remarks]
    lines.append("PASS" if report.passed else "FAIL")
    return "\n".join(lines)
