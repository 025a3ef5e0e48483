"""``export --format hf`` and ``--format peft`` read what they write and no more (job/export.py's
`SavedModel`, job/export_hf.py's `write_weights`): the hf folder is filled one tensor at a time, each
read from the checkpoint with only the tensors it is made from (a QLoRA layer: its 4-bit codes, A and
B) and written in the shard being filled, which goes to disk when full; the PEFT folder reads the
adapters alone, never the base. The sharded folder holds exactly the tensors of the single-file one,
and transformers loads it to the same logits."""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file

from scaletrain.commands.cli import main
from scaletrain.commands.train import launch
from scaletrain.config import ModelConfig
from scaletrain.job import export, export_hf
from scaletrain.models import family_config, spec_for
from tests.test_lora_zero3 import _config, llama_and_prose

SHARD = 64 * 1024  # bytes: the tiny model's export cut into several shards


@pytest.fixture(scope="module")
def qlora_run(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("export-streaming")
    return launch(_config(llama_and_prose(root), root, quantize="nf4", steps=1)).run_dir


def _reads(monkeypatch) -> list[list[str] | None]:
    """The names each checkpoint read of the export asks for, recorded as it runs."""
    reads, real = [], export.read_model_tensors

    def recorded(path, names=None):
        reads.append(None if names is None else list(names))
        return real(path, names)

    monkeypatch.setattr(export, "read_model_tensors", recorded)
    return reads


def test_a_qlora_hf_export_is_read_and_written_a_tensor_and_a_shard_at_a_time(qlora_run, tmp_path, monkeypatch):
    assert main(["export", "--from", str(qlora_run), "--to", str(tmp_path / "whole"), "--format", "hf"]) == 0
    reads = _reads(monkeypatch)
    monkeypatch.setattr(export_hf, "SHARD_BYTES", SHARD)
    sharded = tmp_path / "sharded"
    assert main(["export", "--from", str(qlora_run), "--to", str(sharded), "--format", "hf"]) == 0

    whole = load_file(tmp_path / "whole" / "model.safetensors")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    files = sorted(sharded.glob("model-*-of-*.safetensors"))
    assert len(files) > 2 and {path.name for path in files} == set(index["weight_map"].values())
    assert index["metadata"]["total_size"] == sum(path.stat().st_size for path in files)
    tensors = {}
    for path in files:
        shard = load_file(path)
        assert all(index["weight_map"][name] == path.name for name in shard)
        held = sum(t.numel() * t.element_size() for t in shard.values())
        assert held <= SHARD or len(shard) == 1, path.name  # full, or one tensor larger than a shard
        tensors.update(shard)
    assert tensors.keys() == whole.keys()
    assert all(torch.equal(tensors[name], whole[name]) for name in whole)

    # one read per tensor written, each of one tensor's sources: a merged 4-bit layer's five code
    # buffers, A and B at most, never the whole checkpoint
    assert all(names is not None and len(names) <= 7 for names in reads)
    assert any(any(name.endswith("packed_indices") for name in names) for names in reads)
    assert len(reads) == len(whole)

    ids = torch.randint(0, 200, (2, 16))
    logits = [transformers.AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32)(ids).logits
              for folder in (tmp_path / "whole", sharded)]
    assert torch.equal(logits[0], logits[1])


def test_a_peft_export_reads_the_adapters_and_not_the_base(qlora_run, tmp_path, monkeypatch):
    reads = _reads(monkeypatch)
    assert main(["export", "--from", str(qlora_run), "--to", str(tmp_path / "peft"), "--format", "peft"]) == 0
    (names,) = reads
    assert names and all(name.endswith((".lora_A", ".lora_B")) for name in names)
    assert len(load_file(tmp_path / "peft" / "adapter_model.safetensors")) == len(names)


class _CountedReads(dict):
    """A model's tensors that count how often each is read, as a checkpoint's reads would be."""

    def __init__(self, tensors: dict):
        super().__init__(tensors)
        self.reads = Counter()

    def __getitem__(self, name: str):
        self.reads[name] += 1
        return super().__getitem__(name)


def test_a_bias_the_format_has_and_we_lack_reads_no_weight_twice():
    """GPT-2's format has a bias on every linear layer, which our GPT builds without: each is written as
    zeros shaped by its weight, already read for its own entry, so every tensor is read once."""
    spec = spec_for("gpt-tiny")
    family_cfg = family_config(dataclasses.replace(ModelConfig(), name="gpt-tiny"), 300, 64)
    model = spec.build(family_cfg)
    ours = _CountedReads({name: tensor.detach() for name, tensor in model.state_dict().items()})
    written = dict(export_hf.hf_tensors(ours, spec.hf.names(family_cfg)))
    zeros = [name for name, (our, _) in spec.hf.names(family_cfg).items() if our not in ours]
    assert zeros and all(not written[name].any() for name in zeros)
    assert written["transformer.h.0.attn.c_attn.bias"].shape == (model.blocks[0].attn.qkv.weight.shape[0],)
    assert set(ours.reads.values()) == {1}
