"""``scaletrain.check_parity``: a user's model under a layout against one process.

    report = scaletrain.check_parity(make_model, global_batch, loss_fn, nproc=4, steps=5,
                                     plan=PLAN, tp=2, zero=3, lr=1e-3)
    print(scaletrain.format_parity(report)); assert report.passed      (parity.py's table)

The same rule as ``scaletrain parity`` (parity.py), for a model the command
does not know: ``make_model()`` builds the model (after ``torch.manual_seed``
of the ``seed`` option, on every rank), ``global_batch(step)`` gives the whole
global batch of a step as (inputs, targets), and ``loss_fn(outputs,
targets)`` the mean loss of a micro-batch (None: the mean cross-entropy,
``Engine.cross_entropy``, which also takes logits a tp plan left split). Both runs go through
`scaletrain.setup` and `Engine.train_step`, each in fresh processes: the
reference in one process with the layout options dropped and every
micro-batch of the global batch in turn, the layout in ``nproc``, micro-batch
m of rank r of the R ranks that read different samples holding rows
``(m*R + r)*B ... +B`` of the global batch (the reference's micro-batch m is
their union). The steps' losses and gradient norms, and the final weights read
from both runs' checkpoints into full tensors, must agree within
``tolerance`` (by default the command's for the ``precision`` option: 1e-5 in fp32, 1e-2 in
bf16, fp16 and fp8). The three callables are pickled into the workers: define them at
a module's top level (a script's, under ``if __name__ == "__main__":``).

Dropout: a layout draws other masks than one process (each rank draws its
rows' masks, tp ranks their heads'), so a model with dropout matches one
process only in distribution. Both runs switch every dropout of the model off
(``dropout=False``, the default, said in the report's notes); ``dropout=True``
keeps it, and the report says why the figures then differ.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from scaletrain.commands.parity import ParityReport, default_tolerance, relative_diffs
from scaletrain.errors import JobFailed, UserError
from scaletrain.library import setup
from scaletrain.library_checks import engine_config
from scaletrain.parallel.parallelize import model_dropout, switch_off_dropout
from scaletrain.parallel.pipeline.schedules import PIPEDREAM_2BW
from scaletrain.runtime.spawn import WorkerFailed, spawn_local
from scaletrain.train import checkpoint as ckpt

# What the reference drops: everything that places the model over ranks.
LAYOUT_OPTIONS = dict(dp=None, tp=1, sp=False, pp=1, cp=1, ep=1, zero=0, shard_group=None, quantize_weights="none",
                      microbatches=None, virtual_stages=None, sync_every=1)


def _run(make_model: Callable[[], nn.Module], global_batch: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
         loss_fn: Callable, steps: int, folder: str, options: dict[str, Any], setup_args: dict[str, Any],
         dropout: bool) -> tuple[list[float], list[float], float]:
    """One worker of one run: its share of every step's global batch, then a checkpoint; the
    model's dropout probability as built."""
    torch.manual_seed(options.get("seed", 1234))
    model = make_model()
    rate = model_dropout(model)
    if not dropout:
        switch_off_dropout(model)
    engine = setup(model, **setup_args, **options)
    loss_fn = loss_fn or engine.cross_entropy
    try:
        per_step = engine.micro_batches_per_step
        readers = engine.layout.replicas.batch
        losses, norms = [], []
        for step in range(steps):
            inputs, targets = global_batch(step)
            rows = inputs.shape[0] // (per_step * readers.size)
            micro = [(inputs[(m * readers.size + readers.rank) * rows:][:rows],
                      targets[(m * readers.size + readers.rank) * rows:][:rows]) for m in range(per_step)]
            record = engine.train_step(micro, loss_fn)
            losses.append(record["loss"])
            norms.append(record["grad_norm"] if record["grad_norm"] is not None else 0.0)
        engine.save(folder)
    finally:
        engine.close()
    return losses, norms, rate


def check_parity(make_model: Callable[[], nn.Module], global_batch: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
                 loss_fn: Callable | None = None, *, nproc: int, steps: int = 3, tolerance: float | None = None,
                 plan: Any = None, seq_len: int | None = None, dropout: bool = False, sync_batchnorm: bool = False,
                 **options: Any) -> ParityReport:
    """The layout of ``options`` on ``nproc`` processes against one process (module docstring);
    ``dropout``: keep the model's dropout rather than switch it off in both runs;
    ``sync_batchnorm``: `setup`'s, in both runs."""
    cfg = engine_config(options)
    tolerance = default_tolerance(cfg.train.precision) if tolerance is None else tolerance
    if nproc < 1 or steps < 1 or tolerance <= 0:
        raise UserError(f"check_parity needs nproc >= 1, steps >= 1 and a positive tolerance, not nproc={nproc}, "
                        f"steps={steps}, tolerance={tolerance}.")
    micro, _ = cfg.parallel.pipeline_sizes()
    delayed = cfg.parallel.pp_schedule == PIPEDREAM_2BW
    reference = {**options, **LAYOUT_OPTIONS, "grad_accum": cfg.train.grad_accum * micro,
                 "pp_schedule": PIPEDREAM_2BW if delayed else "1f1b"}
    runs = []
    with tempfile.TemporaryDirectory(prefix="scaletrain-parity-") as tmp:
        for name, procs, run_options, setup_args in (
                ("reference", 1, reference, {"seq_len": seq_len, "sync_batchnorm": sync_batchnorm}),
                ("layout", nproc, options, {"plan": plan, "seq_len": seq_len, "sync_batchnorm": sync_batchnorm})):
            folder = str(Path(tmp, name))
            try:
                results = spawn_local(procs, _run, (make_model, global_batch, loss_fn, steps, folder, run_options,
                                                    setup_args, dropout))
            except WorkerFailed as failure:
                raise JobFailed(f"the {name} run failed: {failure}") from None
            losses, norms, rate = results[0]
            runs.append((losses, norms, ckpt.read_model_tensors(ckpt.latest_checkpoint(Path(folder)))))
    (ref_losses, ref_norms, ref_params), (losses, norms, params) = runs
    per_tensor, whole = relative_diffs(params, ref_params)
    described = ", ".join(f"{key}={value}" for key, value in options.items() if key in LAYOUT_OPTIONS)
    notes = ()
    if rate > 0 and dropout:
        notes = (f"dropout {rate:g} kept: each rank draws its own masks, other than one process's, so the runs "
                 f"agree in distribution only",)
    elif rate > 0:
        notes = (f"dropout {rate:g} switched off in both runs: a layout draws other masks than one process "
                 f"(check_parity(..., dropout=True) keeps it)",)
    return ParityReport(layout=f"{described or 'one replica'} on {nproc} process(es)", tolerance=tolerance,
                        reference_losses=ref_losses, layout_losses=losses, reference_grad_norms=ref_norms,
                        layout_grad_norms=norms, param_rel_diffs=per_tensor, param_rel_diff=whole, notes=notes)
