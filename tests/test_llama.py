"""The Llama family computes what transformers' Llama, Qwen2 and Mistral compute, and its spec reads
and writes their config.json files.

Random models built by transformers in several shapes (grouped-query, multi-query and
multi-head attention; tied and untied heads; Qwen2's q, k, v biases; Llama 3.1's rope
scaling; another rope_theta; Mistral's window) give their weights, under the names of
``LLAMA_SPEC.hf.names``, to our Llama, configured from ``config_from_hf`` of their
config: the logits agree within relative 1e-5 in fp32.
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import pytest
import torch

from scaletrain.config import ModelConfig
from scaletrain.errors import UserError
from scaletrain.models.llama import Llama, LlamaConfig, RotaryEmbedding
from scaletrain.models.llama_spec import LLAMA_SPEC
from scaletrain.models.moe import Expert, MoEConfig

WHERE = Path("folder/config.json")
SEQ = 16
VOCAB = 96


@pytest.fixture(scope="module")
def transformers():
    return pytest.importorskip("transformers", reason="comparing with transformers' Llama needs transformers")


def model_cfg(**values) -> ModelConfig:
    return dataclasses.replace(ModelConfig(), **values)


def family_cfg(hf_config: dict, seq_len: int = SEQ) -> LlamaConfig:
    values = LLAMA_SPEC.hf.config_from_hf(hf_config, WHERE)
    return LLAMA_SPEC.configure(model_cfg(**values), values["n_vocab"], seq_len)


def ours_from(hf_model, cfg: LlamaConfig) -> Llama:
    """Our Llama holding ``hf_model``'s weights, mapped by the spec's names."""
    theirs = hf_model.state_dict()
    names = LLAMA_SPEC.hf.names(cfg)
    assert set(theirs) - set(names) == {copy for copy, _ in LLAMA_SPEC.hf.tied(cfg)}
    tensors = {our: theirs[name] for name, (our, transposed) in names.items() if not transposed}
    if cfg.tie_embeddings:
        tensors["head.weight"] = tensors["tok_emb.weight"]
    model = Llama(cfg)
    model.load_state_dict(tensors, strict=True)
    return model.eval()


def randomize(hf_model) -> None:
    """Norm weights and biases away from their ones and zeros, so that each one counts."""
    with torch.no_grad():
        for name, param in hf_model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                param.normal_(std=0.1)


def relative_error(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return ((ours - theirs).norm() / theirs.norm()).item()


SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
             max_position_embeddings=64, rms_norm_eps=1e-5)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32}  # short: wavelengths on both sides of the blend
SHAPES = {
    "llama-gqa-untied": ("LlamaForCausalLM", "LlamaConfig", dict(num_key_value_heads=2)),
    "llama-mqa-tied-theta": ("LlamaForCausalLM", "LlamaConfig",
                             dict(num_key_value_heads=1, tie_word_embeddings=True, rope_theta=500000.0)),
    "llama-mha-llama3-rope": ("LlamaForCausalLM", "LlamaConfig",
                              dict(num_key_value_heads=4, rope_theta=50000.0, rope_scaling=LLAMA3)),
    "qwen2-biases-tied": ("Qwen2ForCausalLM", "Qwen2Config",
                          dict(num_key_value_heads=2, tie_word_embeddings=True, rope_theta=1000000.0)),
    "mistral-window": ("MistralForCausalLM", "MistralConfig", dict(num_key_value_heads=2, sliding_window=32)),
}


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
@pytest.mark.parametrize("shape", SHAPES)
def test_logits_equal_transformers(transformers, shape, attention):
    model_class, config_class, changes = SHAPES[shape]
    changes = copy.deepcopy(changes)  # transformers writes rope_theta into the rope_scaling dict it is given
    torch.manual_seed(0)
    hf_model = getattr(transformers, model_class)(getattr(transformers, config_class)(
        **SMALL, **changes, attn_implementation=attention)).eval()
    randomize(hf_model)
    cfg = family_cfg(hf_model.config.to_dict())
    assert (cfg.n_kv_heads, cfg.tie_embeddings) == (changes["num_key_value_heads"],
                                                   changes.get("tie_word_embeddings", False))
    assert cfg.bias == (model_class == "Qwen2ForCausalLM")
    model = ours_from(hf_model, cfg)
    idx = torch.randint(VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert relative_error(model(idx), hf_model(idx).logits) < 1e-5


def test_rope_frequencies_follow_the_llama3_formula():
    rope = RotaryEmbedding(16, 50000.0, (8.0, 1.0, 4.0, 32))
    plain = RotaryEmbedding(16, 50000.0).inv_freq(torch.device("cpu"))
    scaled = rope.inv_freq(torch.device("cpu"))
    wavelength = 2 * torch.pi / plain
    assert torch.equal(scaled[wavelength < 8], plain[wavelength < 8])  # shorter than 32 / 4: kept
    assert torch.allclose(scaled[wavelength > 32], plain[wavelength > 32] / 8)  # longer than 32 / 1: / factor
    between = (wavelength >= 8) & (wavelength <= 32)
    assert between.any() and (scaled[between] < plain[between]).all() and (scaled[between] > plain[between] / 8).all()
    assert list(rope.parameters()) == [] and list(rope.buffers()) == []


def test_exported_config_builds_the_same_model_in_transformers(transformers):
    for changes in (dict(), dict(tie_embeddings=True, bias=True), dict(sliding_window=SEQ),
                    dict(rope_scaling="8,1,4,32", rope_theta=50000.0, n_kv_heads=1)):
        cfg = LLAMA_SPEC.configure(model_cfg(name="llama-tiny", **changes), VOCAB, SEQ)
        hf_config = LLAMA_SPEC.hf.config_to_hf(cfg)
        assert family_cfg(hf_config) == dataclasses.replace(cfg, n_positions=cfg.positions), changes
        model_type = hf_config.pop("model_type")
        hf_model = transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.for_model(model_type, **hf_config), attn_implementation="eager").eval()
        torch.manual_seed(0)
        ours = Llama(cfg).eval()
        theirs = hf_model.state_dict()
        names = LLAMA_SPEC.hf.names(cfg)
        assert set(theirs) - set(names) == {copy for copy, _ in LLAMA_SPEC.hf.tied(cfg)}
        assert {name: tuple(theirs[name].shape) for name in names} == {
            name: tuple(ours.state_dict()[our].shape) for name, (our, _) in names.items()}
        # Our weights in their model: the same logits.
        with torch.no_grad():
            for name, (our, _) in names.items():
                theirs[name].copy_(ours.state_dict()[our] + (0.1 * torch.randn_like(theirs[name])
                                                             if our.endswith(".bias") else 0))
        ours.load_state_dict({our: theirs[name] for name, (our, _) in names.items()}, strict=False)
        idx = torch.randint(VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            assert relative_error(ours(idx), hf_model(idx).logits) < 1e-5, changes


def test_presets_keep_the_released_sizes():
    cfg = LLAMA_SPEC.configure(model_cfg(name="llama3-8b"), 256, 128)
    assert (cfg.vocab_size, cfg.n_kv_heads, cfg.ffn_hidden, cfg.positions) == (128256, 8, 14336, 131072)
    assert cfg.rope_scaling == (8.0, 1.0, 4.0, 8192) and cfg.rope_theta == 500000.0
    smol = LLAMA_SPEC.configure(model_cfg(name="smollm-135m"), 256, 128)
    with torch.device("meta"):
        params = sum(p.numel() for p in Llama(smol).parameters())
    assert 134e6 < params < 135e6 and smol.tie_embeddings  # SmolLM-135M's 134,515,008
    # A resized preset keeps SwiGLU's 8/3 width, in multiples of 16.
    assert LLAMA_SPEC.configure(model_cfg(name="llama-tiny", d_model=96), 256, 32).ffn_hidden == 256


def _folder(**changes) -> dict:
    return {"model_type": "llama", **SMALL, "num_key_value_heads": 2, **changes}


@pytest.mark.parametrize("changes, field", [
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope_type"),
    (dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}), "rope_type"),
    (dict(head_dim=32), "head_dim"),
    (dict(attention_bias=True), "attention_bias"),
    (dict(mlp_bias=True), "mlp_bias"),
    (dict(num_key_value_heads=3), "num_key_value_heads"),
    (dict(intermediate_size=0), "intermediate_size"),
    (dict(partial_rotary_factor=0.5), "partial_rotary_factor"),
])
def test_config_from_hf_refuses_in_one_sentence_naming_the_field(changes, field):
    with pytest.raises(UserError, match=field) as caught:
        LLAMA_SPEC.hf.config_from_hf(_folder(**changes), WHERE)
    assert str(WHERE) in str(caught.value) and "\n" not in str(caught.value)


def test_config_from_hf_follows_transformers_defaults():
    assert LLAMA_SPEC.hf.config_from_hf({"model_type": "llama", "num_key_value_heads": None}, WHERE)["n_kv_heads"] == 32
    mistral = LLAMA_SPEC.hf.config_from_hf({"model_type": "mistral"}, WHERE)
    assert (mistral["n_kv_heads"], mistral["sliding_window"], mistral["norm_eps"]) == (8, 4096, 1e-6)
    qwen2 = LLAMA_SPEC.hf.config_from_hf({"model_type": "qwen2", "sliding_window": 128}, WHERE)
    assert qwen2["bias"] and qwen2["sliding_window"] is None  # use_sliding_window is off by default
    old_style = LLAMA_SPEC.hf.config_from_hf(_folder(rope_theta=5e5, rope_scaling={**LLAMA3, "type": "llama3"}), WHERE)
    assert (old_style["rope_theta"], old_style["rope_scaling"]) == (5e5, "8,1,4,32")


def test_check_refuses_a_tp_that_splits_key_value_heads():
    cfg = LLAMA_SPEC.configure(model_cfg(name="llama-tiny"), 256, 32)
    LLAMA_SPEC.check(cfg, 2)
    with pytest.raises(UserError) as caught:
        LLAMA_SPEC.check(cfg, 4)
    assert str(caught.value) == ("--tp 4 splits attention into 4 groups of heads, but the model has 2 key/value "
                                 "heads; choose a --tp that divides 2.")
    with pytest.raises(UserError, match="--n-kv-heads"):
        LLAMA_SPEC.check(LLAMA_SPEC.configure(model_cfg(name="llama-tiny", n_kv_heads=3), 256, 32), 1)
    with pytest.raises(UserError, match="sliding attention window"):
        LLAMA_SPEC.check(LLAMA_SPEC.configure(model_cfg(name="llama-tiny", sliding_window=16), 256, 32), 1)


def test_flops_per_token_is_the_hand_formula():
    vocab, seq = 256, 32
    cfg = LLAMA_SPEC.configure(model_cfg(name="llama-tiny"), vocab, seq)
    d, ffn, layers, kv_width = 64, 176, 2, 2 * 16
    per_layer = d * (d + 2 * kv_width) + d * d + 3 * d * ffn  # q, k, v; proj; gate, up, down
    assert Llama(cfg).flops_per_token() == 6 * (layers * per_layer + d * vocab) + 12 * layers * d * seq


def test_rope_sees_positions_through_its_module():
    """Context parallelism hands each rope module the rank's global positions by a forward
    pre-hook; shifting every position alike leaves relative positions, and the logits, as they were."""
    torch.manual_seed(0)
    model = Llama(LLAMA_SPEC.configure(model_cfg(name="llama-tiny"), 64, SEQ)).eval()
    idx = torch.randint(64, (2, SEQ))
    with torch.no_grad():
        before = model(idx)
        for block in model.blocks:
            block.attn.rope.register_forward_pre_hook(lambda module, args: (args[0] + 7,))
        assert relative_error(model(idx), before) < 1e-5
    assert not any("rope" in name for name in model.state_dict())


@pytest.mark.parametrize("packed", [False, True], ids=["windows", "packed"])
def test_the_rotary_table_is_computed_once_and_read_bit_for_bit(packed):
    """The model's cos and sin table (one per length and device, kept across forwards) gives every block
    exactly the angles each would compute for itself, for plain windows and packed documents, in the
    logits and in every gradient; a sequence past the run's length gets a table of its own, not kept."""
    torch.manual_seed(0)
    model = Llama(LLAMA_SPEC.configure(model_cfg(name="llama-tiny"), 64, SEQ))
    idx = torch.randint(64, (2, SEQ))
    documents = torch.tensor([[0] * 5 + [1] * 11, [0] * 9 + [1] * 7]) if packed else None

    def blocks_computing_their_own(ids: torch.Tensor) -> torch.Tensor:
        x = model.embed(ids, documents)
        for block in model.blocks:
            x = block(x, *(() if documents is None else (documents,)))
        return model.unembed(x)

    results = []
    for forward in (lambda: model(idx, documents=documents), lambda: blocks_computing_their_own(idx)):
        model.zero_grad(set_to_none=True)
        logits = forward()
        logits.square().mean().backward()
        results.append((logits.detach(), [p.grad.clone() for p in model.parameters()]))
    (table_logits, table_grads), (own_logits, own_grads) = results
    assert torch.equal(table_logits, own_logits)
    assert all(torch.equal(a, b) for a, b in zip(table_grads, own_grads))
    first = model.position_table(SEQ, idx.device)
    assert first[0].shape == (SEQ, model.cfg.head_dim) and len(model._tables) == 1
    with torch.no_grad():
        model(idx[:, :5])
    assert model.position_table(SEQ, idx.device) is first and len(model._tables) == 1  # one table, every step
    longer = model.position_table(SEQ + 4, idx.device)
    assert longer[0].shape[0] == SEQ + 4 and len(model._tables) == 1
    assert torch.equal(longer[0][:SEQ], first[0]) and torch.equal(longer[1][:SEQ], first[1])


