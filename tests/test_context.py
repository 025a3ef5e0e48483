"""Context parallelism: the zigzag split, ring attention against full-sequence
attention (values, gradients, work per rank, bytes on the ring), and a GPT
split along its sequence against one device, alone and with tensor parallelism."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from scaletrain.models.decoder import CausalAttention
from scaletrain.models.gpt import GPT, GPTConfig
from scaletrain.models.gpt_spec import GPT_SPEC
from scaletrain.models.gpt_spec import TENSOR_PLAN as GPT_PLAN
from scaletrain.parallel import context
from scaletrain.parallel.context import (
    RingAttention,
    parallelize_context,
    ring_attention,
    zigzag_positions,
)
from scaletrain.parallel.tensor import parallelize_tensor
from scaletrain.runtime import Comm, Mesh, ParallelDims
from tests.distributed import run_distributed

# batch, heads, sequence, head_dim of the attention tests
B, A, S, D = 2, 3, 32, 8
CFG = GPTConfig(vocab_size=64, seq_len=32, n_layers=2, n_heads=4, d_model=32)
POSITIONS = dict(seq_len=CFG.seq_len, position_modules=GPT_SPEC.position_modules)


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over every position, as the trainer computes it."""
    return F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten())


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


def _cp_group(rank: int, n: int):
    return Mesh.build(ParallelDims(cp=n), rank, n).group("cp")


# -- the zigzag split ------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 4])
def test_zigzag_covers_every_position_once(n):
    parts = [zigzag_positions(S, n, rank) for rank in range(n)]
    assert torch.equal(torch.cat(parts).sort().values, torch.arange(S))
    chunk = S // (2 * n)
    for rank, positions in enumerate(parts):
        assert (positions.diff() > 0).all()  # increasing, so a plain causal mask is exact locally
        assert positions[0] == rank * chunk and positions[-1] == S - rank * chunk - 1


def test_zigzag_refuses_a_sequence_it_cannot_cut_evenly():
    with pytest.raises(ValueError, match="multiple of 8"):
        zigzag_positions(36, 4, 0)


# -- ring attention against full-sequence attention -------------------------------


def _counting(function, counts: list[int]):
    def counted(q, k, *args):
        counts.append(q.shape[-2] * k.shape[-2])
        return function(q, k, *args)
    return counted


def _ring_run(rank: int, n: int) -> dict:
    group, comm = _cp_group(rank, n), Comm()
    generator = torch.Generator().manual_seed(0)
    q_full, k_full, v_full, dout_full = (torch.randn(B, A, S, D, generator=generator) for _ in range(4))
    reference = [t.clone().requires_grad_() for t in (q_full, k_full, v_full)]
    want = F.scaled_dot_product_attention(*reference, is_causal=True)
    want.backward(dout_full)

    positions = zigzag_positions(S, n, rank)
    mine = [t[:, :, positions].requires_grad_() for t in (q_full, k_full, v_full)]
    forward_scores, backward_scores = [], []
    context.attention_block = _counting(context.attention_block, forward_scores)
    context.attention_block_backward = _counting(context.attention_block_backward, backward_scores)
    start = comm.ledger.snapshot()
    out = ring_attention(*mine, comm, group)
    traffic = {"forward": comm.ledger.since(start)}
    middle = comm.ledger.snapshot()
    out.backward(dout_full[:, :, positions])
    traffic["backward"] = comm.ledger.since(middle)
    scores = (sum(forward_scores), sum(backward_scores))

    diffs = {"out": _relative(out, want[:, :, positions])}
    for name, got, full in zip("qkv", mine, reference):
        diffs["d" + name] = _relative(got.grad, full.grad[:, :, positions])

    # 16-bit inputs: computed in fp32, returned in their dtype; compared with fp32 on the same values
    half = [t.detach().bfloat16().requires_grad_() for t in mine]
    half_out = ring_attention(*half, comm, group)
    half_out.backward(dout_full[:, :, positions].bfloat16())
    rounded = [t.detach().bfloat16().float().requires_grad_() for t in mine]
    rounded_out = ring_attention(*rounded, comm, group)
    rounded_out.backward(dout_full[:, :, positions])
    bf16 = {"dtypes": {t.dtype for t in (half_out, *(h.grad for h in half))},
            "diff": max(_relative(h, r) for h, r in zip((half_out, *(t.grad for t in half)),
                                                        (rounded_out, *(t.grad for t in rounded))))}
    return {"diffs": diffs, "scores": scores, "traffic": traffic,
            "bf16": bf16}


