"""What `scaletrain.setup` refuses before any work, one sentence each (library.py).

The options are the command's own fields (``zero=3`` is ``--zero 3``), so the
command's range checks (config_checks.py) hold for them too; what only a
library call can get wrong is checked here: an option the engine does not
take, a layout that does not fit the processes that were started, a plan
that names what the model lacks, and a tensor plan that would train with
wrong gradients (LoRA's options: library_lora.py).
"""

from __future__ import annotations

import dataclasses
import fnmatch
from typing import Any

from torch import nn

from scaletrain.config import Config, FinetuneConfig, ParallelConfig, TrainConfig, coerce
from scaletrain.config_checks import check_values, refuse_auto
from scaletrain.errors import UserError
from scaletrain.library_lora import LORA_OPTIONS, spelled_as_option
from scaletrain.models.decoder import CausalAttention
from scaletrain.models.moe import moe_layers
from scaletrain.models.spec import ModelPlan
from scaletrain.parallel.batchnorm import check_synchronizable
from scaletrain.parallel.parallelize import model_dropout
from scaletrain.parallel.tensor_plan_checks import check_tensor_plan
from scaletrain.parallel.zero import layer_modules
from scaletrain.runtime.mesh import ParallelDims
from scaletrain.techniques.recompute import parse_policy

# The command's options that belong to a run rather than to a step: its evaluation, the
# launcher's processes, its MFU figure, its epochs over its data; a script has its own of each.
NOT_ENGINE_OPTIONS = frozenset({"eval_every", "eval_batches", "eval_tasks", "eval_tasks_every", "eval_tasks_include",
                                "eval_tasks_limit", "peak_tflops", "nproc", "max_restarts", "epochs",
                                "launcher", "ray_address", "cpus_per_worker", "gpus_per_worker", "debug_dist"})
ENGINE_OPTIONS = (*(f.name for section in (TrainConfig, ParallelConfig) for f in dataclasses.fields(section)
                    if f.name not in NOT_ENGINE_OPTIONS), *LORA_OPTIONS)


def engine_config(options: dict[str, Any]) -> Config:
    """The configuration of ``setup(**options)``: each option a field of ``scaletrain train`` (LoRA's of
    ``scaletrain finetune``, library_lora.py)."""
    options = spelled_as_option(options)
    unknown = sorted(set(options) - set(ENGINE_OPTIONS))
    if unknown:
        raise UserError(f"setup() takes no option {', '.join(map(repr, unknown))}; the options are the training and "
                        f"parallel fields of scaletrain train and LoRA's of scaletrain finetune "
                        f"({', '.join(ENGINE_OPTIONS)}).")
    fields = {f.name: f for section in (TrainConfig, ParallelConfig, FinetuneConfig)
              for f in dataclasses.fields(section)}
    checked = {name: coerce(name, fields[name], value, named="setup() option", fix="give one of that type")
               for name, value in options.items()}
    cfg = Config().replace(**checked)
    refuse_auto(cfg, "setup()")
    parse_policy(cfg.train.recompute)
    return cfg


def check_combinations(cfg: Config, model: nn.Module, seq_len: int | None, sync_batchnorm: bool = False) -> Config:
    """The command's checks of options that contradict each other (config_checks.py), told what
    the command would know from its flags: the model's experts and dropout, the sequence length;
    and what ``sync_batchnorm`` needs (parallel/batchnorm.py). The configuration so told, checked."""
    if sync_batchnorm:
        check_synchronizable(model, cfg.parallel.allreduce == "ring" or cfg.parallel.compress != "none")
    experts = moe_layers(model)
    facts = dict(dropout=model_dropout(model), moe_experts=experts[0].cfg.experts if experts else 0,
                 moe_top_k=experts[0].cfg.top_k if experts else 1)
    told = cfg.replace(**facts, **({"seq_len": seq_len} if seq_len else {}))
    check_values(told)
    return told


def layout_for_world(cfg: Config, world_size: int) -> ParallelDims:
    """The mesh of the options over ``world_size`` processes, or one sentence on why it does not fit."""
    p = cfg.parallel
    fixed = p.tp * p.pp * p.cp * p.ep
    if world_size % fixed or (p.dp is not None and p.dp * fixed != world_size):
        needed = f"{p.dp * fixed}" if p.dp is not None else f"a multiple of {fixed}"
        raise UserError(f"the layout dp={p.dp or 'any'} x tp={p.tp} x pp={p.pp} x cp={p.cp} x ep={p.ep} needs {needed} "
                        f"processes, but {world_size} were started; start a fitting number (scaletrain run --nproc "
                        f"N) or change the sizes.")
    dims = p.mesh_dims(world_size)
    if p.sync_every > 1 and dims.dp == 1:
        raise UserError(f"sync_every={p.sync_every} averages data-parallel replicas, but the layout has one (dp 1); "
                        f"start more processes or drop sync_every.")
    return dims


