"""One layout's prediction: memory per rank, the step's traffic, seconds per step."""

from __future__ import annotations

import dataclasses
import functools

from scaletrain.config import Config
from scaletrain.kernels import head_loss
from scaletrain.models.spec import matmul_flops_per_token
from scaletrain.parallel.pipeline.schedules import Action, compute_orders
from scaletrain.planner import activations, compute
from scaletrain.planner.hardware import Cluster
from scaletrain.planner.inventory import Planned, RankWeights, Split, rank_weights, whole_model
from scaletrain.planner.memory import ALLOWANCE, dtype_bytes, weight_memory
from scaletrain.planner.prediction import MEMORY_ROWS, Prediction
from scaletrain.planner.step_time import collective_seconds, step_seconds
from scaletrain.planner.traffic import Groups, step_traffic


def predict(cfg: Config, world: int, vocab_size: int, cluster: Cluster) -> Prediction:
    """Memory, communication and time of training ``cfg`` on ``world`` ranks of ``cluster``."""
    p, t = cfg.parallel, cfg.train
    model = Planned.of(cfg.model, vocab_size, cfg.data.seq_len, cfg.finetune)
    micro, virtual = p.pipeline_sizes()
    split = Split(tp=p.tp, ep=p.ep, pp=p.pp, virtual=virtual)
    groups = Groups.of(cfg, world)
    shards = groups.sizes[groups.zero_shard], groups.sizes[groups.experts]  # ZeRO's dense and experts' groups
    host_is_device = cluster.device.name == "cpu"
    # The trainer's rule (train/layout.py): chunked where the head's weight is whole on its rank, and a
    # plain linear layer (a fine-tune's adapters or 4-bit weights on it keep its own forward).
    chunked = (model.shape.vocab > 0 and head_loss.head_is_whole(p.tp, p.pp, p.zero) and not model.adapted_head
               and head_loss.chunked(t.head_loss, t.fused, on_gpu=not host_is_device))
    x = activations.shape_of(model.shape, model.tensor_plan, t.micro_batch, p.tp, p.sp, p.cp, t.precision,
                             t.param_dtype, p.ep, t.compress_activations, chunked, model.lora)
    stages, traffics = [], []
    for pp_rank in range(p.pp):
        weights = rank_weights(model, split, pp_rank)
        held = weight_memory(cfg, weights, shards, host_is_device)
        saved = _activation_peak(cfg, weights, x, micro, pp_rank)
        stages.append(_rank_memory(held, saved, x, weights))
        traffics.append(step_traffic(cfg, world, weights, x, list(weights.stages), weights.n_stages))
    busiest = max(range(p.pp), key=lambda r: stages[r]["total"])
    micro_batches = t.grad_accum * (micro if p.pp > 1 else 1)
    tokens = micro_batches * t.micro_batch * groups.sizes[groups.batch] * model.shape.seq_len
    blocks = [len(rank_weights(model, split, r).blocks) for r in range(p.pp)]
    slowest = blocks.index(max(blocks))  # the first rank with the most blocks
    # a recomputed block launches its forward's operators again (planner/compute.py FORWARD_SHARE)
    block_runs = micro_batches * blocks[slowest] * (1 + compute.FORWARD_SHARE * compute.block_rerun_share(t.recompute))
    held = stages[busiest]
    # the optimizer reads and writes the weights it steps (not a fine-tune's frozen base) and its state
    stepped = held["params"] - rank_weights(model, split, busiest).untrained_bytes(dtype_bytes(t.param_dtype))
    clock = compute.clock(model.shape, x, blocks[slowest], slowest == p.pp - 1, micro_batches,
                          2 * (stepped + held["optimizer"]) + held["grads"], t.precision, cluster,
                          t.recompute)
    time = step_seconds(cfg, world, _flops(model, t.recompute, tokens),
                        _slowest(traffics, groups.sizes, cfg, world, cluster), groups, cluster, block_runs, clock)
    return Prediction(cfg=cfg, world=world, memory=stages[busiest], stages=stages, comm=traffics,
                      time=time, tokens_per_step=tokens, fits=stages[busiest]["total"] <= cluster.device.memory_bytes)


