"""The mixture-of-experts layer (routing, capacity, auxiliary losses, statistics) and
expert parallelism over real gloo process groups of 2 and 4 ranks: outputs, gradients
and the all-to-all bytes against the single-device layer."""

from __future__ import annotations

import math
from collections import Counter
from functools import cache

import pytest
import torch
import torch.nn.functional as F

from scaletrain.models.gpt import GPT, GPTConfig
from scaletrain.models.moe import (
    MoE,
    MoEConfig,
    auxiliary_loss,
    dropped_counts,
    expert_token_counts,
    moe_layers,
)
from scaletrain.parallel.experts import parallelize_experts
from scaletrain.runtime import Comm, Mesh, ParallelDims
from tests.distributed import run_distributed

# d_model, sequence length, sequences in a batch, experts
D, S, B, E = 16, 8, 4, 4


def _layer(**changes) -> MoE:
    torch.manual_seed(0)
    return MoE(D, MoEConfig(**{"experts": E, "top_k": 2, "hidden": 32, **changes}))


def _tokens(sequences: int = B) -> torch.Tensor:
    return torch.randn(sequences, S, D, generator=torch.Generator().manual_seed(1))


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).norm() / want.norm()).item()


# -- routing --------------------------------------------------------------------------


def test_router_takes_the_top_k_and_renormalizes_their_gates():
    x = _tokens()
    layer = _layer()
    routing = layer.route(x)
    probs = (x @ layer.router.weight.detach().T).softmax(-1)
    top, experts = probs.topk(2, dim=-1)
    assert torch.equal(routing.experts, experts)
    assert torch.allclose(routing.gates, top / top.sum(-1, keepdim=True))
    assert torch.allclose(routing.gates.sum(-1), torch.ones(B, S))
    # k = 1: the raw probability, as Switch.
    switch = _layer(top_k=1).route(x)
    assert torch.allclose(switch.gates[..., 0], probs.max(-1).values)

    # The output is the gate-weighted sum of the chosen experts.
    with torch.no_grad():
        y = layer(x)
        token = x[1, 3]
        want = sum(gate * layer.experts[e](token) for gate, e in
                   zip(routing.gates[1, 3], routing.experts[1, 3].tolist(), strict=True))
    assert torch.allclose(y[1, 3], want, atol=1e-7)


def _hand_routed() -> tuple[MoE, torch.Tensor]:
    """Two experts, both chosen by every token; a token [a, b] prefers expert 0 when a > b.
    Capacity 0.5: ceil(0.5 * 4 tokens * 2 / 2) = 2 assignments per expert."""
    torch.manual_seed(0)
    layer = MoE(2, MoEConfig(experts=2, top_k=2, hidden=8, capacity=0.5))
    with torch.no_grad():
        layer.router.weight.copy_(torch.eye(2))
    return layer, torch.tensor([[[2.0, 0.0], [1.0, 0.0], [3.0, 0.0], [0.0, 1.0]]])


def test_capacity_keeps_first_choices_before_second_then_by_position():
    """Expert 0's queue: the first choices of tokens 0, 1, 2, so token 2 is dropped.
    Expert 1's: token 3's first choice, then the second choices of tokens 0, 1, 2 in order:
    token 3 keeps its place although it comes last, and tokens 1 and 2 lose theirs.
    Token 3's second choice finds expert 0 full."""
    layer, x = _hand_routed()
    routing = layer.route(x)
    assert routing.experts[0].tolist() == [[0, 1], [0, 1], [0, 1], [1, 0]]
    assert routing.kept[0].tolist() == [[True, True], [True, False], [False, False], [True, False]]
    layer(x)
    assert layer.tokens_per_expert.tolist() == [2, 2]
    assert layer.dropped.item() == 4


def test_a_fully_dropped_token_gets_exactly_zero():
    """It leaves the block through the residual connection unchanged."""
    layer, x = _hand_routed()
    y = layer(x)
    assert torch.equal(y[0, 2], torch.zeros(2))
    assert (y[0, [0, 1, 3]].abs().sum(-1) > 0).all()


# -- auxiliary losses -----------------------------------------------------------------


