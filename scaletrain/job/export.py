"""Export: one checkpoint as one unsharded safetensors file.

A checkpoint is made for resuming: DCP files cut the way the run was laid
out (ZeRO's flat ranges, tp slices, pipeline stages), the optimizer state
beside the weights, and a pickled metadata file. An export is made for using
the model: its full tensors only, with their single-device shapes, in one
safetensors file that any tool reads without scaletrain and without running
code.

Every key of the model's ``state_dict()`` is written, so
``model.load_state_dict(load_file(path))`` works strictly on a freshly built
model of the same configuration. A head tied to the token embedding shares its
weight; its ``state_dict()`` and its checkpoints name both, so the
file holds both, as two equal copies (safetensors stores no tensors that
share memory). That costs one embedding's bytes and spares every reader the
tie: nothing to re-create, no ``strict=False``. The header records the tie.

The header's ``__metadata__`` (strings only): ``format``, ``step``,
``source`` (the checkpoint), ``tied`` (``head.weight=tok_emb.weight``) and
``config``, the run's ``config.toml``, from which the model is rebuilt.

A LoRA fine-tune exports merged: each adapted weight is written as
``W + (alpha / r) B A`` (an NF4 base dequantized first), so the file is the
plain model's, whatever trained it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from scaletrain.errors import UserError
from scaletrain.paths import readable_dir, writable_file
from scaletrain.train.checkpoint import (
    READ_ERRORS,
    STATE_FILE,
    failure_reason,
    latest_checkpoint,
    read_model_tensors,
    saved_shapes,
)
from scaletrain.train.manifest import MANIFEST

FORMAT = "scaletrain-model-v1"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Exported:
    path: Path
    step: int
    tensors: int
    parameters: int  # a tied weight counted once, as model.parameters() counts it
    bytes: int

    def describe(self) -> str:
        return (f"exported step {self.step}: {self.tensors} tensors, {self.parameters:,} parameters, "
                f"{self.bytes:,} bytes to {self.path}")


def find_checkpoint(source: Path) -> Path:
    """A complete checkpoint folder as it is, or a run folder's latest complete one."""
    readable_dir("--from", source, "a run folder or one of its checkpoints/step_NNNNNN folders")
    if (source / MANIFEST).is_file():  # a complete step_NNNNNN folder
        return source
    latest = latest_checkpoint(source)
    if latest is None:
        raise UserError(f"--from {source} holds no complete checkpoint; give a run folder or one of its "
                        f"checkpoints/step_NNNNNN folders.")
    return latest


def check_target(target: Path, force: bool) -> None:
    if not target.name.endswith(".safetensors") or target.name == ".safetensors":
        raise UserError(f"--to {target} does not end in .safetensors; name the file so that tools "
                        f"recognize its format.")
    writable_file("--to", target)
    if not target.parent.is_dir():
        raise UserError(f"--to {target}: the folder {target.parent} does not exist; create it first.")
    if target.exists() and not force:
        raise UserError(f"--to {target} already exists; add --force to replace it, or choose another name.")


def _unreadable(checkpoint: Path, exc: BaseException) -> UserError:
    """A damaged checkpoint is a user's problem: one sentence."""
    return UserError(f"checkpoint {checkpoint} cannot be read ({failure_reason(exc)}); export an earlier one.")


def _step(checkpoint: Path) -> int:
    try:
        return json.loads((checkpoint / STATE_FILE).read_text())["step"]
    except READ_ERRORS as exc:
        raise _unreadable(checkpoint, exc) from None


def _read(checkpoint: Path, names: list[str] | None = None) -> tuple[int, dict[str, torch.Tensor]]:
    """The step and the model's full tensors (``names``' only, where given)."""
    step = _step(checkpoint)
    try:
        return step, read_model_tensors(checkpoint, names)
    except READ_ERRORS as exc:
        raise _unreadable(checkpoint, exc) from None


def saved_names(checkpoint: Path) -> list[str]:
    """The names of the model's tensors a checkpoint holds, from its metadata (nothing else read)."""
    try:
        return list(saved_shapes(checkpoint))
    except READ_ERRORS as exc:
        raise _unreadable(checkpoint, exc) from None


class SavedModel(Mapping[str, torch.Tensor]):
    """A checkpoint's model as the plain model's tensors (`without_adapters`), each read from the files,
    and merged, when it is asked for: a writer that takes them one at a time holds one at a time, not
    the model (a 70B's merged fp32 weights would be 280 GB)."""

    def __init__(self, checkpoint: Path):
        from scaletrain.finetune.lora import merge_sources

        self.checkpoint, self.step = checkpoint, _step(checkpoint)
        self.sources = merge_sources(saved_names(checkpoint))
        self.scaling = _lora_scaling(checkpoint)

    def __getitem__(self, name: str) -> torch.Tensor:
        from scaletrain.finetune.lora import merged_tensor
        from scaletrain.finetune.nf4 import dequantize_saved

        _, saved = _read(self.checkpoint, self.sources[name])
        return merged_tensor(name, saved, self.scaling, dequantize_saved)

    def __contains__(self, name: object) -> bool:  # by the names alone: Mapping's own would read the tensor
        return name in self.sources

    def __iter__(self) -> Iterator[str]:
        return iter(self.sources)

    def __len__(self) -> int:
        return len(self.sources)


