"""A model and its tokenizer from what ``--from`` names: ``scaletrain generate``'s and ``scaletrain
eval``'s one loader (and the harness's during training, job/harness.py).

``--from`` names a Hugging Face model folder (finetune/hf.py reads its weights and tokenizer;
nothing is downloaded), a run folder (its latest complete checkpoint) or one of its
``checkpoints/step_NNNNNN`` folders. A checkpoint holds weights only, so the model is rebuilt
from the run's ``config.toml`` (a fine-tuned folder's architecture, positions and vocabulary
included), a LoRA fine-tune's adapters merged into its weights (an NF4 base dequantized first:
job/export.py), and the text goes through the run's tokenizer: the ``tokenizer.json`` training
saved in the run folder (job/data_setup.py; for runs older than that file, bytes or the BPE
training cached beside the run folders, found by its corpus's fingerprint).
"""

from __future__ import annotations

from pathlib import Path

from torch import nn

from scaletrain.config import Config, load_run_config
from scaletrain.errors import UserError
from scaletrain.finetune.hf import is_hf_folder, load_hf_tokenizer
from scaletrain.finetune.sliced import load_hf_model
from scaletrain.job.data_setup import AnyTokenizer, run_tokenizer
from scaletrain.job.export import find_checkpoint, without_adapters
from scaletrain.models import CLASSIFIER, build_model
from scaletrain.paths import readable_dir
from scaletrain.train.checkpoint import READ_ERRORS, failure_reason, read_model_tensors


def check_fits(model: nn.Module, saved: dict[str, tuple[int, ...]], checkpoint: Path) -> None:
    """The checkpoint's tensors (``saved``: their full shapes by name) are ``model``'s: one
    sentence otherwise."""
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    differing = sorted(name for name in expected.keys() | saved.keys() if expected.get(name) != saved.get(name))
    if differing:
        name = differing[0]
        raise UserError(f"checkpoint {checkpoint} does not fit the model its run's config.toml describes ({name}: "
                        f"saved {saved.get(name)}, built {expected.get(name)}); give the run that saved it.")


def run_config(checkpoint: Path) -> Config:
    """The configuration of the run that saved ``checkpoint``: one sentence where the checkpoint
    is not inside its run folder, or the run is not a language model's."""
    run_dir = checkpoint.parent.parent  # RUN/checkpoints/step_NNNNNN
    if not (run_dir / "config.toml").is_file():
        raise UserError(f"checkpoint {checkpoint} is not inside its run folder (no {run_dir / 'config.toml'}); "
                        f"give it where training wrote it.")
    cfg = load_run_config(run_dir)
    if cfg.model.name == CLASSIFIER:
        raise UserError(f"--from {checkpoint} is a run of the mlp classifier, which writes no text; give a "
                        f"language model's run.")
    return cfg


def load_run_model(checkpoint: Path) -> tuple[nn.Module, AnyTokenizer]:
    """A checkpoint's model (fp32 on the CPU, in eval mode), rebuilt from its run's config.toml,
    and the run's tokenizer."""
    cfg = run_config(checkpoint)
    tokenizer = run_tokenizer(checkpoint.parent.parent)
    model = build_model(cfg.model, vocab_size=tokenizer.vocab_size, seq_len=cfg.data.seq_len)
    try:
        tensors = without_adapters(read_model_tensors(checkpoint), checkpoint)  # a LoRA fine-tune: merged
    except READ_ERRORS as exc:
        raise UserError(f"checkpoint {checkpoint} cannot be read ({failure_reason(exc)}); give an earlier "
                        f"one.") from None
    check_fits(model, {name: tuple(t.shape) for name, t in tensors.items()}, checkpoint)
    model.load_state_dict(tensors)
    return model.eval(), tokenizer


def find_model(source: Path) -> Path | None:
    """The checkpoint ``--from`` names (a run folder's latest complete one); None for a Hugging Face
    folder. Reads no weights: a mistake is found before any work."""
    readable_dir("--from", source, "a Hugging Face model folder, a run folder or one of its checkpoints/step_NNNNNN "
                                   "folders")
    if is_hf_folder(source):
        return None
    try:
        return find_checkpoint(source)
    except UserError:  # it exists: what it lacks is a checkpoint
        raise UserError(f"--from {source} is neither a Hugging Face model folder (it has no config.json) nor "
                        f"a run folder with a complete checkpoint; give one of those, or a checkpoints/"
                        f"step_NNNNNN folder.") from None


def load_model(source: Path) -> tuple[nn.Module, AnyTokenizer]:
    """The model (fp32 on the CPU, in eval mode) and tokenizer that ``--from`` names."""
    return load_found(source, find_model(source))


def load_found(source: Path, checkpoint: Path | None) -> tuple[nn.Module, AnyTokenizer]:
    """`load_model` where `find_model` has already found ``checkpoint`` for ``source``."""
    if checkpoint is None:
        tokenizer = load_hf_tokenizer(source)  # the small files first: a mistake costs no weights read
        return load_hf_model(source)[0], tokenizer
    return load_run_model(checkpoint)
