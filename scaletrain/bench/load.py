"""``scaletrain bench load``: a Hugging Face folder read slice by slice, against the plain whole load.

What each rank's process holds at its peak while it starts from released
weights, before the first step (getrusage's peak resident set size, in a
fresh process for each measurement):

  ours  ``scaletrain finetune --from DIR`` in the layout given (``--nproc``
        ranks; ``--tp``, ``--pp``, ``--zero 3``; ``--lora-rank R``: LoRA's
        adapters over the frozen base, with ``--quantize nf4`` coded in 4
        bits), one step: each rank builds the model
        on the meta device, splits it there and reads its own slices
        (finetune/sliced.py); memory.json's ``host_peak_at_start`` of every
        rank.
  peer  the plain load every rank did before, as a hand-written loader or
        ``from_pretrained`` without its low-memory path does it: the model
        built whole (initialized), every tensor of the folder read, then
        ``load_state_dict``; one process, as each rank ran it.

Beside them, the model's fp32 bytes and a rank's share (the model over the
ranks that split it). The folder is ``--from DIR``, or made here for
``--model PRESET``: random weights, N(0, 0.02), written tensor by tensor
into shards of at most 1 GB under the names the family's adapter gives, so
making it never holds the model either.

The step itself is one short sequence: the figure is the start, not the
training, whose memory the ledger reports (its AdamW state and gradients
add three times the share; plan for them on a small machine).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from scaletrain.bench import machine
from scaletrain.config import Config, ModelConfig
from scaletrain.data.tokenizer import ByteTokenizer
from scaletrain.errors import UserError
from scaletrain.finetune.hf import is_hf_folder, read_hf_model
from scaletrain.job.export_hf import byte_tokenizer
from scaletrain.models import CLASSIFIER, family_config, spec_for

SHARD_BYTES = 10**9
LAYOUT_FLAGS = ("tp", "pp", "zero", "dp")
PLAIN_LOAD = """
import resource, sys, torch
from scaletrain.config import ModelConfig
from scaletrain.finetune.hf import read_hf_model, read_hf_weights
hf_model = read_hf_model(sys.argv[1])
family_cfg = hf_model.family_cfg(ModelConfig(**hf_model.values))
model = hf_model.spec.build(family_cfg)
model.load_state_dict(read_hf_weights(hf_model, family_cfg))
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
"""


def make_folder(model_cfg: ModelConfig, folder: Path, vocab_size: int = 32000, seq_len: int = 2048) -> Path:
    """A Hugging Face folder of random weights for ``model_cfg``'s preset, written tensor by tensor."""
    family = spec_for(model_cfg.name)
    family_cfg = family_config(model_cfg, vocab_size, seq_len)
    with torch.device("meta"):
        shapes = {name: tuple(t.shape) for name, t in family.build(family_cfg).state_dict().items()}
    folder.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(0)
    shard, size, count = {}, 0, 0
    for name, (ours, transposed) in family.hf.names(family_cfg).items():
        shape = shapes[ours][::-1] if transposed else shapes[ours]
        shard[name] = torch.randn(shape, generator=generator) * 0.02 if len(shape) > 1 else torch.ones(shape)
        size += shard[name].numel() * 4
        if size >= SHARD_BYTES:
            count += 1
            save_file(shard, folder / f"model-{count:05d}.safetensors", metadata={"format": "pt"})
            shard, size = {}, 0
    if shard:
        count += 1
        save_file(shard, folder / f"model-{count:05d}.safetensors", metadata={"format": "pt"})
    weight_map = {}
    for path in sorted(folder.glob("model-*.safetensors")):
        with safe_open(path, framework="pt") as f:
            weight_map.update(dict.fromkeys(f.keys(), path.name))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (folder / "config.json").write_text(json.dumps(family.hf.config_to_hf(family_cfg)))
    return folder