def _rank_memory(held: dict[str, int], saved: int, x: activations.Shape, weights: RankWeights) -> dict[str, int]:
    """The ledger's categories plus ``other`` (buffers, the loss's temporaries, the allowance) and ``total``;
    chunked (kernels/head_loss.py), the temporaries of one chunk: the gradients the kernel keeps are
    saved activations (planner/activations.py `loss_gradients`)."""
    if not weights.last:
        logits = 0
    elif x.chunked_loss:  # one chunk's logits, and the 16-bit product each adds to the head's gradient
        product = x.vocab * x.h * x.e if x.e < 4 and not x.frozen else 0
        logits = head_loss.chunk_rows(x.b * x.s, x.h, x.vocab) * x.vocab * x.e + product
    else:
        logits = 8 * x.b * x.s * -(-x.vocab // x.tp)
    memory = {"params": held["params"], "grads": held["grads"], "optimizer": held["optimizer"],
              "activations": saved}
    device = sum(memory.values()) - held["host"] + held["buffers"] + logits
    memory["other"] = held["buffers"] + logits + int(ALLOWANCE * device)
    memory["total"] = sum(memory[k] for k in MEMORY_ROWS[:-1]) - held["host"]
    memory["host"] = held["host"]
    return memory


def _activation_peak(cfg: Config, weights: RankWeights, x: activations.Shape, micro: int, pp_rank: int) -> int:
    """The saved-activation peak over one round of the rank's schedule (one micro-batch without a pipeline)."""
    p, recompute = cfg.parallel, cfg.train.recompute
    per_stage = {stage: (*activations.chunk_peak(x, experts, stage == 0, last, recompute),
                         activations.weight_grad_inputs(x, experts, last))
                 for stage, blocks in weights.stages.items()
                 for last, experts in [(stage == weights.n_stages - 1, [x.model.moe_in_block(i) for i in blocks])]}
    if p.pp == 1:
        order = [Action("F", 0, 0), Action("BW", 0, 0)]
    else:
        _, virtual = p.pipeline_sizes()
        order = _compute_order(p.pp_schedule, p.pp, micro, virtual, pp_rank)
    return activations.schedule_peak(order, per_stage)


def _compute_order(schedule: str, pp: int, micro: int, virtual: int, pp_rank: int) -> list[Action]:
    return _compute_orders(schedule, pp, micro, virtual)[pp_rank]


@functools.lru_cache(maxsize=256)
def _compute_orders(schedule: str, pp: int, micro: int, virtual: int) -> list[list[Action]]:
    """Every rank's computations, made once for all of them (a 64-stage schedule of 512
    micro-batches is tens of thousands of actions)."""
    return compute_orders(schedule, pp, micro, virtual)


def _flops(model: Planned, recompute: str, tokens: int) -> dict[str, float]:
    """FLOPs of the step: the model's (its ``flops_per_token``, the trainer's MFU formula),
    recomputation's, and attention's (QK^T and AV: 4*a*d*s per token and block forward,
    12*a*d*s with backward)."""
    return {name: per_token * tokens for name, per_token in _flops_per_token(model, recompute).items()}


@functools.lru_cache(maxsize=256)
def _flops_per_token(model: Planned, recompute: str) -> dict[str, float]:
    """`_flops` per token. A recomputed block reruns its forward: 2 FLOPs per weight of its
    linear layers, an expert's at top_k/E (the third of the 6N that the spec's
    `matmul_flops_per_token` counts for them), and its attention's 4*a*d*s; ``selective``
    reruns the attention core alone, 4*a*d*s.

    A LoRA fine-tune computes no gradient of its frozen weights: 4 FLOPs per weight (forward,
    input gradient) where training takes 6, and its adapters' 6 each. The base is read as the
    dense model (a 4-bit base's weights are buffers, which the spec's count leaves out);
    dequantizing them is not counted."""
    m = model.shape
    whole = whole_model(dataclasses.replace(model, adapters=()))
    core = 4 * m.n_heads * m.head_dim * m.seq_len
    attention = 3.0 * m.n_layers * core
    flops = whole.flops_per_token()
    if model.adapters:
        adapters = sum(q.numel() for q in whole_model(model).parameters() if q.requires_grad)
        flops -= (flops - attention) / 3 - 6 * adapters
    if recompute == "none":
        extra = 0.0
    elif recompute == "selective":
        extra = float(m.n_layers * core)
    else:
        every = int(recompute.split(":")[1]) if recompute.startswith("every:") else 1
        share = m.moe_top_k / m.moe_experts if m.moe_experts else 1.0
        blocks = getattr(whole, model.spec.stages.stack)
        extra = sum(matmul_flops_per_token(blocks[i], 0, 0, 0, share) / 3 + core for i in range(0, m.n_layers, every))
    return {"model": flops, "recompute": extra, "attention": attention}


def _slowest(traffics: list[dict], sizes: dict, cfg: Config, world: int, cluster: Cluster) -> dict:
    """The pipeline rank whose collectives take longest (ranks differ: the first embeds, the last
    computes the loss): the one the step waits for."""
    dims = cfg.parallel.mesh_dims(world)
    return max(traffics, key=lambda tr: sum(collective_seconds(tr, sizes, dims, cluster).values()))
