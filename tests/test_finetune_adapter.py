"""``finetune --from BASE --adapter DIR`` (finetune/peft_adapter.py, job/base_model.py): a PEFT LoRA
adapter that peft itself saved over a Hugging Face folder starts the run from exactly its weights, the
run's settings taken from it; with a 4-bit base and over data-parallel ranks too; every adapter or flag
the run cannot continue is refused in one sentence before anything is written.

Where a run starts is seen through its exports: one SGD step at a learning rate far below the fp32
resolution of the adapters' values moves none of them, so the run's ``--format peft`` export holds the
tensors it started from (compared bit for bit) and its ``--format hf`` export the model it started as.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from scaletrain.commands.cli import main
from tests.test_hf import TEXT, gpt2_config, gpt2_tensors, random_gpt, train_tokenizer, write_folder
from tests.test_llama_hf import PROSE, SEQ, make_folder, relative, their_logits

transformers = pytest.importorskip("transformers", reason="building the folders needs the dev extra")
peft = pytest.importorskip("peft", reason="making the adapters needs peft (the dev extra)")

# One step that moves nothing: SGD at 1e-30 changes no adapter value of fp32 (each is far above 1e-20).
STILL = ["--steps", "1", "--optimizer", "sgd", "--momentum", "0", "--lr", "1e-30", "--warmup-steps", "0",
         "--seq-len", str(SEQ), "--micro-batch", "2", "--eval-every", "0", "--eval-batches", "1",
         "--sample-tokens", "0", "--no-progress"]
LLAMA_GROUPS = ["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"]  # --lora-targets qkv,fc


def continue_from(base: Path, adapter: Path, out: Path, text: str = PROSE, *flags: str) -> int:
    """``finetune --from base --adapter adapter`` for one step that moves nothing; its exit code."""
    data = out.parent / f"{out.name}.txt"
    data.write_text(text)
    return main(["finetune", "--from", str(base), "--adapter", str(adapter), "--data", str(data), "--out", str(out),
                 "--cache-dir", str(out.parent / "cache"), *STILL, *flags])


def exported_adapter(run: Path) -> dict[str, torch.Tensor]:
    """The adapters of ``run``, exported as a PEFT folder and read back."""
    assert main(["export", "--from", str(run), "--to", str(run.parent / f"{run.name}-peft"), "--format", "peft"]) == 0
    return load_file(run.parent / f"{run.name}-peft" / "adapter_model.safetensors")


def peft_adapter(base: Path, folder: Path, **options) -> torch.nn.Module:
    """peft's own LoRA over the model in ``base``, B set off zero, saved to ``folder``; the PeftModel."""
    model = transformers.AutoModelForCausalLM.from_pretrained(base, torch_dtype=torch.float32)
    adapted = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, **options))
    torch.manual_seed(1)
    with torch.no_grad():
        for name, param in adapted.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.05)
    adapted.save_pretrained(folder)
    return adapted.eval()


def gpt2_base(folder: Path) -> Path:
    write_folder(folder, gpt2_tensors(random_gpt()), gpt2_config())
    train_tokenizer().save_model(str(folder))
    return folder


def finetune_settings(run: Path) -> dict:
    return {line.split(" = ")[0]: line.split(" = ")[1] for line in (run / "config.toml").read_text().splitlines()
            if line.startswith("lora_")}


