"""LoRA: the adapter's algebra, what trains, PEFT's LoRA as the reference, and fine-tuning end to end."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from scaletrain.data import ByteTokenizer
from scaletrain.commands.parity import run_parity
from scaletrain.commands.train import execute, launch
from scaletrain.config import ModelConfig
from scaletrain.finetune.lora import (
    ADAPTER_FILE,
    LoRALinear,
    adapters,
    apply_lora,
    merged_tensors,
)
from scaletrain.models import build_model
from scaletrain.train import checkpoint as ckpt

TARGETS = ["qkv", "proj", "fc"]


def _gpt(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return build_model(ModelConfig(name="gpt-tiny"), vocab_size=ByteTokenizer().vocab_size, seq_len=32)


def test_an_adapter_starts_as_its_base_and_merges_to_the_same_function():
    torch.manual_seed(0)
    base = nn.Linear(16, 24)
    layer = LoRALinear(copy.deepcopy(base), rank=4, alpha=8.0)
    x = torch.randn(5, 16)
    assert torch.equal(layer(x), base(x))  # B = 0: exactly the base
    with torch.no_grad():
        layer.lora_B.normal_()
    adapted = layer(x)
    assert not torch.allclose(adapted, base(x))
    layer.merge()
    assert torch.allclose(layer(x), adapted, atol=1e-6)
    assert torch.allclose(layer.base.weight, base.weight + 2.0 * layer.lora_B @ layer.lora_A, atol=1e-6)
    layer.unmerge()
    assert torch.allclose(layer.base.weight, base.weight, atol=1e-6) and torch.allclose(layer(x), adapted, atol=1e-6)


def test_only_the_adapters_train():
    model = _gpt()
    names = apply_lora(model, TARGETS, rank=4, alpha=16.0, dropout=0.0)
    assert names == [f"blocks.{i}.{layer}" for i in range(2) for layer in ("attn.qkv", "attn.proj", "mlp.fc",
                                                                           "mlp.proj")]
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable == {f"{name}.lora_{m}" for name in names for m in "AB"}
    # r (d_in + d_out) per layer: qkv 64+192, attn.proj 64+64, fc 64+256, mlp.proj 256+64
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == 2 * 4 * (256 + 128 + 320 + 320)
    model(torch.randint(0, 256, (2, 32))).float().mean().backward()
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)


def test_merged_tensors_give_the_plain_model_the_adapted_function():
    model = _gpt()
    apply_lora(model, TARGETS, rank=4, alpha=16.0, dropout=0.0)
    for layer in adapters(model):
        with torch.no_grad():
            layer.lora_B.normal_(std=0.02)
    plain = _gpt(seed=1)
    plain.load_state_dict(merged_tensors(model.state_dict(), scaling=16.0 / 4))  # strict: every key
    tokens = torch.randint(0, 256, (2, 32))
    assert torch.allclose(plain(tokens), model(tokens), atol=1e-5)


def test_lora_trains_as_peft_lora_does():
    """The same base, the same adapter initialization, the same batches and AdamW: the
    same losses (fp32) as Hugging Face PEFT's LoRA on the same module names."""
    peft = pytest.importorskip("peft", reason="peft is not installed: pip install peft")
    ours = _gpt()
    theirs = peft.get_peft_model(copy.deepcopy(ours), peft.LoraConfig(
        r=4, lora_alpha=16, lora_dropout=0.0, target_modules=TARGETS, bias="none", init_lora_weights=True))
    apply_lora(ours, TARGETS, rank=4, alpha=16.0, dropout=0.0)
    with torch.no_grad():  # PEFT draws A from its own generator state: start both from ours
        for layer in adapters(ours):
            name = next(n for n, m in ours.named_modules() if m is layer)
            theirs.base_model.model.get_submodule(name).lora_A["default"].weight.copy_(layer.lora_A)
    optimizers = [torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2) for m in (ours, theirs)]
    generator = torch.Generator().manual_seed(0)
    for _ in range(4):
        tokens = torch.randint(0, 256, (4, 33), generator=generator)
        losses = []
        for model, optimizer in zip((ours, theirs), optimizers):
            logits = model(tokens[:, :-1])
            loss = nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        assert losses[0] == pytest.approx(losses[1], rel=1e-5)


@pytest.fixture(scope="module")
def base_run(corpus, tmp_path_factory) -> Path:
    from scaletrain.config import Config

    root = tmp_path_factory.mktemp("base")
    cfg = Config().replace(name="gpt-tiny", data=str(corpus), seq_len=32, micro_batch=4, steps=3, warmup_steps=1,
                           eval_every=0, eval_batches=1, sample_tokens=0, progress=False, out=str(root / "run"),
                           cache_dir=str(root / "cache"))
    return execute(cfg, None).run_dir


@pytest.fixture
def prose(tmp_path) -> Path:
    path = tmp_path / "prose.txt"
    path.write_text("".join(f"The fox number {i} jumps over the lazy dog, and the dog sleeps.\n" for i in range(600)))
    return path


