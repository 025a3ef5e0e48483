"""``scaletrain eval --tp T --pp P``: the model split over groups of T x P processes, each holding its part.

A model too large for one device is scored the way training holds it: built on the meta device
(shapes, no storage), split by its family's tensor-parallel plan into slices and by its pipeline
plan into stages (parallel/parallelize.py, parallel/tensor.py, parallel/pipeline/), and only then
given storage, each rank reading just the slices of the stages it keeps, so no rank ever holds
the whole model:

    a run's checkpoint      the trainer's checkpoint loader reads the chunks of the full tensors
                            this rank's slices cover, whatever layout saved them
                            (train/checkpoint.py, as a resume into another layout does)
    a Hugging Face folder   each slice read straight from the safetensors files
                            (finetune/sliced.py, as a full fine-tune under tp does)

The ``--nproc N`` processes form a mesh of N / (T x P) data-parallel groups (runtime/mesh.py):
the T x P ranks of one copy of the model compute it together, so they answer the same requests,
and the requests are split over the data-parallel groups (job/harness.py). Each forward is one
forward-only round of the pipeline, whose last stage's logits every rank receives. A LoRA
fine-tune is refused: its adapters are merged into whole weights (job/export.py), which its
``scaletrain export --format hf`` folder holds and this module reads slice by slice.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from scaletrain.config import ModelConfig
from scaletrain.errors import UserError
from scaletrain.finetune.hf import load_hf_tokenizer, read_hf_model
from scaletrain.finetune.sliced import FolderSource, materialize
from scaletrain.job.data_setup import AnyTokenizer, run_tokenizer
from scaletrain.job.model_source import check_fits, run_config
from scaletrain.models import spec_for
from scaletrain.models.spec import ModelSpec
from scaletrain.parallel.parallelize import parallelize
from scaletrain.parallel.pipeline.parallel import PipelineParallel
from scaletrain.parallel.tensor import TensorParallel
from scaletrain.runtime.comm import Comm
from scaletrain.runtime.mesh import Mesh, ParallelDims
from scaletrain.train.checkpoint import READ_ERRORS, failure_reason, load_checkpoint, saved_shapes


def _family(source: Path, checkpoint: Path | None, vocab_size: int) -> tuple[ModelSpec, Any]:
    """The model's family and its config: a Hugging Face folder's own, or the run's (its
    vocabulary ``vocab_size``)."""
    if checkpoint is None:
        hf_model = read_hf_model(source)
        return hf_model.spec, hf_model.family_cfg(ModelConfig(**hf_model.values))
    cfg = run_config(checkpoint)
    spec = spec_for(cfg.model.name)
    return spec, spec.configure(cfg.model, vocab_size, cfg.data.seq_len)


@dataclass
class EvalSplit:
    """This rank's part of a split model, in eval mode, and what scoring it needs: its
    tokenizer; the tensor-parallel split, whose ``generation()`` gives whole logits on every rank
    of its group (None: no tp); the pipeline of stages (None: no pp); the rows of the head (its
    logits' last dimension, which the stages without the head receive)."""

    model: nn.Module
    tokenizer: AnyTokenizer
    tensor: TensorParallel | None
    pipeline: PipelineParallel | None
    head_rows: int


def check_split(source: Path, checkpoint: Path | None, tp: int, pp: int, nproc: int) -> None:
    """One sentence, before any weight is read, where ``--tp`` and ``--pp`` cannot split this model
    over ``--nproc`` processes."""
    flags = " and ".join(f"--{axis} {size}" for axis, size in (("tp", tp), ("pp", pp)) if size > 1)
    if nproc % (tp * pp):
        raise UserError(f"{flags} must divide --nproc {nproc}: each group of {tp * pp} processes holds one copy of "
                        f"the model; choose a split that divides {nproc}.")
    if checkpoint is not None and run_config(checkpoint).finetune.lora_rank:
        raise UserError(f"{flags} splits whole weights, and {source} is a LoRA fine-tune whose adapters are "
                        f"merged whole; scaletrain export --format hf it, and evaluate that folder with {flags}.")
    # The heads and layers alone matter here: any vocabulary will do (as the training checks do).
    spec, family_cfg = _family(source, checkpoint, vocab_size=1)
    if tp > 1 and spec.tensor_plan is None:
        raise UserError(f"--tp {tp}: the {spec.family} family has no tensor-parallel plan; use --tp 1.")
    if pp > 1 and spec.plan(family_cfg).stages is None:
        raise UserError(f"--pp {pp}: the {spec.family} family has no pipeline plan; use --pp 1.")
    spec.check(family_cfg, tp)
    shape = spec.shape(family_cfg)
    ParallelDims(dp=nproc // (tp * pp), tp=tp, pp=pp).validate_for_model(
        n_heads=shape.n_heads, n_layers=shape.n_layers, seq_len=shape.seq_len)


def load_split(source: Path, checkpoint: Path | None, mesh: Mesh, comm: Comm, device: torch.device) -> EvalSplit:
    """This rank's part (slices of its stages) of the model ``--from`` names (``checkpoint``: what
    `find_model` found; None for a Hugging Face folder), on ``device``, with what scoring it needs."""
    if checkpoint is None:
        tokenizer = load_hf_tokenizer(source)  # the small files first: a mistake costs no weights read
        hf_model = read_hf_model(source)
        spec, family_cfg = hf_model.spec, hf_model.family_cfg(ModelConfig(**hf_model.values))
        folder = FolderSource(hf_model, family_cfg)  # every name and shape checked before any weight is read

        def fill(model: nn.Module, split: TensorParallel | None) -> None:
            materialize(model, folder, device, split.splits if split else {}, split.group.rank if split else 0)
    else:
        tokenizer = run_tokenizer(checkpoint.parent.parent)
        spec, family_cfg = _family(source, checkpoint, tokenizer.vocab_size)

        def fill(model: nn.Module, split: TensorParallel | None) -> None:
            _read_checkpoint(model, checkpoint, split, device)
    with torch.device("meta"):
        model = spec.build(family_cfg)
    if checkpoint is not None:
        try:
            saved = saved_shapes(checkpoint)
        except READ_ERRORS as exc:
            raise UserError(f"checkpoint {checkpoint} cannot be read ({failure_reason(exc)}); give an earlier "
                            f"one.") from None
        check_fits(model, saved, checkpoint)
    parts = parallelize(model, spec.plan(family_cfg), mesh, comm, device, read_weights=partial(fill, model))
    return EvalSplit(model.eval(), tokenizer, parts.tensor, parts.pipeline, spec.shape(family_cfg).vocab)


def _read_checkpoint(model: nn.Module, checkpoint: Path, split: TensorParallel | None, device: torch.device
                     ) -> None:
    """Storage for this rank's meta weights (those of the stages it keeps) on ``device``, filled
    from ``checkpoint``: each slice's chunks of the full tensors."""
    for param in model.parameters():  # swapped in place, so a tied weight stays one and the split's keys hold
        torch.utils.swap_tensors(param, nn.Parameter(torch.empty(param.shape, device=device),
                                                     requires_grad=param.requires_grad))
    load_checkpoint(checkpoint, model, None, tensor_parallel=split)