def test_balance_loss_is_e_sum_f_p_per_sequence():
    """f counts every choice, dropped or not; P averages the probabilities; per sequence,
    then the mean over sequences. Uniform routing gives exactly 1."""
    x = _tokens()
    layer = _layer(aux_coef=1.0, capacity=0.5)
    layer(x)
    routing = layer.route(x)
    assert not routing.kept.all()
    want = 0.0
    for sequence in range(B):
        chosen = Counter(routing.experts[sequence].flatten().tolist())
        mean_prob = routing.probs[sequence].mean(0)
        want += E * sum(chosen[e] / (S * 2) * mean_prob[e].item() for e in range(E)) / B
    assert layer.aux_loss.item() == pytest.approx(want, rel=1e-6)

    with torch.no_grad():
        layer.router.weight.zero_()
    layer(x)
    assert layer.aux_loss.item() == pytest.approx(1.0, abs=1e-7)


def test_z_loss_is_the_mean_squared_logsumexp():
    x = _tokens()
    layer = _layer(aux_coef=0.0, z_coef=1.0)
    layer(x)
    want = torch.logsumexp(x @ layer.router.weight.detach().T, -1).square().mean()
    assert layer.aux_loss.item() == pytest.approx(want.item(), rel=1e-6)
    with torch.no_grad():
        layer.router.weight.zero_()
    layer(x)
    assert layer.aux_loss.item() == pytest.approx(math.log(E) ** 2, rel=1e-6)


@pytest.mark.parametrize("coefs", [{"aux_coef": 1.0}, {"aux_coef": 0.0, "z_coef": 1.0}], ids=["balance", "z"])
def test_each_auxiliary_loss_trains_the_router_alone(coefs):
    layer = _layer(**coefs)
    layer(_tokens())
    layer.aux_loss.backward()
    assert layer.router.weight.grad.abs().sum() > 0
    assert all(p.grad is None for p in layer.experts.parameters())


@pytest.mark.parametrize("capacity", [None, 0.5], ids=["dropless", "capacity"])
def test_a_sequence_routes_alike_alone_or_in_a_batch(capacity):
    """Routing, capacity and the losses are per sequence: a sequence's output and its
    share of the aux loss and statistics do not depend on its neighbours."""
    x = _tokens()
    layer = _layer(capacity=capacity, z_coef=1e-2)
    y, aux = layer(x), layer.aux_loss
    tokens, dropped = layer.tokens_per_expert, layer.dropped
    alone = []
    for sequence in range(B):
        y_alone = layer(x[sequence:sequence + 1])
        assert torch.allclose(y_alone[0], y[sequence], rtol=1e-5, atol=1e-7)
        alone.append((layer.aux_loss, layer.tokens_per_expert, layer.dropped))
    assert aux.item() == pytest.approx(torch.stack([a for a, _, _ in alone]).mean().item(), rel=1e-6)
    assert torch.equal(tokens, sum(t for _, t, _ in alone))
    assert dropped.item() == sum(d.item() for _, _, d in alone)
    assert (dropped.item() > 0) == (capacity is not None)


def test_statistics_count_kept_and_dropped_assignments():
    x = _tokens()
    layer = _layer(capacity=0.5)
    layer(x)
    routing = layer.route(x)
    assert layer.tokens_per_expert.dtype == layer.dropped.dtype == torch.int64
    assert layer.tokens_per_expert.tolist() == torch.bincount(routing.experts[routing.kept], minlength=E).tolist()
    assert layer.dropped.item() == (~routing.kept).sum().item() > 0
    assert not layer.tokens_per_expert.requires_grad and not layer.dropped.requires_grad


def test_model_helpers_gather_every_layer():
    torch.manual_seed(0)
    moe = MoEConfig(experts=E, top_k=2, hidden=32, capacity=0.5, every=2)
    model = GPT(GPTConfig(vocab_size=32, seq_len=S, n_layers=4, n_heads=2, d_model=D, moe=moe))
    layers = moe_layers(model)
    assert [name for name, module in model.named_modules() if module in layers] == ["blocks.1.moe", "blocks.3.moe"]
    assert auxiliary_loss(model).item() == 0.0
    model(torch.randint(0, 32, (B, S), generator=torch.Generator().manual_seed(2)))
    assert auxiliary_loss(model).item() == pytest.approx(sum(layer.aux_loss.item() for layer in layers))
    counts, dropped = expert_token_counts(model), dropped_counts(model)
    assert counts.shape == (2, E) and dropped.shape == (2,)
    assert (counts.sum(1) + dropped).tolist() == [B * S * 2] * 2

    dense = GPT(GPTConfig(vocab_size=32, seq_len=S, n_layers=1, n_heads=2, d_model=D))
    assert auxiliary_loss(dense).item() == 0.0
    assert expert_token_counts(dense).shape == (0, 0)