def check_plan(model: nn.Module, plan: ModelPlan | None, dims: ParallelDims, cfg: Config,
               seq_len: int | None, sample: Any) -> None:
    """Refuse a split the plan does not describe, a plan that names modules the model lacks, or a
    tensor plan that would give wrong gradients (parallel/tensor_plan_checks.py)."""
    plan = plan or ModelPlan()
    p = cfg.parallel
    names = {name for name, _ in model.named_modules()}
    for pattern, _ in plan.tensor:
        if not any(fnmatch.fnmatchcase(name, pattern) for name in names):
            raise UserError(f"the plan's tensor entry {pattern!r} matches no module of the model; name its modules as "
                            f"model.named_modules() does (e.g. 'blocks.*.attn.qkv').")
    check_tensor_plan(model, plan.tensor)
    for pattern in plan.position_modules:
        if not any(fnmatch.fnmatchcase(name, pattern) for name in names):
            raise UserError(f"the plan's position module {pattern!r} matches no module of the model; fix the pattern.")
    stack = plan.block_stack
    if stack is not None and not isinstance(getattr(model, stack, None), nn.ModuleList):
        raise UserError(f"the plan names the blocks {stack!r}, but the model has no nn.ModuleList of that name; give "
                        f"the attribute that holds the repeated blocks.")
    if plan.stages:
        for name in (*plan.stages.first, *plan.stages.last):
            if name not in names:
                raise UserError(f"the plan's stages name the module {name!r}, which the model lacks; fix the stages.")
        for method in (plan.stages.enter, plan.stages.leave):
            if not callable(getattr(model, method, None)):
                raise UserError(f"the plan's stages call the model's method {method!r}, which it lacks; define it.")
    needs = (("tp", dims.tp > 1, bool(plan.tensor), "a plan with tensor entries (ModelPlan(tensor=...))"),
             ("pp", dims.pp > 1, plan.stages is not None and plan.width is not None,
              "a plan with stages and width (ModelPlan(stages=StagePlan(...), width=...))"),
             ("cp", dims.cp > 1, seq_len is not None, "seq_len, the length of every sequence"))
    for option, used, given, what in needs:
        if used and not given:
            raise UserError(f"{option}={getattr(dims, option)} needs {what}; give it, or set {option}=1.")
    if dims.pp > 1 and dims.pp * p.pipeline_sizes()[1] > len(getattr(model, stack)):
        raise UserError(f"pp={dims.pp} cuts the model into more stages than its {len(getattr(model, stack))} blocks; "
                        f"lower pp.")
    if dims.pp > 1 and p.pp_balance == "time" and sample is None:
        raise UserError("pp_balance='time' times the blocks on a sample; give setup(..., sample=INPUTS).")
    if dims.cp > 1:
        if seq_len % (2 * dims.cp):
            raise UserError(f"cp={dims.cp} splits each sequence into {2 * dims.cp} chunks, which must divide seq_len "
                            f"{seq_len}; choose another cp or seq_len.")
        if not any(isinstance(m, CausalAttention) for m in model.modules()):
            raise UserError(f"cp={dims.cp} runs ring attention in place of scaletrain.CausalAttention, which the model "
                            f"does not use; compute attention with it, or set cp=1.")
    if dims.ep > 1:
        layers = moe_layers(model)
        if not layers:
            raise UserError(f"ep={dims.ep} divides the experts of scaletrain's MoE layer, which the model does not "
                            f"use; build its mixture of experts with scaletrain.MoE, or set ep=1.")
        if any(layer.cfg.experts % dims.ep for layer in layers):
            raise UserError(f"ep={dims.ep} must divide every MoE layer's experts; choose another ep.")
    if cfg.train.recompute != "none" and not (list(getattr(model, stack)) if stack else layer_modules(model)):
        raise UserError(f"recompute={cfg.train.recompute!r} recomputes the model's repeated blocks, but it has no "
                        f"nn.ModuleList or nn.Sequential holding them; hold the blocks in one (or name it by "
                        f"ModelPlan(blocks=...)), or drop recompute.")
    if cfg.train.recompute == "selective":
        blocks = list(getattr(model, stack)) if stack else []
        if not blocks or not all(isinstance(getattr(block, "attn", None), nn.Module) for block in blocks):
            raise UserError("recompute='selective' recomputes the attention inside each block's 'attn' module; give "
                            "the plan blocks that have one, or use recompute='full'.")
