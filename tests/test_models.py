import math

import torch

from scaletrain.config import ModelConfig
from scaletrain.models import GPT, GPTConfig, MLPClassifier, build_model
from scaletrain.optim import decay_groups, lr_at


def _gpt(**kw) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=50, seq_len=16, n_layers=2, n_heads=4, d_model=32, **kw))


def test_gpt_shapes_and_tied_head():
    model = _gpt()
    logits = model(torch.randint(0, 50, (3, 16)))
    assert logits.shape == (3, 16, 50)
    assert model.head.weight is model.tok_emb.weight


def test_gpt_is_causal():
    model = _gpt().eval()
    x = torch.randint(0, 50, (1, 16))
    y = x.clone()
    y[0, 10:] = (y[0, 10:] + 1) % 50
    assert torch.equal(model(x)[0, :10], model(y)[0, :10])
    assert not torch.allclose(model(x)[0, 10:], model(y)[0, 10:])


def test_gpt_learns_a_fixed_batch():
    model = _gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    x = torch.randint(0, 50, (4, 16))
    losses = []
    for _ in range(30):
        loss = torch.nn.functional.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[0] > math.log(50) - 0.5 and losses[-1] < losses[0] / 2
    assert all(p.grad is None for p in model.parameters())


def test_flops_formula_counts_matmul_weights_once():
    model = _gpt()
    c = model.cfg
    per_block = 3 * c.d_model**2 + c.d_model**2 + 2 * 4 * c.d_model**2
    expected = 6 * (c.n_layers * per_block + c.vocab_size * c.d_model) + 12 * c.n_layers * c.d_model * c.seq_len
    assert model.flops_per_token() == expected


def test_presets_and_overrides():
    model = build_model(ModelConfig(name="gpt-small", n_layers=1), vocab_size=256, seq_len=8)
    assert len(model.blocks) == 1 and model.cfg.d_model == 256
    mlp = build_model(ModelConfig(name="mlp", mlp_hidden=16), vocab_size=0, seq_len=0, n_features=64,
                      n_classes=10)
    assert isinstance(mlp, MLPClassifier) and mlp(torch.zeros(2, 64)).shape == (2, 10)


def test_weight_decay_only_on_matrices_and_tied_weight_once():
    model = _gpt()
    decay, no_decay = decay_groups(model, 0.1)
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() < 2 for p in no_decay["params"])
    ids = [id(p) for g in (decay, no_decay) for p in g["params"]]
    assert len(ids) == len(set(ids)) == len(list(model.parameters()))


def test_lr_schedule_warmup_then_cosine_to_floor():
    kw = dict(peak=1.0, warmup=10, total=110, min_ratio=0.1)
    warm = [lr_at(t, **kw) for t in range(10)]
    assert warm == [(t + 1) / 10 for t in range(10)]
    assert lr_at(10, **kw) == 1.0
    assert lr_at(60, **kw) == 0.55  # halfway through the cosine: (peak + floor) / 2
    assert abs(lr_at(110, **kw) - 0.1) < 1e-12 and abs(lr_at(500, **kw) - 0.1) < 1e-12
    decay = [lr_at(t, **kw) for t in range(10, 111)]
    assert all(a >= b for a, b in zip(decay, decay[1:]))


def test_a_padded_vocabulary_is_never_sampled():
    """--vocab-multiple 64: 100 ids take 128 rows of embedding and head; the 28 extra
    rows' logits are left out of sampling even when they are the largest."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=100, seq_len=16, n_layers=1, n_heads=2, d_model=32, vocab_multiple=64))
    assert model.tok_emb.weight.shape == (128, 32) and model.head.weight is model.tok_emb.weight
    with torch.no_grad():
        model.tok_emb.weight[100:] = 10.0  # padded rows: the largest logits by far
    out = model.generate(torch.zeros(2, 4, dtype=torch.long), 20, generator=torch.Generator().manual_seed(1))
    assert out.shape == (2, 24) and int(out.max()) < 100


def test_a_padded_vocabulary_trains_over_tensor_parallel_ranks(tiny_cfg):
    from scaletrain.commands.parity import run_parity

    report = run_parity(tiny_cfg.replace(nproc=2, tp=2, vocab_multiple=64, steps=3), tolerance=1e-5)
    assert report.passed, report.to_json()