def _ours(cfg: Config, folder: Path, work: Path) -> list[int]:
    corpus = work / "corpus.txt"
    corpus.write_text("".join(f"line {i} of a small corpus for one step\n" for i in range(2000)))
    run = work / "run"
    flags = [f"--{name}={getattr(cfg.parallel, name)}" for name in LAYOUT_FLAGS if getattr(cfg.parallel, name)]
    if cfg.finetune.lora_rank:
        flags.append(f"--lora-rank={cfg.finetune.lora_rank}")
    if cfg.finetune.quantize != "none":
        flags.append(f"--quantize={cfg.finetune.quantize}")
    command = [sys.executable, "-m", "scaletrain", "finetune", "--from", str(folder), "--data", str(corpus),
               "--nproc", str(cfg.parallel.nproc), *flags, "--steps", "1", "--seq-len", "16",
               "--micro-batch", "1", "--eval-every", "0", "--eval-batches", "1",
               "--sample-tokens", "0", "--no-progress", "--report-memory", "--out", str(run),
               "--cache-dir", str(work / "cache")]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        raise UserError(f"bench load's fine-tune failed: {done.stderr.strip().splitlines()[-1]}")
    ledgers = json.loads((run / "memory.json").read_text())
    return [ledgers[rank]["host_peak_at_start"] for rank in sorted(ledgers, key=int)]


def _peer(folder: Path) -> int:
    done = subprocess.run([sys.executable, "-c", PLAIN_LOAD, str(folder)], capture_output=True, text=True)
    if done.returncode:
        raise UserError(f"bench load's plain load failed: {done.stderr.strip().splitlines()[-1]}")
    return int(done.stdout.split()[-1])


def run(cfg: Config, folder: Path | None) -> dict:
    """Measure both loads of ``folder`` (made for ``--model`` when None); the result as ``bench --json``
    prints it."""
    if folder is None and cfg.model.name == CLASSIFIER:
        raise UserError("bench load reads a language model's folder; give --from DIR or a --model preset.")
    with tempfile.TemporaryDirectory(prefix="scaletrain-bench-load-") as tmp:
        work = Path(tmp)
        if folder is None:
            folder = make_folder(cfg.model, work / "folder")
            byte_tokenizer(ByteTokenizer()).save(str(folder / "tokenizer.json"))  # any vocabulary within the model's
        elif not is_hf_folder(folder):
            raise UserError(f"--from {folder} has no config.json; give a Hugging Face model folder.")
        hf_model = read_hf_model(folder)
        with torch.device("meta"):
            numel = sum(p.numel() for p in hf_model.spec.build(
                hf_model.family_cfg(ModelConfig(**hf_model.values))).parameters())
        ours, peer = _ours(cfg, folder, work), _peer(folder)
    p = cfg.parallel
    splitting = p.tp * p.pp * (p.nproc // (p.tp * p.pp) if p.zero == 3 else 1)
    return {"what": "load", "machine": machine(), "model": hf_model.values["name"], "parameters": numel,
            "model_bytes": 4 * numel, "share_bytes": 4 * numel // splitting, "nproc": p.nproc,
            "layout": {name: getattr(p, name) for name in LAYOUT_FLAGS}, "lora_rank": cfg.finetune.lora_rank,
            "quantize": cfg.finetune.quantize,
            "ours": {"name": "slice by slice (finetune/sliced.py)", "host_peak_bytes": ours},
            "peer": {"name": "whole: build, read every tensor, load_state_dict", "host_peak_bytes": peer},
            "ratio": max(ours) / peer}


def format_table(result: dict) -> str:
    gib = 2**30
    layout = ", ".join(f"{name} {value}" for name, value in result["layout"].items()
                       if value and (value > 1 or name == "zero"))
    coded = " (NF4)" if result.get("quantize", "none") != "none" else ""
    adapters = f", LoRA rank {result['lora_rank']} over the frozen base{coded}" if result.get("lora_rank") else ""
    lines = [f"bench load: {result['parameters'] / 1e9:.2f}B parameters ({result['model_bytes'] / gib:.2f} GiB "
             f"fp32), {result['nproc']} ranks ({layout or 'replicated'}){adapters}, on {result['machine']}",
             f"a rank's share of the weights: {result['share_bytes'] / gib:.2f} GiB",
             *(f"ours, rank {rank}: peak {peak / gib:.2f} GiB" for rank, peak in
               enumerate(result["ours"]["host_peak_bytes"])),
             f"peer (one rank): peak {result['peer']['host_peak_bytes'] / gib:.2f} GiB",
             f"ours / peer: {result['ratio']:.3f} (peak resident set size before the first step, the "
             f"interpreter and torch included)"]
    return "\n".join(lines)
