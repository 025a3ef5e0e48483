"""Released GPT-2 weights and `scaletrain generate`: a Hugging Face folder computes
the same logits in our GPT as in transformers, its tokenizer round-trips, and
generate writes text from such a folder and from our own checkpoints; every
mistake is one sentence.

Folders are made here, never downloaded: by transformers' save_pretrained
where transformers is installed, and by hand (our GPT's weights under GPT-2's
names) for the tests that need only our code.
"""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch
from safetensors.torch import save_file
from tokenizers import ByteLevelBPETokenizer

from scaletrain.commands.cli import main
from scaletrain.finetune.hf import is_hf_folder, load_hf_tokenizer
from scaletrain.finetune.sliced import load_hf_model
from scaletrain.models import GPT, GPTConfig
from scaletrain.models.gpt_spec import GPT_SPEC
from scaletrain.commands.train import execute, prepare_run
from tests.conftest import run_cli

VOCAB = 300
SMALL = GPTConfig(vocab_size=VOCAB, seq_len=32, n_layers=2, n_heads=4, d_model=32, bias=True)
TEXT = "".join(f"def function_{i}(x):\n    return x * {i} + {i % 7}  # line {i}\n" for i in range(200))


def random_gpt(cfg: GPTConfig = SMALL) -> GPT:
    """A GPT whose biases and norms are not at their initial 0 and 1, so that a
    transposed or misplaced tensor changes the logits."""
    torch.manual_seed(0)
    model = GPT(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    return model.eval()


def gpt2_tensors(model: GPT) -> dict[str, torch.Tensor]:
    """The model's weights under GPT-2's names and layout, as the Hub's files hold them."""
    ours = model.state_dict()
    return {name.removeprefix("transformer."): (ours[our_name].t() if transposed else ours[our_name]).contiguous().clone()
            for name, (our_name, transposed) in GPT_SPEC.hf.names(model.cfg).items()}


def gpt2_config(cfg: GPTConfig = SMALL, **changes) -> dict:
    return {"model_type": "gpt2", "n_layer": cfg.n_layers, "n_head": cfg.n_heads, "n_embd": cfg.d_model,
            "n_positions": cfg.seq_len, "vocab_size": cfg.vocab_size, "activation_function": "gelu_new",
            "layer_norm_epsilon": 1e-5, **changes}


def write_folder(folder, tensors, config, weights="model.safetensors"):
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    if weights.endswith(".safetensors"):
        save_file(tensors, folder / weights)
    else:
        torch.save(tensors, folder / weights)
    return folder


def train_tokenizer() -> ByteLevelBPETokenizer:
    tokenizer = ByteLevelBPETokenizer()
    tokenizer.train_from_iterator([TEXT], vocab_size=VOCAB, min_frequency=2, show_progress=False)
    return tokenizer


@pytest.fixture
def gpt2_folder(tmp_path):
    """A hand-made GPT-2 folder with a vocab.json/merges.txt tokenizer: (folder, the model it holds)."""
    model = random_gpt()
    folder = write_folder(tmp_path / "gpt2", gpt2_tensors(model), gpt2_config())
    train_tokenizer().save_model(str(folder))
    return folder, model


@pytest.fixture
def transformers():
    return pytest.importorskip("transformers", reason="comparing with transformers' GPT-2 needs transformers "
                                                      "installed (the dev extra)")


def test_bias_gives_the_four_block_linears_zero_biases_and_the_default_has_none():
    plain = set(GPT(GPTConfig(vocab_size=50, seq_len=8, n_layers=1, n_heads=2, d_model=8)).state_dict())
    biased = GPT(GPTConfig(vocab_size=50, seq_len=8, n_layers=1, n_heads=2, d_model=8, bias=True))
    added = {name: t for name, t in biased.state_dict().items() if name not in plain}
    assert sorted(added) == [f"blocks.0.{part}.bias" for part in ("attn.proj", "attn.qkv", "mlp.fc", "mlp.proj")]
    assert all(not t.any() for t in added.values())


@pytest.mark.parametrize("weights", ["model.safetensors", "pytorch_model.bin"])
def test_a_gpt2_folder_loads_as_the_same_function(tmp_path, weights):
    model = random_gpt()
    # save_pretrained of GPT2LMHeadModel prefixes "transformer." and may keep the tied head and the mask buffer.
    tensors = {f"transformer.{name}": t for name, t in gpt2_tensors(model).items()}
    tensors["lm_head.weight"] = tensors["transformer.wte.weight"].clone()
    tensors["transformer.h.0.attn.bias"] = torch.tril(torch.ones(1, 1, SMALL.seq_len, SMALL.seq_len))
    folder = write_folder(tmp_path / "gpt2", tensors, gpt2_config(), weights)
    loaded, cfg = load_hf_model(folder)
    assert is_hf_folder(folder) and cfg == dataclasses.replace(SMALL, n_positions=SMALL.seq_len) and not loaded.training
    ids = torch.randint(0, VOCAB, (2, SMALL.seq_len))
    assert torch.equal(loaded(ids), model(ids))
    assert loaded.head.weight is loaded.tok_emb.weight


@pytest.mark.parametrize("saved_as", ["vocab.json+merges.txt", "tokenizer.json"])
def test_the_folder_tokenizer_matches_the_library_and_round_trips(tmp_path, saved_as):
    trained = train_tokenizer()
    if saved_as == "tokenizer.json":
        trained.save(str(tmp_path / "tokenizer.json"))
    else:
        trained.save_model(str(tmp_path))
    tokenizer = load_hf_tokenizer(tmp_path)
    text = "def function_7(x):\n    return  x * 7 é\n"
    assert tokenizer.encode(text).tolist() == trained.encode(text).ids
    assert tokenizer.decode(tokenizer.encode(text)) == text
    assert tokenizer.vocab_size == trained.get_vocab_size()


def test_logits_equal_transformers_gpt2(tmp_path, transformers):
    torch.manual_seed(0)
    # No bos/eos ids: GPT-2's own (50256) lie outside this vocabulary, and greedy decoding must not stop early.
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_head=4, n_embd=64, n_positions=64,
                                                               vocab_size=VOCAB, bos_token_id=None,
                                                               eos_token_id=None))
    with torch.no_grad():  # biases and norms off their initial 0 and 1
        for p in hf.parameters():
            p.add_(0.02 * torch.randn_like(p))
    hf.eval().save_pretrained(tmp_path, safe_serialization=True)
    ours, cfg = load_hf_model(tmp_path)
    assert (cfg.n_layers, cfg.n_heads, cfg.d_model, cfg.seq_len, cfg.vocab_size) == (2, 4, 64, 64, VOCAB)
    ids = torch.randint(0, VOCAB, (3, 64))
    with torch.no_grad():
        expected = hf(ids).logits
    torch.testing.assert_close(ours(ids), expected, rtol=0, atol=1e-5)
    greedy = hf.generate(ids[:1, :8], attention_mask=torch.ones(1, 8, dtype=torch.long), max_new_tokens=12,
                         do_sample=False, pad_token_id=0)
    assert torch.equal(ours.generate(ids[:1, :8], 12, temperature=0), greedy)


