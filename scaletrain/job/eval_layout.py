"""``scaletrain eval --tp T``: the model split over groups of T processes, each holding its slices.

A model too large for one device is scored the way training holds it: built on the meta device
(shapes, no storage), split by its family's tensor-parallel plan (parallel/parallelize.py,
parallel/tensor.py), and only then given storage, each rank reading just its own slices, so no
rank ever holds the whole model:

    a run's checkpoint      torch.distributed.checkpoint reads the chunks of the full tensors
                            this rank's slices cover, whatever layout saved them
                            (train/checkpoint.py, as a resume into another layout does)
    a Hugging Face folder   each slice read straight from the safetensors files
                            (finetune/sliced.py, as a full fine-tune under tp does)

The ``--nproc N`` processes form a mesh of N / T data-parallel groups of T (runtime/mesh.py):
the T ranks of a tp group compute one model together, so they answer the same requests, and
the requests are split over the data-parallel groups (job/harness.py). A LoRA fine-tune is
refused: its adapters are merged into whole weights (job/export.py), which its ``scaletrain
export --format hf`` folder holds and this module reads slice by slice.
"""

from __future__ import annotations

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


def check_split(source: Path, checkpoint: Path | None, tp: int, nproc: int) -> None:
    """One sentence, before any weight is read, where ``--tp`` cannot split this model over
    ``--nproc`` processes."""
    if nproc % tp:
        raise UserError(f"--tp {tp} must divide --nproc {nproc}: each group of --tp processes holds one copy of the "
                        f"model; choose a --tp that divides {nproc}.")
    if checkpoint is not None and run_config(checkpoint).finetune.lora_rank:
        raise UserError(f"--tp {tp} splits whole weights, and {source} is a LoRA fine-tune whose adapters are "
                        f"merged whole; scaletrain export --format hf it, and evaluate that folder with --tp {tp}.")
    # The heads alone matter here: any vocabulary will do (as the training checks do).
    spec, family_cfg = _family(source, checkpoint, vocab_size=1)
    if spec.tensor_plan is None:
        raise UserError(f"--tp {tp}: the {spec.family} family has no tensor-parallel plan; use --tp 1.")
    spec.check(family_cfg, tp)
    shape = spec.shape(family_cfg)
    ParallelDims(dp=nproc // tp, tp=tp).validate_for_model(n_heads=shape.n_heads, n_layers=shape.n_layers,
                                                            seq_len=shape.seq_len)


def load_split(source: Path, checkpoint: Path | None, mesh: Mesh, comm: Comm, device: torch.device
               ) -> tuple[nn.Module, AnyTokenizer, TensorParallel]:
    """This rank's slices of the model ``--from`` names (``checkpoint``: what `find_model` found;
    None for a Hugging Face folder), on ``device`` in eval mode; its tokenizer; the split, whose
    ``generation()`` gives whole logits on every rank of the group."""
    if checkpoint is None:
        tokenizer = load_hf_tokenizer(source)  # the small files first: a mistake costs no weights read
        hf_model = read_hf_model(source)
        spec, family_cfg = hf_model.spec, hf_model.family_cfg(ModelConfig(**hf_model.values))
        folder = FolderSource(hf_model, family_cfg)  # every name and shape checked before any weight is read

        def fill(model: nn.Module, split: TensorParallel) -> None:
            materialize(model, folder, device, split.splits, split.group.rank)
    else:
        tokenizer = run_tokenizer(checkpoint.parent.parent)
        spec, family_cfg = _family(source, checkpoint, tokenizer.vocab_size)

        def fill(model: nn.Module, split: TensorParallel) -> None:
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
    return model.eval(), tokenizer, parts.tensor


def _read_checkpoint(model: nn.Module, checkpoint: Path, split: TensorParallel, device: torch.device) -> None:
    """Storage for this rank's meta weights on ``device``, filled from ``checkpoint``: each
    slice's chunks of the full tensors."""
    for param in model.parameters():  # swapped in place, so a tied weight stays one and the split's keys hold
        torch.utils.swap_tensors(param, nn.Parameter(torch.empty(param.shape, device=device),
                                                     requires_grad=param.requires_grad))
    load_checkpoint(checkpoint, model, None, tensor_parallel=split)