def _finetune_cfg(base_run: Path, prose: Path, tmp_path: Path, **changes):
    from scaletrain.config import Config

    return Config().replace(base=str(base_run), lora_rank=4, data=str(prose), micro_batch=4, steps=3,
                            warmup_steps=1, eval_every=0, eval_batches=1, sample_tokens=0, progress=False,
                            out=str(tmp_path / "ft"), cache_dir=str(tmp_path / "cache"), **changes)


def test_finetune_trains_the_adapters_and_leaves_the_base_as_it_was(base_run, prose, tmp_path):
    summary = launch(_finetune_cfg(base_run, prose, tmp_path, report_memory=True))
    base = ckpt.read_model_tensors(ckpt.latest_checkpoint(base_run))
    tuned = ckpt.read_model_tensors(summary.checkpoint)
    assert torch.equal(tuned["blocks.0.attn.qkv.base.weight"], base["blocks.0.attn.qkv.weight"])
    assert torch.equal(tuned["tok_emb.weight"], base["tok_emb.weight"])
    assert tuned["blocks.0.attn.qkv.lora_B"].abs().sum() > 0  # the adapters moved
    saved = load_file(summary.run_dir / ADAPTER_FILE)
    assert set(saved) == {k for k in tuned if k.endswith(("lora_A", "lora_B"))}
    adapter_bytes = 4 * sum(t.numel() for t in saved.values())
    import json
    ledger = json.loads((summary.run_dir / "memory.json").read_text())["0"]
    assert ledger["grads"] == adapter_bytes  # gradients of the adapters alone
    assert 2 * adapter_bytes <= ledger["optimizer"] < 2 * adapter_bytes + 1024  # AdamW's two moments (+ steps)

    from scaletrain.commands.generate import (
        generate,  # from the fine-tune's run: the adapters merged
    )
    assert generate(summary.run_dir, "The fox", tokens=8, temperature=0).startswith("The fox")


@pytest.mark.parametrize("zero", [0, 1, 2])
def test_finetune_over_data_parallel_ranks_equals_one_device(base_run, prose, tmp_path, zero):
    report = run_parity(_finetune_cfg(base_run, prose, tmp_path, nproc=2, dp=2, zero=zero), tolerance=1e-5)
    assert report.passed, report.to_json()


def test_qlora_keeps_the_base_in_4_bits_and_exports_the_merged_model(base_run, prose, tmp_path):
    from safetensors.torch import load_file as load_safetensors

    from scaletrain.finetune.nf4 import NF4Linear
    from scaletrain.job.export import export

    summary = launch(_finetune_cfg(base_run, prose, tmp_path, quantize="nf4"))
    tuned = ckpt.read_model_tensors(summary.checkpoint)
    base = ckpt.read_model_tensors(ckpt.latest_checkpoint(base_run))
    stored = sum(t.numel() * t.element_size() for k, t in tuned.items() if ".base." in k and "shape" not in k)
    full = sum(4 * base[f"{name}.weight"].numel() for name in {k.split(".base.")[0] for k in tuned if ".base." in k})
    assert 4.127 / 32 < stored / full < 4.7 / 32  # 4-bit codes, 8-bit scales; a small model pads its last groups

    exported = export(summary.run_dir, tmp_path / "merged.safetensors")
    plain = _gpt(seed=1)
    plain.load_state_dict(load_safetensors(exported.path))  # strict: the plain model's keys
    quantized = _gpt(seed=2)
    apply_lora(quantized, TARGETS, rank=4, alpha=16.0, dropout=0.0)
    for layer in adapters(quantized):  # the fine-tune's modules, to run its saved state
        layer.base = NF4Linear.from_linear(layer.base)
    quantized.load_state_dict(tuned)
    tokens = torch.randint(0, 256, (2, 32))
    assert torch.allclose(plain(tokens), quantized(tokens), atol=1e-4)


@pytest.mark.parametrize("changes", [{}, {"quantize": "nf4"}, {"precision": "bf16", "param_dtype": "bf16"}],
                         ids=["lora", "qlora", "lora-bf16"])
def test_the_planner_predicts_an_adapter_fine_tunes_ledger(base_run, prose, tmp_path, changes):
    """The frozen base (in 4 bits under QLoRA, in bf16 with --param-dtype bf16: no master for a
    weight that never steps), the adapters' gradients and state: within 5% of the real ledger."""
    import json

    from scaletrain.job.base_model import as_finetune
    from scaletrain.planner.hardware import Cluster, cpu_device
    from scaletrain.planner.predict import predict

    cfg = _finetune_cfg(base_run, prose, tmp_path, report_memory=True, **changes)
    summary = launch(cfg)
    ledger = json.loads((summary.run_dir / "memory.json").read_text())["0"]
    planned = predict(as_finetune(cfg), 1, 256, Cluster(cpu_device(1.0, 2**40), 1, 1)).memory
    for name in ("params", "grads", "optimizer"):
        assert planned[name] == pytest.approx(ledger[name], rel=0.05), name