def test_a_recomputed_forward_keeps_the_first_forwards_loss_and_counts():
    """Under full recompute each MoE block's forward runs again in backward: the checkpoint still
    finds the tensors the first forward saved, and the layer keeps that forward's loss and counts
    (a second graph kept by the layer would hold the recomputed block alive until the step ends)."""
    from scaletrain.techniques.recompute import apply_recompute

    torch.manual_seed(0)
    moe = MoEConfig(experts=E, top_k=2, hidden=32, every=1)
    model = GPT(GPTConfig(vocab_size=32, seq_len=S, n_layers=2, n_heads=2, d_model=D, moe=moe))
    apply_recompute(model, "full")
    logits = model(torch.randint(0, 32, (B, S), generator=torch.Generator().manual_seed(2)))
    first = [(layer.aux_loss, layer.tokens_per_expert) for layer in moe_layers(model)]
    (F.cross_entropy(logits.flatten(0, 1), torch.zeros(B * S, dtype=torch.long)) + auxiliary_loss(model)).backward()
    assert all(layer.aux_loss is loss and layer.tokens_per_expert is counts
               for layer, (loss, counts) in zip(moe_layers(model), first))


# -- expert parallelism ------------------------------------------------------------------


def _loss(y: torch.Tensor, weights: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
    """Sums over sequences, never means: each rank's loss is then exactly its share of
    the whole batch's, so the ranks' gradients add up to the single-device ones. The aux
    loss is a mean over the sequences given; times their number it is a sum as well."""
    return (y * weights).sum() + len(y) * aux


def _output_weights() -> torch.Tensor:
    return torch.randn(B, S, D, generator=torch.Generator().manual_seed(3))


def _expert_parallel(rank: int, n: int, capacity: float | None) -> dict:
    layer = _layer(capacity=capacity, z_coef=1e-2)
    comm = Comm()
    parallelize_experts(layer, comm, Mesh.build(ParallelDims(ep=n), rank, n).group("ep"))
    mine = slice(rank * B // n, (rank + 1) * B // n)
    x = _tokens()[mine].requires_grad_()
    before = comm.ledger.snapshot()
    y = layer(x)
    _loss(y, _output_weights()[mine], layer.aux_loss).backward()
    return {"y": y.detach(), "x_grad": x.grad, "tokens": layer.tokens_per_expert,
            "grads": {name: p.grad for name, p in layer.named_parameters()}, "traffic": comm.ledger.since(before)}


@cache
def _expert_parallel_run(n: int, capacity: float | None) -> tuple[MoE, torch.Tensor, torch.Tensor, list[dict]]:
    """The reference layer after its forward and backward, its input and output, and the ranks' results."""
    reference = _layer(capacity=capacity, z_coef=1e-2)
    x = _tokens().requires_grad_()
    y = reference(x)
    _loss(y, _output_weights(), reference.aux_loss).backward()
    return reference, x, y.detach(), run_distributed(_expert_parallel, n, capacity)


@pytest.mark.parametrize("capacity", [None, 0.5], ids=["dropless", "capacity"])
@pytest.mark.parametrize("n", [2, 4])
def test_expert_parallel_layer_matches_one_device(n, capacity):
    """Each rank feeds its own sequences: outputs and input gradients are the reference's
    rows, each rank's expert gradients the reference's for its experts, and the router's
    gradients add up over the ranks to the reference's."""
    reference, x, y, ranks = _expert_parallel_run(n, capacity)
    assert (reference.dropped.item() > 0) == (capacity is not None)
    assert _relative(torch.cat([r["y"] for r in ranks]), y) < 1e-5
    assert _relative(torch.cat([r["x_grad"] for r in ranks]), x.grad) < 1e-5
    want = dict(reference.named_parameters())
    for rank, result in enumerate(ranks):
        experts = {f"experts.{e}.{part}.weight" for e in range(rank * E // n, (rank + 1) * E // n)
                   for part in ("fc", "proj")}
        assert set(result["grads"]) == {"router.weight"} | experts
        for name in experts:
            assert _relative(result["grads"][name], want[name].grad) < 1e-5, (rank, name)
    router = sum(result["grads"]["router.weight"] for result in ranks)
    assert _relative(router, want["router.weight"].grad) < 1e-5


@pytest.mark.parametrize("capacity", [None, 0.5], ids=["dropless", "capacity"])
@pytest.mark.parametrize("n", [2, 4])
def test_expert_parallel_moves_only_the_routed_tokens(n, capacity):
    """Forward and backward: one all-gather of the [n, E] counts, and 4 all-to-alls that
    move the kept assignments' rows, 4 x kept x d_model x 4 bytes over the group. A rank
    sends its own kept rows (dispatch, and the combine's backward) and the rows it
    received (combine, and the dispatch's backward); its wire bytes leave out the rows
    that stay with it."""
    reference, _, _, ranks = _expert_parallel_run(n, capacity)
    row = D * 4
    for rank, result in enumerate(ranks):
        mine = slice(rank * E // n, (rank + 1) * E // n)
        sent = result["tokens"].sum().item()
        received = sum(other["tokens"][mine].sum().item() for other in ranks)
        stays = result["tokens"][mine].sum().item()
        assert result["traffic"] == {
            "all_gather": {"ep": {"calls": 1, "bytes": n * E * 8, "wire_bytes": (n - 1) * E * 8}},
            "all_to_all": {"ep": {"calls": 4, "bytes": 2 * (sent + received) * row,
                                  "wire_bytes": 2 * (sent + received - 2 * stays) * row}},
        }
    total = sum(result["traffic"]["all_to_all"]["ep"]["bytes"] for result in ranks)
    assert total == 4 * reference.tokens_per_expert.sum().item() * row


# -- a GPT with experts ---------------------------------------------------------------------


def _gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=64, seq_len=S, n_layers=2, n_heads=2, d_model=32,
                         moe=MoEConfig(experts=4, top_k=2, hidden=64)))


def _gpt_batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(4)
    return torch.randint(0, 64, (B, S), generator=generator), torch.randint(0, 64, (B, S), generator=generator)


def _gpt_loss(model: GPT, idx: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed cross-entropy plus the sequences' aux losses: a sum over sequences (see `_loss`)."""
    logits = model(idx)
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum") + len(idx) * auxiliary_loss(model)
    return logits, loss


def _gpt_expert_parallel(rank: int, n: int) -> dict:
    model = _gpt()
    ep = parallelize_experts(model, Comm(), Mesh.build(ParallelDims(ep=n), rank, n).group("ep"))
    idx, targets = (t[rank * B // n:(rank + 1) * B // n] for t in _gpt_batch())
    logits, loss = _gpt_loss(model, idx, targets)
    loss.backward()
    return {"logits": logits.detach(), "grads": {name: p.grad for name, p in model.named_parameters()},
            "experts": list(ep.expert_params.values()),
            "counted": [name for name, p in model.named_parameters() if ep.counts(p)]}


@cache
def _gpt_run(n: int) -> tuple[GPT, torch.Tensor, list[dict]]:
    reference = _gpt()
    logits, loss = _gpt_loss(reference, *_gpt_batch())
    loss.backward()
    return reference, logits.detach(), run_distributed(_gpt_expert_parallel, n)


@pytest.mark.parametrize("n", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_expert_parallel_gpt_matches_one_device(n):
    """Logits are the reference's rows; every expert gradient the reference's, on the one
    rank that keeps the expert under its single-device name; every other gradient adds up
    over the ranks to the reference's."""
    reference, logits, ranks = _gpt_run(n)
    assert _relative(torch.cat([r["logits"] for r in ranks]), logits) < 1e-5
    want = {name: p.grad for name, p in reference.named_parameters()}
    every_expert = sorted(name for name in want if ".experts." in name)
    assert sorted(name for result in ranks for name in result["experts"]) == every_expert
    for result in ranks:
        assert set(result["grads"]) == {name for name in want if ".experts." not in name} | set(result["experts"])
        for name in result["experts"]:
            assert _relative(result["grads"][name], want[name]) < 1e-5, name
    for name, grad in want.items():
        if ".experts." not in name:
            assert _relative(sum(r["grads"][name] for r in ranks), grad) < 1e-5, name


def test_every_parameter_is_counted_once_for_the_norm():
    """Own experts on their rank, replicated weights on ep rank 0 only (optim/clip.py)."""
    reference, _, ranks = _gpt_run(2)
    counted = Counter(name for result in ranks for name in result["counted"])
    assert counted == Counter(name for name, _ in reference.named_parameters())
    assert all(".experts." in name for name in ranks[1]["counted"])
