"""One layout's prediction: memory per rank, the step's traffic, seconds per step."""

from __future__ import annotations

import functools

from scaletrain.config import Config
from scaletrain.models import gpt_config
from scaletrain.models.gpt import GPTConfig
from scaletrain.parallel.pipeline.schedules import Action, build
from scaletrain.plan import activations
from scaletrain.plan.hardware import Cluster
from scaletrain.plan.inventory import RankWeights, Split, rank_weights, whole_model
from scaletrain.plan.memory import ALLOWANCE, weight_memory
from scaletrain.plan.prediction import MEMORY_ROWS, Prediction
from scaletrain.plan.step_time import collective_seconds, step_seconds
from scaletrain.plan.traffic import Groups, step_traffic


def predict(cfg: Config, world: int, vocab_size: int, cluster: Cluster) -> Prediction:
    """Memory, communication and time of training ``cfg`` on ``world`` ranks of ``cluster``."""
    p, t = cfg.parallel, cfg.train
    gpt = gpt_config(cfg.model, vocab_size, cfg.data.seq_len)
    micro, virtual = p.pipeline_sizes()
    split = Split(tp=p.tp, ep=p.ep, pp=p.pp, virtual=virtual)
    x = activations.shape_of(gpt, t.micro_batch, p.tp, p.sp, p.cp, t.precision, t.param_dtype)
    groups = Groups.of(cfg, world)
    shards = groups.sizes[groups.zero_shard]
    host_is_device = cluster.device.name == "cpu"
    stages, traffics = [], []
    for pp_rank in range(p.pp):
        weights = rank_weights(gpt, split, pp_rank)
        held = weight_memory(cfg, weights, shards, host_is_device)
        saved = _activation_peak(cfg, weights, x, micro, pp_rank)
        stages.append(_rank_memory(held, saved, x, weights))
        traffics.append(step_traffic(cfg, world, gpt, weights, x, list(weights.stages), weights.n_stages))
    busiest = max(range(p.pp), key=lambda r: stages[r]["total"])
    tokens = t.micro_batch * t.grad_accum * (micro if p.pp > 1 else 1) * groups.sizes[groups.batch] * gpt.seq_len
    micro_batches = t.grad_accum * (micro if p.pp > 1 else 1)
    block_runs = micro_batches * max(len(rank_weights(gpt, split, r).blocks) for r in range(p.pp))
    time = step_seconds(cfg, world, _flops(gpt, t.recompute, tokens),
                        _slowest(traffics, groups.sizes, cfg, world, cluster), groups, cluster, block_runs)
    return Prediction(cfg=cfg, world=world, memory=stages[busiest], stages=stages, comm=traffics,
                      time=time, tokens_per_step=tokens, fits=stages[busiest]["total"] <= cluster.device.memory_bytes)


def _rank_memory(held: dict[str, int], saved: int, x: activations.Shape, weights: RankWeights) -> dict[str, int]:
    """The ledger's categories plus ``other`` (buffers, the loss's temporaries, the allowance) and ``total``."""
    logits = 8 * x.b * x.s * -(-x.vocab // x.tp) if weights.last else 0
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
    per_stage = {stage: (*activations.chunk_peak(x, len(blocks), stage == 0, last, recompute),
                         activations.weight_grad_inputs(x, len(blocks), last))
                 for stage, blocks in weights.stages.items()
                 for last in [stage == weights.n_stages - 1]}
    if p.pp == 1:
        order = [Action("F", 0, 0), Action("BW", 0, 0)]
    else:
        _, virtual = p.pipeline_sizes()
        order = _compute_order(p.pp_schedule, p.pp, micro, virtual, pp_rank)
    return activations.schedule_peak(order, per_stage)


@functools.lru_cache(maxsize=1024)
def _compute_order(schedule: str, pp: int, micro: int, virtual: int, pp_rank: int) -> list[Action]:
    return build(schedule, pp, micro, virtual).compute(pp_rank)


def _flops(gpt: GPTConfig, recompute: str, tokens: int) -> dict[str, float]:
    """FLOPs of the step: the model's (the trainer's MFU formula), recomputation's, attention's."""
    per_token = whole_model(gpt).flops_per_token()
    attention = 12 * gpt.n_layers * gpt.d_model * gpt.seq_len
    matmuls_per_block = (per_token - attention) / 6 / gpt.n_layers  # embeddings' share spread over blocks
    if recompute == "selective":
        extra = 4 * gpt.n_layers * gpt.d_model * gpt.seq_len
    elif recompute == "none":
        extra = 0.0
    else:
        every = int(recompute.split(":")[1]) if recompute.startswith("every:") else 1
        blocks = len(range(0, gpt.n_layers, every))
        extra = blocks * (2 * matmuls_per_block + 4 * gpt.d_model * gpt.seq_len)
    return {"model": per_token * tokens, "recompute": extra * tokens, "attention": attention * tokens}


def _slowest(traffics: list[dict], sizes: dict, cfg: Config, world: int, cluster: Cluster) -> dict:
    """The pipeline rank whose collectives take longest (ranks differ: the first embeds, the last
    computes the loss): the one the step waits for."""
    dims = cfg.parallel.mesh_dims(world)
    return max(traffics, key=lambda tr: sum(collective_seconds(tr, sizes, dims, cluster).values()))