def _linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.nn.Linear:
    layer = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    layer.weight.data, layer.bias = weight, bias if bias is None else torch.nn.Parameter(bias)
    return layer


def test_attention_reads_its_head_counts_from_the_weights():
    """Tensor parallelism leaves each rank a slice of q, k, v and proj: half the heads of each kind,
    whose partial outputs sum to the whole attention's."""
    torch.manual_seed(0)
    cfg = LLAMA_SPEC.configure(model_cfg(name="llama-tiny", bias=True), 64, SEQ)
    attn = Llama(cfg).blocks[0].attn
    x = torch.randn(2, SEQ, cfg.d_model)
    halves = []
    with torch.no_grad():
        for rank in range(2):
            part = copy.deepcopy(attn)
            for name in ("q", "k", "v"):
                whole = getattr(attn, name)
                rows = slice(rank * whole.out_features // 2, (rank + 1) * whole.out_features // 2)
                setattr(part, name, _linear(whole.weight[rows], torch.randn(whole.out_features)[rows]))
                whole.bias[rows] = getattr(part, name).bias
            cols = slice(rank * attn.proj.in_features // 2, (rank + 1) * attn.proj.in_features // 2)
            part.proj = _linear(attn.proj.weight[:, cols])
            halves.append(part(x))
        assert relative_error(halves[0] + halves[1], attn(x)) < 1e-5


def test_mixtral_style_experts_train():
    torch.manual_seed(0)
    cfg = LLAMA_SPEC.configure(model_cfg(name="llama-tiny", moe_experts=4, moe_top_k=2), 64, SEQ)
    assert cfg.moe.activation == "swiglu" and cfg.moe.hidden == 176 // 2
    model = Llama(cfg)
    expert = model.blocks[0].moe.experts[0]
    assert sorted(name for name, _ in expert.named_children()) == ["gate", "proj", "up"]
    idx = torch.randint(64, (2, SEQ))
    logits = model(idx)
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), idx.flatten()).add(
        model.blocks[0].moe.aux_loss).backward()
    used = [e for e in model.blocks[0].moe.experts if e.gate.weight.grad is not None]
    assert used and all(e.up.weight.grad.abs().sum() > 0 for e in used)
    assert model.blocks[0].moe.router.weight.grad.abs().sum() > 0
    shared = 6 * sum(p.numel() for n, p in model.named_parameters()
                     if p.dim() == 2 and ".experts." not in n and n != "tok_emb.weight")  # the lookup is free
    active = 6 * sum(p.numel() for n, p in model.named_parameters() if ".experts." in n) * 2 / 4
    assert model.flops_per_token() == shared + active + 12 * 2 * 64 * SEQ


def test_gelu_experts_are_unchanged():
    torch.manual_seed(0)
    expert = Expert(8, 16)
    assert [name for name, _ in expert.named_parameters()] == ["fc.weight", "proj.weight"]
    x = torch.randn(3, 8)
    want = expert.proj(torch.nn.functional.gelu(expert.fc(x), approximate="tanh"))
    assert torch.equal(expert(x), want) and MoEConfig(experts=2, top_k=1, hidden=4).activation == "gelu"