@pytest.mark.numerics
@pytest.mark.parametrize("family,options,settings", [
    ("llama", dict(target_modules=["q_proj", "v_proj", "gate_proj", "up_proj"]),
     dict(lora_targets='"q_proj,v_proj,gate_proj,up_proj"', lora_dropout="0.0")),
    ("llama", dict(target_modules=["q_proj", "v_proj", "o_proj"]),  # PEFT's common three: o_proj apart
     dict(lora_targets='"q_proj,v_proj,o_proj"')),
    ("llama", dict(target_modules=r".*\.(o_proj|down_proj)", lora_dropout=0.1),
     dict(lora_targets='"o_proj,down_proj"', lora_dropout="0.1")),
    ("gpt2", dict(target_modules=["c_attn", "c_proj"], fan_in_fan_out=True), dict(lora_targets='"c_attn,c_proj"')),
], ids=["llama-list", "llama-q-v-o", "llama-regex", "gpt2-conv1d"])
def test_a_peft_adapter_starts_the_run_from_exactly_its_weights(tmp_path, capsys, family, options, settings):
    base = make_folder(tmp_path / "base", "llama") if family == "llama" else gpt2_base(tmp_path / "base")
    adapted = peft_adapter(base, tmp_path / "adapter", **options)
    assert continue_from(base, tmp_path / "adapter", tmp_path / "run", PROSE if family == "llama" else TEXT) == 0
    assert main(["export", "--from", str(tmp_path / "run"), "--to", str(tmp_path / "merged"), "--format", "hf"]) == 0
    capsys.readouterr()
    assert finetune_settings(tmp_path / "run") == {"lora_rank": "4", "lora_alpha": "8.0", "lora_dropout": "0.0",
                                                   **settings}
    saved = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    back = exported_adapter(tmp_path / "run")
    assert back.keys() == saved.keys() and all(torch.equal(back[key], saved[key]) for key in saved)
    ids = torch.randint(0, 300, (2, SEQ), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        started_as = their_logits(tmp_path / "merged", ids)
        assert relative(adapted(ids).logits, started_as) < 1e-5
        assert relative(their_logits(base, ids), started_as) > 1e-3  # the adapter moves the logits


def test_a_fine_tune_of_our_own_run_continues_from_its_peft_export(corpus, tmp_path, capsys):
    """The base one of our runs (a byte-level GPT): the export of a LoRA fine-tune of it comes back."""
    steps = ["--seq-len", "32", "--micro-batch", "2", "--eval-every", "0", "--eval-batches", "1",
             "--sample-tokens", "0", "--no-progress", "--cache-dir", str(tmp_path / "cache"), "--data", str(corpus)]
    base, lora = tmp_path / "base", tmp_path / "lora"
    assert main(["train", "--model", "gpt-tiny", "--steps", "2", "--out", str(base), *steps]) == 0
    assert main(["finetune", "--from", str(base), "--lora-rank", "4", "--lora-targets", "qkv,proj", "--steps", "2",
                 "--lr", "3e-2", "--warmup-steps", "1", "--out", str(lora), *steps]) == 0
    saved = exported_adapter(lora)
    assert continue_from(base, lora.parent / "lora-peft", tmp_path / "run", corpus.read_text()) == 0
    capsys.readouterr()
    assert finetune_settings(tmp_path / "run")["lora_targets"] == '"c_attn,c_proj"'
    back = exported_adapter(tmp_path / "run")
    assert back.keys() == saved.keys() and all(torch.equal(back[key], saved[key]) for key in saved)


@pytest.fixture(scope="module")
def llama_adapter(tmp_path_factory) -> tuple[Path, Path]:
    """A Llama folder and a peft adapter over it (q, k, v, gate, up: --lora-targets qkv,fc)."""
    tmp = tmp_path_factory.mktemp("adapter")
    base = make_folder(tmp / "base", "llama")
    peft_adapter(base, tmp / "adapter", target_modules=LLAMA_GROUPS)
    return base, tmp / "adapter"


@pytest.mark.parametrize("flags", [
    ["--quantize", "nf4"],
    ["--nproc", "2", "--zero", "3", "--quantize", "nf4"],
    # the same path with the adapter split or staged (about 8 s each): pytest -m slow tests/test_finetune_adapter.py
    pytest.param(["--nproc", "2", "--zero", "1"], marks=pytest.mark.slow),
    pytest.param(["--nproc", "2", "--tp", "2", "--sp"], marks=pytest.mark.slow),
    pytest.param(["--nproc", "2", "--pp", "2", "--microbatches", "2"], marks=pytest.mark.slow),
], ids=["qlora", "qlora-zero3", "dp-zero1", "tp2-sp", "pp2"])
def test_every_layout_starts_from_the_adapter(llama_adapter, tmp_path, capsys, flags):
    """A PEFT folder continued into a layout (its adapters sharded, split or staged) exports as it was read."""
    base, adapter = llama_adapter
    assert continue_from(base, adapter, tmp_path / "run", PROSE, *flags) == 0
    saved, back = load_file(adapter / "adapter_model.safetensors"), exported_adapter(tmp_path / "run")
    assert back.keys() == saved.keys() and all(torch.equal(back[key], saved[key]) for key in saved)


def _config(**changes):
    def change(folder: Path) -> None:
        path = folder / "adapter_config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
    return change


def _tensors(change_of):
    def change(folder: Path) -> None:
        path = folder / "adapter_model.safetensors"
        save_file(change_of(load_file(path)), path)
    return change


def _without(name):
    return lambda folder: (folder / name).unlink()


Q = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"


@pytest.mark.parametrize("change,flags,said", [
    (_without("adapter_config.json"), [], "holds no adapter_config.json"),
    (_without("adapter_model.safetensors"), [], "holds no adapter_model.safetensors"),
    (_config(peft_type="LOHA"), [], "gives peft_type 'LOHA'; --adapter continues a LoRA adapter"),
    (_config(use_dora=True), [], "sets use_dora (DoRA's magnitude vectors)"),
    (_config(use_rslora=True), [], "sets use_rslora (rsLoRA's scaling alpha / sqrt(r))"),
    (_config(rank_pattern={"q_proj": 8}), [], "sets rank_pattern {'q_proj': 8}"),
    (_config(modules_to_save=["norm"]), [], "sets modules_to_save ['norm'], which trains model.norm whole, where "
                                            "scaletrain trains whole only the token embedding and the head"),
    (_config(modules_to_save=["lm_head"]), [], "lacks base_model.model.lm_head.weight"),
    (_config(bias="all"), [], "sets bias 'all'"),
    (_config(init_lora_weights="pissa"), [], "gives init_lora_weights 'pissa'"),
    (_config(fan_in_fan_out=True), [], "sets fan_in_fan_out true, but the base does not store"),
    (_config(target_modules=r"model\.layers\.0\..*_proj"), [],
     "adapts part of a kind of layer (it leaves out model.layers.1.self_attn.q_proj, model.layers.1.self_attn.k_proj "
     "and 5 more), where scaletrain adapts each kind in every block (q_proj, k_proj, v_proj, o_proj, gate_proj, "
     "up_proj, down_proj)"),
    (_config(target_modules=[*LLAMA_GROUPS, "embed_tokens"]), [],
     "adapts embed_tokens, which is no layer scaletrain's LoRA adapts in this base"),
    (_config(target_modules=["c_attn"]), [], "match no module of the base; the adapter was made for another"),
    (_config(target_modules="(q_proj"), [], "which is no regular expression"),
    (_config(target_modules=[*LLAMA_GROUPS, "o_proj", "down_proj"]), [],
     "lacks base_model.model.model.layers.0.mlp.down_proj.lora_A.weight"),
    (_tensors(lambda saved: {**saved, Q: saved[Q][:, :32].clone()}), [],
     f"holds {Q} of shape [4, 32], where the base's model.layers.0.self_attn.q_proj takes [4, 64] at r 4"),
    (_tensors(lambda saved: {**saved, "base_model.model.lm_head.lora_A.weight": saved[Q].clone()}), [],
     "holds tensors of no module it adapts, such as base_model.model.lm_head.lora_A.weight"),
    (None, ["--lora-rank", "8"], "which sets it to 4; drop --lora-rank."),
    (None, ["--lora-alpha", "32"], "--lora-alpha 32.0 contradicts"),
    (None, ["--lora-alpha", "8", "--lora-rank", "4", "--lora-targets", "fc,qkv", "--quantize", "nf4", "--tp", "2"],
     "--quantize nf4 does not combine with --tp"),  # flags that agree pass, and the adapter's layout is checked
    (None, ["--lora-targets", "qkv"], "--lora-targets qkv contradicts the adapter in"),
    (None, ["--lora-modules-to-save", "head"], "--lora-modules-to-save head contradicts the adapter in"),
])
def test_what_the_run_cannot_continue_is_one_sentence_before_anything_is_written(
        llama_adapter, tmp_path, capsys, change, flags, said):
    base, made = llama_adapter
    adapter = Path(shutil.copytree(made, tmp_path / "adapter"))
    if change:
        change(adapter)
    assert continue_from(base, adapter, tmp_path / "run", PROSE, *flags) == 2
    err = capsys.readouterr().err
    assert said in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "run").exists()


def test_an_adapter_without_a_base_is_one_sentence(llama_adapter, tiny_cfg, tmp_path, capsys):
    assert main(["train", "--model", "llama-tiny", "--data", tiny_cfg.data.data, "--adapter", str(llama_adapter[1]),
                 "--out", str(tmp_path / "run"), *STILL]) == 2
    err = capsys.readouterr().err
    assert "add --from with that base" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists()