@pytest.fixture(scope="module", params=[2, 4], ids=["cp2", "cp4"])
def ring(request) -> tuple[int, list[dict]]:
    """One forward and backward of ring attention per rank, for the tests below to read."""
    return request.param, run_distributed(_ring_run, request.param)


def test_ring_attention_equals_full_causal_attention(ring):
    """Each rank's output rows and its dq, dk, dv equal those of scaled_dot_product_attention
    over the whole sequence at the rank's positions (fp32)."""
    _, ranks = ring
    for rank, result in enumerate(ranks):
        assert max(result["diffs"].values()) <= 1e-5, (rank, result["diffs"])


def test_work_is_even_and_skips_the_future(ring):
    """Score elements computed per rank, per batch row and head (forward, and again in
    backward): equal on every rank,
    4c^2 + (N-1) 2c^2 for chunks of c positions; in all the causal half of s x s plus the
    other half of the N diagonal blocks, s^2 (N+1) / 2N, not s^2."""
    n, ranks = ring
    chunk = S // (2 * n)
    per_rank = 4 * chunk**2 + (n - 1) * 2 * chunk**2
    assert all(result["scores"] == (per_rank, per_rank) for result in ranks)
    assert n * per_rank == S * S * (n + 1) // (2 * n) < S * S


def test_ring_traffic_matches_the_formula(ring):
    """Per rank: forward N-1 sends of a K, V pair; backward N-1 K, V sends and N sends of
    the fp32 dK, dV pair that bring every key's gradient home; nothing else."""
    n, ranks = ring
    pair = 2 * B * A * (S // n) * D * 4
    for result in ranks:
        forward, backward = result["traffic"]["forward"], result["traffic"]["backward"]
        assert set(forward) == set(backward) == {"send", "recv"}
        assert forward["send"] == {"cp": {"calls": n - 1, "bytes": (n - 1) * pair, "wire_bytes": (n - 1) * pair}}
        assert backward["send"] == {"cp": {"calls": 2 * n - 1, "bytes": (2 * n - 1) * pair,
                                           "wire_bytes": (2 * n - 1) * pair}}


def test_ring_attention_in_bf16_keeps_dtypes(ring):
    """bf16 inputs give a bf16 output and bf16 gradients, within bf16 rounding of the
    fp32 computation on the same values."""
    _, ranks = ring
    for result in ranks:
        assert result["bf16"]["dtypes"] == {torch.bfloat16}
        assert result["bf16"]["diff"] < 1e-2


# -- a GPT split along its sequence ---------------------------------------------------


def _gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(CFG)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return tuple(torch.randint(0, CFG.vocab_size, (2, CFG.seq_len), generator=generator) for _ in range(2))


def _model_run(rank: int, n: int, cp: int, tp: int, sp: bool) -> dict[str, float]:
    full = _gpt()
    x, y = _batch()
    reference = loss_fn(full(x), y)
    reference.backward()

    mesh, comm = Mesh.build(ParallelDims(cp=cp, tp=tp), rank, n), Comm()
    model = _gpt()
    tensor_parallel = parallelize_tensor(model, GPT_PLAN, comm, mesh.group("tp"), sequence_parallel=sp,
                                         dropout=0.0) if tp > 1 else None
    cp_group = mesh.group("cp")
    context_parallel = parallelize_context(model, comm, cp_group, **POSITIONS)
    logits, targets = model(context_parallel.local(x)), context_parallel.local(y)
    loss = tensor_parallel.loss(logits, targets) if tensor_parallel else loss_fn(logits, targets)
    loss.backward()

    # Every rank holds as many positions: the global mean is the mean of the local ones.
    mean = loss.detach().clone()
    comm.all_reduce(mean, cp_group, op="avg")
    diffs = {"loss": abs(mean.item() - reference.item()) / reference.item()}
    whole = dict(full.named_parameters())
    for name, p in model.named_parameters():
        grad = p.grad.clone()
        comm.all_reduce(grad, cp_group, op="avg")
        split = tensor_parallel.splits.get(p) if tensor_parallel else None
        want = split.local(whole[name].grad, mesh.group("tp").rank) if split else whole[name].grad
        diffs[name] = _relative(grad, want)
    return diffs


@pytest.mark.parametrize("cp,tp,sp", [(2, 1, False), (4, 1, False), (2, 2, False), (2, 2, True)],
                         ids=["cp2", "cp4", "cp2-tp2", "cp2-tp2-sp"])
def test_gpt_split_along_the_sequence_matches_one_device(cp, tp, sp):
    """Each rank feeds its positions of tokens and targets: the mean of the ranks' losses is
    the one-device loss and the gradients averaged over the cp group are the one-device
    gradients (tp: each rank's slice of them), every tensor within 1e-5."""
    for rank, diffs in enumerate(run_distributed(_model_run, cp * tp, cp, tp, sp)):
        assert max(diffs.values()) <= 1e-5, (rank, diffs)
        assert len(diffs) == 1 + 20  # the loss and every tensor of the 2-layer GPT


def _autocast_run(rank: int, n: int) -> dict:
    full = _gpt()
    x, y = _batch()
    reference = loss_fn(full(x), y)
    reference.backward()

    group, comm = _cp_group(rank, n), Comm()
    model = _gpt()
    context_parallel = parallelize_context(model, comm, group, **POSITIONS)
    seen = set()
    model.blocks[0].attn.core.register_forward_hook(
        lambda module, args, out: seen.update(t.dtype for t in (*args, out) if t is not None))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = loss_fn(model(context_parallel.local(x)), context_parallel.local(y))
    loss.backward()
    loss = loss.detach().clone()
    comm.all_reduce(loss, group, op="avg")
    grads = [p.grad.clone() for p in model.parameters()]
    for grad in grads:
        comm.all_reduce(grad, group, op="avg")
    return {"dtypes": seen, "loss": abs(loss.item() - reference.item()) / reference.item(),
            "grads": max(_relative(g, p.grad) for g, p in zip(grads, full.parameters()))}


def test_bf16_autocast_stays_close_to_fp32():
    """Under bf16 autocast the ring sees and returns bf16 (the qkv projection's output);
    loss and averaged gradients stay within bf16 rounding of the fp32 single-device ones."""
    for result in run_distributed(_autocast_run, 2):
        assert result["dtypes"] == {torch.bfloat16}
        assert result["loss"] < 1e-2
        assert result["grads"] < 5e-2


# -- text sampling on one rank ----------------------------------------------------------


def _generation_run(rank: int, n: int) -> dict:
    full = _gpt()
    comm = Comm()
    model = _gpt()
    context_parallel = parallelize_context(model, comm, _cp_group(rank, n), **POSITIONS)
    if rank != 0:
        return {}
    prompts = [torch.randint(0, CFG.vocab_size, (1, length), generator=torch.Generator().manual_seed(3))
               for length in (CFG.seq_len, 11)]
    with torch.no_grad(), context_parallel.generation():
        diffs = [(model(prompt) - full(prompt)).abs().max().item() for prompt in prompts]
    try:
        with context_parallel.generation():
            raise RuntimeError("interrupted")
    except RuntimeError:
        pass
    restored = not any(attention.local_only for attention in context_parallel.attentions)
    positions = []
    model.pos_emb.register_forward_hook(lambda module, args, out: positions.append(args[0]))
    model.embed(context_parallel.local(prompts[0]))
    return {"diffs": diffs, "traffic": comm.ledger.to_json(), "restored": restored,
            "positions": torch.equal(positions[0], context_parallel.positions)}


def test_generation_runs_whole_sequences_on_one_rank():
    """Inside generation() rank 0 alone gives the untransformed model's logits for a full
    and a short sequence, without a byte on the network; on exit (even by an exception)
    the ring and the global positions are back."""
    result = run_distributed(_generation_run, 2)[0]
    assert max(result["diffs"]) < 1e-6
    assert result["traffic"] == {}
    assert result["restored"] and result["positions"]


def test_pruned_pipeline_stage_keeps_what_it_has():
    """A later pipeline stage (a placeholder block, no position embedding) is transformed
    without error; over a group of one the ring is plain causal attention."""
    model = _gpt()
    model.blocks[0] = nn.Module()
    model.pos_emb = None
    context_parallel = parallelize_context(model, Comm(), Mesh.build(ParallelDims(), 0, 1).group("cp"), **POSITIONS)
    assert isinstance(model.blocks[1].attn.core, RingAttention)
    assert not any(isinstance(m, CausalAttention) for m in model.modules())
    assert context_parallel.attentions == [model.blocks[1].attn.core]
    q, k, v = torch.randn(3, B, A, S, D, generator=torch.Generator().manual_seed(4))
    assert torch.equal(model.blocks[1].attn.core(q, k, v), F.scaled_dot_product_attention(q, k, v, is_causal=True))


def test_attention_dropout_is_refused():
    torch.manual_seed(0)
    with pytest.raises(ValueError, match="no attention dropout"):
        parallelize_context(GPT(GPTConfig(**{**vars(CFG), "dropout": 0.1})), Comm(),
                            Mesh.build(ParallelDims(), 0, 1).group("cp"), **POSITIONS)