def test_generate_from_a_gpt2_folder(gpt2_folder):
    folder, _ = gpt2_folder
    result = run_cli("generate", "--from", str(folder), "--prompt", "def", "--tokens", "20")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("def") and len(result.stdout) > len("def\n")


def test_the_same_seed_gives_the_same_text(gpt2_folder, capsys):
    folder, _ = gpt2_folder
    texts = []
    for seed in ("1", "1", "2"):
        assert main(["generate", "--from", str(folder), "--prompt", "def f", "--tokens", "30", "--seed", seed]) == 0
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1] != texts[2]


@pytest.mark.parametrize("tokenizer", ["byte", "bpe"])
def test_generate_from_our_own_checkpoint(tiny_cfg, capsys, tokenizer):
    cfg = tiny_cfg.replace(steps=2, tokenizer=tokenizer, vocab_size=VOCAB)
    run_dir = execute(*prepare_run(cfg)).run_dir
    capsys.readouterr()  # the run's own lines
    for source in (run_dir, run_dir / "checkpoints" / "step_000002"):
        assert main(["generate", "--from", str(source), "--prompt", "def ", "--tokens", "10"]) == 0
        assert capsys.readouterr().out.startswith("def ")


def test_a_bpe_run_generates_from_its_saved_tokenizer_and_an_older_run_without_it_is_one_sentence(
        tiny_cfg, tmp_path, capsys):
    cfg = tiny_cfg.replace(steps=2, tokenizer="bpe", vocab_size=VOCAB)
    run_dir = execute(*prepare_run(cfg)).run_dir
    shutil.rmtree(tmp_path / "cache")  # the run folder's tokenizer.json is enough
    capsys.readouterr()  # the run's own lines
    assert main(["generate", "--from", str(run_dir), "--prompt", "def", "--temperature", "0"]) == 0
    assert capsys.readouterr().out.startswith("def")
    (run_dir / "tokenizer.json").unlink()  # as runs saved before that file: the cache was their only copy
    assert main(["generate", "--from", str(run_dir), "--prompt", "def"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "is not in its cache" in err, err


def _folder_mistake(change_tensors=None, tokenizer=True, **config):
    """A hand-made GPT-2 folder with its tensors, config.json or tokenizer changed."""
    def make(tmp):
        tensors = gpt2_tensors(random_gpt())
        if change_tensors:
            change_tensors(tensors)
        folder = write_folder(tmp / "gpt2", tensors, gpt2_config(**config))
        if tokenizer:
            train_tokenizer().save_model(str(folder))
        return folder
    return make


def _overwritten(name, content):
    """A hand-made GPT-2 folder with one of its files replaced by ``content``."""
    def make(tmp):
        folder = _folder_mistake()(tmp)
        (folder / name).write_bytes(content)
        return folder
    return make


def _empty(tmp):
    (tmp / "empty").mkdir()
    return tmp / "empty"


MISTAKES = {
    "missing folder": (lambda tmp: tmp / "no-such-folder", "does not exist"),
    "folder without config.json": (_empty, "is neither a Hugging Face model folder (it has no config.json)"),
    "another activation": (_folder_mistake(activation_function="relu"), "names activation_function 'relu'"),
    "another model type": (_folder_mistake(model_type="falcon"), "gives model_type 'falcon'"),
    "heads not dividing": (_folder_mistake(n_head=5), "n_head 5 does not divide"),
    "missing tensor": (_folder_mistake(lambda t: t.pop("h.1.mlp.c_fc.bias")),
                       "lacks the weight transformer.h.1.mlp.c_fc.bias"),
    "unexpected tensor": (_folder_mistake(lambda t: t.update({"h.2.ln_1.weight": torch.ones(32)})),
                          "holds h.2.ln_1.weight, which is no weight"),
    "untransposed tensor": (_folder_mistake(lambda t: t.update({"h.0.mlp.c_fc.weight": torch.zeros(128, 32)})),
                            "h.0.mlp.c_fc.weight of shape [128, 32], but its config.json's sizes give [32, 128]"),
    "config not JSON": (_overwritten("config.json", b"{n_layer: 2"), "config.json cannot be read as JSON"),
    "damaged weights": (_overwritten("model.safetensors", b"not a safetensors file"),
                        "model.safetensors cannot be read"),
    "damaged tokenizer": (_overwritten("vocab.json", b"not JSON"), "cannot be read"),
    "no tokenizer": (_folder_mistake(tokenizer=False),
                     "holds no tokenizer (tokenizer.json, or vocab.json with merges.txt)"),
    "bad temperature": (lambda tmp: tmp, "--temperature must be 0"),
}


@pytest.mark.parametrize("mistake", MISTAKES)
def test_mistakes_are_one_sentence(tmp_path, capsys, mistake):
    make, phrase = MISTAKES[mistake]
    extra = ["--temperature", "-1"] if mistake == "bad temperature" else []
    assert main(["generate", "--from", str(make(tmp_path)), "--prompt", "def", *extra]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and phrase in err, err


def test_a_mistake_shows_no_traceback_to_a_user(tmp_path):
    result = run_cli("generate", "--from", str(tmp_path / "nowhere"), "--prompt", "def")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