def without_adapters(tensors: dict[str, torch.Tensor], checkpoint: Path) -> dict[str, torch.Tensor]:
    """A LoRA fine-tune's tensors merged into the plain model's (finetune/lora.py): the file
    loads into the model its base was, and computes what the fine-tune does."""
    if not any(key.endswith(".lora_A") for key in tensors):
        return tensors
    from scaletrain.finetune.lora import merged_tensors
    from scaletrain.finetune.nf4 import dequantize_saved

    return merged_tensors(tensors, _lora_scaling(checkpoint), dequantize_saved)


def _lora_scaling(checkpoint: Path) -> float:
    """alpha / r of the fine-tune that wrote ``checkpoint`` (1 without adapters: nothing is merged)."""
    from scaletrain.config import load_run_config

    finetune = load_run_config(checkpoint.parent.parent).finetune
    return finetune.lora_alpha / finetune.lora_rank if finetune.lora_rank else 1.0


def model_ties(run_dir: Path) -> tuple[tuple[str, str], ...]:
    """(copy, original) names of the run's model that are one parameter (models/spec.py)."""
    from scaletrain.config import load_run_config
    from scaletrain.models import CLASSIFIER, spec_for
    from scaletrain.models.spec import tied_parameters

    if not (run_dir / "config.toml").is_file():
        return ()
    model_cfg = load_run_config(run_dir).model
    if model_cfg.name == CLASSIFIER:
        return ()
    family = spec_for(model_cfg.name)
    with torch.device("meta"):  # the ties do not depend on the sizes: any vocabulary will do
        return tied_parameters(family.build(family.configure(model_cfg, 1, 1)))


def _present_ties(tensors: dict[str, torch.Tensor], checkpoint: Path) -> list[tuple[str, str]]:
    """The ties whose both names the checkpoint holds; loading writes both into one
    parameter, so copies that differ would make the result depend on key order."""
    ties = [(copy, original) for copy, original in model_ties(checkpoint.parent.parent)
            if copy in tensors and original in tensors]
    for copy, original in ties:
        if not torch.equal(tensors[copy], tensors[original]):
            raise UserError(f"checkpoint {checkpoint} holds different {copy} and {original}, which the "
                            f"model ties; it is damaged, export an earlier one.")
    return ties


def _prepared(tensors: dict[str, torch.Tensor], dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """Cast floating tensors; make each contiguous and the sole owner of its memory,
    which safetensors requires (it refuses tensors that share storage)."""
    prepared, owners = {}, set()
    for name, tensor in tensors.items():
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        tensor = tensor.contiguous()
        if tensor.untyped_storage().data_ptr() in owners:
            tensor = tensor.clone()
        owners.add(tensor.untyped_storage().data_ptr())
        prepared[name] = tensor
    return prepared


def _metadata(checkpoint: Path, step: int, ties: list[tuple[str, str]]) -> dict[str, str]:
    metadata = {"format": FORMAT, "step": str(step), "source": str(checkpoint.resolve())}
    if ties:
        metadata["tied"] = ",".join(f"{copy}={original}" for copy, original in ties)
    config = checkpoint.parent.parent / "config.toml"  # RUN/checkpoints/step_N
    if config.is_file():
        metadata["config"] = config.read_text()
    return metadata


def _new_file_mode() -> int:
    """The mode open() gives a new file (0o666 less the umask). safetensors writes
    through a private temporary file of its own (0o600), but an exported model is
    made to be shared."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def _write_atomically(tensors: dict[str, torch.Tensor], metadata: dict[str, str], target: Path) -> None:
    """Into a temporary file beside the target, then renamed over it: a crash leaves
    the old file or the new one, never part of one."""
    partial = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        save_file(tensors, partial, metadata=metadata)
        os.chmod(partial, _new_file_mode())
        with open(partial, "rb") as f:
            os.fsync(f.fileno())
        os.replace(partial, target)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise


def export(source: Path, target: Path, dtype: str | None = None, force: bool = False) -> Exported:
    """Write the model of ``source`` (a checkpoint or a run folder) to ``target``;
    ``dtype`` (fp32, bf16, fp16) casts floating tensors, None keeps them as saved."""
    check_target(target, force)
    checkpoint = find_checkpoint(source)
    step, tensors = _read(checkpoint)
    tensors = without_adapters(tensors, checkpoint)
    ties = _present_ties(tensors, checkpoint)
    cast = DTYPES[dtype] if dtype else None
    _write_atomically(_prepared(tensors, cast), _metadata(checkpoint, step, ties), target)
    copies = {copy for copy, _ in ties}
    return Exported(path=target, step=step, tensors=len(tensors),
                    parameters=sum(t.numel() for name, t in tensors.items() if name not in copies),
                    bytes=target.stat().st_size)
